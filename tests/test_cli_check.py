"""`blocklab check`: the table, its JSON form, the report section and its rows."""

import json
import math

import pytest

from blocklab import cli
from blocklab.commands import check


def _stub_rows(*_, **__):
    return [
        check._row("ex. 1a: an identity", 1.0, 1.0, 0.0, 1e-10, True),
        check._row(
            "ex. 4b: a model", 0.0388, 0.0425, 0.095, 0.02, False, "why it fails"
        ),
    ]


@pytest.fixture
def stubbed(monkeypatch):
    """Replace the expensive parts (signal runs, timings) by fixed rows."""
    monkeypatch.setattr(check, "signal_rows", _stub_rows)
    monkeypatch.setattr(check, "norm_rows", lambda **_: [])
    monkeypatch.setattr(check, "post_ln_factor_rows", lambda: [])
    monkeypatch.setattr(check, "identity_rows", lambda: [])


def test_json_is_a_list_of_rows_with_the_documented_keys(stubbed, capsys):
    assert cli.main(["check", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert isinstance(rows, list) and rows
    for row in rows:
        assert set(row) == set(check.KEYS)
        assert row["holds"] == (row["discrepancy"] <= row["tolerance"])
    assert [r["claim"][:5] for r in rows] == sorted(r["claim"][:5] for r in rows)


def test_table_prints_every_column_and_flags_failures(stubbed, capsys):
    assert cli.main(["check", "--seeds", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "| claim | closed form | measured | discrepancy | tolerance | holds |"
    )
    assert (
        "| ex. 4b: a model | 0.0388 | 0.0425 | 0.095 | 0.02 | **no**: why it fails |"
        in out
    )
    assert "| ex. 1a: an identity | 1 | 1 | 0 | 1e-10 | yes |" in out


def test_report_section_has_heading_count_and_explanations(stubbed, tmp_path):
    section = check.report_section(tmp_path, quick=True)
    assert section.startswith("## ")
    rows = check.check_rows(seeds=2, quick=True)
    assert f"{sum(r['holds'] for r in rows)} of {len(rows)} claims hold" in section
    assert "c_attn_1 at finite n" in section  # the causes of the disagreements


def test_seed_row_uses_students_t_interval():
    # 4 samples, mean 1.0, sample std s: half-width t_{0.995, 3} s / sqrt(4)
    row = check._seed_row("ex. 4a: x", 1.3, [0.9, 1.0, 1.1, 1.0], note="n")
    s = math.sqrt((0.1**2 * 2) / 3)
    assert row["tolerance"] == pytest.approx(5.841 * s / 2 / 1.3, rel=1e-3)
    assert row["discrepancy"] == pytest.approx(0.3 / 1.3)
    assert row["measured"] == pytest.approx(1.0)
    assert not row["holds"] and row["note"] == "n"


@pytest.mark.slow
def test_identity_rows_all_hold():
    rows = check.identity_rows()
    assert len(rows) == 13
    assert all(r["holds"] and r["discrepancy"] <= 1e-10 for r in rows)


def test_exact_rows_hold():
    for row in check.count_rows(quick=True) + check.qk_rows():
        assert row["holds"], row


def test_post_ln_factor_in_branch_mean_squares_holds():
    per_c, common = check.post_ln_factor_rows(2, seeds=4)
    assert per_c["holds"], per_c
    assert common["closed_form"] <= per_c["closed_form"]  # Jensen


def test_seeds_are_validated():
    with pytest.raises(ValueError, match="seeds must be >= 2"):
        check.check_rows(seeds=1)


@pytest.mark.slow
def test_full_quick_table_flags_exactly_the_explained_disagreements():
    rows = {r["claim"]: r for r in check.check_rows(seeds=4, quick=True, gpt1=True)}
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
