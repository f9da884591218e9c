r"""Low-rank adapters (LoRA; Hu et al., 2021, arXiv:2106.09685).

An adapted projection computes

$$y = x W^\top + b + s\,(x A^\top) B^\top,\qquad A \in \mathbb{R}^{r\times n},\;
B \in \mathbb{R}^{m\times r},$$

with $s = \alpha / r$, or $s = \alpha / \sqrt r$ with rsLoRA (Kalajdzievski,
2023, arXiv:2312.03732). $B$ starts at zero, so the adapted model equals the
base at step 0. The product is two thin matrix products; $BA$ is never formed.

`lora(model, ...)` swaps each targeted `eqx.nn.Linear` for a `LoRALinear`
with `eqx.tree_at`. In a `Stack` the Linear's leaves carry the layer axis, so
the adapters do too (`A`: `(L, r, n)`, `B`: `(L, m, r)`) and are sliced by the
same `lax.scan`. `blocklab.nn.functional.dense` dispatches on the adapter.

Training only the adapters: `lora_filter(model)` marks the `A`/`B` leaves
(`eqx.partition(model, lora_filter(model))` splits them off), and
`lora_optimizer(optimizer)` wraps an optax transformation so that it
keeps state for, and updates, those leaves only (the rest get zero updates).
The base weight of an adapted layer is also behind `jax.lax.stop_gradient`,
so the backward pass never forms its gradient.

**Ranks by masking.** An adapter sweep (`blocklab.train_sweep(base, ...,
sweep=SweepConfig(adapters=...))`) holds members of different ranks
$r \le R$ in one array shape: `mask_lora(model, R)` zero-pads a rank-$r$
adapter to rank $R$ (`MaskedLoRALinear`) and masks the rank axis,

$$y = x W^\top + b + s_r\,\big((x A^\top) \odot m\big) B^\top,\qquad
m_j = [\,j < r\,],$$

with $s_r$ the scaling of rank $r$. The padded rows of $A$ and columns of
$B$ get exactly zero gradients and stay zero, so the member follows the
rank-$r$ adapter's trajectory; `unmask_lora` slices it back to a
`LoRALinear` of rank $r$.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from .._validate import ConfigError, check_bool, check_float, check_int, check_key
from .functional import linear

__all__ = [
    "LORA_TARGETS",
    "LoRAConfig",
    "LoRALinear",
    "lora",
    "lora_config",
    "lora_filter",
    "lora_optimizer",
    "merge_lora",
    "unmerge_lora",
    "lora_layers",
    "MaskedLoRALinear",
    "mask_lora",
    "unmask_lora",
]

#: Target names -> the path tail (module attribute names) of the Linear they
#: adapt in a `TransformerBlock`.
LORA_TARGETS: dict[str, tuple[str, str]] = {
    "q": ("attention", "W_q"),
    "k": ("attention", "W_k"),
    "v": ("attention", "W_v"),
    "o": ("attention", "W_o"),
    "gate": ("ffn", "W_g"),
    "up": ("ffn", "W_1"),
    "down": ("ffn", "W_2"),
}

#: Targets the issue names that this version does not adapt, with the reason.
_NOT_YET = {
    "experts": "the MoE experts' stacked projections are applied by their own "
    "routine (blocklab.nn.moe), not by dense",
    "embed": "the embedding is a table lookup, not a Linear",
    "head": "the output head is applied as a tied/untied weight, not a Linear",
}


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """$s = \\alpha / r$, or $\\alpha / \\sqrt r$ with rsLoRA (PEFT's scaling)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class _Adapted(eqx.Module):
    """What both adapters share: a frozen `base` Linear and `delta(x)`, the
    adapter's term (defined by each)."""

    def frozen_base(self) -> eqx.nn.Linear:
        """The base Linear behind `stop_gradient` (what `dense` applies)."""
        return jax.lax.stop_gradient(self.base)

    def add_delta(
        self, x: Float[Array, "*batch n"], y: Float[Array, "*batch m"]
    ) -> Float[Array, "*batch m"]:
        """`y` (the base's product on `x`) plus the adapter's term, in `y`'s dtype."""
        return (y + self.delta(x).astype(y.dtype)).astype(y.dtype)


class LoRALinear(_Adapted):
    r"""An `eqx.nn.Linear` with a low-rank adapter:
    $y = x W^\top + b + s\,(x A^\top) B^\top$ (Hu et al., 2021).

    The base weight is frozen (`stop_gradient`); `A` and `B` are float32
    whatever the base's dtype, and the adapter's term is computed in float32
    then cast to the base product's dtype. Leading axes of `A`, `B` (a
    stack's layer axis) match those of the base weight.
    """

    base: eqx.nn.Linear
    A: Float[Array, "*layers r n"]
    B: Float[Array, "*layers m r"]
    scale: float = eqx.field(static=True)
    rank: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    use_rslora: bool = eqx.field(static=True)

    def delta(self, x: Float[Array, "*batch n"]) -> Float[Array, "*batch m"]:
        """The adapter's term $s\\,(x A^\\top) B^\\top$ in float32."""
        xa = linear(x.astype(jnp.float32), self.A.astype(jnp.float32))
        return linear(xa, self.B.astype(jnp.float32)) * self.scale

    def merged(self) -> eqx.nn.Linear:
        """The plain Linear with $W + s BA$ (computed in float32, cast to W's dtype)."""
        W = self.base.weight
        delta = jnp.matmul(self.B.astype(jnp.float32), self.A.astype(jnp.float32))
        new = (W.astype(jnp.float32) + self.scale * delta).astype(W.dtype)
        return eqx.tree_at(lambda m: m.weight, self.base, new)


class MaskedLoRALinear(_Adapted):
    r"""A rank-$r$ adapter held at a larger rank $R$ (`mask_lora`):
    $y = x W^\top + b + s_r\,((x A^\top) \odot m) B^\top$, $m_j = [j < r]$.

    `rank` is an integer array (one entry per layer of a stack, so that the
    stack's scan slices it like the weights; not trained), so members of
    different ranks share one structure and can be vmapped. $s_r$ is
    `lora_scale(r, alpha, use_rslora)` rounded to float32, read from a table
    over $0..R$.
    """

    base: eqx.nn.Linear
    A: Float[Array, "*layers R n"]
    B: Float[Array, "*layers m R"]
    rank: Int[Array, "*layers"]
    alpha: float = eqx.field(static=True)
    use_rslora: bool = eqx.field(static=True)
    max_rank: int = eqx.field(static=True)

    def scale(self) -> Float[Array, "*layers"]:
        """$s_r$ per layer, float32 (the table's entry 0 is unused)."""
        table = np.asarray(
            [0.0]
            + [
                lora_scale(r, self.alpha, self.use_rslora)
                for r in range(1, self.max_rank + 1)
            ],
            np.float32,
        )
        return jnp.asarray(table)[self.rank]

    def delta(self, x: Float[Array, "*batch n"]) -> Float[Array, "*batch m"]:
        r"""$s_r\,((x A^\top) \odot m) B^\top$ in float32."""
        xa = linear(x.astype(jnp.float32), self.A.astype(jnp.float32))
        mask = jnp.arange(self.max_rank) < self.rank
        xa = jnp.where(mask, xa, 0.0)
        return linear(xa, self.B.astype(jnp.float32)) * self.scale()

    def merged(self) -> eqx.nn.Linear:
        r"""The plain Linear with $W + s_r B\,\mathrm{diag}(m)\,A$."""
        W = self.base.weight
        mask = (jnp.arange(self.max_rank) < self.rank[..., None]).astype(jnp.float32)
        A = self.A.astype(jnp.float32) * mask[..., :, None]
        delta = jnp.matmul(self.B.astype(jnp.float32), A)
        s = self.scale()[..., None, None]
        new = (W.astype(jnp.float32) + s * delta).astype(W.dtype)
        return eqx.tree_at(lambda m: m.weight, self.base, new)


_ADAPTED = (LoRALinear, MaskedLoRALinear)


def _is_adapted(x: Any) -> bool:
    return isinstance(x, _ADAPTED)


def _is_linear(x: Any) -> bool:
    return isinstance(x, (eqx.nn.Linear, *_ADAPTED))


def _name(k: Any) -> Any:
    for attr in ("name", "idx", "key"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"unexpected pytree key {k!r}")


def _getter(path: Sequence[Any]) -> Callable[[Any], Any]:
    def get(tree):
        for k in path:
            tree = getattr(tree, k.name) if hasattr(k, "name") else tree[_name(k)]
        return tree

    return get


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(_name(k)) for k in path)


def lora_layers(model: Any) -> dict[str, LoRALinear]:
    """The adapted layers of `model` by dotted path (`stack.blocks.attention.W_q`)."""
    nodes = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, LoRALinear)
    )[0]
    return {_path_str(p): n for p, n in nodes if isinstance(n, LoRALinear)}


def _target_paths(model: Any, owner: str, targets: Sequence[str]) -> dict[str, list]:
    """Each target name -> the pytree paths of the Linears it names."""
    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    found: dict[str, list] = {t: [] for t in targets}
    for path, node in nodes:
        if not _is_linear(node):
            continue
        tail = tuple(str(_name(k)) for k in path[-2:])
        for t in targets:
            if tail == LORA_TARGETS[t]:
                if _is_adapted(node):
                    raise ConfigError(
                        f"{owner}: {_path_str(path)} already has an adapter "
                        "(adding adapters twice); merge_lora or unmerge_lora first."
                    )
                found[t].append(path)
    for t, paths in found.items():
        if not paths:
            raise ConfigError(
                f"{owner}: target {t!r} names no layer of this "
                f"{type(model).__name__} (no {'.'.join(LORA_TARGETS[t])} Linear)."
            )
    return found


def _check_targets(owner: str, targets: Any) -> list[str]:
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, Sequence) or not targets:
        raise ConfigError(
            f"{owner}: targets must be a non-empty list of names from "
            f"{sorted(LORA_TARGETS)}, got {targets!r}."
        )
    out = []
    for t in targets:
        if t in _NOT_YET:
            raise ConfigError(
                f"{owner}: target {t!r} is not supported yet: {_NOT_YET[t]}."
            )
        if t not in LORA_TARGETS:
            raise ConfigError(
                f"{owner}: target {t!r} is not a projection name; targets must "
                f"come from {sorted(LORA_TARGETS)}."
            )
        if t not in out:
            out.append(t)
    return out


def _add(
    model: Any,
    owner: str,
    specs: Mapping[str, tuple[int, float]],
    use_rslora: bool,
    key: Any,
) -> Any:
    """Adapters on every target of `specs` (target -> (rank, alpha)); A drawn
    like PEFT's (Kaiming-uniform, bound $1/\\sqrt n$), B = 0."""
    found = _target_paths(model, owner, list(specs))
    paths = [(t, p) for t in specs for p in found[t]]
    keys = jax.random.split(key, len(paths))
    for (t, path), k in zip(paths, keys, strict=True):
        rank, alpha = specs[t]
        get = _getter(path)
        base = get(model)
        *lead, m, n = base.weight.shape
        if rank > min(m, n):
            raise ConfigError(
                f"{owner}: rank must lie in [1, min(out, in)] = [1, {min(m, n)}] "
                f"for target {t!r} ({_path_str(path)}, weight {m}x{n}), got {rank}."
            )
        bound = 1.0 / math.sqrt(n)
        A = jax.random.uniform(k, (*lead, rank, n), jnp.float32, -bound, bound)
        B = jnp.zeros((*lead, m, rank), jnp.float32)
        node = LoRALinear(
            base=base,
            A=A,
            B=B,
            scale=lora_scale(rank, alpha, use_rslora),
            rank=rank,
            alpha=alpha,
            use_rslora=use_rslora,
        )
        model = eqx.tree_at(get, model, node, is_leaf=_is_linear)
    return model


@dataclass(frozen=True)
class LoRAConfig:
    r"""The settings of one set of low-rank adapters, checked once.

    `lora(model, LoRAConfig(rank=8, alpha=16.0, targets=("q", "v")), key=k)`
    adds them; `blocklab.SweepConfig(adapters=...)` sweeps them (one config,
    or K configs that differ in `rank`); `lora_config(model)` reads them back
    from an adapted model's leaves (what `blocklab.save_adapter` writes to
    `adapter_config.json`).

    Attributes:
        rank: $r \ge 1$, at most `min(out, in)` of every adapted weight
            (checked by `lora`, which sees the weights).
        alpha: the scaling numerator (finite): $s = \alpha / r$, or
            $\alpha / \sqrt r$ with `use_rslora`.
        targets: names from `LORA_TARGETS`: `"q"`, `"k"`, `"v"`, `"o"`
            (attention), `"gate"`, `"up"`, `"down"` (the MLP); a string is
            one target; stored as a tuple without repeats.
        use_rslora: rank-stabilized scaling (Kalajdzievski, 2023).
        dropout: must be 0.0 in this version (the blocks do not pass a key
            to their projections; a non-zero rate is refused rather than
            ignored).

    Raises:
        ConfigError: a rank below 1, a non-finite alpha, a target that is
            unknown or not supported yet, a non-bool `use_rslora`, a
            non-zero dropout; each named with its value.
    """

    rank: int
    alpha: float
    targets: Sequence[str]
    use_rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        owner = "LoRAConfig"
        put = functools.partial(object.__setattr__, self)
        put("rank", check_int(owner, "rank", self.rank, min=1))
        put("alpha", check_float(owner, "alpha", self.alpha))
        put("targets", tuple(_check_targets(owner, self.targets)))
        put("use_rslora", check_bool(owner, "use_rslora", self.use_rslora))
        dropout = check_float(
            owner, "dropout", self.dropout, min=0.0, max=1.0, max_open=True
        )
        if dropout != 0.0:
            raise ConfigError(
                f"{owner}: dropout={dropout} is not supported yet (the projections "
                "get no key); use dropout=0.0."
            )
        put("dropout", dropout)

    @property
    def scale(self) -> float:
        r"""$s = \alpha / r$, or $\alpha / \sqrt r$ with rsLoRA."""
        return lora_scale(self.rank, self.alpha, self.use_rslora)


def lora(model: Any, config: LoRAConfig, *, key: Any) -> Any:
    r"""Add the low-rank adapters of `config` to the projections of `model`.

    Each targeted `eqx.nn.Linear` $W$ becomes a `LoRALinear` computing
    $y = x W^\top + b + s\,(x A^\top) B^\top$ with $A$ `(r, in)` drawn like
    PEFT's (Kaiming-uniform, bound $1/\sqrt{n}$) and $B = 0$ `(out, r)`.

    Args:
        model: a `DecoderLM`, `Stack` or `TransformerBlock` (any module whose
            blocks hold `attention.W_{q,k,v,o}` / `ffn.W_{g,1,2}` Linears).
        config: a `LoRAConfig` (rank, alpha, targets, use_rslora, dropout),
            e.g. `LoRAConfig(rank=8, alpha=16.0, targets=("q", "v"))`.
        key: draws $A$; $B = 0$.

    Returns:
        `model` with each targeted Linear replaced by a `LoRALinear`; in a
        stack, the adapters carry its layer axis. The result's outputs equal
        `model`'s exactly (B = 0).

    Raises:
        ConfigError: `config` not a `LoRAConfig`; a target that names no
            layer; a rank above `min(out, in)` of a targeted weight; a layer
            that already has an adapter.
    """
    return _lora(model, config, key=key, owner="lora")


def _lora(model: Any, config: Any, *, key: Any, owner: str) -> Any:
    """`lora` with the caller's name in its errors."""
    if not isinstance(config, LoRAConfig):
        raise ConfigError(
            f"{owner}: config must be a blocklab.LoRAConfig (e.g. LoRAConfig("
            f"rank=8, alpha=16.0, targets=('q', 'v'))), got {config!r}."
        )
    key = check_key(owner, "key", key)
    specs = {t: (config.rank, config.alpha) for t in config.targets}
    return _add(model, owner, specs, config.use_rslora, key)


def lora_config(model: Any) -> LoRAConfig:
    """The `LoRAConfig` of an adapted model, read from its `LoRALinear` leaves.

    `rank` and `alpha` are those of most adapted layers (PEFT's `r` and
    `lora_alpha`; `lora_layers` has each layer's), `targets` the
    target names adapted, in `LORA_TARGETS` order.

    Raises:
        ConfigError: no adapters, or adapters that mix `use_rslora`.
    """
    layers = lora_layers(model)
    if not layers:
        raise ConfigError("lora_config: the model has no adapters (LoRALinear).")
    ranks = [n.rank for n in layers.values()]
    alphas = [n.alpha for n in layers.values()]
    rslora = {n.use_rslora for n in layers.values()}
    if len(rslora) > 1:
        raise ConfigError(
            "lora_config: the model's adapters mix use_rslora=True and False; "
            "one LoRAConfig has one setting."
        )
    tails = {tuple(p.split(".")[-2:]) for p in layers}
    targets = [t for t, tail in LORA_TARGETS.items() if tail in tails]
    return LoRAConfig(
        rank=max(set(ranks), key=ranks.count),
        alpha=max(set(alphas), key=alphas.count),
        targets=tuple(targets),
        use_rslora=rslora.pop(),
    )


def lora_filter(model: Any) -> Any:
    """A pytree of bools like `model`: True on the adapters' `A` and `B`
    leaves, False elsewhere (for `eqx.partition` / `optax` masks)."""

    def mark(node):
        if _is_adapted(node):
            marked = eqx.tree_at(
                lambda m: (m.A, m.B), node, (True, True), is_leaf=lambda x: x is None
            )
            return jax.tree.map(lambda x: x is True, marked)
        return False

    return jax.tree.map(mark, model, is_leaf=_is_adapted)


def lora_optimizer(
    optimizer: optax.GradientTransformation,
) -> optax.GradientTransformation:
    """`optimizer` on the adapter leaves only: its state holds them alone, and
    every other leaf gets a zero update (`optax.set_to_zero`, no state). The
    leaves are found in the parameters `init` and `update` receive (any tree
    holding `LoRALinear`s, e.g. `eqx.filter(model, eqx.is_inexact_array)`)."""

    def labels(params):
        return jax.tree.map(lambda f: "adapter" if f else "frozen", lora_filter(params))

    return optax.multi_transform(
        {"adapter": optimizer, "frozen": optax.set_to_zero()}, labels
    )


def merge_lora(model: Any) -> Any:
    """A plain model: each `LoRALinear` replaced by the Linear with weight
    $W + s BA$ (float32 sums, cast to W's dtype). Its outputs equal the
    adapted model's to float32 rounding."""
    return jax.tree.map(
        lambda n: n.merged() if _is_adapted(n) else n, model, is_leaf=_is_adapted
    )


def unmerge_lora(model: Any) -> tuple[Any, Any]:
    """`(base, adapters)` of an adapted model.

    `base` is the model the adapters were added to, bit for bit (each
    `LoRALinear` replaced by its `base`); `adapters` is
    `eqx.partition(model, lora_filter(model))[0]` (the `A`/`B` leaves, None
    elsewhere). A merged model cannot give its base back exactly
    ($W + sBA - sBA$ rounds), so this takes the adapted model, which JAX's
    immutability keeps alongside `merge_lora`'s result.
    """
    if not lora_layers(model):
        raise ConfigError("unmerge_lora: the model has no adapters (LoRALinear).")
    adapters = eqx.partition(model, lora_filter(model))[0]
    base = jax.tree.map(
        lambda n: n.base if isinstance(n, LoRALinear) else n,
        model,
        is_leaf=lambda x: isinstance(x, LoRALinear),
    )
    return base, adapters


def _pad(a: Array, axis: int, size: int) -> Array:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def mask_lora(model: Any, max_rank: int) -> Any:
    r"""Each `LoRALinear` of rank $r \le R$ = `max_rank` as a
    `MaskedLoRALinear` of rank $R$: $A$ zero-padded to $(R, n)$, $B$ to
    $(m, R)$, and `rank` $= r$. Its outputs equal the adapter's (the padded
    terms are masked), and so do its gradients on the first $r$ rows of $A$
    and columns of $B$; the padded ones get zero gradients.

    Raises:
        ConfigError: no adapters, or an adapter of rank above `max_rank`.
    """
    owner = "mask_lora"
    max_rank = check_int(owner, "max_rank", max_rank, min=1)
    layers = lora_layers(model)
    if not layers:
        raise ConfigError(f"{owner}: the model has no adapters (LoRALinear).")
    for path, node in layers.items():
        if node.rank > max_rank:
            raise ConfigError(
                f"{owner}: {path} has rank {node.rank} > max_rank={max_rank}."
            )

    def masked(n):
        if not isinstance(n, LoRALinear):
            return n
        lead = n.A.shape[:-2]
        return MaskedLoRALinear(
            base=n.base,
            A=_pad(n.A, -2, max_rank),
            B=_pad(n.B, -1, max_rank),
            rank=jnp.full(lead, n.rank, jnp.int32),
            alpha=n.alpha,
            use_rslora=n.use_rslora,
            max_rank=max_rank,
        )

    return jax.tree.map(masked, model, is_leaf=_is_adapted)


def unmask_lora(model: Any) -> Any:
    """Each `MaskedLoRALinear` as the `LoRALinear` of its rank $r$ (the first
    $r$ rows of $A$ and columns of $B$, scaling $s_r$): the inverse of
    `mask_lora`. Needs concrete ranks (not under `jit`).

    Raises:
        ConfigError: a layer whose ranks differ between its stacked layers.
    """

    def unmasked(n):
        if not isinstance(n, MaskedLoRALinear):
            return n
        ranks = np.unique(np.asarray(n.rank))
        if ranks.size != 1:
            raise ConfigError(
                f"unmask_lora: one adapter's layers have different ranks "
                f"{ranks.tolist()}."
            )
        r = int(ranks[0])
        return LoRALinear(
            base=n.base,
            A=n.A[..., :r, :],
            B=n.B[..., :r],
            scale=lora_scale(r, n.alpha, n.use_rslora),
            rank=r,
            alpha=n.alpha,
            use_rslora=n.use_rslora,
        )

    return jax.tree.map(unmasked, model, is_leaf=_is_adapted)
