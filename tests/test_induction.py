"""The induction-heads study (`blocklab.experiments.induction`, `blocklab induction`).

The data generator, the scores, the losses and the head masks are checked
against hand-worked values and NumPy loops; the edits against the library's
single-layer edit; the result's recovery and JSON on a hand-built result; one
tiny run end to end through the CLI (`--json`, strict). The slow test trains
the quick protocol and checks the finding itself: ablating the induction
heads hurts the in-context loss more than ablating random heads, and patching
them recovers more.
"""

import contextlib
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strict_json import strict_object, strict_round_trip

import blocklab as bl
from blocklab import interp
from blocklab._validate import ConfigError
from blocklab.cli import main
from blocklab.experiments import induction as ind

TINY = ind.InductionProtocol(
    "tiny", 3, seeds=(0, 1), vocab_size=8, segment_len=4, min_repeat=2,
    num_hiddens=16, num_heads=2, batch_size=8, warmup_steps=1, eval_sequences=4,
    num_random=2, shorter=3, lens_sequences=2, steps_per_call=3,
)  # fmt: skip


# ------------------------------------------------------------------- data
def test_repeated_segments_is_r_r_at_full_length():
    S, V = 5, 7
    t = np.asarray(ind.repeated_segments(jax.random.key(0), 64, S, V))
    assert t.shape == (64, 2 * S) and t.dtype == np.int32
    assert t.min() >= 0 and t.max() < V
    np.testing.assert_array_equal(t[:, S:], t[:, :S])  # the second copy is r
    assert len({tuple(r) for r in t[:, :S]}) > 60  # r is drawn per row


def test_repeated_segments_ends_in_a_repeat_of_each_drawn_length():
    S, V, lo = 6, 50, 2
    t = np.asarray(ind.repeated_segments(jax.random.key(1), 200, S, V, min_repeat=lo))
    T = 2 * S
    seen = set()
    for row in t:
        # the longest P in [lo, S] whose last P tokens repeat the P before
        fits = [
            P
            for P in range(lo, S + 1)
            if (row[T - P :] == row[T - 2 * P : T - P]).all()
        ]
        assert fits, row
        seen.add(max(fits))
    assert seen == set(range(lo, S + 1))  # every length is drawn
    one = np.asarray(
        ind.repeated_segments(jax.random.key(2), 20, S, V, min_repeat=3, max_repeat=3)
    )
    np.testing.assert_array_equal(one[:, -3:], one[:, -6:-3])


def test_repeated_segments_refuses_bad_lengths():
    with pytest.raises(ConfigError, match="max_repeat must lie in"):
        ind.repeated_segments(jax.random.key(0), 2, 4, 8, max_repeat=5)
    with pytest.raises(ConfigError, match="min_repeat must lie in"):
        ind.repeated_segments(jax.random.key(0), 2, 4, 8, min_repeat=4, max_repeat=3)


def test_corrupt_first_copy_changes_every_first_token_only():
    t = ind.repeated_segments(jax.random.key(3), 100, 6, 5)
    c = np.asarray(ind.corrupt_first_copy(jax.random.key(4), t, 5))
    t = np.asarray(t)
    assert (c[:, :6] != t[:, :6]).all()
    np.testing.assert_array_equal(c[:, 6:], t[:, 6:])
    assert c.min() >= 0 and c.max() < 5
    # (r + u) mod V with u uniform in 1..V-1: every other token is reached
    assert set(np.unique((c[:, :6] - t[:, :6]) % 5)) == {1, 2, 3, 4}


def test_repeated_segments_source_gives_next_token_pairs():
    X, Y = ind.RepeatedSegments(8, 4, 3).batch(jax.random.key(5))
    full = ind.repeated_segments(jax.random.key(5), 3, 4, 8)
    np.testing.assert_array_equal(X, full[:, :-1])
    np.testing.assert_array_equal(Y, full[:, 1:])


# ----------------------------------------------------------------- scores
def _uniform_causal(T):
    return jnp.tril(jnp.ones((T, T))) / jnp.arange(1, T + 1)[:, None]


def test_prefix_matching_score_of_a_hand_built_pattern():
    S, T, w = 4, 8, 0.7
    # weight w on the induction key i - S + 1 of each query of the second
    # copy, the rest spread over the other causal keys
    A = np.zeros((T, T))
    for i in range(T):
        A[i, : i + 1] = 1.0 / (i + 1)
        if i >= S:
            A[i, : i + 1] = (1 - w) / i
            A[i, i - S + 1] = w
    A = jnp.asarray(A)
    assert float(bl.interp.prefix_matching_scores(A, S)) == pytest.approx(w, abs=1e-6)
    # uniform causal attention: (1/S) sum_{i=S}^{2S-1} 1/(i+1) = (1/5+1/6+1/7+1/8)/4
    want = (1 / 5 + 1 / 6 + 1 / 7 + 1 / 8) / 4
    U = _uniform_causal(T)
    assert float(bl.interp.prefix_matching_scores(U, S)) == pytest.approx(
        want, rel=1e-6
    )
    # all weight on the previous token: no prefix matching (S > 2), score 1
    prev = jnp.eye(T, k=-1).at[0, 0].set(1.0)
    assert float(bl.interp.prefix_matching_scores(prev, S)) == 0.0
    assert float(bl.interp.previous_token_scores(prev)) == 1.0
    # (1/(T-1)) sum_{i=1}^{T-1} 1/(i+1) for the uniform pattern
    want_prev = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    assert float(bl.interp.previous_token_scores(U)) == pytest.approx(
        want_prev, rel=1e-6
    )


def test_scores_keep_the_leading_axes_of_a_captured_pattern():
    """A fake `hook_pattern` capture `(L, B, H, T, T)`: layer 1 head 0 is the
    hand-built induction head, every other head attends uniformly."""
    L, B, H, S = 2, 3, 2, 4
    T = 2 * S
    induction = jnp.zeros((T, T)).at[jnp.arange(S, T), jnp.arange(1, S + 1)].set(1.0)
    induction = induction.at[jnp.arange(S), jnp.arange(S)].set(1.0)
    pattern = jnp.broadcast_to(_uniform_causal(T), (L, B, H, T, T))
    pattern = pattern.at[1, :, 0].set(induction)
    scores = jnp.mean(bl.interp.prefix_matching_scores(pattern, S), axis=1)
    assert scores.shape == (L, H)
    assert float(scores[1, 0]) == 1.0
    assert float(jnp.max(scores.at[1, 0].set(0.0))) < 0.2


def test_prefix_matching_refuses_a_pattern_too_short():
    with pytest.raises(ConfigError, match="T >= 2 \\* repeat"):
        bl.interp.prefix_matching_scores(jnp.ones((6, 6)), 4)


def test_token_losses_match_a_numpy_loop():
    logits = jax.random.normal(jax.random.key(6), (2, 5, 7))
    tokens = jax.random.randint(jax.random.key(7), (2, 5), 0, 7)
    got = np.asarray(ind.token_losses(logits, tokens))
    z, t = np.asarray(logits, np.float64), np.asarray(tokens)
    want = np.zeros((2, 4))
    for b in range(2):
        for i in range(4):
            zi = z[b, i] - z[b, i].max()
            want[b, i] = -(zi[t[b, i + 1]] - np.log(np.exp(zi).sum()))
    np.testing.assert_allclose(got, want, rtol=1e-5)


# ------------------------------------------------------------------ heads
def test_random_heads_are_as_many_others():
    heads = jnp.array([[False, True, False, False], [True, False, False, False]])
    for s in range(20):
        r = np.asarray(bl.interp.random_heads(jax.random.key(s), heads))
        assert r.sum() == 2 and not (r & np.asarray(heads)).any()
    many = jnp.array([[True, True, True], [True, False, True]])
    r = np.asarray(bl.interp.random_heads(jax.random.key(0), many))
    np.testing.assert_array_equal(r, ~np.asarray(many))  # fewer others: all of them


def _model(**kw):
    cfg = bl.models.DecoderConfig(11, 16, 4, 3, positions="rope", max_len=16, **kw)
    return bl.DecoderLM(cfg, key=jax.random.key(0))


def test_heads_edit_ablates_the_masked_heads_of_each_layer():
    """Mask: layer 0 head 2, layer 2 heads 0 and 3. Reference: one edit per
    layer with the library's single-layer site names."""
    m = _model()
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, 11)
    mask = jnp.zeros((3, 4), bool).at[0, 2].set(True).at[2, 0].set(True)
    mask = mask.at[2, 3].set(True)
    got = interp.intervene(m, ids, {ind.Z: bl.interp.heads_edit(mask)})
    want = interp.intervene(
        m, ids,
        {"blocks.0.attn.hook_z": interp.ablate_heads([2]),
         "blocks.2.attn.hook_z": interp.ablate_heads([0, 3])},
    )  # fmt: skip
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert float(jnp.max(jnp.abs(got - m(ids)))) > 1e-3  # it did something
    none = interp.intervene(
        m, ids, {ind.Z: bl.interp.heads_edit(jnp.zeros((3, 4), bool))}
    )
    np.testing.assert_array_equal(none, m(ids))  # no heads: the identity


def test_heads_edit_patches_a_clean_run_into_a_corrupted_one():
    """Mask: layer 0 head 1, layer 2 heads 0 and 2. Reference: the library's
    `patch` at single-layer sites. Every head patched: the recorded `hook_z`
    is the clean run's; no head: nothing changes."""
    m = _model()
    clean = ind.repeated_segments(jax.random.key(2), 2, 4, 11)
    corrupt = ind.corrupt_first_copy(jax.random.key(3), clean, 11)
    z = interp.capture(m, clean, ind.Z)[1][ind.Z]
    mask = jnp.zeros((3, 4), bool).at[0, 1].set(True).at[2, 0].set(True)
    mask = mask.at[2, 2].set(True)
    got = interp.intervene(m, corrupt, {ind.Z: bl.interp.heads_edit(mask, source=z)})
    want = interp.intervene(
        m, corrupt,
        {"blocks.0.attn.hook_z": interp.patch(z, index=[1], axis=-2),
         "blocks.2.attn.hook_z": interp.patch(z, index=[0, 2], axis=-2)},
    )  # fmt: skip
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert float(jnp.max(jnp.abs(got - m(corrupt)))) > 1e-3
    every = {ind.Z: bl.interp.heads_edit(jnp.ones((3, 4), bool), source=z)}
    np.testing.assert_array_equal(
        interp.capture(m, corrupt, ind.Z, edits=every)[1][ind.Z], z
    )
    empty = {ind.Z: bl.interp.heads_edit(jnp.zeros((3, 4), bool), source=z)}
    np.testing.assert_array_equal(interp.intervene(m, corrupt, empty), m(corrupt))


# ----------------------------------------------------------------- result
def _result(**changes):
    """A hand-built result: S = 4, V = 8, two seeds, 2 layers x 2 heads."""
    T1 = 7
    losses = {n: np.zeros((2, T1)) for n in ind.LOSSES}
    losses["clean"][:, :3] = 2.0  # first copy
    losses["clean"][:, 4:] = 0.5  # in-context (predictions 4..6)
    losses["corrupt"][:, 4:] = 3.0
    losses["patched"][:, 4:] = [[1.0], [2.0]]
    losses["patched_random"][:, 4:] = 3.0
    losses["ablated"][:, 4:] = 2.5
    losses["ablated_random"][:, 4:] = 0.6
    heads = np.array(
        [[[False, False], [True, False]], [[False, False], [False, False]]]
    )
    fields = dict(
        protocol=TINY, probe_steps=np.array([0, 3]),
        probes={n: np.ones((2, 2)) for n in ("first", "second", "score")},
        train_losses=np.ones((2, 3)), scores=np.where(heads, 0.9, 0.1),
        prev_scores=np.full((2, 2, 2), 0.2), short_scores=np.where(heads, 0.8, 0.0),
        heads=heads, num_random_heads=np.array([1.0, 0.0]), losses=losses,
        lens=None, lens_note="not run", seconds={"train": 1.0},
    )  # fmt: skip
    fields.update(changes)
    return ind.InductionResult(**fields)


def test_recovery_and_losses_of_a_hand_built_result():
    r = _result()
    np.testing.assert_allclose(r.first_copy_loss(), [2.0, 2.0])
    np.testing.assert_allclose(r.in_context_loss(), [0.5, 0.5])
    # (3 - 1) / (3 - 0.5) and (3 - 2) / (3 - 0.5)
    np.testing.assert_allclose(r.recovery(), [0.8, 0.4])
    np.testing.assert_allclose(r.recovery(random=True), [0.0, 0.0])
    np.testing.assert_array_equal(r.num_heads_found(), [1, 0])
    np.testing.assert_array_equal(r.content_based(), [True, False])
    np.testing.assert_array_equal(r.formed(), [True, False])
    assert r.head_names(0) == ["1.0"] and r.head_names(1) == []
    data = strict_round_trip(r.to_json())
    assert data["heads"] == [["1.0"], []]
    # seed 1 has no heads: the mean score over its heads is null, not NaN
    assert data["summary"]["their prefix-matching score"]["per_seed"] == [0.9, None]
    assert "| patching recovery, induction heads | 0.600 ± 0.283 | 0.800, 0.400 |" in (
        r.table()
    )


def test_result_unstacks_the_model_of_a_seed():
    import equinox as eqx

    keys = jax.random.split(jax.random.key(0), 2)
    stacked = eqx.filter_vmap(lambda k: bl.DecoderLM(TINY.config, key=k))(keys)
    r = _result(models=stacked)
    ids = jnp.arange(8) % 8
    one = bl.DecoderLM(TINY.config, key=keys[1])
    np.testing.assert_allclose(r.model(1)(ids), one(ids), atol=1e-6)
    with pytest.raises(ConfigError, match="k must lie in"):
        r.model(2)
    with pytest.raises(ConfigError, match="holds no models"):
        _result().model(0)


def test_heads_that_match_by_position_only_are_not_induction_heads():
    """The same heads, but scoring 0 on the shorter repeats: positional."""
    r = _result(short_scores=np.zeros((2, 2, 2)))
    np.testing.assert_array_equal(r.num_heads_found(), [1, 0])
    np.testing.assert_array_equal(r.content_based(), [False, False])
    np.testing.assert_array_equal(r.formed(), [False, False])


def test_recovery_without_a_gap_is_nan():
    r = _result()
    r.losses["corrupt"][:] = r.losses["clean"]
    assert np.isnan(r.recovery()).all()
    assert strict_round_trip(r.to_json())["recovery"] == [None, None]


def test_figures_of_a_hand_built_result(tmp_path):
    lens = {n: np.array([[1.0, 0.0], [2.0, 0.0]]) for n in ind.LENSES}
    paths = _result(lens=lens).figures(tmp_path)
    assert [p.name for p in paths] == [
        "induction_training.png", "induction_scores.png",
        "induction_loss_per_position.png", "induction_patching.png",
        "induction_lenses.png",
    ]  # fmt: skip
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert len(_result().figures(tmp_path)) == 4  # no lenses, no lens figure


def test_protocol_is_checked():
    with pytest.raises(ConfigError, match="shorter < segment_len"):
        TINY.replace(shorter=4)
    with pytest.raises(ConfigError, match="multiple of num_heads"):
        TINY.replace(num_hiddens=10, num_heads=4)
    with pytest.raises(ConfigError, match="positions must be one of"):
        TINY.replace(positions="alibi")
    with pytest.raises(ConfigError, match="must be distinct"):
        TINY.replace(seeds=(1, 1))


def test_run_refuses_a_protocol_that_is_not_one(plain_python):
    with pytest.raises(ConfigError, match="must be an InductionProtocol"):
        ind.run_induction({"steps": 3})


def test_report_estimates():
    q = ind.report_estimate(quick=True, full=False)
    assert 0 < q <= ind.report_estimate(quick=False, full=False)
    assert ind.report_estimate(quick=False, full=True) > q


# ------------------------------------------------------------------ a run
def test_cli_json_of_a_tiny_run(tmp_path, monkeypatch):
    """`blocklab induction --protocol quick --seeds 0 1 --steps 3 --json` (the
    quick protocol replaced by a tiny one): one strict JSON object, per-seed
    results of the vmapped program, the figures written."""
    monkeypatch.setitem(ind.PROTOCOLS, "quick", TINY.replace(steps=10))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main([
            "induction", "--protocol", "quick", "--seeds", "0", "1", "--steps", "3",
            "--out", str(tmp_path), "--no-progress", "--json",
        ])  # fmt: skip
    assert status == 0
    data = strict_object(out.getvalue())
    assert data["protocol"]["steps"] == 3 and data["seeds"] == [0, 1]
    assert np.shape(data["scores"]) == (2, 2, 2)  # (seeds, layers, heads)
    assert np.shape(data["losses_per_position"]["clean"]) == (2, 7)
    first = data["summary"][f"first-copy loss (log V = {math.log(8):.3f})"]
    assert abs(first["mean"] - math.log(8)) < 0.5  # 3 steps: about log V
    assert data["probe_steps"] == [0, 3]
    assert len(data["figures"]) == 5 and data["lens_kl"] is not None
    assert np.shape(data["lens_kl"]["jacobian"]) == (2, 2)
    for name in data["figures"]:
        assert (tmp_path / name.split("/")[-1]).exists()


def test_cli_refuses_bad_seeds_before_any_work(capsys):
    assert main(["induction", "--seeds", "1", "1", "--json"]) == 2
    assert "must be distinct" in strict_object(capsys.readouterr().out)["error"]
    assert main(["induction", "--steps", "0", "--json"]) == 2
    assert "--steps must lie in" in strict_object(capsys.readouterr().out)["error"]


@pytest.mark.slow  # about 20 s
def test_quick_protocol_finds_positional_heads_that_matter():
    """The quick protocol (one repeat length): heads that match prefixes form,
    zero-ablating them raises the in-context loss more than as many random
    heads, and patching them from the clean run recovers more of it; but
    they find the earlier copy by its distance, not its content."""
    r = ind.run_induction(ind.QUICK, lenses=False)
    assert (r.num_heads_found() > 0).all()
    assert (r.in_context_loss() < 0.5 * r.first_copy_loss()).all()
    assert (r.in_context_loss("ablated") > r.in_context_loss("ablated_random")).all()
    assert (r.recovery() > r.recovery(random=True)).all()
    assert not r.content_based().any()


@pytest.mark.slow  # about 2 min
def test_cpu_protocol_forms_induction_heads():
    """Repeats of 2 to 8 tokens: a previous-token head in layer 0, induction
    heads in layer 1 that keep their score on repeats of another length;
    ablating them takes the in-context loss back to the first copy's, and
    patching them recovers the clean run's in-context loss while as many
    other heads recover none. (The other heads are all of layer 0 here, with
    the previous-token head the induction heads read: ablating them hurts as
    much, which is why the comparison of ablations is not asserted.)"""
    r = ind.run_induction(ind.CPU.replace(steps=1500, seeds=(0, 1)), lenses=False)
    assert r.formed().all() and r.content_based().all()
    assert (r.heads[:, 1].sum(-1) > 0).all() and not r.heads[:, 0].any()
    assert (r.prev_scores[:, 0].max(-1) > 0.5).all()
    assert (r.in_context_loss("ablated") > 0.9 * r.first_copy_loss()).all()
    assert (r.recovery() > 0.8).all() and (r.recovery(random=True) < 0.2).all()
