"""`CharLM`, a causal character language model on a scanned stack.

Text in, text out is `blocklab.generate_text(model, blocklab.data.VOCAB,
prompt, n)` (the interop layer): this module works on token ids only.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_ids, check_int, check_key
from ..nn.block import TransformerBlock
from ..nn.config import BlockConfig
from ..nn.functional import causal_lengths, linear
from ..nn.hooks import Hooks, at, scope
from ..nn.normalization import RMSNorm
from ..nn.parametrization import apply_init, attention_scale, check_base_width
from ..nn.parametrization import readout_multiplier as _readout_multiplier
from ..nn.stack import Stack
from . import decoding as _cache

__all__ = ["CharLM"]


def _python_scalar(value: Any) -> Any:
    """A NumPy scalar (or 0-d NumPy array) as the Python number it holds."""
    if isinstance(value, np.generic) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        return value.item()
    return value


@eqx.filter_jit
def _build_charlm(
    key, vocab_size, block, layer_data, factories, num_blks, max_len, remat, unroll
):
    """CharLM's random arrays, drawn in one compiled program.

    Drawing them op by op compiles dozens of tiny kernels; one jitted builder
    compiles once per configuration. `layer_data` is `(block.window,
    block.rope_theta)`: `BlockConfig`'s `==` leaves them out (they are data),
    so they key the compiled builder here.
    """
    del layer_data
    tok_key, pos_key, stack_key = jax.random.split(key, 3)

    def embedding(n, k):
        weight = 0.02 * jax.random.normal(k, (n, block.num_hiddens), jnp.float32)
        return eqx.nn.Embedding(weight=weight)

    def make_block(k):
        return TransformerBlock(block, key=k, **dict(factories))

    stack = Stack(make_block, num_blks, remat=remat, unroll=unroll, key=stack_key)
    return embedding(vocab_size, tok_key), embedding(max_len, pos_key), stack


class CharLM(eqx.Module, _cache.Decoding):
    r"""A causal character language model: embeddings, a `Stack` of blocks, a tied head.

    For token ids $t_1, \ldots, t_T$ (with $T \le$ `max_len`),
    $$h_0 = E[t] + P[1{:}T],\qquad h_N = \mathrm{Stack}(h_0;\ L_i = i),\qquad
    \text{logits} = \mathrm{RMSNorm}(h_N)\, E^\top,$$
    where the per-query valid length $L_i = i$ makes every position attend only
    to itself and the positions before it (causal). The token embedding $E$
    (`vocab_size x d`) and the learned position embedding $P$ (`max_len x d`)
    are drawn from $\mathcal N(0, 0.02^2)$; the output head reuses $E$ (weight
    tying, Press & Wolf, 2017). The blocks are `TransformerBlock(self.block)`,
    `self.block = BlockConfig(num_hiddens, num_heads, act=act,
    **block_options)`, with their default (Flax NNX-matching) initialization.

    `parametrization="mup"` (with `base_width` $d_0$) applies the μP table of
    `blocklab.nn.parametrization`: $W_q$ starts at zero, the logits are
    multiplied by $d_0/d$ (the tied head) and the attention scale is
    $\sqrt{p_0}/p$ (unless `attn_scale` is given); `blocklab.optimizer`
    applies the per-leaf rates.
    """

    token_emb: eqx.nn.Embedding
    pos_emb: eqx.nn.Embedding
    stack: Stack
    norm: RMSNorm
    vocab_size: int = eqx.field(static=True)
    num_hiddens: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_blks: int = eqx.field(static=True)
    act: str = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    block_options: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    block: BlockConfig = eqx.field(static=True)
    parametrization: str = eqx.field(static=True)
    base_width: int | None = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        num_hiddens: int = 128,
        num_heads: int = 4,
        num_blks: int = 2,
        act: str = "swiglu",
        max_len: int = 128,
        *,
        remat: bool = False,
        unroll: int | bool | None = None,
        parametrization: str = "standard",
        base_width: int | None = None,
        key: PRNGKeyArray,
        **block_options: Any,
    ):
        """Args:
        vocab_size: number of token ids (28 for `blocklab.data.TimeMachine`).
        num_hiddens, num_heads, act: the blocks' width, heads and FFN activation.
        num_blks: depth of the stack.
        max_len: longest input sequence (rows of the position embedding).
        remat: rematerialize each block in the backward pass (see `Stack`).
        unroll: blocks per scan iteration (see `Stack`); default
            `min(num_blks, 4)`, so shallow stacks (up to 4 blocks) run unrolled.
        parametrization: `"standard"` or `"mup"` (see the class docstring).
        base_width: the width $d_0$ at which μP equals standard (`"mup"`).
        key: PRNG key for every weight.
        **block_options: further `BlockConfig` fields (`norm`, `placement`,
            `bias`, `qk_norm`, `dropout`, ...), checked there once, and the
            `TransformerBlock` factories (`attn_factory`, `ffn_factory`). The
            blocks' config is `self.block`.
        """
        key = check_key("CharLM", "key", key)
        vocab_size, num_hiddens, num_heads, num_blks, max_len = (
            check_int("CharLM", name, value, min=1)
            for name, value in (
                ("vocab_size", vocab_size),
                ("num_hiddens", num_hiddens),
                ("num_heads", num_heads),
                ("num_blks", num_blks),
                ("max_len", max_len),
            )
        )
        remat = check_bool("CharLM", "remat", remat)
        if unroll is not None and not isinstance(unroll, (bool, np.bool_)):
            unroll = check_int("CharLM", "unroll", unroll, min=1)
        elif unroll is not None:
            unroll = bool(unroll)
        self.vocab_size, self.num_hiddens = vocab_size, num_hiddens
        self.num_heads, self.num_blks = num_heads, num_blks
        self.act, self.max_len = _python_scalar(act), max_len
        # Options are static configuration: NumPy scalars become Python numbers
        # here, or they would be traced by the jitted builder below.
        self.block_options = tuple(
            sorted((k, _python_scalar(v)) for k, v in block_options.items())
        )
        options = dict(self.block_options)
        factories = tuple(
            (name, options.pop(name))
            for name in ("attn_factory", "ffn_factory")
            if name in options
        )
        head_dim = options.get("head_dim") or (
            num_hiddens // num_heads if num_hiddens % num_heads == 0 else None
        )
        self.parametrization, self.base_width = check_base_width(
            "CharLM", parametrization, base_width, num_hiddens,
            {} if head_dim is None else {"head_dim": head_dim},
        )  # fmt: skip
        if (
            self.parametrization != "standard"
            and options.get("attn_scale") is None
            and head_dim is not None
        ):
            options["attn_scale"] = attention_scale(
                self.parametrization, head_dim, num_hiddens, self.base_width
            )
        self.block = BlockConfig(num_hiddens, num_heads, act=self.act, **options)
        self.token_emb, self.pos_emb, self.stack = _build_charlm(
            key,
            vocab_size,
            self.block,
            (self.block.window, self.block.rope_theta),
            factories,
            num_blks,
            max_len,
            remat,
            min(num_blks, 4) if unroll is None else unroll,
        )
        self.norm = RMSNorm(num_hiddens)
        if self.parametrization != "standard":
            parts = apply_init({"stack": self.stack}, self.parametrization)
            self.stack = parts["stack"]

    @property
    def readout_multiplier(self) -> float:
        """The factor on the logits: 1, or $d_0/d$ under μP."""
        return _readout_multiplier(
            self.parametrization, self.num_hiddens, self.base_width
        )

    def init_args(self) -> dict[str, Any]:
        """The constructor arguments (without `key`) that rebuild this structure."""
        out = dict(
            vocab_size=self.vocab_size,
            num_hiddens=self.num_hiddens,
            num_heads=self.num_heads,
            num_blks=self.num_blks,
            act=self.act,
            max_len=self.max_len,
            remat=self.stack.remat,
            unroll=self.stack.unroll,
            **dict(self.block_options),
        )
        if self.parametrization != "standard":
            out.update(parametrization=self.parametrization, base_width=self.base_width)
        return out

    def __call__(
        self,
        tokens: Int[ArrayLike, "*batch T"],
        *,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T vocab"]:
        """Next-token logits for one sequence, or for each of a batch.

        Args:
            tokens: `(T,)` integer ids in `[0, vocab_size)`, `1 <= T <= max_len`,
                or a batch `(..., T)` of such sequences. A batch gives the
                values of `jax.vmap` over it, computed with one matrix product
                per projection (faster, see `blocklab.nn.functional.linear`).
            key: enables dropout (when the blocks have any); `None` evaluates.
            hooks: the activation sites, as for `DecoderLM.__call__`
                (`hook_embed`, `hook_pos_embed`, `blocks.*.<site>`,
                `ln_final.hook_normalized`, `unembed.hook_out`).

        Returns:
            `(..., T, vocab_size)` logits, float32 (float64 for a float64
            model; a bfloat16 model's head accumulates in float32); row `i`
            scores the token after `tokens[..., i]`.

        Raises:
            ValueError: `tokens` is a scalar, longer than `max_len` or not of
                an integer dtype; or, when the ids are concrete (not traced),
                an id outside `[0, vocab_size)`, named with its position.
            EquinoxRuntimeError: under `eqx.filter_jit`, an id outside the
                vocabulary. Under plain `jax.jit` JAX reports the same check
                as a `jax.errors.JaxRuntimeError` whose message contains this
                text (JAX wraps every error raised at run time that way; wrap
                the program in `eqx.filter_jit` to get the short form).
        """
        if key is not None:
            key = check_key("CharLM", "key", key)
        tokens = jnp.asarray(tokens)
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ConfigError(
                f"CharLM: tokens must be integer token ids, got dtype "
                f"{tokens.dtype}; encode text with blocklab.data.encode "
                "(floats and bools are refused, not truncated)."
            )
        if tokens.ndim < 1 or not 1 <= tokens.shape[-1] <= self.max_len:
            raise ConfigError(
                f"CharLM takes sequences (T,) or batches (..., T) of 1 to "
                f"max_len={self.max_len} token ids, got "
                f"tokens.shape={tuple(tokens.shape)}; split longer sequences."
            )
        if not isinstance(tokens, jax.core.Tracer):
            # Concrete ids (also constants closed over inside `jit`, where a
            # jnp comparison would already be traced): check them in NumPy.
            ids = np.asarray(tokens)
            outside = (ids < 0) | (ids >= self.vocab_size)
            if outside.any():
                where = tuple(int(i) for i in np.argwhere(outside)[0])
                raise ConfigError(
                    f"CharLM: token ids must lie in [0, vocab_size="
                    f"{self.vocab_size}), got tokens{list(where)}="
                    f"{int(tokens[where])}; the model was built for "
                    f"{self.vocab_size} symbols."
                )
        else:
            # two scalars reach the error branch (no batch pinned on a mesh)
            tokens = check_ids(
                "CharLM", "token ids", tokens, self.vocab_size, what="vocab_size"
            )
        T = tokens.shape[-1]
        h = at(hooks, "hook_embed", self.token_emb.weight[tokens])
        h = h + at(hooks, "hook_pos_embed", self.pos_emb.weight[:T])
        kw = {} if hooks is None else {"hooks": hooks}
        h = self.stack(h, causal_lengths(tokens.shape), key=key, **kw)
        h = self.norm(h, hooks=scope(hooks, "ln_final"))
        return self.logits(h, hooks=hooks)

    def logits(
        self, h: Float[Array, "*batch d"], *, hooks: Hooks | None = None
    ) -> Float[Array, "*batch vocab"]:
        r"""The logits of final-normed hidden states `h`: $z = c_\text{out}\,
        h\, E^\top$ (the tied head) accumulated in float32, $c_\text{out}$ = 1
        or $d_0/d$ under μP; site `unembed.hook_out`."""
        # float32 accumulation and output: logits of a bf16 model are not rounded
        z = linear(h, self.token_emb.weight, out_dtype=jnp.float32)
        c = self.readout_multiplier  # 1, or d0/d under muP
        z = z if c == 1.0 else z * jnp.asarray(c, z.dtype)
        return at(hooks, "unembed.hook_out", z)
