"""The `blocklab` subcommands, one module each: argument parsing, one call into
`blocklab.experiments`, and the rendering of its result. No experiment logic.

Every command module defines:

- `NAME` (the subcommand) and `HELP` (one line);
- `add_arguments(parser)`: its options (`--json` is added by `blocklab.cli`);
- `run(args) -> int`: prints a human-readable table, or one JSON object on
  stdout when `args.json` is set (render it with
  `blocklab.experiments.dumps`: strict JSON, non-finite -> null, and say which
  run diverged in a `diverged` field); returns the exit status;
- optionally `validate(args)`: checks argument values (raise `ValueError` /
  `ConfigError`) before any work; `blocklab.cli` calls it, then checks the
  output paths (`--png`, `--out`, and the names in `OUTPUT_FILES` /
  `OUTPUT_DIRS`), all before `run`.

A command whose study belongs in `blocklab report` also defines

- `report_section(out_dir, *, quick, full) -> str`: runs its study, writes
  PNGs into `out_dir` (atomically, via `blocklab.experiments.plotting` / `blocklab._io`)
  and returns a Markdown section (starting with a `## ` heading) that links
  them by file name. `quick` is `blocklab report --quick` (every section
  reduced, minutes); `full` is True on an accelerator or with `--full` (the
  chapter's full protocol everywhere) and False on a CPU, where a section
  whose full protocol takes hours runs a reduced one, names it in its text and
  says how to run the full one. A section that does not depend on `full` may
  omit the parameter;
- optionally `report_estimate(*, quick, full) -> float`: the section's
  expected seconds on a 2-core CPU (printed before it starts).
"""

#: Subcommand modules (`blocklab NAME`), the report's sections first.
COMMANDS = ("census", "norms", "train", "signal", "check", "lr_sweep", "launch")

#: The sections of `blocklab report`, in the order it presents them.
REPORT_SECTIONS = ("census", "norms", "train", "signal", "check", "lr_sweep")
