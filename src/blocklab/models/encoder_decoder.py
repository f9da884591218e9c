r"""An encoder–decoder language model, `EncoderDecoderLM` (T5, Whisper).

Two scanned stacks of the same `TransformerBlock`: the encoder's attend
bidirectionally over the source (with its padding mask), the decoder's
causally over the target and, through a cross-attention branch, over the
encoder's output. One token embedding is shared by both stacks (and by the
head when tied). T5's relative position bias is one table per stack
(`RelativePositionBias`: both directions in the encoder, causal in the
decoder), computed once per call and added to every layer's self-attention
scores; the cross-attention has none. umT5's (`relative_bias="per_layer"`)
is one table per self-attention layer, held as a `Stack` of tables
(`(N, buckets, H)`): the buckets are computed once per call and each layer
gathers its own bias inside the stack's scan (`stack_bias_inputs`).

Whisper (`src_input="audio"`, `positions="learned"`) reads log-mel features
through `AudioEmbedding` (two convolutions and fixed sinusoidal positions)
instead of source ids, and adds a learned position table to the decoder's
token embedding; its blocks are pre-LayerNorm with biases (the key
projection's is zero in `transformers`, which has none: a key bias adds the
same $q \cdot b$ to every score of a query and cancels in the softmax).

Generation (`greedy`, `init_cache`, `decode_step`) computes the
cross-attention keys and values of every decoder layer once, from the
encoder output, and keeps them in the cache beside the self-attention's
growing keys and values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_ids, check_int, check_key
from ..nn import init
from ..nn.audio_embed import AudioEmbedding
from ..nn.block import TransformerBlock
from ..nn.functional import linear
from ..nn.hooks import Hooks, at, scope
from ..nn.mask import Mask
from ..nn.normalization import LayerNorm, RMSNorm, make_norm
from ..nn.relative_position import (
    RelativePositionBias,
    relative_bias_tables,
    stack_bias_inputs,
)
from ..nn.stack import Stack
from .decode_loop import GenerationConfig, check_sampling, choose, decode_loop, fresh
from .encoder import padding_mask
from .encoder_config import EncoderDecoderConfig, config_of

__all__ = ["EncoderDecoderLM", "EncoderDecoderCache"]

#: The encoder's input: source ids, or log-mel features (`src_input="audio"`).
Source = Int[ArrayLike, "*batch S"] | Float[ArrayLike, "*batch M L"]


@eqx.filter_jit
def _build(cfg: EncoderDecoderConfig, key):
    k_emb, k_enc, k_dec, k_rel_e, k_rel_d, k_head = jax.random.split(key, 6)
    d = cfg.num_hiddens
    emb = eqx.nn.Embedding(
        weight=0.02 * jax.random.normal(k_emb, (cfg.vocab_size, d), jnp.float32)
    )
    enc_block, dec_block = cfg.block, cfg.decoder_block
    encoder = Stack(
        lambda k: TransformerBlock(enc_block, key=k), cfg.num_blks, key=k_enc
    )
    decoder = Stack(
        lambda k: TransformerBlock(dec_block, key=k), cfg.num_decoder_blks, key=k_dec
    )

    def rel(bidirectional, num_blks, k):
        if cfg.positions != "relative":
            return None
        return relative_bias_tables(
            cfg.num_heads, num_blks, per_layer=cfg.relative_bias == "per_layer",
            num_buckets=cfg.relative_num_buckets,
            max_distance=cfg.relative_max_distance, bidirectional=bidirectional,
            key=k,
        )  # fmt: skip

    head = (
        None
        if cfg.tie_embeddings
        else init.linear(d, cfg.vocab_size, bias=False, key=k_head)
    )
    return (
        emb, encoder, decoder, rel(True, cfg.num_blks, k_rel_e),
        rel(False, cfg.num_decoder_blks, k_rel_d), head,
    )  # fmt: skip


def _build_inputs(cfg: EncoderDecoderConfig, key):
    """The audio front-end and the decoder's learned positions (`None` where
    the config has none)."""
    k_audio, k_pos = jax.random.split(key)
    audio = None
    if cfg.src_input == "audio":
        audio = AudioEmbedding(
            cfg.num_mel_bins, cfg.num_hiddens, cfg.max_source_len, key=k_audio
        )
    pos = None
    if cfg.positions == "learned":
        table = 0.02 * jax.random.normal(k_pos, (cfg.max_len, cfg.num_hiddens))
        pos = eqx.nn.Embedding(weight=table.astype(jnp.float32))
    return audio, pos


class EncoderDecoderCache(eqx.Module):
    """What decoding keeps between steps (a pytree).

    Attributes:
        layers: the decoder's self-attention caches, stacked over its layers
            (`AttentionCache`, leaves `(N, *batch, KV, ...)`).
        cross: the cross-attention keys and values of every decoder layer,
            computed once from the encoder output (`(N, *batch, KV, p, S)`
            and `(N, *batch, KV, S, p)`).
        length: `batch_shape` int32, target tokens held per sequence.
        src_mask: `(*batch, S)` booleans, the encoder's real tokens, or `None`.
        max_len: the self-attention cache capacity (static).
    """

    layers: Any
    cross: Any
    length: Int[Array, "*batch"]
    src_mask: Bool[Array, "*batch S"] | None
    max_len: int = eqx.field(static=True)


class EncoderDecoderLM(eqx.Module):
    r"""An encoder–decoder transformer (Vaswani et al., 2017; T5, Raffel et al., 2020).

    For source ids $u$ (with a padding mask $m$) and target ids $t$:
    $$c = \mathrm{Norm}_e\big(\mathrm{Enc}(E[u];\ m,\ B_e)\big),\qquad
    y = \mathrm{Norm}_d\big(\mathrm{Dec}(E[t];\ \text{causal},\ B_d;\ c, m)\big),
    \qquad \text{logits} = \gamma\, y\, W^\top,$$
    (with audio, $E[u]$ is `AudioEmbedding`'s output; with learned positions
    the decoder reads $E[t] + P_d[\text{position}]$), where $B_e$, $B_d$
    are the relative position biases of the two stacks
    (`positions="relative"`), each decoder block attends to $c$ through its
    cross-attention (keys $j$ with $m_j$), $\gamma$ is `head_scale` (T5:
    $d^{-1/2}$ with a tied head) and $W$ is the head or, tied, $E$.

    Attributes:
        token_emb: the shared `(vocab, d)` embedding $E$.
        encoder, decoder: the two `Stack`s (the decoder's blocks have
            `cross_attn` and `norm_cross`).
        enc_norm, dec_norm: the final norms.
        enc_rel_bias, dec_rel_bias: `RelativePositionBias` tables (one per
            stack), a `Stack` of them (one per layer: `relative_bias=
            "per_layer"`), or `None`.
        head: the untied `(vocab, d)` head, or `None` (tied).
        audio_emb: the `AudioEmbedding` (`src_input="audio"`), or `None`.
        dec_pos_emb: the decoder's `(max_len, d)` learned positions
            (`positions="learned"`), or `None`.
        cfg: the `EncoderDecoderConfig` (static).
    """

    token_emb: eqx.nn.Embedding
    encoder: Stack
    enc_norm: RMSNorm | LayerNorm
    enc_rel_bias: RelativePositionBias | Stack | None
    decoder: Stack
    dec_norm: RMSNorm | LayerNorm
    dec_rel_bias: RelativePositionBias | Stack | None
    head: eqx.nn.Linear | None
    audio_emb: AudioEmbedding | None
    dec_pos_emb: eqx.nn.Embedding | None
    cfg: EncoderDecoderConfig = eqx.field(static=True)

    def __init__(
        self, cfg: EncoderDecoderConfig | Mapping[str, Any], *, key: PRNGKeyArray
    ):
        """Args:
        cfg: an `EncoderDecoderConfig`, or the mapping of its fields.
        key: PRNG key for every weight.
        """
        cfg = config_of("EncoderDecoderLM", cfg, EncoderDecoderConfig)
        check_key("EncoderDecoderLM", "key", key)
        self.cfg = cfg
        (
            self.token_emb, self.encoder, self.decoder, self.enc_rel_bias,
            self.dec_rel_bias, self.head,
        ) = _build(cfg, key)  # fmt: skip
        self.enc_norm = make_norm(cfg.norm, cfg.num_hiddens, cfg.norm_eps)
        self.dec_norm = make_norm(cfg.norm, cfg.num_hiddens, cfg.norm_eps)
        self.audio_emb, self.dec_pos_emb = _build_inputs(
            cfg, jax.random.fold_in(key, 1)
        )

    def init_args(self) -> dict[str, Any]:
        """`EncoderDecoderLM(**m.init_args(), key=k)` rebuilds this structure."""
        return {"cfg": self.cfg.to_dict()}

    @property
    def head_weight(self) -> Float[Array, "vocab d"]:
        return self.token_emb.weight if self.head is None else self.head.weight

    def _ids(self, name, ids):
        ids = jnp.asarray(ids)
        if (
            ids.ndim < 1
            or ids.shape[-1] < 1
            or not jnp.issubdtype(ids.dtype, jnp.integer)
        ):
            raise ConfigError(
                f"EncoderDecoderLM: {name} must be integer ids of shape (T,) or "
                f"(..., T) with T >= 1, got dtype {ids.dtype}, shape "
                f"{tuple(ids.shape)}."
            )
        return check_ids(
            "EncoderDecoderLM", name, ids, self.cfg.vocab_size, what="vocab_size"
        )

    def encode(
        self,
        src_ids: Source,
        *,
        src_mask: ArrayLike | None = None,
        src_lens: ArrayLike | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch S d"]:
        """The encoder's output $c$ (final-normed), `(..., S, d)`.

        With `src_input="audio"`, `src_ids` are log-mel features `(...,
        num_mel_bins, 2 max_source_len)` (fixed length: no mask).

        `src_mask` (True at real tokens, `transformers`' `attention_mask`)
        and/or `src_lens` (one length per sequence) hide the padding. `hooks`
        sees the encoder's sites (`hook_embed`, `blocks.*.<site>`,
        `ln_final.hook_normalized`) in a call of their own.
        """
        h, mask = self._source(src_ids, src_mask, src_lens)
        h = at(hooks, "hook_embed", h)
        S = h.shape[-2]
        inputs = stack_bias_inputs(self.enc_rel_bias, S, S)
        mask = None if mask is None else Mask.padding(mask)
        h = self.encoder(h, mask, key=key, hooks=hooks, **inputs)
        return self.enc_norm(h, hooks=scope(hooks, "ln_final"))

    def _source(self, src, src_mask, src_lens):
        """The encoder's input embedding and key mask: source ids through
        the token embedding, or audio features through `audio_emb` (fixed
        length: a mask or lengths are refused)."""
        if self.audio_emb is None:
            src_ids = self._ids("src_ids", src)
            mask = padding_mask("EncoderDecoderLM", src_ids.shape, src_mask, src_lens)
            return self.token_emb.weight[src_ids], mask
        if src_mask is not None or src_lens is not None:
            raise ConfigError(
                "EncoderDecoderLM: an audio encoder (src_input='audio') reads "
                "fixed-length features and takes no src_mask or src_lens."
            )
        return self.audio_emb(src), None

    def _positions(self, h, start, hooks):
        """`h` plus the decoder's learned positions `start + i` (`start`: a
        scalar or one per sequence); `h` itself without a table."""
        if self.dec_pos_emb is None:
            return h
        T, L = h.shape[-2], self.cfg.max_len
        if T > L:
            raise ConfigError(
                f"EncoderDecoderLM: the decoder's learned positions hold "
                f"max_len={L} tokens, got a target of {T}."
            )
        pos = jnp.asarray(start)[..., None] + jnp.arange(T)
        pos = eqx.error_if(
            pos, pos >= L, f"EncoderDecoderLM: target positions beyond max_len={L}."
        )
        p = self.dec_pos_emb.weight[pos].astype(h.dtype)
        return h + at(hooks, "hook_pos_embed", p)

    def _check_enc(self, owner, enc, lead):
        if enc is None:
            raise ConfigError(
                f"{owner}: the decoder needs the encoder states: pass enc = "
                "model.encode(src_ids) (shape (..., S, num_hiddens))."
            )
        if (
            not hasattr(enc, "shape")
            or enc.ndim < 2
            or enc.shape[-1] != self.cfg.num_hiddens
            or tuple(enc.shape[:-2]) != tuple(lead)
        ):
            raise ConfigError(
                f"{owner}: enc (the encoder states) must have shape "
                f"(*batch={tuple(lead)}"
                f", S, num_hiddens={self.cfg.num_hiddens}), got "
                f"{tuple(getattr(enc, 'shape', ()))}."
            )

    def logits(
        self, y: Float[Array, "*batch d"], *, hooks: Hooks | None = None
    ) -> Float[Array, "*batch vocab"]:
        r"""$\gamma\, y W^\top$ in float32 for final-normed decoder states `y`."""
        if self.cfg.head_scale is not None:
            y = y * jnp.asarray(self.cfg.head_scale, y.dtype)
        z = linear(y, self.head_weight, out_dtype=jnp.float32).astype(jnp.float32)
        return at(hooks, "unembed.hook_out", z)

    def decode(
        self,
        tgt_ids: Int[ArrayLike, "*batch T"],
        enc: Float[Array, "..."] | None,
        *,
        src_mask: ArrayLike | None = None,
        src_lens: ArrayLike | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T vocab"]:
        """Next-token logits of the decoder over the whole target (teacher
        forcing): row `i` scores the token after `tgt_ids[..., i]`."""
        owner = "EncoderDecoderLM.decode"
        tgt_ids = self._ids("tgt_ids", tgt_ids)
        self._check_enc(owner, enc, tgt_ids.shape[:-1])
        mask = padding_mask(owner, enc.shape[:-1], src_mask, src_lens)
        h = at(hooks, "hook_embed", self.token_emb.weight[tgt_ids])
        h = self._positions(h, 0, hooks)
        T = h.shape[-2]
        inputs = stack_bias_inputs(self.dec_rel_bias, T, T)
        inputs["context"] = enc
        if mask is not None:
            inputs["cross_mask"] = Mask.padding(mask)
        h = self.decoder(h, Mask.causal(), key=key, hooks=hooks, **inputs)
        y = self.dec_norm(h, hooks=scope(hooks, "ln_final"))
        return self.logits(y, hooks=hooks)

    def __call__(
        self,
        src_ids: Source,
        tgt_ids: Int[ArrayLike, "*batch T"] | None = None,
        *,
        src_mask: ArrayLike | None = None,
        src_lens: ArrayLike | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T vocab"]:
        """Logits `(..., T, vocab)` of the target given the source.

        `hooks` sees the decoder's sites (its blocks' `blocks.*.<site>`,
        the cross-attention's among them); the encoder's come from
        `encode(..., hooks=...)`. `tgt_ids` is required.
        """
        if tgt_ids is None:
            raise ConfigError(
                "EncoderDecoderLM: pass the decoder's input tgt_ids beside src_ids "
                "(teacher forcing; generation is greedy(src_ids, ...))."
            )
        if key is not None:
            k_enc, k_dec = jax.random.split(key)
        else:
            k_enc = k_dec = None
        enc = self.encode(src_ids, src_mask=src_mask, src_lens=src_lens, key=k_enc)
        return self.decode(
            tgt_ids, enc, src_mask=src_mask, src_lens=src_lens, key=k_dec, hooks=hooks
        )

    # Cached decoding --------------------------------------------------------

    def init_cache(
        self,
        enc: Float[Array, "..."],
        *,
        src_mask: ArrayLike | None = None,
        src_lens: ArrayLike | None = None,
        max_len: int | None = None,
    ) -> EncoderDecoderCache:
        """An empty decoding cache for the encoder states `enc`, holding the
        cross-attention keys and values of every decoder layer (computed here,
        once: `cross_attn.cross_kv(enc)` for the stacked layers)."""
        owner = "EncoderDecoderLM.init_cache"
        if enc is None or not hasattr(enc, "shape") or enc.ndim < 2:
            self._check_enc(owner, enc, ())
        lead = tuple(enc.shape[:-2])
        self._check_enc(owner, enc, lead)
        max_len = check_int(
            owner, "max_len", self.cfg.max_len if max_len is None else max_len, min=1
        )
        if self.dec_pos_emb is not None and max_len > self.cfg.max_len:
            raise ConfigError(
                f"{owner}: max_len={max_len} exceeds the decoder's learned "
                f"positions (max_len={self.cfg.max_len})."
            )
        mask = padding_mask(owner, enc.shape[:-1], src_mask, src_lens)
        dynamic, static = eqx.partition(self.decoder.blocks, eqx.is_array)

        def one(params):
            blk = eqx.combine(params, static)
            return blk.cross_attn.cross_kv(enc)

        cross = jax.vmap(one)(dynamic)
        attn = self.decoder.block(0).attention
        empty = attn.init_cache(lead, max_len, enc.dtype)
        N = self.cfg.num_decoder_blks
        layers = jax.tree_util.tree_map(
            lambda a: jnp.broadcast_to(a, (N, *a.shape)), empty
        )
        return EncoderDecoderCache(
            layers, cross, jnp.zeros(lead, jnp.int32), mask, max_len
        )

    def decode_step(
        self,
        ids: Int[ArrayLike, "*batch Tq"],
        cache: EncoderDecoderCache,
        *,
        hooks: Hooks | None = None,
    ) -> tuple[Float[Array, "*batch Tq vocab"], EncoderDecoderCache]:
        """Run new target tokens (the first at each sequence's `cache.length`)
        through the decoder against the cache: `(logits, new_cache)`. Equal,
        row for row, to `decode` on the whole target."""
        owner = "EncoderDecoderLM.decode_step"
        if not isinstance(cache, EncoderDecoderCache):
            raise ConfigError(
                f"{owner}: cache must be an EncoderDecoderCache (init_cache), got "
                f"{type(cache).__name__}."
            )
        ids = self._ids("ids", ids)
        if tuple(ids.shape[:-1]) != tuple(cache.length.shape):
            raise ConfigError(
                f"{owner}: ids must have the cache's batch shape "
                f"{tuple(cache.length.shape)} + (Tq,), got {tuple(ids.shape)}."
            )
        Tq = ids.shape[-1]
        start = cache.length
        h = at(hooks, "hook_embed", self.token_emb.weight[ids])
        h = self._positions(h, start, hooks)
        inputs = stack_bias_inputs(self.dec_rel_bias, Tq, cache.max_len, offset=start)
        if cache.src_mask is not None:
            inputs["cross_mask"] = Mask.padding(cache.src_mask)
        h, layers = self.decoder.step(
            h, cache.layers, start, hooks=hooks, cross_kv=cache.cross, **inputs
        )
        y = self.dec_norm(h, hooks=scope(hooks, "ln_final"))
        new = EncoderDecoderCache(
            layers, cache.cross, start + Tq, cache.src_mask, cache.max_len
        )
        return self.logits(y, hooks=hooks), new

    def greedy(
        self,
        src_ids: Source,
        max_new_tokens: int,
        *,
        src_mask: ArrayLike | None = None,
        src_lens: ArrayLike | None = None,
        prompt_ids: Int[ArrayLike, "*batch P"] | None = None,
    ) -> Int[Array, "*batch max_new_tokens"]:
        """Greedy decoding: `max_new_tokens` ids per sequence after the
        decoder's prompt `prompt_ids` `(..., P)` (default: the one token
        `decoder_start_token_id`; Whisper: its start, language and task
        tokens); after `eos_token_id` a sequence emits `pad_token_id` (as
        `transformers`' `generate`). The encoder runs once, the
        cross-attention keys and values are computed once, the prompt is one
        cached `decode_step` and every further token one more (one compiled
        loop: `blocklab.generate`'s, whose greedy tokens these are). With
        audio, `src_ids` are the features."""
        inputs = src_ids if prompt_ids is None else (src_ids, prompt_ids)
        return generate_seq2seq(
            self,
            inputs,
            max_new_tokens,
            src_mask=src_mask,
            src_lens=src_lens,
            owner="EncoderDecoderLM.greedy",
        )


def generate_seq2seq(
    model, inputs, max_new_tokens, *, key=None, config=None, src_mask=None,
    src_lens=None, selection=None, owner="generate",
):  # fmt: skip
    """`blocklab.generate` of an `EncoderDecoderLM`, and its `greedy`: the new
    tokens (and, with a `selection` of sites, the start's and the steps'
    values), from the one decoding loop (`decode_loop`)."""
    cfg = model.cfg
    config = GenerationConfig() if config is None else config
    prompt = None
    if isinstance(inputs, tuple):
        if len(inputs) != 2:
            raise ConfigError(
                f"{owner}: an encoder-decoder's inputs are the source or "
                f"(source, decoder_prompt), got a tuple of {len(inputs)}."
            )
        inputs, prompt = inputs
    n = check_int(owner, "max_new_tokens", max_new_tokens, min=1)
    if prompt is not None:
        prompt = model._ids("prompt_ids", prompt)
    vocab = cfg.vocab_size
    key, temperature, top_k, top_p = check_sampling(
        owner, key, config.temperature, config.top_k, config.top_p, vocab
    )
    eos = config.eos_id if config.eos_id is not None else cfg.eos_token_id
    eos = check_int(owner, "config.eos_id", eos, min=0, max=vocab - 1, optional=True)
    sampling = key is not None
    new, start_values, steps = _seq2seq(
        model, jnp.asarray(inputs), n, src_mask, src_lens, prompt, key,
        None if not sampling else jnp.float32(temperature),
        None if top_p is None or not sampling else jnp.float32(top_p),
        top_k if sampling else None, eos, selection, owner,
    )  # fmt: skip
    return new if selection is None else (new, start_values, steps)


@eqx.filter_jit
def _seq2seq(model, src, n, src_mask, src_lens, prompt, key, temperature, top_p,
             top_k, eos_id, selection, owner):  # fmt: skip
    cfg = model.cfg
    hooks = fresh(selection)
    enc = model.encode(src, src_mask=src_mask, src_lens=src_lens)
    lead = enc.shape[:-2]
    if prompt is None:
        prompt = jnp.full((*lead, 1), cfg.decoder_start_token_id, jnp.int32)
    model._check_enc(owner, enc, prompt.shape[:-1])
    cache = model.init_cache(
        enc, src_mask=src_mask, src_lens=src_lens, max_len=prompt.shape[-1] + n - 1
    )
    logits, cache = model.decode_step(prompt, cache, hooks=hooks)

    def step(token, cache, hooks=None):
        logits, cache = model.decode_step(token[..., None], cache, hooks=hooks)
        return logits[..., 0, :], cache

    def pick(z, i):
        return choose(z, i, key, temperature, top_k, top_p)

    new, steps = decode_loop(
        step, cache, logits[..., -1, :], n, pick, eos_id,
        jnp.int32(cfg.pad_token_id), selection,
    )  # fmt: skip
    return new, None if hooks is None else hooks.values, steps
