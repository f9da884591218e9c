r"""What each layer would predict: the logit lens and the Jacobian lens.

Write $h_l$ for the residual stream after block $l$ (the site
`blocks.{l}.hook_resid_post`, $l = 0, \ldots, L-1$), so that $h_{L-1}$ is
what the final norm reads, and $U(h) = \mathrm{logits}(\mathrm{Norm}(h))$ for
the model's own final norm and unembedding (`model.norm`, `model.logits`:
its readout multiplier and final soft-cap included). The model's logits are
$U(h_{L-1})$.

- The **logit lens** (nostalgebraist, 2020) reads every layer with the
  model's readout: $z_l = U(h_l)$.
- The **Jacobian lens** first carries $h_l$ to the last layer with the mean
  linearisation of the blocks in between: $z_l = U(J_l\, h_l)$ with
  $$J_l = \mathbb E_{s,\,t}\!\left[\frac{\partial h_{L-1}[s,t]}
  {\partial h_l[s,t]}\right] \in \mathbb R^{d \times d},$$
  the mean over a corpus of sequences $s$ and positions $t$ of the Jacobian
  of the last residual stream at position $t$ with respect to layer $l$'s at
  the same position (`jacobians`). In a causal model $h_{L-1}[t]$ depends on
  $h_l[t']$ for $t' \le t$ only, and on $h_l[t]$ only through paths that stay
  at position $t$. $J_{L-1} = I$, so at the last layer both lenses give the
  model's logits.

Both return a `LensResult`: per layer the top-$k$ tokens and their
probabilities $p_l = \mathrm{softmax}(z_l)$, the probability of given
target tokens, and $\mathrm{KL}(p_{\text{final}} \,\|\, p_l)$ per position,
all in float32 from `log_softmax`. The layers are read one at a time inside
one `lax.map`, so the `(L, ..., T, vocab)` logits are only held when asked
for (`logits=True`).

`save_lens` / `load_lens` keep the $J_l$ as safetensors, with the model's
configuration in the file's metadata.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._io import atomic_write
from .._validate import ConfigError, check_int
from .capture import capture
from .sites import site_shapes

__all__ = [
    "LensResult",
    "logit_lens",
    "jacobians",
    "jacobian_lens",
    "save_lens",
    "load_lens",
]

#: The residual stream after each block: what the lenses read.
SITE = "blocks.*.hook_resid_post"
#: `jacobians`' ways of taking the products.
MODES = ("reverse", "forward")
#: The tensor name and format tag of a lens file.
_TENSOR = "jacobians"
_FORMAT = "blocklab.jacobian_lens"
_RESERVED = ("format", "num_layers", "num_hiddens", "model", "config")


class LensResult(NamedTuple):
    """What a lens reads at every layer `l` (leading axis `L`), for every
    sequence and position of the input.

    Attributes:
        top_k: `(L, ..., T, k)` int32, the `k` most probable next tokens,
            most probable first.
        top_k_probs: `(L, ..., T, k)` float32, their probabilities.
        target_probs: `(L, ..., T)` float32, the probability of the `target`
            token at each position, or `None` without `target`.
        kl: `(L, ..., T)` float32,
            $\\mathrm{KL}(p_\\text{final} \\| p_l) = \\sum_v p_\\text{final}(v)
            (\\log p_\\text{final}(v) - \\log p_l(v))$, with $p_\\text{final}$
            the model's own output distribution.
        logits: `(L, ..., T, vocab)` float32, the lens logits $z_l$, or `None`
            unless asked for (`logits=True`).
    """

    top_k: Any
    top_k_probs: Any
    target_probs: Any
    kl: Any
    logits: Any = None


def _check_unembedding(model: Any, owner: str) -> None:
    """A lens needs the model's final norm and unembedding."""
    norm, logits = getattr(model, "norm", None), getattr(model, "logits", None)
    if norm is None or not callable(logits):
        missing = [n for n, v in (("norm", norm), ("logits", logits)) if v is None]
        raise ConfigError(
            f"{owner}: a model of type {type(model).__name__} has no unembedding "
            f"(it lacks {', '.join(missing) or 'a callable logits'}): a lens applies "
            "the model's final norm `model.norm` and readout `model.logits` to "
            "each layer's residual stream; pass a language model such as "
            "DecoderLM."
        )


def _resid_spec(model: Any, inputs: Any, owner: str, kwargs=None):
    """The `(L, ..., T, d)` shape and dtype of the stacked residual stream."""
    catalogue = site_shapes(model, inputs, **(kwargs or {}))
    spec = catalogue.get(SITE)
    if spec is None:
        raise ConfigError(
            f"{owner}: a model of type {type(model).__name__} has no scanned stack "
            f"of blocks reporting {SITE!r}; its sites are {sorted(catalogue)}."
        )
    return spec


def _lens_args(owner: str, model: Any, ids: Any, k: Any, kwargs):
    """The checks every lens starts with, in order: the model has an
    unembedding, `k >= 1`; returns `k` and the stacked stream's `_resid_spec`."""
    _check_unembedding(model, owner)
    k = check_int(owner, "k", k, min=1)
    return k, _resid_spec(model, ids, owner, kwargs)


def _check_target(owner: str, target: Any, lead: tuple[int, ...], vocab: int | None):
    if target is None:
        return None
    arr = jnp.asarray(target)
    if not jnp.issubdtype(arr.dtype, jnp.integer) or tuple(arr.shape) != lead:
        raise ConfigError(
            f"{owner}: target must be integer token ids of the inputs' shape "
            f"{lead}, got dtype {arr.dtype}, shape {tuple(arr.shape)}."
        )
    if vocab is not None and not isinstance(arr, jax.core.Tracer):
        bad = (np.asarray(arr) < 0) | (np.asarray(arr) >= vocab)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ConfigError(
                f"{owner}: target ids must lie in [0, vocab_size={vocab}), got "
                f"target{list(where)}={int(np.asarray(arr)[where])}."
            )
    return arr


def _vocab(model: Any) -> int | None:
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "vocab_size", getattr(model, "vocab_size", None))


def _readout(model, hs, final_logits, k: int, target, want_logits: bool):
    """The `LensResult` of residual streams `hs` `(L, ..., T, d)`, one layer at
    a time (`lax.map`)."""
    logp_final = jax.nn.log_softmax(final_logits.astype(jnp.float32), axis=-1)
    p_final = jnp.exp(logp_final)
    vocab = logp_final.shape[-1]
    if k > vocab:
        raise ConfigError(f"lens: k must be at most vocab_size={vocab}, got k={k}.")

    def one(h):
        z = model.logits(model.norm(h)).astype(jnp.float32)
        logp = jax.nn.log_softmax(z, axis=-1)
        top_logp, top = jax.lax.top_k(logp, k)
        # p log p -> 0 where the final distribution underflows to 0
        kl = jnp.sum(
            jnp.where(p_final > 0, p_final * (logp_final - logp), 0.0), axis=-1
        )
        tgt = (
            None
            if target is None
            else jnp.exp(jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0])
        )
        return LensResult(
            top.astype(jnp.int32), jnp.exp(top_logp), tgt, kl,
            z if want_logits else None,
        )  # fmt: skip

    return jax.lax.map(one, hs)


@eqx.filter_jit
def _lens(model, ids, jac, k, target, want_logits, kwargs):
    final, values = capture(model, ids, SITE, **kwargs)
    hs = values[SITE]
    if jac is not None:
        # (J_l h)_i = sum_j J_l[i, j] h_j, in float32 at full precision (so
        # that J = I gives h back exactly)
        moved = jnp.einsum(
            "lij,l...j->l...i",
            jac.astype(jnp.float32),
            hs.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        hs = moved.astype(hs.dtype)
    return _readout(model, hs, final, k, target, want_logits)


def logit_lens(
    model: Any,
    ids: Int[ArrayLike, "*batch T"],
    *,
    k: int = 5,
    target: Int[ArrayLike, "*batch T"] | None = None,
    logits: bool = False,
    **kwargs: Any,
) -> LensResult:
    r"""The logit lens: $z_l = \mathrm{logits}(\mathrm{Norm}(h_l))$ for every
    layer's residual stream $h_l$ (`blocks.{l}.hook_resid_post`).

    One forward pass captures every $h_l$ (`blocklab.interp.capture`, one
    scan), then each layer is read with the model's own `norm` and `logits`
    (so a readout multiplier or final soft-cap applies as in the model). At
    the last layer $z_{L-1}$ is the model's logits.

    Args:
        model: a language model with a final norm and unembedding
            (`DecoderLM`); others are refused by name.
        ids: token ids `(T,)` or a batch `(..., T)`.
        k: how many most probable tokens to report per position.
        target: token ids of `ids`' shape (e.g. the next tokens) whose
            probability to report, or `None`.
        logits: also return the `(L, ..., T, vocab)` lens logits.
        **kwargs: forwarded to the model's call (`positions`, `segment_ids`).

    Returns:
        A `LensResult`, every field with a leading layer axis `L`.
    """
    owner = "logit_lens"
    k, spec = _lens_args(owner, model, ids, k, kwargs)
    target = _check_target(owner, target, tuple(spec.shape[1:-1]), _vocab(model))
    return _lens(model, ids, None, k, target, bool(logits), kwargs)


def _check_positions(owner: str, positions: Any, T: int) -> tuple[int, ...]:
    if positions is None:
        return tuple(range(T))
    pos = np.atleast_1d(np.asarray(positions))
    if pos.ndim != 1 or pos.size == 0 or not np.issubdtype(pos.dtype, np.integer):
        raise ConfigError(
            f"{owner}: positions must be a non-empty sequence of int positions in "
            f"[0, T={T}) (or None for all), got {positions!r}."
        )
    if ((pos < -T) | (pos >= T)).any():
        raise ConfigError(
            f"{owner}: positions must lie in [-T, T) for T={T}, got {pos.tolist()}."
        )
    return tuple(int(p) % T for p in pos)


def _chunked(probe, index: Sequence[np.ndarray], chunk: int, init, place):
    """`init` plus `place`d `probe` outputs over all index tuples, `chunk` of
    them (one `vmap`) per step of one `lax.scan`: memory is one chunk's
    products, never all of them."""
    n = len(index[0])
    pad = -n % chunk
    cols = [np.concatenate([a, np.full(pad, a[0], a.dtype)]) for a in index]
    weight = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    xs = tuple(jnp.asarray(c.reshape(-1, chunk)) for c in (*cols, weight))

    def body(acc, xs):
        *idx, w = xs
        out = jax.vmap(probe)(*idx)
        out = out * w.reshape((chunk,) + (1,) * (out.ndim - 1))
        return place(acc, idx, out), None

    acc, _ = jax.lax.scan(body, init, xs)
    return acc


@eqx.filter_jit
def _jacobians(model, inputs, positions, mode, chunk):
    spec = site_shapes(model, inputs)[SITE]
    L, T, d = spec.shape[0], spec.shape[-2], spec.shape[-1]
    batch = tuple(spec.shape[1:-2])
    nseq = math.prod(batch)
    last = f"blocks.{L - 1}.hook_resid_post"

    def final(delta):
        """h_{L-1} when delta[l] is added to h_l at every layer l."""

        def add(v, layer):
            return v + delta[layer]

        _, values = capture(model, inputs, last, edits={SITE: add})
        return values[last]

    def unit(t, j, dtype):
        """e_j at row t of a `(T, d)` stream (broadcast over the batch)."""
        return jax.nn.one_hot(t, T, dtype=dtype)[:, None] * jax.nn.one_hot(
            j, d, dtype=dtype
        )

    def row_sum(x, t):
        """Row t of `(..., *batch, T, d)`, summed over the batch: `(..., d)`."""
        x = jnp.take(x, t, axis=-2).astype(jnp.float32)
        x = x.reshape(x.shape[: x.ndim - 1 - len(batch)] + (nseq, d))
        return x.sum(axis=-2)

    delta0 = jnp.zeros(spec.shape, spec.dtype)
    P = len(positions)
    pos = np.asarray(positions, np.int32)
    coords = np.arange(d, dtype=np.int32)
    init = jnp.zeros((L, d, d), jnp.float32)
    if mode == "reverse":
        h, pullback = jax.vjp(final, delta0)

        def probe(t, j):
            # cotangent e_j at row t of every sequence (sequences are
            # independent); the gradient at row t of delta[l] is row j of
            # dh_{L-1}[t] / dh_l[t], for every l at once.
            (g,) = pullback(jnp.broadcast_to(unit(t, j, h.dtype), h.shape))
            return row_sum(g, t)  # (L, d)

        def place(acc, idx, rows):  # rows (c, L, d): acc[l, j, :] += rows[:, l]
            _, j = idx
            return acc.at[:, j, :].add(jnp.swapaxes(rows, 0, 1))

        index = [np.repeat(pos, d), np.tile(coords, P)]
    else:
        h, push = jax.linearize(final, delta0)

        def probe(layer, t, i):
            # tangent e_i at row t of layer `layer` (every sequence); row t of
            # the output is column i of dh_{L-1}[t] / dh_layer[t].
            e = jax.nn.one_hot(layer, L, dtype=h.dtype)
            e = e.reshape((L,) + (1,) * (len(spec.shape) - 1)) * unit(t, i, h.dtype)
            return row_sum(push(jnp.broadcast_to(e, spec.shape)), t)  # (d,)

        def place(acc, idx, cols):  # cols (c, d): acc[l, :, i] += cols
            layer, _, i = idx
            return acc.at[layer, :, i].add(cols)

        index = [
            np.repeat(np.arange(L, dtype=np.int32), P * d),
            np.tile(np.repeat(pos, d), L),
            np.tile(coords, L * P),
        ]
    return _chunked(probe, index, chunk, init, place) / (P * nseq)


def jacobians(
    model: Any,
    inputs: Any,
    *,
    positions: int | Sequence[int] | None = None,
    mode: str = "reverse",
    chunk: int | None = None,
) -> Float[Array, "L d d"]:
    r"""The mean Jacobians $J_l = \mathbb E_{s,t}[\partial h_{L-1}[s,t] /
    \partial h_l[s,t]]$ of the last residual stream with respect to each
    layer's, at the same position, for every layer $l = 0, \ldots, L-1$.

    $J_l[j, i] = \partial h_{L-1,j} / \partial h_{l,i}$ (rows index the last
    layer), averaged over the sequences of `inputs` and the chosen positions;
    $J_{L-1} = I$. A zero $\delta_l$ is added at every layer's
    `hook_resid_post` (`blocklab.interp.capture` with the edit
    $h_l \leftarrow h_l + \delta_l$), and the map
    $\delta \mapsto h_{L-1}$ is differentiated, all layers in one compiled
    program over the one scanned stack:

    - `mode="reverse"`: one forward pass (`jax.vjp`), then for each position
      $t$ and output coordinate $j$ one vector-Jacobian product with the
      cotangent $e_j$ at row $t$; the gradient at row $t$ of $\delta_l$ is
      row $j$ of the layer-$l$ Jacobian at $t$, for every $l$ at once. Rows
      of different positions cannot share a product (a cotangent at row
      $t' > t$ also reaches row $t$ of every earlier layer through
      attention), but different sequences can: cost $P \cdot d$ backward
      passes over the whole batch ($P$ positions per sequence), independent
      of $L$.
    - `mode="forward"`: one linearisation (`jax.linearize`), then for each
      layer $l$, position $t$ and input coordinate $i$ one Jacobian-vector
      product with the tangent $e_i$ at row $t$ of $\delta_l$; row $t$ of
      the output is column $i$ of the Jacobian. Cost $L \cdot P \cdot d$
      forward-mode products over the batch. The model's attention must
      support forward-mode differentiation (the reference path does).

    The products are taken `chunk` at a time (one `vmap`) inside one
    `lax.scan` and summed into the $J_l$ as they come: memory is one
    chunk's products and the `(L, d, d)` result, never a $(Td) \times (Td)$
    matrix.

    Args:
        model: any model whose scanned stack reports `hook_resid_post`
            (`DecoderLM`, `CharLM`, `Stack`).
        inputs: what the model takes, one sequence or a batch `(B, T)` (the
            corpus; its sequences are averaged over).
        positions: the token positions to average over (ints in `[-T, T)`),
            or `None` for all `T`.
        mode: `"reverse"` or `"forward"`.
        chunk: products per `vmap` (default `d`: one position's); larger is
            faster and takes more memory.

    Returns:
        `(L, d, d)` float32 $J_l$.
    """
    owner = "jacobians"
    if not isinstance(mode, str) or mode not in MODES:
        raise ConfigError(f"{owner}: mode must be one of {list(MODES)}, got {mode!r}.")
    spec = _resid_spec(model, inputs, owner)
    T, d = spec.shape[-2], spec.shape[-1]
    pos = _check_positions(owner, positions, T)
    chunk = check_int(owner, "chunk", chunk, min=1, optional=True)
    try:
        return _jacobians(model, inputs, pos, mode, d if chunk is None else chunk)
    except TypeError as err:
        if mode != "forward" or "custom_vjp" not in str(err):
            raise
        raise ConfigError(
            f"{owner}: mode='forward' needs forward-mode derivatives, which this "
            "model's attention implementation (a custom_vjp kernel) does not "
            "have; use mode='reverse', or "
            "blocklab.with_attention_impl(model, 'reference')."
        ) from None


def _check_lens(owner: str, jac: Any, L: int, d: int) -> Array:
    shape = tuple(getattr(jac, "shape", np.shape(jac)))
    if shape != (L, d, d):
        raise ConfigError(
            f"{owner}: jac must have shape (L, d, d) = {(L, d, d)} for this model "
            f"({L} layers of width d={d}), got {shape}."
        )
    arr = jnp.asarray(jac)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ConfigError(f"{owner}: jac must be floating-point, got {arr.dtype}.")
    return arr


def jacobian_lens(
    model: Any,
    ids: Int[ArrayLike, "*batch T"],
    jac: Float[ArrayLike, "L d d"],
    *,
    k: int = 5,
    target: Int[ArrayLike, "*batch T"] | None = None,
    logits: bool = False,
    **kwargs: Any,
) -> LensResult:
    r"""The Jacobian lens: $z_l = \mathrm{logits}(\mathrm{Norm}(J_l\, h_l))$
    for every layer's residual stream $h_l$ of `ids`.

    $J_l$ (from `jacobians` over a corpus, or `load_lens`) carries layer
    $l$'s stream to the last layer with the blocks' mean linearisation;
    $J_{L-1} = I$ gives the logit lens at the last layer. The product is
    taken in float32 at full precision.

    Args:
        model, ids, k, target, logits, kwargs: as for `logit_lens`.
        jac: `(L, d, d)` Jacobians for this model's depth and width.

    Returns:
        A `LensResult`, every field with a leading layer axis `L`.
    """
    owner = "jacobian_lens"
    k, spec = _lens_args(owner, model, ids, k, kwargs)
    jac = _check_lens(owner, jac, spec.shape[0], spec.shape[-1])
    target = _check_target(owner, target, tuple(spec.shape[1:-1]), _vocab(model))
    return _lens(model, ids, jac, k, target, bool(logits), kwargs)


def _model_dims(model: Any, owner: str) -> tuple[int, int]:
    """(layers, width) of a model with a scanned stack and a final norm."""
    stack, norm = getattr(model, "stack", None), getattr(model, "norm", None)
    L = getattr(stack, "num_blks", None)
    d = getattr(norm, "num_hiddens", None)
    if L is None or d is None:
        raise ConfigError(
            f"{owner}: model of type {type(model).__name__} has no scanned stack "
            "and final norm to read its depth and width from; pass a DecoderLM "
            "or CharLM."
        )
    return int(L), int(d)


def save_lens(
    path: str | Path,
    jac: Float[ArrayLike, "L d d"],
    *,
    model: Any = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write Jacobian-lens maps to a safetensors file (atomically).

    The file holds one float32 tensor `"jacobians"` `(L, d, d)` and string
    metadata: `format` (`"blocklab.jacobian_lens"`), `num_layers`,
    `num_hiddens`, with `model` the model's class and `config` its
    constructor arguments as JSON (`init_args()`; the model's depth and width
    must match the maps'), and each entry of `metadata` (a string as is,
    anything else as JSON; the names above are reserved).

    Returns:
        The path written.
    """
    owner = "save_lens"
    arr = np.asarray(jac, np.float32)
    if arr.ndim != 3 or arr.shape[1] != arr.shape[2]:
        raise ConfigError(
            f"{owner}: jac must have shape (L, d, d), got {tuple(arr.shape)}."
        )
    L, d = arr.shape[0], arr.shape[1]
    meta = {"format": _FORMAT, "num_layers": str(L), "num_hiddens": str(d)}
    if model is not None:
        arr = np.asarray(_check_lens(owner, arr, *_model_dims(model, owner)))
        meta["model"] = type(model).__name__
        if hasattr(model, "init_args"):
            meta["config"] = json.dumps(model.init_args(), sort_keys=True)
    for name, value in (metadata or {}).items():
        if not isinstance(name, str) or name in _RESERVED:
            raise ConfigError(
                f"{owner}: metadata keys must be strings other than the reserved "
                f"{list(_RESERVED)}, got {name!r}."
            )
        try:
            meta[name] = value if isinstance(value, str) else json.dumps(value)
        except TypeError as err:
            raise ConfigError(
                f"{owner}: metadata[{name!r}] must be a string or JSON-serialisable, "
                f"got {type(value).__name__}."
            ) from err
    from safetensors.numpy import save

    blob = save({_TENSOR: np.ascontiguousarray(arr)}, metadata=meta)
    return atomic_write(path, blob, owner=owner)


def load_lens(
    path: str | Path, *, model: Any = None
) -> tuple[Float[Array, "L d d"], dict[str, str]]:
    """Read Jacobian-lens maps written by `save_lens`.

    Args:
        path: the safetensors file.
        model: when given, the maps must be for its depth and width (a lens
            of another model is refused, naming both).

    Returns:
        `(jac, metadata)`: the `(L, d, d)` float32 maps and the file's string
        metadata (`config` holds the model's constructor arguments as JSON).
    """
    owner = "load_lens"
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{owner}: no lens file at {path}.")
    try:
        with safe_open(str(path), framework="np") as f:
            meta = dict(f.metadata() or {})
            keys = set(f.keys())
            arr = f.get_tensor(_TENSOR) if _TENSOR in keys else None
    except SafetensorError as err:
        raise ConfigError(
            f"{owner}: {path} is not a safetensors file ({err})."
        ) from err
    if meta.get("format") != _FORMAT or arr is None:
        raise ConfigError(
            f"{owner}: {path} is not a Jacobian lens written by save_lens (format "
            f"{meta.get('format')!r}, tensors {sorted(keys)})."
        )
    if arr.ndim != 3 or arr.shape[1] != arr.shape[2]:
        raise ConfigError(
            f"{owner}: the lens in {path} has shape {tuple(arr.shape)}, not (L, d, d)."
        )
    if model is not None:
        L, d = _model_dims(model, owner)
        if arr.shape != (L, d, d):
            raise ConfigError(
                f"{owner}: the lens in {path} is for {arr.shape[0]} layers of width "
                f"d={arr.shape[1]}, but the model ({type(model).__name__}) has {L} "
                f"layers of width d={d}."
            )
    return jnp.asarray(arr, jnp.float32), meta
