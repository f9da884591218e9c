r"""A general decoder-only language model, `DecoderLM` (configured by `DecoderConfig`).

One class covers GPT-2, Llama, OLMo 2 and Gemma 3 (and the many models that
differ from them only in sizes): a token embedding (optionally scaled), learned
absolute positions or rotary positions, a `Stack` of `TransformerBlock`s run as
one `lax.scan`, a final norm and a tied or untied head. Layers that differ
(Gemma 3's local and global layers, with their own RoPE base) differ only in
data stored in the stacked pytree (the attention's integer `window` and
`rope_theta` leaves), never in structure, so compile time stays flat in depth.

`blocklab.from_huggingface` converts the `transformers` PyTorch models of these
families into a `DecoderLM`; `nn.decoder_config` holds the config and its
presets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_ids, check_key
from ..nn import init, parametrization
from ..nn.block import TransformerBlock
from ..nn.functional import linear, rope_theta_bits, segment_positions
from ..nn.hooks import Hooks, at, scope
from ..nn.mask import Mask, check_segment_ids
from ..nn.normalization import LayerNorm, RMSNorm, make_norm
from ..nn.stack import Stack
from . import decoding as _cache
from .decoder_config import CONFIG_CLASSES, DecoderConfig

__all__ = ["DecoderLM", "set_layer_data"]


def set_layer_data(stack: Stack, cfg: DecoderConfig) -> Stack:
    """Write the per-layer window and RoPE base into the stacked attention leaves.

    Also used on a skeleton built by `eqx.filter_eval_shape` (`interop` loads
    weights into one), whose integer leaves are abstract until written here.
    """
    if cfg.block.window is not None:
        stack = eqx.tree_at(
            lambda s: s.blocks.attention.window,
            stack,
            jnp.asarray(np.array(cfg.layer_windows(), np.int32)),
        )
    thetas = cfg.layer_thetas()
    if thetas is not None:
        stack = eqx.tree_at(
            lambda s: s.blocks.attention.rope_theta,
            stack,
            jnp.stack([rope_theta_bits(t) for t in thetas]),
        )
    return stack


@eqx.filter_jit
def _build(cfg: DecoderConfig, key):
    """Every random array of a `DecoderLM`, drawn in one compiled program."""
    tok_key, pos_key, stack_key, head_key = jax.random.split(key, 4)
    d = cfg.num_hiddens

    def embedding(n, k):
        return eqx.nn.Embedding(weight=0.02 * jax.random.normal(k, (n, d), jnp.float32))

    block = cfg.block
    # a subclass's FFN (nn.moe_decoder.MoEDecoderConfig)
    ffn_factory = getattr(cfg, "ffn_factory", None)

    def make_block(k):
        return TransformerBlock(block, ffn_factory=ffn_factory, key=k)

    stack = set_layer_data(
        Stack(make_block, cfg.num_blks, remat=cfg.remat, unroll=1, key=stack_key), cfg
    )
    pos = embedding(cfg.max_len, pos_key) if cfg.positions == "learned" else None
    head = (
        None
        if cfg.tie_embeddings
        else init.linear(d, cfg.vocab_size, bias=False, key=head_key)
    )
    return embedding(cfg.vocab_size, tok_key), pos, stack, head


class DecoderLM(eqx.Module, _cache.Decoding):
    r"""A causal decoder-only language model on a scanned `Stack`.

    For token ids $t_1, \ldots, t_T$ at positions $s_1, \ldots, s_T$
    (default $0, \ldots, T-1$):
    $$h_0 = \gamma\, E[t] \;(+\, P[s]),\qquad
    h_N = \mathrm{Stack}(h_0;\ L_i = i,\ s),\qquad
    \text{logits} = \mathrm{Norm}(h_N)\, W_\text{head}^\top,$$
    with $\gamma$ the optional `embed_scale`, $P$ the learned position table
    (`positions="learned"`; with `"rope"` the positions rotate the queries and
    keys of every layer instead), the per-query valid length $L_i = i$ (causal;
    the local layers further restrict query $q$ to keys $k > q - w$), and
    $W_\text{head} = E$ when the embeddings are tied.

    The blocks are `TransformerBlock`s built from the config and run as one
    `lax.scan`; the per-layer window and RoPE base are integer leaves of the
    stacked attention (data, not structure). Weights are drawn as `CharLM`
    draws them (embeddings $\mathcal N(0, 0.02^2)$, blocks at their default
    initialization); `from_huggingface` replaces them all.

    Attributes:
        token_emb: `(vocab, d)` token embedding $E$.
        pos_emb: `(max_len, d)` learned positions, or `None` (RoPE).
        stack: the `Stack` of blocks.
        norm: the final norm.
        head: the untied output projection `(vocab, d)`, or `None` (tied).
        cfg: the `DecoderConfig` (static).
    """

    token_emb: eqx.nn.Embedding
    pos_emb: eqx.nn.Embedding | None
    stack: Stack
    norm: RMSNorm | LayerNorm
    head: eqx.nn.Linear | None
    cfg: DecoderConfig = eqx.field(static=True)

    def __init__(
        self,
        cfg: DecoderConfig | Mapping[str, Any],
        *,
        cfg_class: str = "DecoderConfig",
        key: PRNGKeyArray,
    ):
        """Args:
        cfg: a `DecoderConfig`, or the mapping of its fields (as
            `DecoderLM.init_args()["cfg"]` returns it).
        cfg_class: with a mapping, the name of the config class to build
            (`"DecoderConfig"` or a subclass such as `"MoEDecoderConfig"`).
        key: PRNG key for every weight.
        """
        if isinstance(cfg, Mapping):
            if cfg_class not in CONFIG_CLASSES:
                raise ConfigError(
                    f"DecoderLM: cfg_class must be one of "
                    f"{sorted(CONFIG_CLASSES)}, got {cfg_class!r}."
                )
            cfg = CONFIG_CLASSES[cfg_class](**cfg)
        if not isinstance(cfg, DecoderConfig):
            raise ConfigError(
                f"DecoderLM: cfg must be a DecoderConfig, got {type(cfg).__name__}."
            )
        check_key("DecoderLM", "key", key)
        self.cfg = cfg
        self.token_emb, self.pos_emb, self.stack, self.head = _build(cfg, key)
        self.norm = make_norm(cfg.norm, cfg.num_hiddens, cfg.norm_eps)
        if cfg.parametrization != "standard":
            # the table's zero-initialised leaves (query, untied readout)
            parts = {"stack": self.stack, "head": self.head}
            parts = parametrization.apply_init(parts, cfg.parametrization)
            self.stack, self.head = parts["stack"], parts["head"]

    def init_args(self) -> dict[str, Any]:
        """The constructor arguments (without `key`) that rebuild this
        structure, as JSON-friendly values: `DecoderLM(**m.init_args(), key=k)`."""
        out: dict[str, Any] = {"cfg": self.cfg.to_dict()}
        if type(self.cfg) is not DecoderConfig:
            out["cfg_class"] = type(self.cfg).__name__
        return out

    @property
    def head_weight(self) -> Float[Array, "vocab d"]:
        """The output projection: the token embedding when tied."""
        return self.token_emb.weight if self.head is None else self.head.weight

    def hidden(
        self,
        ids: Int[ArrayLike, "*batch T"],
        *,
        positions: Int[ArrayLike, "*#batch T"] | None = None,
        segment_ids: Int[ArrayLike, "*#batch T"] | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T d"]:
        """The final-normed hidden states $\\mathrm{Norm}(h_N)$ (see `__call__`)."""
        cfg = self.cfg
        ids = jnp.asarray(ids)
        if ids.ndim < 1 or not 1 <= ids.shape[-1] <= cfg.max_len:
            raise ConfigError(
                f"DecoderLM takes sequences (T,) or batches (..., T) of 1 to "
                f"max_len={cfg.max_len} token ids, got ids.shape={tuple(ids.shape)}."
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ConfigError(
                f"DecoderLM: ids must be integers, got dtype {ids.dtype}."
            )
        ids = check_ids(
            "DecoderLM", "token ids", ids, cfg.vocab_size, what="vocab_size"
        )
        T = ids.shape[-1]
        packed = {}
        mask = Mask.causal()  # the one mask of every layer, built here
        if segment_ids is not None:
            seg = check_segment_ids("DecoderLM", segment_ids, ids.shape)
            mask = mask & Mask.segments(seg)
        if positions is None:
            pos = jnp.arange(T) if segment_ids is None else segment_positions(seg)
        else:
            pos = jnp.asarray(positions)
            if not jnp.issubdtype(pos.dtype, jnp.integer) or pos.shape[-1:] != (T,):
                raise ConfigError(
                    f"DecoderLM: positions must be integers of shape (..., T={T}), "
                    f"got dtype {pos.dtype}, shape {tuple(pos.shape)}."
                )
        h = self.token_emb.weight[ids]
        if cfg.embed_scale is not None:
            h = h * jnp.asarray(cfg.embed_scale, h.dtype)
        h = at(hooks, "hook_embed", h)
        if hooks is not None:
            packed["hooks"] = hooks
        if self.pos_emb is not None:
            pos = eqx.error_if(
                pos,
                (pos < 0) | (pos >= cfg.max_len),
                f"DecoderLM: positions must lie in [0, max_len={cfg.max_len}).",
            )
            h = h + at(hooks, "hook_pos_embed", self.pos_emb.weight[pos])
            h = self.stack(h, mask, key=key, **packed)
        else:
            h = self.stack(h, mask, positions=pos, key=key, **packed)
        return self.norm(h, hooks=scope(hooks, "ln_final"))

    def __call__(
        self,
        ids: Int[ArrayLike, "*batch T"],
        *,
        positions: Int[ArrayLike, "*#batch T"] | None = None,
        segment_ids: Int[ArrayLike, "*#batch T"] | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T vocab"]:
        """Next-token logits for one sequence or a batch.

        Args:
            ids: `(T,)` integer ids in `[0, vocab_size)`, `1 <= T <= max_len`,
                or a batch `(..., T)`.
            positions: integer positions `(T,)` or `(..., T)` (default
                `0..T-1`): the rows of the learned table, or the RoPE angles
                (packed sequences, generation offsets). The mask stays causal
                over the `T` inputs.
            segment_ids: packed documents, integers of shape `ids.shape` or
                `(T,)`: a token attends only to earlier tokens of its own
                segment, and (unless `positions` is given) positions restart
                at 0 at each segment change (`functional.segment_positions`),
                so each document gets the logits it would get alone.
            key: enables dropout where the blocks have any; `None` evaluates.
            hooks: records and edits the activation sites
                (`blocklab.nn.hooks`; most users call `blocklab.interp.capture`
                or `intervene`): `hook_embed` (the scaled token embedding),
                `hook_pos_embed` (learned positions), the blocks' sites as
                `blocks.*.<site>` (`TransformerBlock.__call__`; stacked over
                layers), `ln_final.hook_normalized` and `unembed.hook_out`
                (the logits).

        Returns:
            `(..., T, vocab_size)` float32 logits; row `i` scores the token
            after `ids[..., i]`.
        """
        h = self.hidden(
            ids, positions=positions, segment_ids=segment_ids, key=key, hooks=hooks
        )
        return self.logits(h, hooks=hooks)

    def logits(
        self, h: Float[Array, "*batch d"], *, hooks: Hooks | None = None
    ) -> Float[Array, "*batch vocab"]:
        r"""The logits of final-normed hidden states `h` (as `hidden` returns):
        $z = c_\text{out}\, h\, W_\text{head}^\top$ accumulated in float32
        ($c_\text{out}$ = `cfg.readout_multiplier`: 1, or $d_0/d$ under μP), then
        $c \tanh(z / c)$ when `cfg.final_softcap` $= c$ is set."""
        # float32 accumulation: the logits of a bf16 model are not rounded
        z = linear(h, self.head_weight, out_dtype=jnp.float32).astype(jnp.float32)
        c = self.cfg.readout_multiplier  # 1, or d0/d under muP
        z = z if c == 1.0 else z * c
        cap = self.cfg.final_softcap
        z = z if cap is None else cap * jnp.tanh(z / cap)
        return at(hooks, "unembed.hook_out", z)
