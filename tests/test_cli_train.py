"""`blocklab train`: checkpoints, table, strict JSON, divergence, validation, report.

Reference values are independent of the code under test: hand-worked window
means, and the closed-form loss of an untrained character model (its tied
head reads N(0, 0.02^2) embeddings, so every logit is near 0 and the loss is
near log 28).
"""

import math

import numpy as np
import pytest
from strict_json import strict_loads, strict_round_trip

from blocklab.cli import main
from blocklab.cli.commands import COMMANDS
from blocklab.experiments import activations as study

TINY = [
    "--num-hiddens", "16", "--num-heads", "2", "--num-blks", "1", "--seq-len", "8",
    "--batch-size", "4", "--no-progress",
]  # fmt: skip


def test_registered_after_census():
    assert COMMANDS.index("activations") == COMMANDS.index("census") + 1 or (
        "norms" in COMMANDS
        and COMMANDS.index("activations") == COMMANDS.index("norms") + 1
    )


def test_checkpoints_are_the_chapters_at_600_steps():
    assert study.checkpoints(600) == ([200, 400, 600], 100)
    assert study.checkpoints(90) == ([30, 60, 90], 30)
    assert study.checkpoints(2) == ([2], 1)


def test_loss_at_averages_the_window_before_each_checkpoint():
    losses = np.arange(600, dtype=float)  # loss of step s (1-based) is s - 1
    # mean of steps 101..200 -> values 100..199 -> 149.5
    assert study.loss_at(losses, 600) == {"200": 149.5, "400": 349.5, "600": 549.5}
    short = study.loss_at(losses[:300], 600)  # a run stopped early
    assert short["200"] == 149.5 and np.isnan(short["400"])


def _result(loss_at, val_loss, diverged_at):
    return study.ActivationComparison(
        protocol={"steps": 2}, acts=("gelu",), seeds=(0, 1), checkpoints=(2,),
        window=1, loss_at={"gelu": loss_at}, val_loss={"gelu": val_loss},
        curves={"gelu": np.zeros((2, 2))}, diverged_at={"gelu": diverged_at},
    )  # fmt: skip


def test_table_shows_mean_and_std_over_seeds():
    r = _result({"2": [1.5, 2.5]}, [1.0, 1.0], [0, 0])
    assert r.table().splitlines()[-1] == "| gelu | 2.00 ± 0.50 | 1.00 ± 0.00 |"


def test_table_and_json_name_a_diverged_seed():
    r = _result({"2": [1.5, math.nan]}, [1.0, 2.0], [0, 2])
    assert r.table().splitlines()[-1] == "| gelu | 1.50 (1 diverged) | 1.50 ± 0.50 |"
    data = strict_round_trip(r.to_json())
    assert data["results"]["gelu"]["loss_at"]["2"] == [1.5, None]
    assert data["diverged"] == [{"act": "gelu", "seed": 1, "step": 2}]


@pytest.mark.slow
def test_json_output_and_png(tmp_path, capsys):
    png = tmp_path / "curves.png"
    argv = ["train", "--act", "gelu", "swiglu", "--steps", "3", "--seeds", "0", "1",
            "--png", str(png), "--json", *TINY]  # fmt: skip
    assert main(argv) == 0
    out = strict_loads(capsys.readouterr().out)
    assert set(out["results"]) == {"gelu", "swiglu"} and out["diverged"] == []
    assert out["protocol"]["seeds"] == [0, 1] and out["protocol"]["steps"] == 3
    for r in out["results"].values():
        assert set(r["loss_at"]) == {"1", "2", "3"}  # window 1 below 3 thirds
        assert r["diverged_at"] == [0, 0]
        # Step 1's loss is the untrained model's: every logit is within ~0.1 of
        # 0, so the cross-entropy is log 28 up to the noise of 32 tokens.
        np.testing.assert_allclose(r["loss_at"]["1"], math.log(28), atol=0.1)
        np.testing.assert_allclose(r["val_loss"], math.log(28), atol=0.1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_diverged_run_is_reported_with_exit_status_0(tmp_path, capsys):
    png = tmp_path / "c.png"
    argv = ["train", "--act", "relu", "--steps", "4", "--lr", "1e30",
            "--png", str(png), "--json", *TINY]  # fmt: skip
    assert main(argv) == 0
    out = strict_loads(capsys.readouterr().out)
    (d,) = out["diverged"]
    assert d["act"] == "relu" and d["seed"] == 0 and d["step"] >= 1
    assert out["results"]["relu"]["loss_at"]["4"] == [None]
    assert png.exists()  # the figure survives the NaN curve


def test_table_output(tmp_path, capsys):
    argv = ["train", "--act", "relu", "--steps", "3", "--seeds", "0",
            "--png", str(tmp_path / "c.png"), *TINY]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| act | loss @ 1 | loss @ 2 | loss @ 3 | val loss |" in text
    assert "| relu |" in text


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "-5"], "--steps must be >= 1, got -5"),
        (["--lr", "-0.001"], "--lr must be a finite rate > 0"),
        (["--lr", "0"], "--lr must be a finite rate > 0"),
        (["--seeds", "1", "1"], "--seeds must be distinct"),
        (["--seeds", "-1"], "--seeds[0] must lie in [0, 4294967295], got -1"),
        (["--act", "gelu", "gelu"], "--act must be distinct"),
        (["--num-hiddens", "15"], "multiple of --num-heads"),
    ],
)
def test_bad_values_are_refused_before_any_training(bad, message, monkeypatch, capsys):
    def no_training(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(study, "compare_activations", no_training)
    assert main(["train", *bad, "--json"]) == 2
    err = strict_loads(capsys.readouterr().out)
    assert message in err["error"]


def test_an_unwritable_png_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "compare_activations", lambda *a, **k: 1 / 0)
    assert main(["train", "--png", str(tmp_path), "--json"]) == 2
    assert "--png" in strict_loads(capsys.readouterr().out)["error"]


def test_help_says_what_a_diverged_run_exits_with(capsys):
    assert main(["train", "--help", "--json"]) == 0
    text = " ".join(strict_loads(capsys.readouterr().out)["help"].split())
    assert "exit status is still 0" in text


@pytest.mark.slow
def test_report_section(tmp_path, monkeypatch):
    real = study.compare_activations

    def tiny(acts, seeds, steps, **kwargs):
        data = study.TimeMachine(seq_len=8, num_train=200, num_val=10)
        return real(acts, seeds, 3, data=data, num_hiddens=16, num_heads=2,
                    num_blks=1, batch_size=4)  # fmt: skip

    monkeypatch.setattr(study, "compare_activations", tiny)
    section = study.report_section(tmp_path, quick=True)
    assert section.startswith("## GELU vs SwiGLU")
    assert "| gelu |" in section and "| swiglu |" in section
    assert "(train_losses.png)" in section and (tmp_path / "train_losses.png").exists()


def test_unknown_act_is_rejected(capsys):
    assert main(["train", "--act", "tanh"]) == 2
    assert "invalid choice: 'tanh'" in capsys.readouterr().err
