"""One study protocol and one exit-code convention.

- every study module has the same surface (`report_section`,
  `report_estimate`, a result with `table` / `to_json` / `figures`), and its
  command has the study's name;
- `seeds` lists seeds, `num_seeds` counts them (the old count `seeds=N` /
  `--seeds N` is refused: tests/test_removed_paths.py);
- exit status 2 means a bad argument whichever layer refuses it (argparse, a
  command's `validate`, or `ConfigError` deep in `blocklab.nn` during the run);
  1 a failure while working; 130 an interrupt.
"""

import inspect
import json

import pytest

from blocklab._validate import ConfigError
from blocklab.cli import app as cli
from blocklab.experiments import signal
from blocklab.experiments.protocol import STUDIES, study

SECTION = ["out_dir", "quick", "full", "progress"]


@pytest.mark.parametrize("s", STUDIES, ids=lambda s: s.name)
def test_every_study_has_the_one_report_signature(s):
    params = inspect.signature(s.module.report_section).parameters
    assert list(params) == SECTION
    assert [params[n].kind for n in SECTION[1:]] == [inspect.Parameter.KEYWORD_ONLY] * 3
    assert list(inspect.signature(s.module.report_estimate).parameters) == [
        "quick",
        "full",
    ]
    assert s.estimate(quick=True, full=False) <= s.estimate(quick=False, full=False)
    with pytest.raises(ConfigError, match="exclude each other"):
        s.module.report_estimate(quick=True, full=True)


def test_study_lookup_by_name_command_or_alias():
    assert study("lr_sensitivity") is study("lr-sensitivity") is study("lr-sweep")
    assert study("train").name == "activations"
    with pytest.raises(ConfigError, match="unknown study 'nope'"):
        study("nope")


# ------------------------------------------------------------------ seeds
def test_num_seeds_counts_seeds():
    opts = dict(num_blks=2, num_hiddens=16, num_heads=4)
    new = signal.signal_propagation(("pre",), num_seeds=2, **opts)
    assert new.options["num_seeds"] == 2
    assert new.stats["pre"].stream_rms.shape == (2, 2)  # (num_seeds, N)


def run_json(argv, capsys):
    status = cli.main([*argv, "--json"])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


# ------------------------------------------------------------- exit codes
def test_help_lists_the_exit_codes():
    text = cli.build_parser().format_help()
    for line in ("0  done", "1  failed while working", "2  bad arguments",
                 "130  interrupted"):  # fmt: skip
        assert line in text


def test_a_config_error_deep_in_the_library_during_the_run_exits_2(capsys, monkeypatch):
    """An activation that only `blocklab.nn.ffn` knows to refuse, reached
    during the run (past argparse and `validate`): exit 2 with a JSON error."""
    from blocklab.experiments import parameter_census as census
    from blocklab.nn.ffn import FeedForward

    def deep(**_):
        import jax

        FeedForward(8, "tanh", key=jax.random.key(0))

    monkeypatch.setattr(census, "run_census", deep)
    monkeypatch.setattr(cli, "check_outputs", lambda args: None)
    import blocklab.cli.commands.census as cmd

    monkeypatch.setattr(cmd, "validate", lambda args: None)
    status, out, _ = run_json(["census"], capsys)
    assert status == 2, out
    assert out["type"] == "ConfigError" and "tanh" in out["error"]


def test_a_width_that_does_not_divide_the_heads_exits_2(capsys):
    status, out, _ = run_json(
        ["census", "--act", "gelu", "--num-hiddens", "10", "--num-heads", "3"], capsys
    )
    assert status == 2 and out["type"] == "ConfigError" and "num_heads" in out["error"]


def test_a_plain_error_while_working_exits_1(capsys, monkeypatch):
    from blocklab.experiments import parameter_census as census

    def broken(**_):
        raise ArithmeticError("failed half way")

    import blocklab.cli.commands.census as cmd

    monkeypatch.setattr(cmd, "validate", lambda args: None)
    monkeypatch.setattr(census, "run_census", broken)
    status, out, _ = run_json(["census"], capsys)
    assert status == 1 and out["type"] == "ArithmeticError"


def test_argparse_errors_and_unwritable_paths_exit_2(capsys, tmp_path):
    status, out, _ = run_json(["census", "--num-heads", "x"], capsys)
    assert status == 2 and out["type"] == "UsageError"
    assert issubclass(cli.UsageError, ConfigError)
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, out, _ = run_json(["signal", "--out", str(blocker)], capsys)
    assert status == 2 and out["type"] == "ConfigError"
