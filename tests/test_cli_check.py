"""`blocklab check`: the table, its JSON form, the report section and its rows.

Rows are checked against independent values: hand-worked numbers (Student's
t interval, the QK-norm bound sqrt(p) = 8 at p = 64) and closed forms; the CLI
tests stub every measured part with fixed rows, so what the command prints is
known in advance.
"""

import json
import math

import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.cli import app as cli
from blocklab.experiments import check


def _strict(text):
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


STUB_ROWS = [  # given out of exercise order: the table sorts them
    check._row("ex. 4b: a model", 0.0388, 0.0425, 0.095, 0.02, False, "why it fails"),
    check._row("ex. 1a: an identity", 1.0, 1.0, 0.0, 1e-10, True),
]


@pytest.fixture
def stubbed(monkeypatch):
    """Replace every measured part by fixed rows (two claims, one holds)."""
    monkeypatch.setattr(check, "signal_rows", lambda **_: list(STUB_ROWS))
    for part in ("norm_rows", "count_rows"):
        monkeypatch.setattr(check, part, lambda **_: [])
    for part in ("post_ln_factor_rows", "identity_rows", "qk_rows"):
        monkeypatch.setattr(check, part, lambda: [])


def test_json_is_one_object_with_the_rows_in_exercise_order(stubbed, capsys):
    assert cli.main(["check", "--json"]) == 0
    out = _strict(capsys.readouterr().out)
    assert out["held"] == 1 and out["total"] == 2
    assert out["num_seeds"] == 4 and out["quick"] is True
    assert [r["claim"] for r in out["rows"]] == [
        "ex. 1a: an identity",
        "ex. 4b: a model",
    ]
    assert set(out["rows"][1]) == set(check.KEYS)
    assert out["rows"][1]["measured"] == 0.0425
    assert out["rows"][1]["note"] == "why it fails"


def test_table_prints_every_column_and_flags_failures(stubbed, capsys):
    assert cli.main(["check", "--num-seeds", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "| claim | closed form | measured | discrepancy | tolerance | holds |"
    )
    assert (
        "| ex. 4b: a model | 0.0388 | 0.0425 | 0.095 | 0.02 | **no**: why it fails |"
        in out
    )
    assert "| ex. 1a: an identity | 1 | 1 | 0 | 1e-10 | yes |" in out


def test_report_section_counts_the_claims_and_explains_failures(stubbed, tmp_path):
    from blocklab.experiments import check as cmd

    section = cmd.report_section(tmp_path, quick=True)
    assert section.startswith("## ")
    assert "1 of 2 claims hold" in section
    assert "c_attn_1 at finite n" in section  # the causes of the disagreements


def test_a_non_finite_measurement_is_null_in_json(monkeypatch, capsys):
    bad = check._row("ex. 2: diverged", 1.0, math.nan, math.nan, 1e-10, False)
    monkeypatch.setattr(check, "check_rows", lambda **_: [bad])
    assert cli.main(["check", "--json"]) == 0
    row = _strict(capsys.readouterr().out)["rows"][0]
    assert row["measured"] is None and row["discrepancy"] is None


def test_seed_row_uses_students_t_interval():
    # 4 samples, mean 1.0, sample std s: half-width t_{0.995, 3} s / sqrt(4)
    row = check._seed_row("ex. 4a: x", 1.3, [0.9, 1.0, 1.1, 1.0], note="n")
    s = math.sqrt((0.1**2 * 2) / 3)
    assert row["tolerance"] == pytest.approx(5.841 * s / 2 / 1.3, rel=1e-3)
    assert row["discrepancy"] == pytest.approx(0.3 / 1.3)
    assert row["measured"] == pytest.approx(1.0)
    assert not row["holds"] and row["note"] == "n"


def test_seed_row_holds_within_noise_and_in_log_space():
    row = check._seed_row("ex. 5a: x", 1.0, [0.9, 1.0, 1.1, 1.0])
    assert row["holds"] and row["note"] == ""
    # geometric mean of 0.5 and 2 is 1: holds for closed form 1 in log space
    row = check._seed_row("ex. 5a: y", 1.0, [0.5, 2.0, 0.5, 2.0], log=True)
    assert row["measured"] == pytest.approx(1.0) and row["holds"]


def test_exact_rows_refuse_an_off_by_one_claim():
    assert check._exact_row("ex. 8a: x", 787200, 787200)["holds"]
    wrong = check._exact_row("ex. 8a: x", 787200, 787201)
    assert not wrong["holds"] and wrong["discrepancy"] == 1


@pytest.mark.slow
def test_identity_rows_all_hold():
    rows = check.identity_rows()
    assert len(rows) == 13
    assert all(r["holds"] and r["discrepancy"] <= 1e-10 for r in rows)


def test_count_and_qk_rows_hold_against_hand_values():
    counts = {r["claim"]: r for r in check.count_rows(quick=True)}
    chapter = next(r for c, r in counts.items() if "(chapter: 787200)" in c)
    assert chapter["measured"] == 787200 and chapter["holds"]
    assert all(r["holds"] for r in counts.values())
    qk = check.qk_rows()
    unit = next(r for r in qk if "unit gains" in r["claim"])
    # QK-norm with unit gains at p = 64: |q.k|/sqrt(p) <= sqrt(p) = 8, attained
    assert unit["closed_form"] == 8.0 and unit["measured"] == pytest.approx(8, 1e-5)
    # the weight ratio exp(2 sqrt(p)) = e^16
    ratio = next(r for r in qk if "ratio of two attention weights" in r["claim"])
    assert ratio["closed_form"] == pytest.approx(math.exp(16))
    assert all(r["holds"] for r in qk)


def test_post_ln_factor_in_branch_mean_squares_holds():
    per_c, common = check.post_ln_factor_rows(2, num_seeds=4)
    assert per_c["holds"], per_c
    assert common["closed_form"] <= per_c["closed_form"]  # Jensen


def test_seeds_are_validated():
    with pytest.raises(ConfigError, match="num_seeds must"):
        check.run_check(num_seeds=1)
    with pytest.raises(ConfigError, match="num_seeds must be an int"):
        check.run_check(num_seeds=True)


@pytest.mark.slow
def test_full_quick_table_flags_exactly_the_explained_disagreements():
    result = check.run_check(num_seeds=4, quick=True, gpt1=True)
    rows = {r["claim"]: r for r in result.rows}
    for claim, row in rows.items():
        assert row["holds"] or row["note"], claim  # every failure is explained
    # the exercise's exact finite-n model misses the selection term ...
    finite = next(r for c, r in rows.items() if "exercise's model, exactly" in c)
    assert not finite["holds"]
    # ... which restored, the prediction holds, as does the large-n form
    assert next(r for c, r in rows.items() if "selection term added" in c)["holds"]
    # GPT-1: the full block collapses faster than the formula, attention only does not
    assert not next(r for c, r in rows.items() if c.startswith("ex. 5c: GPT-1 (d=768"))[
        "holds"
    ]
    assert next(r for c, r in rows.items() if "GPT-1 init, FFN removed" in c)["holds"]


@pytest.mark.slow  # 37 s; chunked signal sweeps are tested in tests/test_signal.py
def test_measuring_a_few_seeds_at_a_time_gives_each_seed_its_own_values(
    monkeypatch,
):
    """Seeds are measured in chunks (to bound memory); seed k gets the same
    stack and input in any chunking: chunks of 1 and 2 give the values of all
    three seeds at once, and the seeds differ from each other."""
    opts = dict(num_blks=2, num_hiddens=32, num_heads=4)
    runs = {}
    for chunk in (3, 2, 1):
        monkeypatch.setattr(check, "_CHUNK", chunk)
        runs[chunk] = check._measure(3, **opts).token_spread
    assert runs[3].shape == (3, 2)
    np.testing.assert_allclose(runs[2], runs[3], rtol=1e-6)
    np.testing.assert_allclose(runs[1], runs[3], rtol=1e-6)
    assert len({round(float(v), 6) for v in runs[3][:, -1]}) == 3
