"""Looking inside models: named activation sites, capture, interventions,
attribution and lenses.

Every model blocklab builds or converts reports its activations at named
sites (TransformerLens's names; `blocklab.interp.sites`). `capture` reads
them, `intervene` edits them (`edits`: patching, ablation, steering),
`attribute` differentiates a metric with respect to them. All are pure
functions: they compose with `jit`, `vmap`, `grad` and meshes, and a scanned
stack stays one scan.
"""

from .capture import attribute, capture, intervene
from .edits import ablate, ablate_heads, ablate_neurons, patch, steer
from .sites import site_names, site_shapes

__all__ = [
    "capture",
    "intervene",
    "attribute",
    "patch",
    "ablate",
    "ablate_heads",
    "ablate_neurons",
    "steer",
    "site_names",
    "site_shapes",
]
