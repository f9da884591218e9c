"""MoEFeedForward against a NumPy float64 loop over tokens; its statistics,
gradients, dispatch paths, errors, and MoE blocks through the FFN hook."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.nn.moe import route

D = 16


def _f64(module):
    return jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, module
    )


def _moe(E, k, **options):
    """A float64 MoE (float32 with jax_enable_x64 off), cached per configuration
    and per precision: a float32 test never reuses a float64 test's module."""
    return _moe_built(E, k, jax.config.read("jax_enable_x64"), **options)


@functools.cache
def _moe_built(
    E, k, x64, *, routing="mixtral", dispatch="dense", act="swiglu", bias=False
):
    """Built in one compiled program; `x64` is only part of the cache key."""

    @eqx.filter_jit
    def build(key):
        return bl.MoEFeedForward(
            D, E, k, routing=routing, dispatch=dispatch, act=act, bias=bias, key=key
        )

    moe = _f64(build(jax.random.key(0)))
    if bias:  # random biases, so a reference that ignored them would disagree
        rng = np.random.default_rng(100)

        def biases(m):
            layers = (m.experts.W_1, m.experts.W_2, m.experts.W_g)
            return [lin.bias for lin in layers if lin is not None]

        new = [jnp.asarray(rng.normal(0, 0.3, b.shape)) for b in biases(moe)]
        moe = eqx.tree_at(biases, moe, new)
    return moe


@eqx.filter_jit
def _trace(moe, x):
    return moe.trace(x)


@eqx.filter_jit
def _call(moe, x):
    return moe(x)


def _numpy_moe(moe, x):
    """The reference: per token, softmax, top-k by a full sort, gates, expert FFNs."""
    x = np.asarray(x, np.float64).reshape(-1, D)
    Wr = np.asarray(moe.router.weight, np.float64)
    out = np.zeros_like(x)
    logits = x @ Wr.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    counts = np.zeros(moe.num_experts)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[: moe.top_k]
        g = probs[t, chosen]
        if moe.routing == "mixtral":
            g = g / g.sum()
        for e, ge in zip(chosen, g, strict=True):
            counts[e] += 1
            sd = {
                f"ffn.{name}.{p}": np.asarray(getattr(getattr(moe.experts, name), p)[e])
                for name in ("W_1", "W_2", "W_g")
                if getattr(moe.experts, name) is not None
                for p in ("weight", "bias")
                if getattr(getattr(moe.experts, name), p) is not None
            }
            out[t] += ge * ref.ffn(sd, x[t : t + 1], moe.act)[0]
    n, E, k = x.shape[0], moe.num_experts, moe.top_k
    load = counts / (n * k)
    P = probs.mean(0)
    lse = np.log(np.exp(logits).sum(-1))
    stats = dict(
        aux_loss=E * np.sum(k * load * P),
        z_loss=np.mean(lse**2),
        load=load,
        router_prob=P,
        entropy=np.mean(-np.sum(probs * np.log(probs), -1)),
    )
    return out, stats


@pytest.mark.parametrize(
    ("E", "k", "routing", "dispatch"),
    [
        (4, 1, "mixtral", "dense"),
        (4, 1, "softmax_topk", "sorted"),
        (6, 2, "mixtral", "sorted"),
        (6, 2, "softmax_topk", "dense"),
    ],
)
@pytest.mark.float64
def test_moe_matches_numpy_reference(E, k, routing, dispatch):
    moe = _moe(E, k, routing=routing, dispatch=dispatch)
    x = np.random.default_rng(1).normal(size=(2, 7, D))
    tr = _trace(moe, jnp.asarray(x))
    want, stats = _numpy_moe(moe, x)
    np.testing.assert_allclose(tr.output.reshape(-1, D), want, rtol=1e-12, atol=1e-12)
    for name, value in stats.items():
        np.testing.assert_allclose(getattr(tr, name), value, rtol=1e-12, atol=1e-14)
    assert tr.logits.shape == (2, 7, E)


@pytest.mark.parametrize(("act", "dispatch"), [("gelu", "sorted"), ("geglu", "dense")])
@pytest.mark.float64
def test_moe_other_expert_acts_and_biases(act, dispatch):
    moe = _moe(5, 2, dispatch=dispatch, act=act, bias=True)
    assert moe.experts.W_1.bias is not None
    x = np.random.default_rng(2).normal(size=(9, D))
    want, _ = _numpy_moe(moe, x)
    np.testing.assert_allclose(_call(moe, jnp.asarray(x)), want, rtol=1e-12, atol=1e-12)


@pytest.mark.float64
def test_top_k_of_all_experts_without_renormalizing_is_the_softmax_mixture():
    # Closed form: k = E with plain softmax gates is sum_e p_e FFN_e(x).
    moe = _moe(3, 3, routing="softmax_topk")
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, D)))
    p = jax.nn.softmax(x @ moe.router.weight.T, -1)
    want = sum(p[:, e : e + 1] * moe.expert(e)(x) for e in range(3))
    np.testing.assert_allclose(_call(moe, x), want, rtol=1e-12, atol=1e-12)
    # Uniform-router identities: zero router -> load-balancing loss k, entropy log E.
    zero = eqx.tree_at(lambda m: m.router.weight, moe, jnp.zeros((3, D)))
    tr = _trace(zero, x)
    np.testing.assert_allclose(tr.aux_loss, 3.0, rtol=1e-12)
    np.testing.assert_allclose(tr.entropy, np.log(3.0), rtol=1e-12)
    np.testing.assert_allclose(tr.z_loss, np.log(3.0) ** 2, rtol=1e-12)


def test_route_renormalizes_mixtral_gates_only():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    probs, g_mix, idx = route(logits, 2, "mixtral")
    _, g_top, _ = route(logits, 2, "softmax_topk")
    assert g_mix.dtype == jnp.float32  # the suite's default precision
    np.testing.assert_array_equal(idx, [[0, 1]])
    # float32: a log, an exp and a division, each within an ulp (2^-24 ~ 6e-8)
    np.testing.assert_allclose(g_mix, [[0.625, 0.375]], rtol=1e-6)
    np.testing.assert_allclose(g_top, [[0.5, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("transform", ["jit", "vmap"])
@pytest.mark.float64
def test_dispatches_agree_under_transforms(transform):
    dense, sparse = _moe(8, 2), _moe(8, 2, dispatch="sorted")
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 5, D)))
    if transform == "jit":
        a, b = _call(dense, x), _call(sparse, x)
    else:  # one sequence per call: statistics per sequence
        a, b = (eqx.filter_jit(jax.vmap(m))(x) for m in (dense, sparse))
        np.testing.assert_allclose(a[1], _call(dense, x[1]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("routing", "dispatch"), [("mixtral", "sorted"), ("softmax_topk", "dense")]
)
@pytest.mark.float64
def test_router_gradient_matches_finite_differences(routing, dispatch):
    moe = _moe(4, 2, routing=routing, dispatch=dispatch)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(6, D)))
    r = jnp.asarray(np.random.default_rng(6).normal(size=(6, D)))

    @jax.jit
    def loss(W):
        m = eqx.tree_at(lambda m: m.router.weight, moe, W)
        tr = m.trace(x)
        return jnp.sum(r * tr.output) + 0.3 * tr.aux_loss + 0.1 * tr.z_loss

    W = moe.router.weight
    grad = jax.jit(jax.grad(loss))(W)
    assert float(jnp.max(jnp.abs(grad))) > 1e-3  # gradients reach the router
    eps = 1e-6
    for i, j in [(0, 0), (1, 3), (2, 7), (3, 15)]:
        bump = jnp.zeros_like(W).at[i, j].set(eps)
        fd = (loss(W + bump) - loss(W - bump)) / (2 * eps)
        np.testing.assert_allclose(grad[i, j], fd, rtol=1e-6, atol=1e-8)


@pytest.mark.float64
def test_dispatch_gradients_agree():
    dense, sparse = _moe(6, 2), _moe(6, 2, dispatch="sorted")
    x = jnp.asarray(np.random.default_rng(7).normal(size=(10, D)))

    def loss(m):
        return jnp.sum(jnp.sin(m(x)))

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    ga, gb = grad(dense), grad(sparse)
    for a, b in zip(
        jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_sorted_moe_dispatch_fills_tiles_and_matches_a_loop():
    from blocklab.nn.moe import _tile_rows

    E, k, n = 4, 2, 96
    sorted_moe = bl.MoEFeedForward(
        D, E, top_k=k, dispatch="sorted", key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (n, D))
    tr = eqx.filter_jit(lambda m, x: m.trace(x))(sorted_moe, x)
    logits = np.asarray(tr.logits, np.float64).reshape(n, E)
    top = np.argsort(-logits, -1)[:, :k]
    counts = np.bincount(top.reshape(-1), minlength=E)
    m = _tile_rows(n * k, E)
    assert counts.max() >= 2 * m  # some expert fills a whole tile (and more)
    # reference: each token through its top-k experts, one by one
    experts = eqx.filter_jit(lambda m, x: jnp.stack([m.expert(e)(x) for e in range(E)]))
    each = np.asarray(experts(sorted_moe, x), np.float64)
    want = np.zeros((n, D))
    for t in range(n):
        g = np.exp(logits[t, top[t]] - logits[t, top[t]].max())
        g /= g.sum()
        for j, e in enumerate(top[t]):
            want[t] += g[j] * each[e, t]
    np.testing.assert_allclose(np.asarray(tr.output), want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dispatch", ["sorted"])
def test_returns_input_dtype_with_float32_router(dispatch):
    moe = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a,
        _moe(4, 2, dispatch=dispatch),
    )
    x = jax.random.normal(jax.random.key(1), (5, D), jnp.bfloat16)
    tr = _trace(moe, x)
    assert tr.output.dtype == jnp.bfloat16
    assert tr.logits.dtype == jnp.float32 and tr.load.dtype == jnp.float32


def test_load_balancing_loss_pools_blocks():
    rng = np.random.default_rng(8)
    load = rng.dirichlet(np.ones(4), size=3)
    P = rng.dirichlet(np.ones(4), size=3)
    got = bl.nn.moe.load_balancing_loss(jnp.asarray(load), jnp.asarray(P), 2)
    assert got.dtype == jnp.float32
    # float32: means and a sum of 4 products, a few roundings of 2^-24 each
    np.testing.assert_allclose(got, 4 * np.sum(2 * load.mean(0) * P.mean(0)), rtol=1e-6)
    # One block: the trace's aux_loss.
    np.testing.assert_allclose(
        bl.nn.moe.load_balancing_loss(jnp.asarray(load[0]), jnp.asarray(P[0]), 2),
        4 * np.sum(2 * load[0] * P[0]),
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_experts=4, top_k=0), "top_k must lie in \\[1, 4\\], got 0"),
        (dict(num_experts=4, top_k=5), "top_k must lie in \\[1, 4\\], got 5"),
        (dict(num_experts=0, top_k=1), "num_experts must lie in \\[1, inf\\], got 0"),
        (dict(num_experts=True, top_k=1), "num_experts must be an int, got True"),
        (dict(num_experts=4, top_k=2, routing="switch"), "routing=.switch."),
        (dict(num_experts=4, top_k=2, dispatch="ragged"), "dispatch=.ragged."),
        (dict(num_experts=4, top_k=2, bias="no"), "bias"),
        (dict(num_experts=4, top_k=2, width=0), "width must lie in"),
        (dict(num_experts=4, top_k=2, act="tanh"), "act=.tanh."),
    ],
)
def test_bad_configuration_names_the_value(kwargs, match):
    # ConfigError is a ValueError and a TypeError; under the test suite's
    # jaxtyping hook a wrongly typed flag is refused by its annotation first.
    with pytest.raises(TypeError, match=match):
        bl.MoEFeedForward(D, key=jax.random.key(0), **kwargs)


def test_router_of_another_width_is_refused():
    moe = _moe(4, 2)
    wrong = eqx.tree_at(lambda m: m.router.weight, moe, jnp.zeros((4, D + 1)))
    with pytest.raises(ValueError, match=r"router.weight must have shape .*\(4, 17\)"):
        wrong(jnp.zeros((3, D)))
    with pytest.raises(ValueError, match="num_hiddens=16.*shape \\(3, 8\\)"):
        moe(jnp.zeros((3, 8)))
    with pytest.raises(TypeError, match="key"):
        bl.MoEFeedForward(D, 4, 2, key=None)


def test_moe_refuses_integer_input_and_zero_tokens():
    import inspect

    moe = bl.MoEFeedForward(D, 4, top_k=2, key=jax.random.key(0))
    trace = inspect.unwrap(bl.MoEFeedForward.trace)  # past the suite's type hook
    with pytest.raises(ConfigError, match="MoEFeedForward: .* floating dtype"):
        trace(moe, jnp.ones((3, D), jnp.int32))
    with pytest.raises(ConfigError, match="no tokens"):
        moe.trace(jnp.ones((0, D)))


def test_experts_are_one_stacked_feedforward():
    moe = eqx.filter_jit(lambda k: bl.MoEFeedForward(D, 4, 2, width=24, key=k))(
        jax.random.key(0)
    )
    assert isinstance(moe.experts, bl.FeedForward)
    assert moe.experts.W_1.weight.shape == (4, 24, D)
    assert moe.experts.W_2.weight.shape == (4, D, 24)
    assert moe.router.weight.shape == (4, D) and moe.router.bias is None
    # Expert e is the FeedForward built from the e-th expert key.
    expert_key = jax.random.split(jax.random.key(0))[1]
    ffn = bl.FeedForward(D, ffn_width=24, key=jax.random.split(expert_key, 4)[2])
    x = jax.random.normal(jax.random.key(1), (3, D))
    np.testing.assert_allclose(
        _call(moe.expert(2), x), _call(ffn, x), rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(moe.expert(0).W_1.weight, moe.expert(1).W_1.weight)
    with pytest.raises(IndexError):
        moe.expert(4)


# ------------------------------------------------------------- through the hook
H, N_BLKS, E_STACK = 2, 2, 4


def _moe_block(key, dispatch="sorted"):
    def ffn_factory(*, key):
        return bl.MoEFeedForward(D, E_STACK, 2, dispatch=dispatch, key=key)

    return bl.TransformerBlock(D, H, ffn_factory=ffn_factory, key=key)


@functools.cache
def _charlm():
    build = eqx.filter_jit(
        lambda k: bl.CharLM(28, D, H, N_BLKS, max_len=8, ffn_factory=_charlm_ffn, key=k)
    )
    return build(jax.random.key(3))


def _charlm_ffn(*, key):
    return bl.MoEFeedForward(D, E_STACK, 2, dispatch="sorted", key=key)


def test_stack_of_moe_blocks_scans_and_reports_each_block():
    stack = eqx.filter_jit(lambda k: bl.Stack(_moe_block, N_BLKS, key=k))(
        jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (2, 6, D))
    causal = jnp.arange(1, 7)
    h, stats = eqx.filter_jit(bl.nn.moe.stack_moe_stats)(stack, x, causal)
    np.testing.assert_allclose(
        h, eqx.filter_jit(stack)(x, causal), rtol=1e-6, atol=1e-6
    )
    assert stats.load.shape == (N_BLKS, E_STACK) and stats.aux_loss.shape == (N_BLKS,)
    # Reference: the blocks one by one in a Python loop, each FFN's own trace.
    y = x
    for i in range(N_BLKS):
        tr = eqx.filter_jit(lambda b, y: b.trace(y, causal))(stack.block(i), y)
        ffn = tr.ffn_trace
        for name in ("aux_loss", "z_loss", "load", "router_prob", "entropy"):
            np.testing.assert_allclose(
                getattr(stats, name)[i], getattr(ffn, name), rtol=1e-5, atol=1e-6
            )
        y = tr.output
    np.testing.assert_allclose(stats.load.sum(-1), 1.0, rtol=1e-6)
    # signal_stats reports the router entropy and expert load of every block
    # (at initialization, on the unmasked batch).
    sig = bl.signal_stats(stack, x)
    _, plain = eqx.filter_jit(bl.nn.moe.stack_moe_stats)(stack, x)
    np.testing.assert_allclose(sig.router_entropy, plain.entropy, rtol=1e-5)
    np.testing.assert_allclose(sig.expert_load, plain.load, rtol=1e-5, atol=1e-7)
    assert sig.expert_load.shape == (N_BLKS, E_STACK)
    assert np.all(np.asarray(sig.router_entropy) <= np.log(E_STACK) + 1e-6)
    assert "router_entropy" in sig.as_dict()


@pytest.mark.slow
def test_moe_forward_and_loss_on_a_charlm():
    model = _charlm()
    X = jax.random.randint(jax.random.key(4), (3, 8), 0, 28)
    Y = jnp.roll(X, -1, axis=-1)
    logits, (stats,) = eqx.filter_jit(bl.nn.moe.moe_forward)(model, X)
    np.testing.assert_allclose(logits, eqx.filter_jit(model)(X), rtol=1e-5, atol=1e-5)
    assert stats.load.shape == (N_BLKS, E_STACK)
    loss_fn = bl.training.losses.moe_loss(aux_coef=0.5, z_coef=0.25)
    loss, aux = eqx.filter_jit(loss_fn)(model, (X, Y))
    task = optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()
    np.testing.assert_allclose(aux["task"], task, rtol=1e-5)
    want = task + 0.5 * stats.aux_loss.mean() + 0.25 * stats.z_loss.mean()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # The router's gradient is nonzero through the task loss and the aux losses.
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, b: loss_fn(m, b)[0]))(
        model, (X, Y)
    )
    g = grads.stack.blocks.ffn.router.weight
    assert g.shape == (N_BLKS, E_STACK, D) and float(jnp.abs(g).min()) > 0.0
    with pytest.raises(ValueError, match="MoEFeedForward"):
        dense = bl.CharLM(28, D, H, 1, max_len=8, key=jax.random.key(0))
        bl.nn.moe.moe_forward(dense, X)


@pytest.mark.slow
def test_vmapped_seed_sweep_trains_moe_blocks_with_aux_losses():
    data = bl.TimeMachine(seq_len=8, num_train=400, num_val=0)
    result = bl.train_sweep(
        lambda key: bl.CharLM(
            data.vocab_size, D, H, 1, max_len=8, ffn_factory=_charlm_ffn, key=key
        ),
        data,
        30,
        model_keys=[0, 1],
        data_keys=[10, 11],
        loss_fn=bl.training.losses.moe_loss(aux_coef=0.01, z_coef=0.001),
        run=bl.RunConfig(batch_size=8, steps_per_call=15, progress=False),
        sweep=bl.SweepConfig(learning_rates=1e-2, validate=False),
    )
    losses = np.asarray(result.losses)
    assert losses.shape == (2, 30) and np.all(np.isfinite(losses))
    # The loss falls for each seed (from about log 28 = 3.3 at initialization).
    assert np.all(losses[:, -5:].mean(1) < losses[:, :5].mean(1) - 0.3)
    # The two members differ (different initializations and data orders).
    assert not np.allclose(losses[0], losses[1])
