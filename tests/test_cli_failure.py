"""The CLI under failure: for every command, `--json` is one strict JSON object on
every exit path, exit statuses are 0 / 1 / 2 / 130, bad output paths are refused
before any work, and an interrupted report keeps its finished sections."""

import json
import math

import pytest
from strict_json import strict_object

from blocklab.cli import app as cli
from blocklab.cli.commands import REPORT_SECTIONS
from blocklab.experiments.protocol import study


def _subparsers():
    parser = cli.build_parser()
    (action,) = parser._subparsers._group_actions
    return action.choices


SUBPARSERS = _subparsers()

#: The positional arguments a command does not parse without.
REQUIRED = {"eval": ["a-checkpoint-folder"]}
NAMES = sorted(SUBPARSERS)


def _options(name):
    return {s for a in SUBPARSERS[name]._actions for s in a.option_strings}


def _module(name):
    """The module behind `blocklab NAME` (a command or one of its aliases)."""
    return SUBPARSERS[name].get_default("_module")


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any command starts its work."""

    def forbidden(args):
        raise AssertionError("the command started work")

    for name in NAMES:
        monkeypatch.setattr(_module(name), "run", forbidden)


def test_every_command_is_covered():
    studies = {"census", "norms", "activations", "signal", "check", "lr-sensitivity"}
    assert {"report", "launch", *studies, "train", "lr-sweep"} <= set(NAMES)


def test_command_names_are_study_names():
    """Each study of `blocklab.experiments` is the command of its name; the old
    names `train` and `lr-sweep` are aliases that run the same module."""
    from blocklab.experiments.protocol import STUDIES

    for s in STUDIES:
        module = _module(s.command)
        assert module.NAME == s.name and module.__name__.endswith(f".{s.name}")
    assert _module("train") is _module("activations")
    assert _module("lr-sweep") is _module("lr-sensitivity")


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_is_a_json_error_with_status_2(name, no_work, capsys):
    assert cli.main([name, "--no-such-option", "--json"]) == 2
    captured = capsys.readouterr()
    err = strict_object(captured.out)
    assert set(err) == {"error", "type"}
    assert "--no-such-option" in err["error"]


@pytest.mark.parametrize("name", NAMES)
def test_without_json_an_error_is_one_line_on_stderr(name, no_work, capsys):
    assert cli.main([name, "--no-such-option"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in lines[0]


@pytest.mark.parametrize("name", NAMES)
def test_help_with_json_is_one_object(name, capsys):
    assert cli.main([name, "--help", "--json"]) == 0
    assert "usage: blocklab" in strict_object(capsys.readouterr().out)["help"]


def test_no_command_and_unknown_command_are_json_errors(capsys):
    assert cli.main(["--json"]) == 2
    strict_object(capsys.readouterr().out)
    assert cli.main(["frobnicate", "--json"]) == 2
    assert "frobnicate" in strict_object(capsys.readouterr().out)["error"]


@pytest.mark.parametrize("name", [n for n in NAMES if {"--png", "--out"} & _options(n)])
def test_a_bad_output_path_is_refused_before_any_work(name, no_work, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for option in sorted({"--png", "--out"} & _options(name)):
        bad = blocker / "x.png" if option == "--png" else blocker
        if option == "--out" and "out" in getattr(_module(name), "OUTPUT_FILES", ()):
            bad = blocker / "x.json"  # a file --out: one under a file
        argv = [name, *REQUIRED.get(name, []), option, str(bad), "--json"]
        assert cli.main(argv) == 2, option
        err = strict_object(capsys.readouterr().out)
        assert option in err["error"] and err["type"] == "ConfigError"
    assert blocker.read_text() == "not a folder"


def test_cli_refuses_before_any_work(tmp_path, capsys, monkeypatch):
    """Every output and value is checked before the work: a --png that is no
    image name, an --out whose figure name is a folder, a seed or a rate out of
    range (a negative number is a value, refused by its range, not an option),
    and a misspelled --json still answers in JSON; nothing is written."""
    monkeypatch.chdir(tmp_path)

    def run(*argv):
        status = cli.main(list(argv))
        return status, capsys.readouterr()

    status, out = run("train", "--png", "losses.txt", "--steps", "1")
    assert status == 2 and "--png='losses.txt' is not an image file name" in out.err
    (tmp_path / "figs" / "lr_final_loss.png").mkdir(parents=True)
    status, out = run("lr-sensitivity", "--quick", "--out", "figs")
    assert status == 2 and "lr_final_loss.png' is a directory" in out.err
    status, out = run("lr-sensitivity", "--quick", "--seed", "4294967295")
    assert status == 2 and "--seed must lie in [0, 4294967294]" in out.err
    status, out = run("lr-sensitivity", "--quick", "--lrs", "-1e-3", "0.1")
    assert status == 2 and "lrs[0] must lie in (0.0, inf], got -0.001" in out.err
    status, out = run("census", "--jsn")
    obj = strict_object(out.out)
    assert status == 2 and obj["type"] == "UsageError" and "--jsn" in obj["error"]
    assert list(tmp_path.iterdir()) == [tmp_path / "figs"]  # nothing was written


def test_a_value_error_while_working_is_status_1(monkeypatch, capsys, tmp_path):
    from blocklab.experiments import parameter_census as census

    def broken(**_):
        raise ValueError("the study failed half way")

    monkeypatch.setattr(census, "run_census", broken)
    args = ["report", "--only", "census", "--out", str(tmp_path), "--json"]
    assert cli.main(args) == 1
    assert strict_object(capsys.readouterr().out) == {
        "error": "the study failed half way",
        "type": "ValueError",
    }


def test_an_unexpected_exception_is_status_1_with_a_json_error(
    monkeypatch, capsys, tmp_path
):
    from blocklab.experiments import parameter_census as census

    def bug(**_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(census, "run_census", bug)
    args = ["report", "--only", "census", "--out", str(tmp_path), "--json"]
    assert cli.main(args) == 1
    captured = capsys.readouterr()
    err = strict_object(captured.out)
    assert err["type"] == "RuntimeError" and "a bug" in err["error"]
    assert "Traceback" in captured.err  # a bug keeps its traceback, on stderr


def test_non_finite_results_become_null_and_are_named(monkeypatch, capsys):
    """A command that writes NaN (Python's json does) still gives strict JSON."""
    from blocklab.cli.commands import census

    def diverging(args):
        print(json.dumps({"loss": [1.0, math.nan], "final": math.inf, "ok": 2}))
        return 0

    monkeypatch.setattr(census, "run", diverging)
    assert cli.main(["census", "--json"]) == 0
    out = strict_object(capsys.readouterr().out)
    assert out == {
        "loss": [1.0, None],
        "final": None,
        "ok": 2,
        "nonfinite": ["loss[1]", "final"],
    }


def test_a_command_that_names_its_diverged_run_is_left_alone(monkeypatch, capsys):
    from blocklab.cli.commands import census

    def diverging(args):
        print(json.dumps({"loss": math.nan, "diverged": {"seed 1": 17}}))
        return 0

    monkeypatch.setattr(census, "run", diverging)
    assert cli.main(["census", "--json"]) == 0
    assert strict_object(capsys.readouterr().out) == {
        "loss": None,
        "diverged": {"seed 1": 17},
    }


def test_census_json_on_success_against_hand_counts(capsys):
    assert (
        cli.main(["census", "--num-hiddens", "64", "--num-heads", "4", "--json"]) == 0
    )
    blocks = strict_object(capsys.readouterr().out)["blocks"]
    block = blocks["default (pre, rms, swiglu)"]
    # 4 d^2 = 16384; SwiGLU 3 d round(8d/3) = 3 * 64 * 171 = 32832; gains 2 d
    assert block == {
        "norm1": 64,
        "norm2": 64,
        "attention": 16384,
        "ffn": 32832,
        "total": 49344,
    }


def test_census_bad_divisor_is_status_2_before_work(capsys):
    assert (
        cli.main(["census", "--num-hiddens", "10", "--num-heads", "3", "--json"]) == 2
    )
    err = strict_object(capsys.readouterr().out)
    assert "num_heads" in err["error"] and err["type"] == "ConfigError"


# ------------------------------------------------------------ the report
@pytest.fixture
def sections(monkeypatch):
    """Every section a marker; `interrupt_at` makes one raise KeyboardInterrupt."""
    state = {"interrupt_at": None}
    for name in REPORT_SECTIONS:
        module = study(name).module

        def section(out_dir, *, quick, full, progress, _name=name):
            if _name == state["interrupt_at"]:
                raise KeyboardInterrupt
            return f"## {_name}\n\nnew {_name}\n"

        monkeypatch.setattr(module, "report_section", section)
    return state


def test_an_interrupted_report_keeps_the_earlier_report(sections, tmp_path, capsys):
    old = "# blocklab report\n\nthe complete report of yesterday\n"
    (tmp_path / "report.md").write_text(old)
    sections["interrupt_at"] = REPORT_SECTIONS[0]
    assert cli.main(["report", "--out", str(tmp_path), "--json"]) == 130
    assert strict_object(capsys.readouterr().out) == {
        "error": "interrupted",
        "type": "KeyboardInterrupt",
        "interrupted": True,
        "kept": {},  # no section finished: nothing new kept
    }
    assert (tmp_path / "report.md").read_text() == old


def test_an_interrupted_report_keeps_its_finished_sections(sections, tmp_path, capsys):
    (tmp_path / "report.md").write_text("old\n")
    sections["interrupt_at"] = REPORT_SECTIONS[2]
    assert cli.main(["report", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted; kept report: " in err
    assert ", ".join(REPORT_SECTIONS[:2]) in err  # the sections kept, named
    text = (tmp_path / "report.md").read_text()
    assert all(f"new {n}" in text for n in REPORT_SECTIONS[:2])
    assert f"new {REPORT_SECTIONS[2]}" not in text
    assert "in progress" in text


# ------------------------------------------- success at tiny sizes (slow: training)
TINY_RUNS = {
    "activations": "--act gelu --steps 3 --batch-size 2 --num-hiddens 16 "
    "--num-heads 2 --num-blks 1 --seq-len 8 --png {tmp}/t.png",
    "signal": "--placements pre --num-seeds 1 --blocks 2 --num-hiddens 16 "
    "--out {tmp}/s",
    # a rate of 1e30 diverges at once: null losses, a `diverged` field, and a
    # figure whose log axis spans 1e-3 .. 1e30
    "lr-sensitivity": "--quick --lrs 1e-3 1e30 --steps 4 --record-every 2 "
    "--num-hiddens 16 --num-blks 1 --batch-size 2 --seq-len 8 --out {tmp}/lr",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_training_commands_print_strict_json_on_success(name, tmp_path, capsys):
    argv = [name, *TINY_RUNS[name].format(tmp=tmp_path).split(), "--json"]
    assert cli.main(argv) == 0
    out = strict_object(capsys.readouterr().out)
    assert "error" not in out
    if name == "lr-sensitivity":
        assert out["final_loss"]["qk_norm"][1] is None
        assert {d["lr"] for d in out["diverged"]} == {1e30}
        assert all(p.read_bytes()[:4] == b"\x89PNG" for p in tmp_path.rglob("*.png"))
        assert list(tmp_path.rglob("*.png"))


# ------------------------------------------------------------- figures
def test_sanitize_drops_what_cannot_be_drawn_and_clips_the_rest():
    from blocklab.experiments.plotting import sanitize

    x = [1e-4, 1e-3, 1e30, 1e300, 1.0, 2.0]
    y = [1.0, math.nan, 2.0, 3.0, -1.0, math.inf]
    px, py, dropped = sanitize(x, y, logx=True, logy=True)
    # nan, inf and (log y) the negative value go; 1e300 is clipped to 1e100
    assert px.tolist() == [1e-4, 1e30, 1e100] and py.tolist() == [1.0, 2.0, 3.0]
    assert dropped == 3
    px, py, dropped = sanitize(x, y)  # linear axes keep the negative value
    assert py.tolist() == [1.0, 2.0, 3.0, -1.0] and dropped == 2


def test_figures_of_diverged_runs_are_written(tmp_path):
    from blocklab.experiments.plotting import bar_plot, line_plot

    png = line_plot(
        tmp_path / "lr.png",
        {"a": [1e-4, 1e-1, 1e30], "b": [1e-4, 1e-1, 1e30]},
        {"a": [2.0, math.nan, math.inf], "b": [math.nan] * 3},
        xlabel="lr",
        ylabel="loss",
        logx=True,
        logy=True,
        bands={"a": ([1.0, math.nan, 0.0], [3.0, math.inf, 1e308])},
        hlines={"init": math.nan, "ok": 1.5},
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # finite but huge values on a linear axis: matplotlib's tick arithmetic
    # overflows ("arange: cannot compute length") unless they are clipped
    line_plot(
        tmp_path / "huge.png", [1, 2, 3], {"a": [1.0, -1.7e308, 1.7e308]},
        xlabel="step", ylabel="loss",
    )  # fmt: skip
    png = bar_plot(
        tmp_path / "bars.png",
        {"x": {"fresh": math.inf, "donated": 1.0}, "y": {"fresh": 2.0}},
        ylabel="GB/s",
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bars.png",
        "huge.png",
        "lr.png",
    ]


# ------------------------------------------------------------- strict JSON
def test_strict_json_of_numpy_jax_dataclasses_and_paths():
    import dataclasses
    from pathlib import Path

    import jax.numpy as jnp
    import numpy as np

    from blocklab.experiments import dumps, nonfinite_paths, to_jsonable

    @dataclasses.dataclass
    class Result:
        losses: object
        best: object

    value = {
        "a": np.array([[1.5, np.nan], [np.inf, -2.0]], np.float32),
        "b": jnp.asarray(3.0),
        "c": np.int64(7),
        "d": (np.bool_(True), Path("x/y.png")),
        "e": Result(losses=jnp.array([0.5, jnp.nan]), best=np.float64(-np.inf)),
        1: "int key",
    }
    assert to_jsonable(value) == {
        "a": [[1.5, None], [None, -2.0]],
        "b": 3.0,
        "c": 7,
        "d": [True, "x/y.png"],
        "e": {"losses": [0.5, None], "best": None},
        "1": "int key",
    }
    assert strict_object(dumps(value))["e"]["best"] is None
    assert nonfinite_paths(value) == ["a[0,1]", "e.losses[1]", "e.best"]
    with pytest.raises(TypeError, match="no JSON form"):
        to_jsonable({"x": object()})
