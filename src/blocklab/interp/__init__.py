"""Looking inside models: named activation sites, capture, interventions,
attribution and lenses.

Every model blocklab builds or converts reports its activations at named
sites (TransformerLens's names; `blocklab.interp.sites`). `capture` reads
them, `intervene` edits them (`edits`: patching, ablation, steering),
`attribute` differentiates a metric with respect to them; `logit_lens` and
`jacobian_lens` ask each layer what it predicts; `heads` scores attention heads
(induction, previous-token) and edits a mask of them. All are pure
functions: they compose with `jit`, `vmap`, `grad` and meshes, and a scanned
stack stays one scan.
"""

from .capture import attribute, capture, intervene
from .decoding import capture_generate, decode_site_shapes
from .edits import ablate, ablate_heads, ablate_neurons, patch, steer
from .heads import (
    heads_edit,
    prefix_matching_scores,
    previous_token_scores,
    random_heads,
)
from .lenses import (
    LensResult,
    jacobian_lens,
    jacobians,
    load_lens,
    logit_lens,
    save_lens,
)
from .sites import site_names, site_shapes

__all__ = [
    "capture",
    "intervene",
    "attribute",
    "capture_generate",
    "decode_site_shapes",
    "patch",
    "ablate",
    "ablate_heads",
    "ablate_neurons",
    "steer",
    "heads_edit",
    "prefix_matching_scores",
    "previous_token_scores",
    "random_heads",
    "site_names",
    "site_shapes",
    "logit_lens",
    "jacobians",
    "jacobian_lens",
    "LensResult",
    "save_lens",
    "load_lens",
]
