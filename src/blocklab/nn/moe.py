r"""Sparse mixture-of-experts FFN: a softmax router and top-k experts.

`MoEFeedForward` replaces the block's FFN through `TransformerBlock`'s
`ffn_factory` hook. For a token $x \in \mathbb R^d$ the router gives
probabilities $p = \mathrm{softmax}(W_r x) \in \mathbb R^E$ (float32 or wider),
the $k$ largest of which, with indices $S(x)$, select the experts:
$$\mathrm{MoE}(x) = \sum_{e \in S(x)} g_e(x)\, \mathrm{FFN}_e(x),\qquad
g_e = \begin{cases} p_e / \sum_{j \in S(x)} p_j & \text{\texttt{"mixtral"}} \\
p_e & \text{\texttt{"softmax\_topk"}}\end{cases}$$
(Shazeer et al., 2017; Fedus et al., 2022, Switch; Jiang et al., 2024, Mixtral).

The auxiliary quantities of a call over $N$ tokens (`MoEFeedForward.trace`):

- expert load $f_e = \#\{(t, j) : S_j(x_t) = e\} / (N k)$ (the fraction of the
  $Nk$ token slots sent to expert $e$; sums to 1);
- mean router probability $P_e = \frac1N \sum_t p_e(x_t)$;
- load-balancing loss $L_\text{aux} = E \sum_e (k f_e)\, P_e$: `transformers`'
  `load_balancing_loss_func` (Switch's eq. 4 with $k$ slots per token; equal to
  $k$ for perfectly uniform routing);
- router z-loss $L_z = \frac1N \sum_t (\log\sum_e e^{\ell_e(x_t)})^2$ (Zoph et
  al., 2022, ST-MoE);
- router entropy $\frac1N \sum_t -\sum_e p_e \log p_e$ (nats; $\log E$ is
  uniform).

`stack_moe_stats` / `moe_forward` collect them per block out of a `Stack`'s
scan; `load_balancing_loss` pools them over blocks as `transformers` does, and
`blocklab.training.losses.moe_loss` adds them to a language-model loss with
coefficients.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_choice, check_int, check_key
from . import init
from .ffn import _PHI, ACTS, GATED_ACTS, FeedForward
from .functional import ACTIVATIONS, linear
from .hooks import Hooks
from .normalization import check_float_input

__all__ = [
    "MoEFeedForward",
    "MoETrace",
    "MoEStats",
    "ROUTINGS",
    "DISPATCHES",
    "route",
    "load_balancing_loss",
    "stack_moe_stats",
    "moe_forward",
]

#: The routing rules: Mixtral's renormalized top-k, and the plain top-k of the softmax.
ROUTINGS = ("mixtral", "softmax_topk")
#: The dispatch paths: every expert on every token, or each token on its k experts.
DISPATCHES = ("dense", "sorted")


class MoETrace(NamedTuple):
    """What one `MoEFeedForward` call computes (statistics over all its tokens).

    Attributes:
        output: `(..., T, d)`, the layer's output (dtype of the input).
        aux_loss: `()` load-balancing loss $E \\sum_e (k f_e) P_e$.
        z_loss: `()` router z-loss, mean of $(\\mathrm{logsumexp}\\,\\ell)^2$.
        load: `(E,)` fraction $f_e$ of the token slots routed to expert e.
        router_prob: `(E,)` mean router probability $P_e$.
        entropy: `()` mean router entropy in nats.
        logits: `(..., T, E)` router logits (float32 or wider).
    """

    output: Array
    aux_loss: Array
    z_loss: Array
    load: Array
    router_prob: Array
    entropy: Array
    logits: Array


class MoEStats(NamedTuple):
    """Per-block router statistics of a `Stack` of MoE blocks (leading axis N).

    The fields of `MoETrace` without the output and the logits.
    """

    aux_loss: Array
    z_loss: Array
    load: Array
    router_prob: Array
    entropy: Array


def route(
    logits: Float[Array, "*batch E"], top_k: int, routing: str = "mixtral"
) -> tuple[Float[Array, "*batch E"], Float[Array, "*batch k"], Int[Array, "*batch k"]]:
    r"""Router probabilities, the gates of the selected experts and their indices.

    $p = \mathrm{softmax}(\ell)$ in float32 (or wider); the top-`top_k`
    experts by probability (ties to the lower index, `lax.top_k`); gates
    $p_e / \sum_{j \in S} p_j$ (`"mixtral"`) or $p_e$ (`"softmax_topk"`).

    Returns:
        `(probs, gates, indices)`: `(..., E)`, `(..., k)` and `(..., k)` int32.
    """
    check_choice("route", "routing", routing, ROUTINGS)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)
    if routing == "mixtral":
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return probs, top, idx.astype(jnp.int32)


def _tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile of the sorted dispatch: about half the mean group size.

    Each expert's group is padded to a multiple of the tile, so at most
    `num_experts * (tile - 1)` padding rows are computed; bigger tiles mean
    fewer loop iterations (and fewer copies of an expert's weights).
    """
    mean = max(1, num_pairs // (2 * num_experts))
    return int(min(256, max(8, 2 ** math.floor(math.log2(mean)))))


class MoEFeedForward(eqx.Module):
    r"""Top-k mixture of experts, each expert a `FeedForward` (SwiGLU by default).

    $$\mathrm{MoE}(x) = \sum_{e \in \mathrm{top}_k(p)} g_e\, \mathrm{FFN}_e(x),
    \qquad p = \mathrm{softmax}(W_r x)$$
    with gates $g$ per `routing` (see the module docstring and `route`). The
    router `router` is an `eqx.nn.Linear` $(E, d)$ without bias (as Mixtral's
    `gate`); the experts are ONE `FeedForward` whose every array has a leading
    expert axis of size $E$ (built by `eqx.filter_vmap`), so expert $e$ is
    `moe.expert(e)`.

    Dispatch (same values up to float rounding):

    - `"dense"`: every expert runs on every token and the outputs are combined
      with the gates (zero for unselected experts): $E/k$ times the FLOPs of
      the active experts, computed as one FFN of width $E w$ whose hidden
      units are scaled by their expert's gate (three plain matrix products).
      Exact and simple; for few experts.
    - `"sorted"`: the $Nk$ (token, expert) pairs are sorted by expert, each
      expert's group is padded to a multiple of a tile of $m$ rows, and
      the tiles (each with its expert's weights, gathered) run as one batched
      product per matrix; the outputs are gathered back and combined. No
      token is dropped. Cost: $(\lceil Nk/m \rceil + E)\,m$ rows of expert
      FFN (static shapes: room for every expert's last partial tile; with
      $m$ about half the mean group size $Nk/E$, at most 1.5x the active
      FLOPs), plus a copy of one expert's weights per tile, the sort and the
      gathers. (Why not `jax.lax.ragged_dot`: benchmarks/README.md.)
    """

    router: eqx.nn.Linear
    experts: FeedForward
    num_hiddens: int = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    act: str = eqx.field(static=True)
    width: int = eqx.field(static=True)
    routing: str = eqx.field(static=True)
    dispatch: str = eqx.field(static=True)

    def __init__(
        self,
        num_hiddens: int,
        num_experts: int,
        top_k: int,
        *,
        act: str = "swiglu",
        width: int | None = None,
        routing: str = "mixtral",
        dispatch: str = "dense",
        bias: bool = False,
        key: PRNGKeyArray,
    ):
        """Args:
        num_hiddens: model width $d$.
        num_experts: number of experts $E \\ge 1$.
        top_k: experts per token, $1 \\le k \\le E$.
        act: each expert's activation (one of `blocklab.ACTS`).
        width: each expert's hidden width; default `ffn_width(num_hiddens, act)`.
        routing: `"mixtral"` (renormalized top-k) or `"softmax_topk"`.
        dispatch: `"dense"` or `"sorted"` (see the class docstring).
        bias: biases in the experts' linear layers (the router has none).
        key: PRNG key for the router and the experts.
        """
        owner = "MoEFeedForward"
        self.num_hiddens = check_int(owner, "num_hiddens", num_hiddens, min=1)
        self.num_experts = check_int(owner, "num_experts", num_experts, min=1)
        self.top_k = check_int(owner, "top_k", top_k, min=1, max=self.num_experts)
        self.act = check_choice(owner, "act", act, ACTS)
        self.routing = check_choice(owner, "routing", routing, ROUTINGS)
        self.dispatch = check_choice(owner, "dispatch", dispatch, DISPATCHES)
        bias = check_bool(owner, "bias", bias)
        width = check_int(owner, "width", width, min=1, optional=True)
        check_key(owner, "key", key)
        router_key, expert_key = jax.random.split(key)
        self.router = init.linear(
            self.num_hiddens, self.num_experts, bias=False, key=router_key
        )

        def make_expert(k):
            return FeedForward(
                self.num_hiddens, act, ffn_bias=bias, ffn_width=width, key=k
            )

        self.experts = eqx.filter_vmap(make_expert)(
            jax.random.split(expert_key, self.num_experts)
        )
        self.width = self.experts.width

    def __check_init__(self):
        self._check_router()

    def _check_router(self):
        shape = tuple(self.router.weight.shape)
        if shape != (self.num_experts, self.num_hiddens):
            raise ConfigError(
                f"MoEFeedForward: router.weight must have shape (num_experts="
                f"{self.num_experts}, num_hiddens={self.num_hiddens}), got {shape}; "
                "a router of another width or expert count does not fit."
            )
        if self.router.bias is not None:
            raise ConfigError("MoEFeedForward: the router has no bias (as Mixtral's).")

    def expert(self, e: int) -> FeedForward:
        """Expert `e` as an ordinary `FeedForward`."""
        if not -self.num_experts <= e < self.num_experts:
            raise IndexError(
                f"expert index {e} out of range for {self.num_experts} experts."
            )
        return jax.tree_util.tree_map(
            lambda a: a[e] if eqx.is_array(a) else a, self.experts
        )

    def trace(
        self,
        x: Float[Array, "*batch d"],
        *,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> MoETrace:
        """Apply the layer and return its router statistics (see `MoETrace`).

        Args:
            x: `(T, d)` or any `(..., d)`; the statistics are over all its rows.
            key: accepted for the sublayer call signature and unused.
            hooks: sites, in the layer's scope: `hook_router_logits`
                `(..., E)` (float32, before the softmax) and
                `hook_router_choices` `(..., top_k)` (int32 expert indices, in
                order of probability; an edit reroutes the tokens, their gates
                unchanged).
        """
        del key
        self._check_router()
        if x.ndim < 1 or x.shape[-1] != self.num_hiddens:
            raise ConfigError(
                f"MoEFeedForward was built with num_hiddens={self.num_hiddens}, "
                f"but its input x has shape {tuple(x.shape)}."
            )
        check_float_input(x, "MoEFeedForward")
        if x.size == 0:
            raise ConfigError(
                f"MoEFeedForward: x has no tokens (shape {tuple(x.shape)}); the "
                "expert load, the aux loss and the router entropy are means over "
                "tokens and would be NaN."
            )
        wide = jnp.promote_types(x.dtype, jnp.float32)
        rows = x.reshape(-1, self.num_hiddens)
        logits = linear(rows.astype(wide), self.router.weight.astype(wide))
        lead = x.shape[:-1]
        if hooks is not None:  # reshaped only when wanted: no ops otherwise
            logits = hooks.sites(
                "hook_router_logits", logits,
                lambda a: a.reshape(*lead, self.num_experts),
                lambda a: a.reshape(-1, self.num_experts),
            )  # fmt: skip
        probs, gates, idx = route(logits, self.top_k, self.routing)
        if hooks is not None:
            idx = hooks.sites(
                "hook_router_choices", idx,
                lambda a: a.reshape(*lead, self.top_k),
                lambda a: a.reshape(-1, self.top_k),
            )  # fmt: skip
        if self.dispatch == "dense":
            y = self._dense(rows, gates, idx)
        else:
            y = self._sorted(rows, gates, idx)
        out = y.astype(x.dtype).reshape(x.shape)

        E, k, n = self.num_experts, self.top_k, rows.shape[0]
        counts = jnp.zeros(E, wide).at[idx.reshape(-1)].add(1.0)
        load = counts / (n * k)
        router_prob = jnp.mean(probs, axis=0)
        aux = E * jnp.sum(k * load * router_prob)
        z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        logp = jax.nn.log_softmax(logits, axis=-1)
        entropy = jnp.mean(-jnp.sum(probs * logp, axis=-1))
        logits = logits.reshape(*x.shape[:-1], E)
        return MoETrace(out, aux, z, load, router_prob, entropy, logits)

    def __call__(
        self,
        x: Float[Array, "*batch d"],
        *,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch d"]:
        """Apply the mixture to each row of `x` (`(T, d)` or any `(..., d)`).

        `key` is accepted for the sublayer call signature and unused;
        `hooks` as for `trace`. Returns the dtype of `x`.
        """
        return self.trace(x, key=key, hooks=hooks).output

    # ------------------------------------------------------------- dispatch
    def _dense(self, rows, gates, idx):
        """Every expert on every row, as one FFN of width E w with gated hidden units.

        $\\sum_e g_e (W_{2,e} h_e + b_{2,e})
        = [g \\odot h]\\, W_2^\\text{cat} + g\\, b_2$:
        three plain matrix products over the concatenated experts.
        """
        E, w, d = self.num_experts, self.width, self.num_hiddens
        f = self.experts
        name, gated = _PHI[self.act], self.act in GATED_ACTS
        phi = (lambda z: z) if name is None else ACTIVATIONS[name]

        def up(layer):
            b = None if layer.bias is None else layer.bias.reshape(E * w)
            return linear(rows, layer.weight.reshape(E * w, d), b)

        hidden = phi(up(f.W_g)) * up(f.W_1) if gated else phi(up(f.W_1))
        dense_gates = jnp.sum(
            jax.nn.one_hot(idx, E, dtype=gates.dtype) * gates[..., None], axis=-2
        )  # (N, E), zero for the unselected experts
        hidden = hidden.reshape(-1, E, w) * dense_gates[..., None].astype(hidden.dtype)
        W_2 = jnp.moveaxis(f.W_2.weight, 0, 1).reshape(d, E * w)  # (d, E w)
        y = linear(hidden.reshape(-1, E * w), W_2).astype(gates.dtype)
        if f.W_2.bias is not None:
            y = y + dense_gates @ f.W_2.bias.astype(gates.dtype)
        return y

    def _sorted(self, rows, gates, idx):
        """Each row through its k experts only: sort by expert, run tile by tile."""
        n, d = rows.shape
        E, k = self.num_experts, self.top_k
        pairs = n * k
        m = _tile_rows(pairs, E)
        num_tiles = -(-pairs // m) + E  # >= sum_e ceil(count_e / m)

        flat_e = idx.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)  # pair ids grouped by expert
        e_sorted = flat_e[order]
        counts = jnp.bincount(flat_e, length=E)
        tiles = -(-counts // m)
        tile_end = jnp.cumsum(tiles)
        group_start = jnp.cumsum(counts) - counts
        rank = jnp.arange(pairs) - group_start[e_sorted]
        slot_sorted = (tile_end - tiles)[e_sorted] * m + rank  # padded row of pair
        slot = jnp.zeros(pairs, jnp.int32).at[order].set(slot_sorted.astype(jnp.int32))
        # Padded layout: row -> token (n is a zero row for padding).
        token = (
            jnp.full(num_tiles * m, n, jnp.int32)
            .at[slot]
            .set((jnp.arange(pairs) // k).astype(jnp.int32))
        )
        tile_expert = jnp.minimum(
            jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"), E - 1
        )
        padded = jnp.concatenate([rows, jnp.zeros((1, d), rows.dtype)])[token]
        padded = padded.reshape(num_tiles, m, d)
        # Each tile's expert weights, gathered: one batched product per matrix
        # (a scan over tiles indexing the stacked weights instead accumulates a
        # full-size weight cotangent per tile in the backward pass).
        params, static = eqx.partition(self.experts, eqx.is_array)
        tile_params = jax.tree_util.tree_map(lambda a: a[tile_expert], params)
        ys = jax.vmap(lambda p, xt: eqx.combine(p, static)(xt))(tile_params, padded)
        y_pairs = ys.reshape(num_tiles * m, d)[slot].reshape(n, k, d)
        return jnp.einsum("nk,nkd->nd", gates, y_pairs.astype(gates.dtype))


# --------------------------------------------------------------- stack level
def _is_moe_trace(tr: Any) -> bool:
    return isinstance(tr, MoETrace)


def _block_moe_trace(block: Any, h: Array, mask: Any, positions: Any, key: Any):
    """One block's output and its FFN's `MoETrace` (`BlockTrace.ffn_trace`)."""
    extra = {} if positions is None else {"positions": positions}
    tr = block.trace(h, mask, key=key, **extra)
    ffn_trace = getattr(tr, "ffn_trace", None)
    if not _is_moe_trace(ffn_trace):
        raise ConfigError(
            "MoE statistics need blocks whose FFN is a MoEFeedForward (built with "
            "ffn_factory) and a TransformerBlock whose trace returns ffn_trace; "
            f"got ffn_trace={type(ffn_trace).__name__}."
        )
    return tr.output, ffn_trace


def _stats_of(tr: MoETrace) -> MoEStats:
    return MoEStats(tr.aux_loss, tr.z_loss, tr.load, tr.router_prob, tr.entropy)


def stack_moe_stats(
    stack: Any,
    x: Float[Array, "*batch T d"],
    mask: Any = None,
    *,
    positions: Any = None,
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, "*batch T d"], MoEStats]:
    """Run a `Stack` of MoE blocks, collecting each block's router statistics.

    The blocks are applied by `Stack.scan(..., collect=...)` (the one forward
    pass); every field of the returned `MoEStats` has a leading block axis N.

    Returns:
        `(h_N, stats)`.
    """

    def collect(block, h, k):
        out, tr = _block_moe_trace(block, h, mask, positions, k)
        return out, _stats_of(tr)

    extra = {} if positions is None else {"positions": positions}
    return stack.scan(x, mask, key=key, collect=collect, **extra)


class _Sink:
    """A list compared and hashed by identity (a static field must be hashable)."""

    def __init__(self):
        self.items: list[MoEStats] = []


class _RecordingStack(eqx.Module):
    """A `Stack` stand-in that runs `stack_moe_stats` and records the stats.

    Only used inside `moe_forward`, within one trace: the recorded arrays are
    returned by the same function that produced them.
    """

    stack: Any
    sink: _Sink = eqx.field(static=True)

    def __call__(self, x, mask=None, *, positions=None, key=None):
        h, stats = stack_moe_stats(self.stack, x, mask, positions=positions, key=key)
        self.sink.items.append(stats)
        return h

    @property
    def num_blks(self) -> int:
        return self.stack.num_blks

    def __len__(self) -> int:
        return self.stack.num_blks


def moe_forward(model: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[MoEStats]]:
    """Call `model(*args, **kwargs)` and return the router statistics of its stacks.

    Every `blocklab.Stack` inside `model` (e.g. `CharLM.stack`) is run through
    `stack_moe_stats` instead of its plain call, so the model's own forward
    code is used unchanged. Pure: use it inside `jax.grad` / `jit` / `vmap`
    like the model call itself.

    Returns:
        `(output, [MoEStats per Stack, in tree order])`.
    """
    from .stack import Stack

    sink = _Sink()

    def is_stack(node):
        return isinstance(node, Stack)

    def wrap(node):
        return _RecordingStack(node, sink) if is_stack(node) else node

    wrapped = jax.tree_util.tree_map(wrap, model, is_leaf=is_stack)
    out = wrapped(*args, **kwargs)
    if not sink.items:
        raise ConfigError("moe_forward: the model called no blocklab.Stack.")
    return out, list(sink.items)


def load_balancing_loss(
    load: Float[Array, "*N E"], router_prob: Float[Array, "*N E"], top_k: int
) -> Float[Array, ""]:
    r"""`transformers`' `load_balancing_loss_func`, pooled over the blocks.

    With per-block loads $f_{l,e}$ and mean probabilities $P_{l,e}$ over the
    same $N$ tokens, pooled over the $L$ blocks as `transformers` does
    (it concatenates the blocks' router logits):
    $$L_\text{aux} = E \sum_e \Big(\frac kL \sum_l f_{l,e}\Big)
    \Big(\frac1L \sum_l P_{l,e}\Big).$$
    For one block this is `MoETrace.aux_loss`.
    """
    top_k = check_int("load_balancing_loss", "top_k", top_k, min=1)
    E = load.shape[-1]
    f = jnp.mean(load.reshape(-1, E), axis=0)
    P = jnp.mean(router_prob.reshape(-1, E), axis=0)
    return E * jnp.sum(top_k * f * P)
