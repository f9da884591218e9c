r"""The parametrization as data: per-leaf init scale and learning-rate multiplier.

A *parametrization* says, for each kind of parameter, how its initial scale,
its forward multiplier and its (Adam) learning rate change with the model
width $d$. blocklab has two, `"standard"` (SP, what every model did before)
and `"mup"` (the Maximal Update Parametrization of Tensor Programs V, Yang et
al. 2022, arXiv 2203.03466, in its Table 8 form, the one the `mup` package
implements). With the width multiplier $m = d / d_0$ ($d_0$ = `base_width`):

| role | leaves | init std SP | init std μP | Adam LR SP | Adam LR μP |
|---|---|---|---|---|---|
| `embedding` | token, position tables | 0.02 | 0.02 | 1 | 1 |
| `vector` | biases, norm gains | 0 / 1 | 0 / 1 | 1 | 1 |
| `hidden` | k, v, o, FFN matrices | $1/\sqrt{n}$ | $1/\sqrt{n}$ | 1 | $1/m$ |
| `query` | $W_q$ | $1/\sqrt{n}$ | **0** | 1 | $1/m$ |
| `readout` | untied head $d \to V$ | $1/\sqrt{n}$ | **0** | 1 | 1 |

($n$ = fan-in; "Adam LR" is the multiplier on the base rate), and two
forward multipliers:

| | standard | μP |
|---|---|---|
| readout (logits $= c\, h W^\top$) | $c = 1$ | $c = 1/m$ |
| attention logit scale | $1/\sqrt p$ | $\sqrt{p_0}/p$ |

($p_0 = p/m$, the head width at $d_0$)

A tied head reuses the embedding (role `embedding`, constant rate, init 0.02)
and keeps the $1/m$ forward multiplier (`mup.MuSharedReadout`). μP's
attention scale is "$1/d_\text{head}$" with the constant $\sqrt{p_0}$ chosen
so that at $d = d_0$ it equals the standard $1/\sqrt p$. So at
`width == base_width` every multiplier is 1 and μP differs from standard only
by the zero-initialised query projection and untied readout (the `mup`
README's recommendation: it removes the transient $1/\sqrt{d}$ shrinkage of the
attention and output logits at init).

Widths scale at fixed head count: $p$, the FFN width and $d$ are all
multiplied by $m$, so every hidden fan-in ratio is $m$ (a gated FFN's rounded
width $\approx 8d/3$ to within one unit) and the base model's sizes
$w \cdot d_0 / d$ must be integers (`check_base_width`). The multiplier
uses $m = d/d_0$ for every hidden matrix, as `mup.MuAdam` groups them.

The learning-rate multipliers are applied by `blocklab.optimizer` (a tree of
Python floats, `lr_multipliers(model)`), the init rules by the model builders
(`apply_init`), the forward multipliers by the models themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._validate import ConfigError, check_choice, check_int

__all__ = [
    "PARAMETRIZATIONS",
    "ROLES",
    "TABLE",
    "Rule",
    "apply_init",
    "attention_scale",
    "check_base_width",
    "leaf_roles",
    "lr_multiplier",
    "lr_multipliers",
    "parametrization_of",
    "readout_multiplier",
]

PARAMETRIZATIONS = ("standard", "mup")
ROLES = ("embedding", "vector", "hidden", "query", "readout")


@dataclass(frozen=True)
class Rule:
    """One cell of the table: how a role's leaves are drawn and trained.

    Attributes:
        init: `"default"` (the builder's draw: 0.02 embeddings, LeCun
            $1/\\sqrt{\\text{fan\\_in}}$ matrices, zero biases, unit gains) or
            `"zero"`.
        lr_power: the Adam learning-rate multiplier is $m^{\\text{lr\\_power}}$
            ($m$ = width / base_width): 0 constant, -1 for $1/m$.
    """

    init: str
    lr_power: int


_DEFAULT = Rule("default", 0)

#: The table above as data: parametrization -> role -> `Rule`.
TABLE: Mapping[str, Mapping[str, Rule]] = {
    "standard": {role: _DEFAULT for role in ROLES},
    "mup": {
        "embedding": _DEFAULT,
        "vector": _DEFAULT,
        "hidden": Rule("default", -1),
        "query": Rule("zero", -1),
        "readout": Rule("zero", 0),
    },
}


def _check_name(owner: str, parametrization: Any) -> str:
    return check_choice(owner, "parametrization", parametrization, PARAMETRIZATIONS)


def check_base_width(
    owner: str,
    parametrization: Any,
    base_width: Any,
    width: int,
    sizes: Mapping[str, int] | None = None,
) -> tuple[str, int | None]:
    """Check `(parametrization, base_width)` for a model of width `width`.

    `base_width` is an int >= 1 (or `None`); μP needs it. Each of `sizes`
    (e.g. `{"head_dim": p, "ffn_width": f}`) and `width` itself must scale to
    an integer at the base width: $w \\cdot d_0 / d \\in \\mathbb{N}$.

    Returns:
        The checked `(parametrization, base_width)`.
    """
    parametrization = _check_name(owner, parametrization)
    base_width = check_int(owner, "base_width", base_width, min=1, optional=True)
    if parametrization == "mup":
        if base_width is None:
            raise ConfigError(
                f"{owner}: parametrization='mup' needs base_width (the width d0 "
                "whose rates are tuned, e.g. base_width=64), got base_width=None."
            )
        for name, w in {"num_hiddens": width, **(sizes or {})}.items():
            if (w * base_width) % width:
                raise ConfigError(
                    f"{owner}: base_width={base_width} does not divide into the "
                    f"model's widths: {name}={w} at base width would be "
                    f"{w} * {base_width} / {width} = {w * base_width / width:g}, "
                    "not an integer; choose a base_width for which every width "
                    "scales to an integer (e.g. a power of two dividing num_hiddens)."
                )
    return parametrization, base_width


def _m(parametrization: str, width: int, base_width: int | None) -> float:
    if parametrization == "standard" or base_width is None:
        return 1.0
    return width / base_width


def lr_multiplier(
    parametrization: str, role: str, width: int, base_width: int | None
) -> float:
    """The Adam learning-rate multiplier $m^{\\text{lr\\_power}}$ of one role."""
    parametrization = _check_name("lr_multiplier", parametrization)
    role = check_choice("lr_multiplier", "role", role, ROLES)
    rule = TABLE[parametrization][role]
    return float(_m(parametrization, width, base_width) ** rule.lr_power)


def readout_multiplier(
    parametrization: str, width: int, base_width: int | None
) -> float:
    """The forward multiplier $c$ of the logits: 1 (standard) or $d_0 / d$ (μP)."""
    name = _check_name("readout_multiplier", parametrization)
    return 1.0 / _m(name, width, base_width)


def attention_scale(
    parametrization: str, head_dim: int, width: int, base_width: int | None
) -> float:
    """$1/\\sqrt p$ (standard) or $\\sqrt{p_0}/p$ with $p_0 = p\\,d_0/d$ (μP)."""
    parametrization = _check_name("attention_scale", parametrization)
    # sqrt(p0)/p = p^(-1/2) m^(-1/2): exactly the standard scale at m = 1
    # (the same float as BlockConfig's default 1 / math.sqrt(p))
    return 1.0 / math.sqrt(head_dim) / math.sqrt(_m(parametrization, width, base_width))


def parametrization_of(model: Any) -> tuple[str, int, int | None]:
    """`(parametrization, width, base_width)` of a `DecoderLM` or `CharLM`.

    Any other module is standard at its own width (`num_hiddens` if it has
    one, else 1).
    """
    cfg = getattr(model, "cfg", model)
    name = getattr(cfg, "parametrization", "standard")
    width = getattr(cfg, "num_hiddens", 1)
    return name, width, getattr(cfg, "base_width", None)


def _names(path) -> list[str]:
    out = []
    for k in path:
        name = getattr(k, "name", None)
        if name is None:
            name = getattr(k, "key", None)
        out.append(str(name))
    return out


def _role(path, leaf) -> str:
    names = _names(path)
    if any(n in ("token_emb", "pos_emb") for n in names):
        return "embedding"
    if "head" in names:
        return "readout"
    # A Stack stores each leaf with a leading layer axis.
    per_layer_ndim = leaf.ndim - (1 if "stack" in names or "blocks" in names else 0)
    if per_layer_ndim < 2:
        return "vector"
    if "W_q" in names and names[-1] == "weight":
        return "query"
    return "hidden"


def leaf_roles(model: Any) -> Any:
    """The role (`ROLES`) of every floating-point leaf of `model`.

    A tree shaped like `eqx.filter(model, eqx.is_inexact_array)` with a role
    string at each array: `embedding` (under `token_emb` / `pos_emb`),
    `readout` (under `head`), `vector` (one array axis per layer: biases and
    norm gains), `query` (the weight of a `W_q`), `hidden` (every other
    matrix).
    """
    params = eqx.filter(model, _is_float)
    return jax.tree_util.tree_map_with_path(_role, params)


def _is_float(x: Any) -> bool:
    """A floating-point array, or the shape of one (an `eval_shape` skeleton)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def lr_multipliers(model: Any) -> Any:
    """Per-leaf Adam learning-rate multipliers of `model`, from `TABLE`.

    A tree shaped like `eqx.filter(model, eqx.is_inexact_array)` holding a
    Python float at each array (all 1.0 under standard, or at base width).
    """
    name, width, base = parametrization_of(model)
    return jax.tree_util.tree_map(
        lambda role: lr_multiplier(name, role, width, base), leaf_roles(model)
    )


def apply_init(model: Any, parametrization: str | None = None) -> Any:
    """Apply the table's `"zero"` init rules to `model`; other leaves are kept.

    Under μP this zeroes the query projections' weights and an untied head;
    under standard it returns `model` unchanged. `parametrization` defaults
    to the model's own (`parametrization_of`); give it for a part of a model
    (e.g. `{"stack": stack, "head": head}`, whose keys name the roles).
    """
    name = parametrization_of(model)[0] if parametrization is None else parametrization
    name = _check_name("apply_init", name)
    zero_roles = {role for role, rule in TABLE[name].items() if rule.init == "zero"}
    if not zero_roles:
        return model
    params, static = eqx.partition(model, eqx.is_inexact_array)
    roles = leaf_roles(model)
    params = jax.tree_util.tree_map(
        lambda p, r: jnp.zeros_like(p) if r in zero_roles else p, params, roles
    )
    return eqx.combine(params, static)
