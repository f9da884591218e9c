"""Issue 23, the last two items.

6. A 1-D lengths array on a batch whose `B == T` is refused with both forms
   (`(1, T)` per query, `(B, 1)` per sequence) at every entry point that takes
   `valid_lens`; the documented forms equal a NumPy loop; the library's own
   causal lengths and `generate(lengths=(B,))` work at `B == T`.
8. The multi-process join meets every peer in Python first: process 0 whose
   peer never starts raises `RuntimeError` naming it (no SIGABRT), a late
   peer still joins, duplicate / unknown ids and a different process count are
   refused on both sides. Every child process is ended by its pid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError
from blocklab.nn import functional as F

# -- item 6: lengths ----------------------------------------------------------

D, H = 16, 2


def _np_masked_softmax(scores, lens):
    """NumPy float64 loop: row (..., i) softmax over keys j < lens[..., i];
    a row with no visible key is uniform (the library's MASK_VALUE rule)."""
    s = np.asarray(scores, np.float64)
    lens = np.broadcast_to(np.asarray(lens), s.shape[:-1])
    out = np.zeros_like(s)
    for idx in np.ndindex(*s.shape[:-1]):
        L = min(int(lens[idx]), s.shape[-1])
        if L == 0:
            out[idx] = 1.0 / s.shape[-1]
            continue
        e = np.exp(s[idx][:L] - s[idx][:L].max())
        out[idx][:L] = e / e.sum()
    return out


@pytest.fixture(scope="module")
def mods():
    k = jax.random.split(jax.random.key(0), 4)

    def moe_block(key):
        def ffn_factory(*, key):
            return bl.MoEFeedForward(D, 4, 2, key=key)

        return bl.TransformerBlock(D, H, ffn_factory=ffn_factory, key=key)

    return {
        "mha": bl.MultiHeadAttention(D, H, num_kv_heads=1, key=k[0]),
        "block": bl.TransformerBlock(D, H, key=k[1]),
        "stack": bl.Stack(lambda kk: bl.TransformerBlock(D, H, key=kk), 2, key=k[2]),
        "moe_stack": bl.Stack(moe_block, 1, key=k[3]),
    }


#: Every entry point that takes `valid_lens` on a batch `x` of shape (B, T, D).
ENTRIES = {
    "masked_softmax": lambda m, x, L: F.masked_softmax(x[..., :, : x.shape[-2]], L),
    "attention-reference": lambda m, x, L: m["mha"](x, L, impl="reference"),
    "attention-chunked": lambda m, x, L: m["mha"](x, L, impl="chunked"),
    "attention-fused": lambda m, x, L: m["mha"](x, L, impl="fused"),
    "attention.trace": lambda m, x, L: m["mha"].trace(x, L).output,
    "block": lambda m, x, L: m["block"](x, L),
    "block.trace": lambda m, x, L: m["block"].trace(x, L).output,
    "stack": lambda m, x, L: m["stack"](x, L),
    "stack.scan": lambda m, x, L: m["stack"].scan(x, L)[0],
    "stack_moe_stats": lambda m, x, L: bl.nn.moe.stack_moe_stats(m["moe_stack"], x, L)[
        0
    ],
}


def _x(B, T, seed=1):
    # masked_softmax reads the first T columns as (B, T, T) scores: D >= T
    return jax.random.normal(jax.random.key(seed), (B, T, D))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("jit", [False, True])
def test_a_1d_lengths_array_on_a_batch_with_b_equal_t_is_refused_with_both_forms(
    mods, entry, jit, monkeypatch
):
    # as in a user's program: the suite's run-time shape checker (jaxtyping)
    # would catch the B != T shape first, with a TypeCheckError
    import jaxtyping

    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    fn = ENTRIES[entry]
    if jit:
        fn = eqx.filter_jit(fn)
    x = _x(4, 4)
    with pytest.raises(ConfigError, match=r"ambiguous.*\(1, 4\).*\(4, 1\)") as err:
        fn(mods, x, jnp.array([4, 1, 3, 2]))
    assert "per query" in str(err.value) and "per sequence" in str(err.value)
    # a (B,) array with B != T never broadcasts as (T,): refused naming (B, 1)
    with pytest.raises(ConfigError, match=r"\(B, 1\) for one length per sequence"):
        fn(mods, _x(3, 4), jnp.array([4, 1, 3]))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize(("B", "T"), [(4, 4), (5, 3)])
def test_every_documented_form_equals_a_loop_over_single_sequences(mods, entry, B, T):
    """(1, T) and (T,) per query, (B, 1) per sequence, (B, T) per both: the
    batch equals the loop of single sequences (T, d) with their (T,) lengths;
    a single sequence has no batch axis to confuse."""
    fn = eqx.filter_jit(ENTRIES[entry])
    x = _x(B, T, seed=B + T)
    rng = np.random.default_rng(B * 10 + T)
    per_query = rng.integers(1, T + 1, T)
    per_seq = rng.integers(1, T + 1, B)
    full = rng.integers(0, T + 2, (B, T))
    forms = [
        (per_query[None], np.broadcast_to(per_query, (B, T))),
        (per_seq[:, None], np.broadcast_to(per_seq[:, None], (B, T))),
        (full, full),
        (np.int32(2), np.full((B, T), 2)),
    ]
    if B != T:
        forms.append((per_query, np.broadcast_to(per_query, (B, T))))
    for given, rows in forms:
        out = np.asarray(fn(mods, x, jnp.asarray(given)))
        loop = np.stack(
            [np.asarray(fn(mods, x[b], jnp.asarray(rows[b]))) for b in range(B)]
        )
        np.testing.assert_allclose(out, loop, rtol=2e-5, atol=2e-6, err_msg=str(given))


@pytest.mark.parametrize(("B", "T"), [(4, 4), (3, 5)])
def test_masked_softmax_and_attention_weights_equal_a_numpy_loop(mods, B, T):
    rng = np.random.default_rng(B + T)
    scores = rng.normal(size=(B, T, T)).astype(np.float32)
    per_query = rng.integers(1, T + 1, T)
    per_seq = rng.integers(0, T + 1, B)
    for given in (per_query[None], per_seq[:, None]):
        got = F.masked_softmax(jnp.asarray(scores), jnp.asarray(given))
        np.testing.assert_allclose(got, _np_masked_softmax(scores, given), atol=1e-6)
        # the attention layer's weights: its logits through the same NumPy rule,
        # per head (lengths broadcast over the head axis)
        tr = mods["mha"].trace(_x(B, T), jnp.asarray(given))
        ref = _np_masked_softmax(tr.logits, np.asarray(given)[:, None])
        np.testing.assert_allclose(tr.weights, ref, atol=1e-6)
    # a single sequence: 1-D is per query, whatever its size
    one = F.masked_softmax(jnp.asarray(scores[0]), jnp.asarray(per_query))
    np.testing.assert_allclose(one, _np_masked_softmax(scores[0], per_query), atol=1e-6)


def test_the_ambiguity_rule_in_general():
    from blocklab.nn.functional import _ambiguous_lengths as amb

    assert (
        amb((4,), (4, 4)) and amb((4,), (2, 4, 4)) and amb((4, 4), (3, 4, 4)) is False
    )
    assert amb((4, 4), (4, 4, 4))  # per query over (B, T), or per sequence over (N, B)
    assert not amb((4,), (4,)) and not amb((1,), (4, 4)) and not amb((), (4, 4))
    assert (
        not amb((1, 4), (4, 4)) and not amb((4, 1), (4, 4)) and not amb((4, 4), (4, 4))
    )
    assert not amb((4,), (3, 4)) and not amb((3,), (3, 4))  # one reading only
    # causal_lengths has the full number of axes: never ambiguous
    for shape in [(4,), (4, 4), (2, 4, 4)]:
        c = F.causal_lengths(shape)
        assert c.ndim == len(shape) and not amb(c.shape, shape)
        assert np.array_equal(
            np.broadcast_to(c, shape)[..., :], np.broadcast_to(np.arange(1, 5), shape)
        )
    with pytest.raises(ConfigError, match="causal_lengths"):
        F.causal_lengths(())


@pytest.fixture(scope="module")
def lms():
    V = 11
    return {
        "charlm": bl.CharLM(V, D, H, 1, max_len=8, key=jax.random.key(5)),
        "llama": bl.DecoderLM(
            bl.DecoderConfig.llama(V, D, H, 1, num_kv_heads=1, max_len=8),
            key=jax.random.key(6),
        ),
    }


@pytest.mark.parametrize("name", ["charlm", "llama"])
def test_models_and_losses_use_causal_lengths_at_b_equal_t(lms, name):
    """The models' own causal lengths work on a batch with B == T: logits equal
    the loop over rows, and `lm_loss` equals the NumPy mean of the rows'
    cross-entropies."""
    model = lms[name]
    rng = np.random.default_rng(0)
    X = rng.integers(0, 11, (6, 6)).astype(np.int32)
    Y = rng.integers(0, 11, (6, 6)).astype(np.int32)
    logits = np.asarray(eqx.filter_jit(model)(X), np.float64)
    rows = np.stack([np.asarray(model(X[b]), np.float64) for b in range(6)])
    np.testing.assert_allclose(logits, rows, rtol=1e-5, atol=1e-5)
    z = rows - rows.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, Y[..., None], -1).mean()
    loss = bl.training.losses.lm_loss(model, jnp.asarray(X), jnp.asarray(Y))
    np.testing.assert_allclose(float(loss), ce, rtol=1e-5)


def test_generate_lengths_are_one_per_row_also_when_b_equals_t(lms):
    """`generate(lengths=(B,))` with B == T: row b continues its first
    lengths[b] tokens, as generating that row alone does."""
    model = lms["charlm"]
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, 11, (3, 3)).astype(np.int32)
    lengths = np.array([3, 1, 2], np.int32)
    out = np.asarray(bl.generate(model, prompts, 2, lengths=lengths))
    for b in range(3):
        L = int(lengths[b])
        alone = np.asarray(bl.generate(model, prompts[b, :L], 2))
        assert np.array_equal(out[b, : L + 2], alone), b


def test_mup_activation_rms_at_b_equal_t(lms):
    from blocklab.experiments.mup import activation_rms

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (6, 6)), jnp.int32)
    rms = activation_rms(lms["charlm"], tokens)
    assert all(np.isfinite(float(v)) for v in rms.values())


# -- item 8: the pre-join handshake ---------------------------------------------


def _free_address():
    from blocklab.training.launcher import free_port

    return f"127.0.0.1:{free_port()}"


def _in_threads(*calls):
    """Run each `fn()` in a thread; return each one's result or exception."""
    results = [None] * len(calls)

    def go(i, fn):
        try:
            results[i] = fn()
        except Exception as err:  # noqa: BLE001 - returned to the test
            results[i] = err

    threads = [
        threading.Thread(target=go, args=(i, fn), daemon=True)
        for i, fn in enumerate(calls)
    ]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_handshake_all_peers_join_in_any_order_and_a_probe_does_not_count():
    import socket

    from blocklab.training.distributed import _gather_peers, _join_coordinator

    addr = _free_address()
    host, port = addr.rsplit(":", 1)

    def probe():  # a port check that connects while process 0 waits, says nothing
        time.sleep(0.3)
        for _ in range(50):
            try:
                with socket.create_connection((host, int(port)), timeout=2):
                    return "connected"
            except OSError:
                time.sleep(0.05)
        return "never connected"

    # peers 2 and 1 first (they retry until process 0 listens), then process 0,
    # the probe, and peer 3 last
    res = _in_threads(
        lambda: _join_coordinator(addr, 2, 4, 10),
        lambda: _join_coordinator(addr, 1, 4, 10),
        lambda: (time.sleep(0.3), _gather_peers(addr, 4, 10))[1],
        probe,
        lambda: (time.sleep(1.5), _join_coordinator(addr, 3, 4, 10))[1],
    )
    assert res == [None, None, None, "connected", None], res
    # the port is free at once, even without SO_REUSEADDR: each peer closed
    # first, so no TIME_WAIT is left on the coordinator's port
    with socket.socket() as s:
        s.bind((host, int(port)))


@pytest.mark.parametrize(
    ("peers", "match"),
    [([(1, 3), (1, 3)], "process id 1 joined twice"),
     ([(1, 2)], "started with BLOCKLAB_NUM_PROCESSES=2, process 0 with 3"),
     ([(5, 3)], r"process id 5 is not one of 1..2")],
)  # fmt: skip
def test_handshake_refuses_duplicate_unknown_and_miscounted_peers_on_both_sides(
    peers, match
):
    from blocklab.training.distributed import _gather_peers, _join_coordinator

    addr = _free_address()
    t0 = time.monotonic()
    res = _in_threads(
        lambda: _gather_peers(addr, 3, 20),
        *[lambda p=p, n=n: _join_coordinator(addr, p, n, 20) for p, n in peers],
    )
    assert time.monotonic() - t0 < 10  # at once, not after the timeout
    assert isinstance(res[0], RuntimeError) and re.search(match, str(res[0])), res
    assert any(
        isinstance(r, RuntimeError) and "refused process" in str(r) for r in res[1:]
    )
    assert all(isinstance(r, RuntimeError) for r in res[1:]), res


def test_handshake_timeouts_name_the_missing_ids_the_address_and_the_timeout():
    from blocklab.training.distributed import _gather_peers, _join_coordinator

    addr = _free_address()
    res = _in_threads(
        lambda: _gather_peers(addr, 4, 2), lambda: _join_coordinator(addr, 2, 4, 5)
    )
    assert isinstance(res[0], RuntimeError), res
    msg = str(res[0])
    assert "[1, 3] never joined" in msg and addr in msg and "2 s" in msg
    # the peer that did come is told, not left waiting
    assert isinstance(res[1], RuntimeError) and "never joined" in str(res[1])
    # a peer alone: no coordinator
    with pytest.raises(
        RuntimeError, match=f"no coordinator answered at {addr} within 1 s"
    ):
        _join_coordinator(addr, 1, 2, 1)


JOIN = textwrap.dedent(
    """
    import json, os, sys, time
    time.sleep(float(os.environ.get("DELAY", "0")))
    from blocklab.training import distributed
    job = distributed.initialize()
    import jax, numpy as np
    from jax.experimental import multihost_utils
    seen = multihost_utils.process_allgather(np.array([jax.process_index()]))
    print(json.dumps({"job": [job.process_id, job.num_processes],
                      "seen": np.ravel(seen).tolist()}), flush=True)
    """
)


def _start(pid, addr, num, timeout, delay=0.0):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        BLOCKLAB_COORDINATOR=addr,
        BLOCKLAB_NUM_PROCESSES=str(num),
        BLOCKLAB_PROCESS_ID=str(pid),
        BLOCKLAB_INIT_TIMEOUT=str(timeout),
        DELAY=str(delay),
    )
    return subprocess.Popen(
        [sys.executable, "-c", JOIN], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _finish(procs, timeout):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outs


def test_process_0_whose_peer_never_starts_raises_runtime_error_not_sigabrt():
    addr = _free_address()
    p0 = _start(0, addr, 2, 3)
    t0 = time.monotonic()
    ((out, err),) = _finish([p0], timeout=60)
    assert p0.returncode == 1, (p0.returncode, err[-2000:])  # not -SIGABRT
    assert time.monotonic() - t0 < 30
    last = err.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: initialize: process 0 waited 3 s"), err[
        -2000:
    ]
    assert "process id(s) [1] never joined" in last and addr in last


def test_a_peer_that_starts_late_within_the_timeout_joins():
    addr = _free_address()
    procs = [_start(0, addr, 2, 30), _start(1, addr, 2, 30, delay=3.0)]
    outs = _finish(procs, timeout=120)
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, (i, err[-2000:])
        res = json.loads(out.strip().splitlines()[-1])
        assert res == {"job": [i, 2], "seen": [0, 1]}
