"""The `blocklab` subcommands, one module each.

Every command module defines:

- `NAME` (the subcommand) and `HELP` (one line);
- `add_arguments(parser)`: its options (`--json` is added by `blocklab.cli`);
- `run(args) -> int`: prints a human-readable table, or one JSON object on
  stdout when `args.json` is set; returns the exit status;
- `report_section(out_dir, *, quick) -> str`: runs its experiment (reduced
  under `quick`), writes PNGs into `out_dir` and returns a Markdown section
  (starting with a `## ` heading) that links them by file name.
"""

#: Subcommand modules, in the order the report presents them (the final order:
#: census, norms, train, signal, check, lr_sweep).
COMMANDS = ("census", "norms", "train", "signal", "check", "lr_sweep")
