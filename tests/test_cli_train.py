"""`blocklab train`: loss checkpoints, the table, JSON, PNG and the report section."""

import json

import numpy as np
import pytest

from blocklab.cli import main
from blocklab.commands import COMMANDS
from blocklab.commands import train as cmd

TINY = [
    "--num-hiddens",
    "16",
    "--num-heads",
    "2",
    "--num-blks",
    "1",
    "--num-steps",
    "8",
    "--batch-size",
    "4",
    "--no-progress",
]


def test_registered_after_census():
    assert COMMANDS.index("train") == COMMANDS.index("census") + 1 or (
        "norms" in COMMANDS and COMMANDS.index("train") == COMMANDS.index("norms") + 1
    )


def test_checkpoints_are_the_chapters_at_600_steps():
    assert cmd.checkpoints(600) == ([200, 400, 600], 100)
    assert cmd.checkpoints(90) == ([30, 60, 90], 30)
    assert cmd.checkpoints(2) == ([2], 1)


def test_loss_at_averages_the_window_before_each_checkpoint():
    losses = np.arange(600, dtype=float)  # loss of step s (1-based) is s - 1
    # mean of steps 101..200 -> values 100..199 -> 149.5
    assert cmd.loss_at(losses, 600) == {"200": 149.5, "400": 349.5, "600": 549.5}
    short = cmd.loss_at(losses[:300], 600)  # a run stopped early
    assert short["200"] == 149.5 and np.isnan(short["400"])


def test_table_shows_mean_and_std_over_seeds():
    results = {"gelu": {"loss_at": {"2": [1.5, 2.5]}, "val_loss": [1.0, 1.0]}}
    assert cmd.table(results).splitlines()[-1] == "| gelu | 2.00 ± 0.50 | 1.00 ± 0.00 |"


def test_json_output_and_png(tmp_path, capsys):
    png = tmp_path / "curves.png"
    argv = [
        "train",
        "--act",
        "gelu",
        "swiglu",
        "--steps",
        "6",
        "--seeds",
        "0",
        "1",
        "--png",
        str(png),
        "--json",
        *TINY,
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"gelu", "swiglu"}
    for r in out.values():
        assert set(r["loss_at"]) == {"2", "4", "6"}
        assert all(len(v) == 2 and np.isfinite(v).all() for v in r["loss_at"].values())
        # an untrained char model starts near the uniform loss log(28) = 3.33
        assert all(2.5 < v < 3.6 for v in r["loss_at"]["2"])
        assert len(r["val_loss"]) == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output(tmp_path, capsys):
    argv = [
        "train",
        "--act",
        "relu",
        "--steps",
        "3",
        "--seeds",
        "0",
        "--png",
        str(tmp_path / "c.png"),
        *TINY,
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| act | loss @ 1 | loss @ 2 | loss @ 3 | val loss |" in text
    assert "| relu |" in text


def test_report_section(tmp_path, monkeypatch):
    real = cmd.compare

    def tiny_compare(acts, seeds, steps, **kwargs):
        data = cmd.TimeMachine(num_steps=8, num_train=200, num_val=10)
        return real(
            acts,
            seeds,
            3,
            data=data,
            progress=False,
            num_hiddens=16,
            num_heads=2,
            num_blks=1,
            batch_size=4,
        )

    monkeypatch.setattr(cmd, "compare", tiny_compare)
    section = cmd.report_section(tmp_path, quick=True)
    assert section.startswith("## GELU vs SwiGLU")
    assert "| gelu |" in section and "| swiglu |" in section
    assert "(train_losses.png)" in section and (tmp_path / "train_losses.png").exists()


def test_unknown_act_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--act", "tanh"])
    assert "invalid choice: 'tanh'" in capsys.readouterr().err
