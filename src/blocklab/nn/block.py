"""The configurable transformer block."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_key
from .attention import AttentionTrace, MultiHeadAttention
from .config import PLACEMENTS, BlockConfig, as_config
from .ffn import FeedForward
from .functional import dropout
from .hooks import Hooks, at, scope
from .mask import Mask
from .normalization import LayerNorm, RMSNorm, check_float_input, make_norm

__all__ = ["TransformerBlock", "BlockTrace", "BlockConfig", "PLACEMENTS"]


class BlockTrace(NamedTuple):
    """What one block call computes, for diagnostics.

    Attributes:
        output: `(T, d)`, the block's output.
        attn_out: `(T, d)`, what the attention branch adds to the stream (after
            its output norm and dropout, where the placement has them).
        ffn_out: `(T, d)`, likewise for the FFN branch.
        attention: the attention's `AttentionTrace`, or `None` when a custom
            attention module has no `trace` method.
        ffn_trace: what `ffn.trace(y, key=...)` returned when the FFN module
            has a `trace` method (an object with `.output`, e.g. the router
            statistics of a mixture of experts), else `None`.
        cross_out: `(T, d)`, what the cross-attention branch adds to the
            stream (`cross_attention` blocks), else `None`.

    For a batch `(..., T, d)` every field gains the same leading axes.
    """

    output: Array
    attn_out: Array
    ffn_out: Array
    attention: AttentionTrace | None
    ffn_trace: Any = None
    cross_out: Array | None = None


class TransformerBlock(eqx.Module):
    r"""Attention and an FFN on a residual stream, with a choice of norm placement.

    Writing $F$ for a sublayer (attention, then the FFN) and $N$, $N'$ for
    norms, each sublayer updates the stream $x$ as

    - `"post"` (Vaswani et al., 2017): $x \leftarrow N(x + F(x))$
    - `"pre"` (GPT-2, Llama; Xiong et al., 2020): $x \leftarrow x + F(N(x))$
    - `"output"` (OLMo 2): $x \leftarrow x + N(F(x))$
    - `"sandwich"` (Gemma 3): $x \leftarrow x + N'(F(N(x)))$

    Only `"post"` normalizes the stream's identity path. Norms are `norm1`,
    `norm2` (the branch-output norms of `"sandwich"` are `out_norm1`,
    `out_norm2`). Dropout acts on each branch output when a `key` is passed.

    With `cross_attention=True` (an encoder–decoder's decoder block: T5,
    Whisper) a third sublayer sits between the two, the cross-attention
    $F_\times(y) = \mathrm{MHA}(q = y;\ k, v = c)$ over the encoder states
    $c$ (`cross_attn`, never RoPE nor window), under the same placement with
    its own norm `norm_cross` (`out_norm_cross` in `"sandwich"`):
    pre-norm reads $x \leftarrow x + F_\times(N_\times(x))$.
    Without a causal mask (`Mask.causal()`, or causal `valid_lens`) the
    self-attention is bidirectional (an encoder's block): every query sees
    every (unmasked) key.

    The defaults (pre-norm, RMSNorm, SwiGLU, no bias) are the modern open-weights
    block; `norm="layer", act="gelu", placement="post", bias=True` is the 2017
    encoder block (with GELU for ReLU). With the attention options
    (`num_kv_heads`, `head_dim`, `attn_scale`, `rope_theta`, `window`,
    `qk_norm="full"`) and `norm="gemma_rms"` the block is that of GPT-2
    (`"pre"`, `"layer"`, `"gelu"`, biases), Llama (`"pre"`, `"rms"`,
    `"swiglu"`, RoPE, GQA), OLMo 2 (`"output"`, `qk_norm="full"`) or Gemma 3
    (`"sandwich"`, `"gemma_rms"`, `"geglu"`, `qk_norm="head"`, a window).

    Inputs must have a floating dtype (integer input is refused). In float16
    (and bfloat16), the `"post"` residual sum is computed in float32 before
    its norm, and the `"output"` placement, which feeds the raw stream to the
    branch, runs the branch and its norm in float32: a stream near float16's
    range (~1e4) overflows in neither (a gated FFN grows as $|x|^2$). The
    other placements feed the branch a normalized stream.
    """

    norm1: RMSNorm | LayerNorm
    norm2: RMSNorm | LayerNorm
    out_norm1: RMSNorm | LayerNorm | None
    out_norm2: RMSNorm | LayerNorm | None
    attention: Any
    ffn: Any
    cfg: BlockConfig = eqx.field(static=True)
    norm_cross: RMSNorm | LayerNorm | None = None
    out_norm_cross: RMSNorm | LayerNorm | None = None
    cross_attn: MultiHeadAttention | None = None
    skip_norm1: Int[Array, ""] | None = None

    def __init__(
        self,
        num_hiddens: int | BlockConfig,
        num_heads: int | None = None,
        *,
        attn_factory: Callable[..., Any] | None = None,
        ffn_factory: Callable[..., Any] | None = None,
        key: PRNGKeyArray,
        **options: Any,
    ):
        """Build the block of a `BlockConfig`, or of its options.

        `TransformerBlock(d, H, **options, key=key)` is
        `TransformerBlock(BlockConfig(d, H, **options), key=key)`: the options
        (`dropout`, `norm`, `act`, `placement`, `bias`, `qk_norm`, and the
        rest) are the fields of `BlockConfig`, declared, checked and
        documented there once; a bad one raises `ConfigError`, an unknown one
        `TypeError`. The block stores the config as `cfg`.

        Args:
            num_hiddens: model width $d$, or a `BlockConfig` (then alone, but
                for the factories).
            num_heads: attention (query) heads $H$.
            attn_factory: `attn_factory(key=...)` returns the attention module,
                called as `attn(x, mask, key=...)` (and `positions=` when
                the block is given positions); replaces the default.
            ffn_factory: `ffn_factory(key=...)` returns the FFN module, called as
                `ffn(x, key=...)`, or `ffn.trace(x, key=...)` when it has a
                `trace` method; replaces the default.
            key: PRNG key for the weights.
            **options: the other fields of `BlockConfig`.
        """
        cfg = as_config("TransformerBlock", num_hiddens, num_heads, options)
        key = check_key("TransformerBlock", "key", key)
        self.cfg = cfg
        attn_key, ffn_key = jax.random.split(key)

        def new_norm():
            return make_norm(cfg.norm, cfg.num_hiddens, cfg.norm_eps)

        self.norm1, self.norm2 = new_norm(), new_norm()
        sandwich = cfg.placement == "sandwich"
        self.out_norm1 = new_norm() if sandwich else None
        self.out_norm2 = new_norm() if sandwich else None
        self.attention = (
            MultiHeadAttention(cfg, key=attn_key)
            if attn_factory is None
            else attn_factory(key=attn_key)
        )
        self.ffn = (
            FeedForward(cfg, key=ffn_key)
            if ffn_factory is None
            else ffn_factory(key=ffn_key)
        )
        if cfg.cross_attention:
            # its own key: the other weights stay those of a block without it
            cross_cfg = dataclasses.replace(cfg, rope_theta=None, window=None)
            self.cross_attn = MultiHeadAttention(
                cross_cfg, key=jax.random.fold_in(key, 2)
            )
            self.norm_cross = new_norm()
            self.out_norm_cross = new_norm() if sandwich else None
        else:
            self.cross_attn = self.norm_cross = self.out_norm_cross = None
        # data, not structure: 0 (use norm1) until a model sets its layers
        self.skip_norm1 = jnp.zeros((), jnp.int32) if cfg.skip_attn_norm else None

    # The block's main options as attributes, read from the config.
    @property
    def num_hiddens(self) -> int:
        return self.cfg.num_hiddens

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads

    @property
    def norm(self) -> str:
        return self.cfg.norm

    @property
    def act(self) -> str:
        return self.cfg.act

    @property
    def placement(self) -> str:
        return self.cfg.placement

    @property
    def dropout(self) -> float:
        return self.cfg.dropout

    def _sublayer(self, x, branch_fn, i, key, hooks=None):
        """Sublayer `i` (1: attention, 2: FFN, `"cross"`: cross-attention);
        returns (new stream, what the branch wrote). Sites: `ln{i}.*`,
        `ln{i}_post.*` (sandwich) and the branch's output, `hook_attn_out`,
        `hook_mlp_out` or `hook_cross_attn_out`."""
        norm, out_norm = {
            1: (self.norm1, self.out_norm1),
            2: (self.norm2, self.out_norm2),
            "cross": (self.norm_cross, self.out_norm_cross),
        }[i]
        out_site = {1: "hook_attn_out", 2: "hook_mlp_out"}.get(i, "hook_cross_attn_out")
        ln = scope(hooks, f"ln{i}" if i != "cross" else "ln_cross")
        if self.placement == "output":
            # The raw stream feeds the branch: a half-precision stream near
            # 1e4 would overflow inside it (a gated FFN grows as |x|^2), so
            # the branch and its norm run in float32 (or wider).
            wide = jnp.promote_types(x.dtype, jnp.float32)
            branch = norm(branch_fn(x.astype(wide)), hooks=ln).astype(x.dtype)
        else:
            reads_normed = self.placement in ("pre", "sandwich")
            y = norm(x, hooks=ln) if reads_normed else x
            if i == 1 and self.skip_norm1 is not None:
                y = jnp.where(self.skip_norm1 > 0, x, y)
            branch = branch_fn(y)
        if self.placement == "sandwich":
            post = f"ln{i}_post" if i != "cross" else "ln_cross_post"
            branch = out_norm(branch, hooks=scope(hooks, post))
        branch = dropout(branch, self.dropout, key)
        branch = at(hooks, out_site, branch)
        if self.placement == "post":
            # The sum feeding the norm in float32 (or wider): float16 streams
            # near 1e4 would overflow in x + branch before being normalized.
            wide = jnp.promote_types(x.dtype, jnp.float32)
            out = norm(x.astype(wide) + branch.astype(wide), hooks=ln)
            return out.astype(x.dtype), branch
        return x + branch, branch

    def trace(
        self,
        x: Float[Array, "*batch T d"],
        mask: Mask | Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
        **inputs: Any,
    ) -> BlockTrace:
        """Run the block, returning its output and the intermediate values.

        The one implementation of the forward pass (`__call__` returns its
        `.output`); see `BlockTrace`. Arguments as for `__call__`. The
        attention is traced, i.e. runs its reference path whatever its
        `attention_impl` (`__call__` uses the chosen implementation).
        """
        return self._run(
            x, mask, positions, key, traced=True, hooks=hooks, **inputs
        )  # fmt: skip

    def _cross_inputs(self, owner, context, cross_mask, kv=None):
        """The cross-attention's keywords, checked against the block's kind."""
        given = context is not None or kv is not None
        if self.cross_attn is None:
            if given or cross_mask is not None:
                raise ConfigError(
                    f"{owner}: context (encoder states) was given to a block "
                    "without cross-attention; build it with cross_attention=True."
                )
            return None
        if not given:
            raise ConfigError(
                f"{owner}: this block has cross-attention (cross_attention=True) "
                "and needs the encoder states: pass context=(..., Tk, "
                f"num_hiddens={self.num_hiddens}) (or its cached kv when decoding)."
            )
        return dict(context=context, mask=cross_mask, kv=kv)

    def _run(
        self, x, mask, positions, key, traced, hooks=None, *, score_bias=None,
        context=None, cross_mask=None,
    ):  # fmt: skip
        check_float_input(x, "TransformerBlock")  # also refuses a Python list
        if x.ndim < 2 or x.shape[-1] != self.num_hiddens:
            raise ConfigError(
                f"TransformerBlock acts on a sequence x of shape (T, "
                f"num_hiddens={self.num_hiddens}) (or a batch (..., T, "
                f"num_hiddens)), got x.shape={tuple(x.shape)}."
            )
        cross = self._cross_inputs("TransformerBlock", context, cross_mask)
        if key is None:
            k_attn = k_drop1 = k_drop2 = k_ffn = k_cross = k_drop_x = None
        else:
            key = check_key("TransformerBlock", "key", key)
            k_attn, k_drop1, k_drop2 = jax.random.split(key, 3)
            # Independent keys without changing the three above.
            k_ffn = jax.random.fold_in(key, 3)
            k_cross, k_drop_x = jax.random.fold_in(key, 4), jax.random.fold_in(key, 5)
        attn_trace = ffn_trace = cross_out = None
        extra = {} if positions is None else {"positions": positions}
        if score_bias is not None:
            extra["score_bias"] = score_bias

        attn_extra = {**extra, **_hooks_for(self.attention, hooks, "attn")}
        ffn_extra = _hooks_for(self.ffn, hooks, "mlp")

        def attend(y):
            nonlocal attn_trace
            if traced and hasattr(self.attention, "trace"):
                attn_trace = self.attention.trace(y, mask, key=k_attn, **attn_extra)
                return attn_trace.output
            return self.attention(y, mask, key=k_attn, **attn_extra)

        def feed(y):
            nonlocal ffn_trace
            if hasattr(self.ffn, "trace"):
                ffn_trace = self.ffn.trace(y, key=k_ffn, **ffn_extra)
                return ffn_trace.output
            return self.ffn(y, key=k_ffn, **ffn_extra)

        x = at(hooks, "hook_resid_pre", x)
        x, attn_out = self._sublayer(x, attend, 1, k_drop1, hooks)
        x = at(hooks, "hook_resid_mid", x)
        if cross is not None:
            x, cross_out = self._cross_sublayer(x, cross, k_cross, k_drop_x, hooks)
        x, ffn_out = self._sublayer(x, feed, 2, k_drop2, hooks)
        x = at(hooks, "hook_resid_post", x)
        return BlockTrace(x, attn_out, ffn_out, attn_trace, ffn_trace, cross_out)

    def _cross_sublayer(self, x, cross, key, drop_key, hooks):
        """The cross-attention sublayer; sites `ln_cross.*`, `cross_attn.*`,
        `hook_cross_attn_out`, then `hook_resid_mid_cross` (the stream)."""
        sub = scope(hooks, "cross_attn")

        def attend(y):
            return self.cross_attn.cross(y, key=key, hooks=sub, **cross)

        x, out = self._sublayer(x, attend, "cross", drop_key, hooks)
        return at(hooks, "hook_resid_mid_cross", x), out

    def __call__(
        self,
        x: Float[Array, "*batch T d"],
        mask: Mask | Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
        score_bias: ArrayLike | None = None,
        context: Float[Array, "*cbatch Tk dc"] | None = None,
        cross_mask: Mask | None = None,
    ) -> Float[Array, "*batch T d"]:
        r"""Apply the block to one sequence, or to each of a batch.

        Args:
            x: `(T, num_hiddens)`, or a batch `(..., T, num_hiddens)`, of a
                floating dtype. A batch gives the same values as `jax.vmap`,
                computed as one matrix product per projection
                (`blocklab.nn.functional.linear`).
            mask: the self-attention's `Mask` (causal, lengths, key padding,
                segments, chunks, ...; `blocklab.nn.mask`), `None`, or the
                chapter's `valid_lens`: integer lengths broadcastable to
                `x.shape[:-1]` = `(..., T)`: a scalar, `(T,)` per-query lengths
                (`jnp.arange(1, T + 1)` is causal), `(B, 1)` per sequence,
                `(1, T)` or `(B, T)` per query; a 1-D array on a batch with
                `B == T` is refused as ambiguous (write `(1, T)` or `(B, 1)`).
                Masked keys never give NaN, and non-finite values at masked
                positions never leak.
            positions: integer positions for RoPE (default `arange(T)`),
                forwarded to the attention only when given.
            key: enables dropout; `None` is deterministic (evaluation).
            score_bias: additive `(H, T, T)` (or with the batch's axes)
                scores of the self-attention (T5's relative positions).
            context: the encoder states `(..., Tk, num_hiddens)` the
                cross-attention reads (needed by, and only by, a block with
                `cross_attention=True`).
            cross_mask: the cross-attention's `Mask` over the encoder's
                keys (`Mask.padding(m)`, `m` `(..., Tk)`), or `None`.
            hooks: records and edits the block's activation sites
                (`blocklab.nn.hooks`, `blocklab.interp`; TransformerLens's
                names): `hook_resid_pre` (the input), `ln1.hook_normalized`,
                `attn.*` (see `MultiHeadAttention.__call__`),
                `hook_attn_out` (what the attention branch adds to the
                stream: after its output norm, `ln1_post`, in `"sandwich"`,
                after `ln1` in `"output"`), `hook_resid_mid` (the stream
                between the sublayers; in `"post"` that is
                $N_1(x + \mathrm{attn})$), `ln2.hook_normalized`, `mlp.*`
                (see `FeedForward.__call__`, `MoEFeedForward.trace`),
                `hook_mlp_out`, `hook_resid_post` (the output). In `"post"`
                `ln{i}` normalizes the sum $x + F(x)$, in `"output"` the
                branch's output. A cross-attention block adds, between
                `hook_resid_mid` and `ln2`: `ln_cross.hook_normalized`
                (`ln_cross_post.*` in `"sandwich"`), `cross_attn.*` (see
                `MultiHeadAttention.cross`), `hook_cross_attn_out` and
                `hook_resid_mid_cross`.

        Returns:
            The shape and dtype of `x`.
        """
        out = self._run(
            x, mask, positions, key, traced=False, hooks=hooks,
            score_bias=score_bias, context=context, cross_mask=cross_mask,
        )  # fmt: skip
        return out.output

    def step(
        self,
        x: Float[Array, "*batch Tq d"],
        cache: Any,
        start: Int[ArrayLike, "*#batch"],
        *,
        defer_write: bool = False,
        hooks: Hooks | None = None,
        score_bias: ArrayLike | None = None,
        cross_kv: Any = None,
        cross_mask: Mask | None = None,
    ) -> tuple[Float[Array, "*batch Tq d"], Any]:
        """Apply the block to new tokens against the attention's key/value cache.

        The same sublayers as `__call__` (evaluation: no dropout), with the
        attention replaced by `attention.step(y, cache, start)`: the new tokens,
        whose first one sits at cache index (and position) `start`, see the
        cached keys before them and each other causally. Prefill is `start = 0`
        with the whole prompt, decoding one token at a time; row by row the
        output equals `__call__` on the whole sequence with causal lengths.

        Args:
            x: `(Tq, d)` new tokens, or a batch `(..., Tq, d)`.
            cache: the attention's cache (`attention.init_cache(...)`).
            start: int, or one per sequence (shape `x.shape[:-2]`).
            defer_write: as for `MultiHeadAttention.step`: return the new
                tokens' keys and values instead of the written cache.
            hooks: the sites of `__call__` for the new tokens, but for the
                attention's scores and pattern (`MultiHeadAttention.step`).
            score_bias: the self-attention's additive bias over the cache's
                indices, `(H, Tq, max_len)` or with the batch's axes.
            cross_kv: a cross-attention block's cached encoder keys and
                values (`cross_attn.cross_kv(context)`, computed once).
            cross_mask: the cross-attention's `Mask` (the encoder's padding).

        Returns:
            `(output, new_cache)`: the shape and dtype of `x`, and the cache
            with the new tokens' keys and values written (or those alone).
        """
        if x.ndim < 2 or x.shape[-1] != self.num_hiddens:
            raise ConfigError(
                f"TransformerBlock.step acts on new tokens x of shape (Tq, "
                f"num_hiddens={self.num_hiddens}) (or a batch (..., Tq, "
                f"num_hiddens)), got x.shape={tuple(x.shape)}."
            )
        new_cache = []
        attn_extra = _hooks_for(self.attention, hooks, "attn", method="step")
        if score_bias is not None:
            attn_extra["score_bias"] = score_bias
        ffn_extra = _hooks_for(self.ffn, hooks, "mlp")
        cross = self._cross_inputs("TransformerBlock.step", None, cross_mask, cross_kv)

        def attend(y):
            out, written = self.attention.step(
                y, cache, start, defer_write=defer_write, **attn_extra
            )
            new_cache.append(written)
            return out

        x = at(hooks, "hook_resid_pre", x)
        x, _ = self._sublayer(x, attend, 1, None, hooks)
        x = at(hooks, "hook_resid_mid", x)
        if cross is not None:
            x, _ = self._cross_sublayer(x, cross, None, None, hooks)
        x, _ = self._sublayer(
            x, lambda y: self.ffn(y, key=None, **ffn_extra), 2, None, hooks
        )
        x = at(hooks, "hook_resid_post", x)
        return x, new_cache[0]


def _hooks_for(module, hooks, name, method="__call__") -> dict[str, Any]:
    """`{"hooks": hooks.scope(name)}` for a sub-module whose `method` takes
    hooks, `{}` when there are none; a sub-module that cannot report the
    sites wanted under `name` is refused by name."""
    if hooks is None:
        return {}
    fn = getattr(module, method, None)
    try:
        takes = fn is not None and "hooks" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = False
    if takes:
        return {"hooks": hooks.scope(name)}
    if hooks.under(name):
        raise ConfigError(
            f"sites under {hooks.prefix}{name}.* were asked for, but the block's "
            f"{type(module).__name__} has no `hooks` argument to report them."
        )
    return {}
