r"""Rematerialization policies as data: what a `Stack` keeps for the backward pass.

Reverse-mode differentiation of $h_N = B_N \circ \cdots \circ B_1(h_0)$ needs,
for every block, the values its backward pass reads (its *residuals*).
Keeping them all costs memory $O(N \cdot a)$, $a$ a block's activations;
recomputing a block from its input in the backward pass
(`jax.checkpoint`) trades that memory for one more forward pass. A policy
says, per value, which of the two:

- `"none"` (`False`): every residual is kept, nothing recomputed;
- `"full"` (`True`): each block keeps its input and is recomputed whole;
- `"dots"`: the outputs of the weight matrix products are kept (products
  without batch dimensions: the q/k/v, output and FFN projections); the
  norms, activations and the attention are recomputed;
- `"names:a,b"`: the block's input and the named sites are kept;
- `"offload:a,b"`: the named sites are kept in host memory;
- `"nested"`: the inputs of about $\sqrt N$ groups of $g \approx \sqrt N$
  blocks are kept; a group, then each of its blocks, is recomputed;
- a callable: what the `jax.checkpoint` policy
  `policy(prim, *args, **params)` says.

Names are the block's activation sites (`blocklab.nn.hooks`,
TransformerLens's): `attn.hook_q`, `attn.hook_k`, `attn.hook_v` (the
projections), `attn.hook_z` (the attention's mixed values, before $W_O$),
`hook_attn_out`, `mlp.hook_pre`, `mlp.hook_pre_linear` (gated FFNs),
`mlp.hook_post` (the FFN's hidden activations), `hook_mlp_out`,
`hook_resid_pre`, `hook_resid_mid`, `hook_resid_post` (the block's
output), and `attn.hook_rot_q`, `attn.hook_rot_k`. A policy that reads names
(`names:`, `offload:`, a callable) has the stack pass its blocks a `Hooks`
(`NamedSites`) whose call tags each site's value with
`jax.ad_checkpoint.checkpoint_name(value, "blocks.*.<site>")` and that asks
for nothing (`wants` is false), so the modules keep their fast paths; the
other policies add nothing to the program. A listed name that the block
does not carry on its path (`mlp.hook_pre_linear` of an ungated FFN) is
refused when the stack is traced.

Nested (square-root) rematerialization: with groups of $g$ blocks, the
backward pass keeps the $N/g$ group inputs, recomputes one group at a time
keeping its $g$ block inputs, and recomputes each block: memory
$O(N/g + g + a)$, minimal at $g = \sqrt N$, for about two extra forward
passes.

Host offload (`"offload:"`) uses XLA's host-offload passes, which exist on
GPU and TPU; on a CPU the device memory is host memory already (XLA:CPU
compiles the policy and moves nothing), so it is refused there by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .._validate import ConfigError
from .config import replace_static
from .hooks import STACKED, Hooks

__all__ = [
    "BLOCK_SITES",
    "NamedSites",
    "REMAT_KINDS",
    "Remat",
    "check_remat",
    "nested_groups",
    "parse_remat",
    "with_remat",
]

#: The named policies (`names:` and `offload:` take a comma-separated list).
REMAT_KINDS = ("none", "full", "dots", "nested", "names:", "offload:")

#: The sites of a `TransformerBlock` a name-based policy can keep
#: (block-relative; the checkpoint names are `blocks.*.<site>`).
BLOCK_SITES = (
    "hook_resid_pre",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "mlp.hook_pre",
    "mlp.hook_pre_linear",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)

_POLICIES = (
    "'none', 'full', 'dots', 'nested', 'names:SITE,...', 'offload:SITE,...' "
    f"(SITE one of {', '.join(BLOCK_SITES)}) or a jax.checkpoint_policies "
    "callable"
)


@dataclasses.dataclass(frozen=True)
class Remat:
    """A parsed policy (see the module docstring).

    Attributes:
        kind: `"none"`, `"full"`, `"dots"`, `"names"`, `"offload"`,
            `"nested"` or `"custom"`.
        names: the block-relative site names of `"names"` / `"offload"`.
        fn: the policy callable of `"custom"`.
    """

    kind: str
    names: tuple[str, ...] = ()
    fn: Callable[..., Any] | None = None

    def __str__(self) -> str:
        if self.kind in ("names", "offload"):
            return f"{self.kind}:{','.join(self.names)}"
        if self.kind == "custom":
            return getattr(self.fn, "__name__", "custom")
        return self.kind

    @property
    def checkpoints(self) -> bool:
        """Whether the blocks run under `jax.checkpoint` at all."""
        return self.kind != "none"

    @property
    def tags(self) -> bool:
        """Whether the policy reads checkpoint names (the blocks are tagged)."""
        return self.kind in ("names", "offload", "custom")

    @property
    def full_names(self) -> tuple[str, ...]:
        """The checkpoint names, `blocks.*.<site>`."""
        return tuple(STACKED + n for n in self.names)

    def jax_policy(self) -> Callable[..., Any] | None:
        """The `jax.checkpoint` policy of one block (`None`: save nothing but
        the inputs, which is also each level of `"nested"`)."""
        cp = jax.checkpoint_policies
        if self.kind == "dots":
            return cp.dots_with_no_batch_dims_saveable
        if self.kind == "names":
            return cp.save_only_these_names(*self.full_names)
        if self.kind == "offload":
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=(),
                names_which_can_be_offloaded=self.full_names,
                offload_src="device",
                offload_dst="pinned_host",
            )
        if self.kind == "custom":
            return self.fn
        return None


def _site(owner: str, name: str) -> str:
    name = name.strip()
    short = name[len(STACKED) :] if name.startswith(STACKED) else name
    if short not in BLOCK_SITES:
        raise ConfigError(
            f"{owner}: remat names a site {name!r} that no block carries; the "
            f"block's sites are {', '.join(BLOCK_SITES)} (optionally written "
            f"{STACKED}<site>)."
        )
    return short


def parse_remat(owner: str, value: Any, *, backend: str | None = None) -> Remat:
    """The `Remat` of a `remat=` value (see `check_remat` for the values).

    Args:
        owner: who is asking (named in errors).
        value: the `remat=` argument, or a `Remat`.
        backend: the platform offload is checked against (default
            `jax.default_backend()`).

    Raises:
        ConfigError: an unknown policy, a name no block site has, an empty
            list, or `"offload:"` on a backend without separate host memory.
    """
    if isinstance(value, Remat):
        return value
    if isinstance(value, (bool, np.bool_)):
        return Remat("full" if value else "none")
    if isinstance(value, str):
        text = value.strip()
        if text in ("none", "full", "dots", "nested"):
            return Remat(text)
        kind, sep, rest = text.partition(":")
        if sep and kind in ("names", "offload"):
            parts = [p for p in rest.split(",") if p.strip()]
            if not parts:
                raise ConfigError(
                    f"{owner}: remat={value!r} lists no site; write e.g. "
                    f"'{kind}:attn.hook_q,mlp.hook_post'."
                )
            names = tuple(dict.fromkeys(_site(owner, p) for p in parts))
            if kind == "offload":
                platform = jax.default_backend() if backend is None else backend
                if platform == "cpu":
                    raise ConfigError(
                        f"{owner}: remat={value!r}: offload needs a backend with "
                        "host memory apart from the device's (GPU, TPU); on the "
                        "cpu backend the device memory is host memory (XLA:CPU "
                        "compiles the policy and moves nothing). Use "
                        f"'names:{','.join(names)}' to keep them in place."
                    )
            return Remat(kind, names)
    elif callable(value):
        return Remat("custom", fn=value)
    raise ConfigError(
        f"{owner}: remat must be a bool (True or False), got {value!r} of type "
        f"{type(value).__name__}, or a remat policy: {_POLICIES}."
    )


def check_remat(owner: str, value: Any) -> bool | str | Callable[..., Any]:
    """`value` checked and in canonical form, as configs store it.

    Valid values: `False`/`True` (kept as bools: `"none"`/`"full"`),
    `"none"`, `"full"`, `"dots"`, `"nested"`, `"names:SITE,..."`,
    `"offload:SITE,..."` (spaces removed, repeats dropped, `blocks.*.`
    prefixes dropped), or a callable `jax.checkpoint` policy.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    parsed = parse_remat(owner, value)
    return parsed.fn if parsed.kind == "custom" else str(parsed)


def nested_groups(num_blks: int) -> tuple[int, int, int]:
    """`(g, G, r)`: groups of `g = round(sqrt(N))` blocks, `G = N // g` of
    them, and `r = N - G g` blocks in a last, shorter group."""
    g = max(1, round(math.sqrt(num_blks)))
    return g, num_blks // g, num_blks - (num_blks // g) * g


class NamedSites(Hooks):
    """A `Hooks` that tags every site value with its checkpoint name.

    `value -> checkpoint_name(value, prefix + name)` after the wrapped
    `inner` hooks (a user's capture or edits, or `None`) have seen it. It
    records and edits nothing itself (`wants` is `inner`'s), so a module
    takes the same path as without it. The names seen go to `seen` (the
    stack checks the policy's names against them).
    """

    def __init__(self, inner: Hooks | None, seen: set, *, prefix: str = STACKED):
        super().__init__(
            None, None, prefix=prefix, layer=None if inner is None else inner.layer
        )
        self.inner = inner
        self.seen = seen
        if inner is not None:
            self.values = inner.values

    def scope(self, name: str) -> NamedSites:
        inner = None if self.inner is None else self.inner.scope(name)
        return NamedSites(inner, self.seen, prefix=f"{self.prefix}{name}.")

    def records(self, name: str) -> bool:
        return self.inner is not None and self.inner.records(name)

    def edits(self, name: str) -> bool:
        return self.inner is not None and self.inner.edits(name)

    def under(self, scope: str) -> bool:
        return self.inner is not None and self.inner.under(scope)

    def _tag(self, name: str, value: Any) -> Any:
        full = self.prefix + name
        self.seen.add(full)
        return checkpoint_name(value, full)

    def __call__(self, name: str, value: Any) -> Any:
        if self.inner is not None:
            value = self.inner(name, value)
        return self._tag(name, value)

    def sites(self, name, value, to_site, from_site) -> Any:
        if self.inner is not None:
            value = self.inner.sites(name, value, to_site, from_site)
        return self._tag(name, value)


def _static_remat(node: Any) -> bool:
    """A module with a static `remat` field (a `Stack`)."""
    return isinstance(node, eqx.Module) and any(
        f.name == "remat" and f.metadata.get("static", False)
        for f in dataclasses.fields(node)
    )


def with_remat(model: Any, remat: Any) -> Any:
    """`model` with every `Stack` (and the config of a model that holds one,
    `DecoderConfig.remat`) set to the policy `remat`; the arrays are shared.

    Raises:
        ConfigError: a bad policy, or a model that holds no `Stack`.
    """
    value = check_remat("with_remat", remat)
    out, found = replace_static(model, "remat", value, _static_remat)
    if not found:
        raise ConfigError(
            f"with_remat: model holds no Stack to set remat on, got a "
            f"{type(model).__name__}."
        )
    return out
