r"""A bidirectional encoder, `EncoderModel` (configured by `EncoderConfig`).

One class covers BERT (learned positions, token types, post-norm, the MLM
head with its transform), ModernBERT (RoPE, alternating local and global
layers with a bidirectional window, GeGLU, no biases, layer 0 without its
attention norm), ViT (patches, a CLS token, pre-norm, a classification head)
and T5's encoder (relative position bias): an embedding, a `Stack` of
`TransformerBlock`s run as one `lax.scan` without a causal mask, an optional
final norm, and the heads.

Without the causal mask every query sees every unmasked key: the first token
no longer attends only to itself, and a token's output depends on the tokens
after it.
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
from ..nn import init
from ..nn.block import TransformerBlock
from ..nn.functional import ACTIVATIONS, linear, rope_theta_bits, segment_positions
from ..nn.hooks import Hooks, at, scope
from ..nn.mask import Mask, check_key_mask, check_segment_ids
from ..nn.normalization import LayerNorm, RMSNorm, make_norm
from ..nn.patch_embed import ViTEmbedding
from ..nn.relative_position import (
    RelativePositionBias,
    relative_bias_tables,
    stack_bias_inputs,
)
from ..nn.stack import Stack
from .encoder_config import EncoderConfig, config_of

__all__ = ["EncoderModel", "set_encoder_layer_data", "padding_mask"]


def set_encoder_layer_data(stack: Stack, cfg: Any) -> Stack:
    """Write the per-layer data into the stacked leaves: the windows and RoPE
    bases (`EncoderConfig.layer_windows` / `layer_thetas`) and, with
    `first_attn_norm=False`, layer 0's `skip_norm1`. Also for skeletons built
    by `eqx.filter_eval_shape`, whose integer leaves are abstract until here."""
    if cfg.block.window is not None:
        stack = eqx.tree_at(
            lambda s: s.blocks.attention.window,
            stack,
            jnp.asarray(np.array(cfg.layer_windows(), np.int32)),
        )
    thetas = cfg.layer_thetas() if hasattr(cfg, "layer_thetas") else None
    if thetas is not None:
        stack = eqx.tree_at(
            lambda s: s.blocks.attention.rope_theta,
            stack,
            jnp.stack([rope_theta_bits(t) for t in thetas]),
        )
    if cfg.block.skip_attn_norm:
        skip = np.zeros(cfg.num_blks, np.int32)
        skip[0] = 0 if getattr(cfg, "first_attn_norm", True) else 1
        stack = eqx.tree_at(lambda s: s.blocks.skip_norm1, stack, jnp.asarray(skip))
    return stack


def padding_mask(
    owner: str,
    shape: tuple[int, ...],
    key_mask: Any = None,
    valid_lens: Any = None,
) -> Array | None:
    """The boolean key mask `(..., T)` of a padded batch, from a mask
    (`transformers`' `attention_mask` as booleans) and/or lengths per
    sequence (key $j$ is real iff $j < L$); `None` when neither is given."""
    mask = None
    if key_mask is not None:
        mask = check_key_mask(owner, "key_mask", key_mask, shape)
    if valid_lens is not None:
        lens = jnp.asarray(valid_lens)
        lead = tuple(shape[:-1])
        try:
            ok = jnp.issubdtype(lens.dtype, jnp.integer) and (
                np.broadcast_shapes(lens.shape, lead) == lead
            )
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"{owner}: valid_lens must be integers, a scalar or one per "
                f"sequence (shape {lead}), got dtype {lens.dtype}, shape "
                f"{tuple(lens.shape)}."
            )
        by_len = jnp.arange(shape[-1]) < lens[..., None]
        by_len = jnp.broadcast_to(by_len, shape)
        mask = by_len if mask is None else mask & by_len
    return mask


def _check_fits(owner: str, name: str, value: Any, shape: tuple[int, ...]) -> None:
    """Refuse per-token integers (`positions`, `token_type_ids`) whose shape
    does not broadcast to the ids' `shape` (a shorter sequence would
    otherwise fail inside the sum, or broadcast to a wrong one)."""
    got = tuple(jnp.shape(value))
    try:
        fits = np.broadcast_shapes(got, shape) == tuple(shape)
    except ValueError:
        fits = False
    if not fits:
        raise ConfigError(
            f"{owner}: {name} must have the ids' shape {tuple(shape)} or one "
            f"broadcasting to it (e.g. (T,) = ({shape[-1]},)), got shape {got}."
        )


@eqx.filter_jit
def _build(cfg: EncoderConfig, key):
    """Every random array of an `EncoderModel`, drawn in one compiled program."""
    keys = iter(jax.random.split(key, 10))
    d = cfg.num_hiddens

    def embedding(n):
        return eqx.nn.Embedding(
            weight=0.02 * jax.random.normal(next(keys), (n, d), jnp.float32)
        )

    parts: dict[str, Any] = {}
    parts["token_emb"] = embedding(cfg.vocab_size) if cfg.vocab_size else None
    parts["pos_emb"] = embedding(cfg.max_len) if cfg.positions == "learned" else None
    parts["type_emb"] = embedding(cfg.type_vocab_size) if cfg.type_vocab_size else None
    k_vit, k_rel, k_stack = next(keys), next(keys), next(keys)
    parts["vit_emb"] = (
        ViTEmbedding(
            cfg.image_size,
            cfg.patch_size,
            cfg.num_channels,
            d,
            bias=cfg.block.ffn_bias,  # ViT's patch conv: biased even without qkv_bias
            key=k_vit,
        )  # fmt: skip
        if cfg.image_size is not None
        else None
    )
    parts["rel_bias"] = (
        relative_bias_tables(
            cfg.num_heads,
            cfg.num_blks,
            per_layer=cfg.relative_bias == "per_layer",
            num_buckets=cfg.relative_num_buckets,
            max_distance=cfg.relative_max_distance,
            bidirectional=True,
            key=k_rel,
        )  # fmt: skip
        if cfg.positions == "relative"
        else None
    )
    block = cfg.block
    stack = Stack(lambda k: TransformerBlock(block, key=k), cfg.num_blks, key=k_stack)
    parts["stack"] = set_encoder_layer_data(stack, cfg)
    k_mlm, k_dec, k_pool, k_cls = next(keys), next(keys), next(keys), next(keys)
    if cfg.mlm_head:
        parts["mlm_dense"] = init.linear(d, d, bias=cfg.head_bias, key=k_mlm)
        parts["mlm_decoder"] = (
            None
            if cfg.tie_embeddings
            else init.linear(d, cfg.vocab_size, bias=False, key=k_dec)
        )
    if cfg.pooler != "none":
        parts["pooler_dense"] = init.linear(d, d, bias=cfg.head_bias, key=k_pool)
    if cfg.num_labels:
        parts["classifier"] = init.linear(d, cfg.num_labels, bias=True, key=k_cls)
    return parts


class EncoderModel(eqx.Module):
    r"""A bidirectional transformer encoder on a scanned `Stack`, with its heads.

    For inputs (token ids $t$, or an image's patches) and a key mask $m$
    (padding):
    $$h_0 = \mathrm{Norm}_e\big(E[t] + P[s] + E_\text{type}[\tau]\big),\qquad
    h_N = \mathrm{Stack}(h_0;\ \text{keys } j \text{ with } m_j),\qquad
    y = \mathrm{Norm}_f(h_N),$$
    each factor present as the config says (`positions`, `type_vocab_size`,
    `embed_norm`, `final_norm`; an image is `ViTEmbedding`'s $[c; xW] + P$;
    RoPE and T5's relative bias act inside the attention). No causal mask:
    query $i$ sees every unmasked key, within $|i - j| < w$ in local layers.

    Without a head (no `mlm_head`, `num_labels=0`) the model is a feature
    extractor, as `transformers`' `BertModel`, `ModernBertModel` and
    `ViTModel`: `model(ids)` is the last hidden state $y$, and
    `pooler_output(y)` the pooled output of a config with a `pooler`.

    Heads:

    - masked LM (`mlm_head`): $\mathrm{logits} = \mathrm{Norm}_t(\phi(y
      W_t^\top + b_t))\, E^\top + b$ ($E$ the token embedding when tied);
    - sequence classification (`num_labels`): pool $p$ = $y_0$ (`"cls"`) or
      the mean of the unmasked rows (`"mean"`), then $\tanh(W_p p + b_p)$
      (`pooler="tanh"`, BERT), $\mathrm{Norm}_p(\phi(W_p p))$
      (`"transform"`, ModernBERT) or $p$ (ViT), then $W_c \cdot + b_c$.

    Attributes: see `EncoderConfig` and the field annotations; layer names
    inside the stack are `TransformerBlock`'s.
    """

    token_emb: eqx.nn.Embedding | None
    pos_emb: eqx.nn.Embedding | None
    type_emb: eqx.nn.Embedding | None
    vit_emb: ViTEmbedding | None
    rel_bias: RelativePositionBias | Stack | None
    emb_norm: RMSNorm | LayerNorm | None
    stack: Stack
    norm: RMSNorm | LayerNorm | None
    mlm_dense: eqx.nn.Linear | None
    mlm_norm: RMSNorm | LayerNorm | None
    mlm_decoder: eqx.nn.Linear | None
    mlm_bias: Float[Array, " vocab"] | None
    pooler_dense: eqx.nn.Linear | None
    pooler_norm: RMSNorm | LayerNorm | None
    classifier: eqx.nn.Linear | None
    cfg: EncoderConfig = eqx.field(static=True)

    def __init__(self, cfg: EncoderConfig | Mapping[str, Any], *, key: PRNGKeyArray):
        """Args:
        cfg: an `EncoderConfig`, or the mapping of its fields.
        key: PRNG key for every weight.
        """
        cfg = config_of("EncoderModel", cfg, EncoderConfig)
        check_key("EncoderModel", "key", key)
        self.cfg = cfg
        parts = _build(cfg, key)
        for name in (
            "token_emb", "pos_emb", "type_emb", "vit_emb", "rel_bias", "stack",
            "mlm_dense", "mlm_decoder", "pooler_dense", "classifier",
        ):  # fmt: skip
            setattr(self, name, parts.get(name))
        d = cfg.num_hiddens

        def norm():
            return make_norm(cfg.norm, d, cfg.norm_eps)

        self.emb_norm = norm() if cfg.embed_norm else None
        self.norm = norm() if cfg.final_norm else None
        self.mlm_norm = norm() if cfg.mlm_head else None
        self.mlm_bias = (
            jnp.zeros((cfg.vocab_size,), jnp.float32)
            if cfg.mlm_head and cfg.decoder_bias
            else None
        )
        self.pooler_norm = norm() if cfg.pooler == "transform" else None

    def init_args(self) -> dict[str, Any]:
        """`EncoderModel(**m.init_args(), key=k)` rebuilds this structure."""
        return {"cfg": self.cfg.to_dict()}

    def _embed(self, ids, images, token_type_ids, positions, hooks):
        cfg, owner = self.cfg, "EncoderModel"
        if cfg.image_size is not None:
            if images is None or ids is not None:
                raise ConfigError(
                    f"{owner}: this encoder reads images (image_size="
                    f"{cfg.image_size}): pass images=(..., C, S, S), not ids."
                )
            h = self.vit_emb(images)
            return at(hooks, "hook_embed", h), None
        if ids is None:
            raise ConfigError(f"{owner}: pass token ids (..., T).")
        if images is not None:
            raise ConfigError(
                f"{owner}: this encoder reads token ids (image_size=None), got "
                "images= as well."
            )
        ids = jnp.asarray(ids)
        if (
            ids.ndim < 1
            or not 1 <= ids.shape[-1]
            or (cfg.positions == "learned" and ids.shape[-1] > cfg.max_len)
        ):
            raise ConfigError(
                f"{owner} takes sequences (T,) or batches (..., T) of 1 to "
                f"max_len={cfg.max_len} token ids, got ids.shape={tuple(ids.shape)}."
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ConfigError(f"{owner}: ids must be integers, got dtype {ids.dtype}.")
        ids = check_ids(owner, "token ids", ids, cfg.vocab_size, what="vocab_size")
        T = ids.shape[-1]
        h = at(hooks, "hook_embed", self.token_emb.weight[ids])
        pos = jnp.arange(T) if positions is None else jnp.asarray(positions)
        _check_fits(owner, "positions", pos, ids.shape)
        if self.pos_emb is not None and positions is not None:
            pos = check_ids(owner, "positions", pos, cfg.max_len, what="max_len")
        if self.pos_emb is not None:
            h = h + at(hooks, "hook_pos_embed", self.pos_emb.weight[pos])
        if self.type_emb is not None:
            if token_type_ids is not None:
                _check_fits(owner, "token_type_ids", token_type_ids, ids.shape)
            types = (
                jnp.zeros_like(ids)
                if token_type_ids is None
                else check_ids(
                    owner,
                    "token_type_ids",
                    jnp.asarray(token_type_ids),
                    cfg.type_vocab_size,
                    what="type_vocab_size",
                )  # fmt: skip
            )
            h = h + at(hooks, "hook_type_embed", self.type_emb.weight[types])
        elif token_type_ids is not None:
            raise ConfigError(
                f"{owner}: token_type_ids given, but the config has "
                "type_vocab_size=0 (no token-type embedding)."
            )
        return h, pos

    def hidden(
        self,
        ids: Int[ArrayLike, "*batch T"] | None = None,
        *,
        images: Float[ArrayLike, "*batch C S S"] | None = None,
        token_type_ids: Int[ArrayLike, "*batch T"] | None = None,
        key_mask: ArrayLike | None = None,
        valid_lens: ArrayLike | None = None,
        positions: Int[ArrayLike, "*#batch T"] | None = None,
        segment_ids: Int[ArrayLike, "*#batch T"] | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T d"]:
        """The encoder's output states $y$ (after the final norm, if any).

        Args:
            ids: `(T,)` token ids, or a batch `(..., T)`.
            images: `(..., C, S, S)` images instead (a ViT config).
            token_type_ids: BERT's segment types (default 0).
            key_mask: booleans `(..., T)`, True at real tokens
                (`transformers`' `attention_mask`); padded keys are unseen.
            valid_lens: real lengths per sequence instead (or as well).
            positions: positions of the tokens (default `0..T-1`, or
                restarting at each segment): rows of the learned table, or
                RoPE angles.
            segment_ids: packed documents `(..., T)`: a token attends only
                within its own (`MultiHeadAttention`'s runs of equal ids).
            key: dropout; `None` evaluates.
            hooks: sites `hook_embed`, `hook_pos_embed`, `hook_type_embed`,
                `ln_embed.hook_normalized`, the blocks' `blocks.*.<site>`,
                `ln_final.hook_normalized`.

        Returns:
            `(..., T, d)` (T = patches + 1 for images). Rows at padded
            positions are computed but meaningless.
        """
        if segment_ids is not None and positions is None and images is None:
            seg = check_segment_ids("EncoderModel", segment_ids, jnp.shape(ids))
            positions = segment_positions(seg)
        h, pos = self._embed(ids, images, token_type_ids, positions, hooks)
        if self.emb_norm is not None:
            h = self.emb_norm(h, hooks=scope(hooks, "ln_embed"))
        # the one mask of every layer, built here (ModernBERT's local
        # windows are the layers' own)
        valid = padding_mask("EncoderModel", h.shape[:-1], key_mask, valid_lens)
        mask = None if valid is None else Mask.padding(valid)
        if segment_ids is not None:
            mask = Mask.segments(segment_ids) & mask
        T = h.shape[-2]
        inputs = stack_bias_inputs(self.rel_bias, T, T)
        if self.cfg.positions == "rope":
            inputs["positions"] = pos
        h = self.stack(h, mask, key=key, hooks=hooks, **inputs)
        if self.norm is not None:
            h = self.norm(h, hooks=scope(hooks, "ln_final"))
        return h

    def mlm_logits(
        self, h: Float[Array, "*batch T d"], *, hooks: Hooks | None = None
    ) -> Float[Array, "*batch T vocab"]:
        """The masked-LM logits of encoder states `h` (float32)."""
        if self.mlm_dense is None:
            raise ConfigError("EncoderModel: this config has no MLM head (mlm_head).")
        act = ACTIVATIONS[self.cfg.head_act]
        t = act(linear(h, self.mlm_dense.weight, self.mlm_dense.bias))
        t = self.mlm_norm(t, hooks=scope(hooks, "mlm.ln"))
        W = (
            self.token_emb.weight
            if self.mlm_decoder is None
            else self.mlm_decoder.weight
        )
        z = linear(t, W, out_dtype=jnp.float32).astype(jnp.float32)
        if self.mlm_bias is not None:
            z = z + self.mlm_bias.astype(jnp.float32)
        return at(hooks, "unembed.hook_out", z)

    def __call__(
        self,
        ids: Int[ArrayLike, "*batch T"] | None = None,
        **kwargs: Any,
    ) -> (
        Float[Array, "*batch T vocab"]
        | Float[Array, "*batch labels"]
        | Float[Array, "*batch T d"]
    ):
        """The output of the model's head, as `transformers`' model of the same
        class returns it: the MLM logits `(..., T, vocab)` (with `mlm_head`:
        `BertForMaskedLM`, `ModernBertForMaskedLM`), the classification logits
        `(..., num_labels)` (with `num_labels`: `classify`;
        `ViTForImageClassification`, `BertForSequenceClassification`,
        `ModernBertForSequenceClassification`), else (a model without a head:
        `BertModel`, `ViTModel`, `ModernBertModel`, `T5EncoderModel`) the last
        hidden state `(..., T, d)`. `hidden` always returns the states.
        Keywords as for `hidden`."""
        if self.mlm_dense is not None:
            hooks = kwargs.get("hooks")
            return self.mlm_logits(self.hidden(ids, **kwargs), hooks=hooks)
        if self.classifier is not None:
            return self.classify(ids, **kwargs)
        return self.hidden(ids, **kwargs)

    def pool(
        self,
        h: Float[Array, "*batch T d"],
        key_mask: ArrayLike | None = None,
    ) -> Float[Array, "*batch d"]:
        """The pooled state: row 0 (`"cls"`) or the mean over `key_mask`'s rows."""
        if self.cfg.pooling == "cls":
            return h[..., 0, :]
        if key_mask is None:
            return jnp.mean(h, axis=-2)
        m = jnp.broadcast_to(key_mask, h.shape[:-1])[..., None].astype(h.dtype)
        return jnp.sum(h * m, axis=-2) / jnp.maximum(jnp.sum(m, axis=-2), 1)

    def pooler_output(
        self,
        h: Float[Array, "*batch T d"],
        key_mask: ArrayLike | None = None,
        *,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch d"]:
        r"""The pooled output of encoder states `h` (`transformers`'
        `pooler_output`): the pooled state $p$ (`pool`), then the pooler:
        $\tanh(W_p p + b_p)$ (`"tanh"`: `BertModel`, `ViTModel`),
        $\mathrm{Norm}_p(\phi(W_p p + b_p))$ (`"transform"`: ModernBERT's
        classifier). A config without a pooler (`"none"`) is refused:
        `transformers` gives no `pooler_output` there.

        Args:
            h: the states `hidden` (or `__call__` without an MLM head) returns.
            key_mask: booleans `(..., T)`, True at real tokens (read by
                `pooling="mean"` only).
            hooks: site `pooler.ln.hook_normalized` (`"transform"`).

        Returns:
            `(..., d)`, the dtype of `h`.
        """
        if self.cfg.pooler == "none":
            raise ConfigError(
                "EncoderModel: this config has no pooler (pooler='none'; a "
                "BertModel or ViTModel stored without pooler.dense.*); the pooled "
                "state without one is pool(h)."
            )
        return self._pooled(h, key_mask, hooks)

    def _pooled(self, h, key_mask, hooks):
        p = self.pool(h, key_mask)
        if self.cfg.pooler == "tanh":
            p = jnp.tanh(linear(p, self.pooler_dense.weight, self.pooler_dense.bias))
        elif self.cfg.pooler == "transform":
            act = ACTIVATIONS[self.cfg.head_act]
            p = act(linear(p, self.pooler_dense.weight, self.pooler_dense.bias))
            p = self.pooler_norm(p, hooks=scope(hooks, "pooler.ln"))
        return p

    def classify(
        self,
        ids: Int[ArrayLike, "*batch T"] | None = None,
        *,
        key_mask: ArrayLike | None = None,
        valid_lens: ArrayLike | None = None,
        hooks: Hooks | None = None,
        **kwargs: Any,
    ) -> Float[Array, "*batch labels"]:
        """Sequence (or image) classification logits `(..., num_labels)`,
        float32; keywords as for `hidden`."""
        if self.classifier is None:
            raise ConfigError(
                "EncoderModel: this config has no classifier (num_labels)."
            )
        h = self.hidden(
            ids, key_mask=key_mask, valid_lens=valid_lens, hooks=hooks, **kwargs
        )
        mask = padding_mask("EncoderModel", h.shape[:-1], key_mask, valid_lens)
        p = self._pooled(h, mask, hooks)
        z = linear(
            p, self.classifier.weight, self.classifier.bias, out_dtype=jnp.float32
        )
        return at(hooks, "classifier.hook_out", z.astype(jnp.float32))
