r"""Named activation sites: the `Hooks` a forward pass reports its values to.

Every module with activation sites takes `hooks=None` and, at each site,
passes the value through `hooks(name, value)`. With `hooks=None` nothing
happens and nothing is added to the program; with a `Hooks`, the call

1. applies the *edits* registered for the site, `value <- fn(value, layer)`
   (each checked to keep the site's shape and dtype), then
2. *records* the (edited) value when the site is selected,

and returns the value the forward pass continues with. Names are those of
TransformerLens (`blocks.3.attn.hook_pattern`), built from the scopes a call
passes through (`hooks.scope("attn")`). A scanned `Stack` runs its blocks
under the scope `blocks.*` with the block index as a traced integer `layer`:
what its blocks record comes out of the scan stacked over layers, and an edit
meant for some layers only acts where `layer` is one of them (a `jnp.where`
inside the one scan). `blocklab.interp` resolves names and patterns into a
`Hooks` (`capture`, `intervene`); modules only ever see this class.

A `Hooks` is a trace-time object: it lives for one call of a forward pass
(inside `jit`, `vmap`, `grad`, `scan` alike) and is never a pytree leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from .._validate import ConfigError

__all__ = ["Hooks", "Edit", "STACKED", "at", "scope"]

#: The scope of the blocks of a scanned stack: their sites' names start with it.
STACKED = "blocks.*."

#: An edit: `fn(value, layer) -> value`; `layer` is the traced block index
#: inside a scanned stack, `None` elsewhere.
Edit = Callable[[Any, Any], Any]


class Hooks:
    """Records and edits the values of named activation sites during one call.

    Args:
        record: the full names of the sites whose values to keep (with
            `blocks.*.` for the sites of a scanned stack), or `"all"`;
            `None` keeps nothing.
        edits: full site name -> a sequence of `(fn, layers)`: `fn(value,
            layer)` gives the new value; `layers`, a tuple of block indices
            (stacked sites only) or `None` for all.
        prefix: the scope of this object's names (`scope` builds these).
        layer: the block index inside a scanned stack (traced), else `None`.
        values: the dict recorded values go to (shared by the scopes of one
            call, own to each scanned block).

    Attributes:
        values: full name -> recorded value.
    """

    def __init__(
        self,
        record: Collection[str] | str | None = None,
        edits: Mapping[str, Sequence[tuple[Edit, tuple[int, ...] | None]]]
        | None = None,
        *,
        prefix: str = "",
        layer: Any = None,
        values: dict[str, Any] | None = None,
    ):
        if record is not None and record != "all":
            record = frozenset(record)
        self._record = record
        self._edits = dict(edits or {})
        self.prefix = prefix
        self.layer = layer
        self.values = {} if values is None else values

    def scope(self, name: str) -> Hooks:
        """The hooks of a sub-module's sites, named `<prefix><name>.<site>`;
        recorded values go to the same dict."""
        return Hooks(
            self._record, self._edits, prefix=f"{self.prefix}{name}.",
            layer=self.layer, values=self.values,
        )  # fmt: skip

    @property
    def selection(self) -> tuple[Any, dict]:
        """`(record, edits)` as given: what to keep and what to edit, without
        the values (a decoding loop builds a fresh `Hooks(*selection)` for
        each call of the model)."""
        return self._record, self._edits

    def stacked(self, layer: Any) -> Hooks:
        """The hooks of one block of a scanned stack (scope `blocks.*`), with
        its traced index `layer` and a dict of its own (the scan stacks it)."""
        return Hooks(self._record, self._edits, prefix=STACKED, layer=layer)

    def records(self, name: str) -> bool:
        """Whether the site `name` (in this scope) is recorded."""
        rec = self._record
        return rec is not None and (rec == "all" or self.prefix + name in rec)

    def edits(self, name: str) -> bool:
        """Whether the site `name` (in this scope) has edits."""
        return (self.prefix + name) in self._edits

    def wants(self, name: str) -> bool:
        """Whether the site `name` (in this scope) is recorded or edited: a
        module computes a site's value (or takes a slower path that has it)
        only then."""
        return self.records(name) or self.edits(name)

    def wants_any(self, names: Sequence[str]) -> bool:
        """Whether any of `names` (in this scope) is recorded or edited."""
        return any(self.wants(n) for n in names)

    def under(self, scope: str) -> bool:
        """Whether any site under `scope` could be wanted (a module without
        hooks support is then refused by the caller, rather than skipped)."""
        full = f"{self.prefix}{scope}."
        if self._record == "all":
            return True
        names = [*self._edits, *(self._record or ())]
        return any(k.startswith(full) for k in names)

    def __call__(self, name: str, value: Any) -> Any:
        """The value the forward pass continues with at site `name`: edited,
        then recorded (see the class docstring)."""
        full = self.prefix + name
        for fn, layers in self._edits.get(full, ()):
            new = fn(value, self.layer)
            new_shape = getattr(new, "shape", None)
            new_dtype = getattr(new, "dtype", None)
            if new_shape != value.shape or new_dtype != value.dtype:
                raise ConfigError(
                    f"edit of site {full!r} returned shape {new_shape} and dtype "
                    f"{new_dtype}, but the site holds shape {tuple(value.shape)} "
                    f"and dtype {value.dtype}; an edit must keep both."
                )
            if layers is not None:
                if self.layer is None:
                    raise ConfigError(
                        f"edit of site {full!r}: layers={layers} given for a "
                        "site outside a scanned stack."
                    )
                hit = jnp.isin(self.layer, jnp.asarray(layers, jnp.int32))
                new = jnp.where(hit, new, value)
            value = new
        if self.records(name):
            self.values[full] = value
        return value

    def sites(
        self,
        name: str,
        value: Any,
        to_site: Callable[[Any], Any],
        from_site: Callable[[Any], Any],
    ) -> Any:
        """`__call__` for a value held in another layout than its site's: the
        site sees `to_site(value)`, and an edited value comes back through
        `from_site`. Nothing is computed when the site is not wanted."""
        if not self.wants(name):
            return value
        site = to_site(value)
        out = self(name, site)
        return value if out is site else from_site(out)


def at(hooks: Hooks | None, name: str, value: Any) -> Any:
    """`hooks(name, value)`, or `value` itself when `hooks` is `None`."""
    return value if hooks is None else hooks(name, value)


def scope(hooks: Hooks | None, name: str) -> Hooks | None:
    """`hooks.scope(name)`, or `None` when `hooks` is `None`."""
    return None if hooks is None else hooks.scope(name)
