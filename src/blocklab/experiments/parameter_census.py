"""The parameter census of the chapter's blocks (section 11.1.3, exercise 8).

`run_census()` counts, per part (attention, FFN, norms, total), the
parameters of the chapter's two blocks at d = 256 with 8 heads, and those of
`FeedForward(d, act)` for every act. Blocks are built abstractly
(`eqx.filter_eval_shape`), so a census of a d = 4096 block allocates nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from .._validate import ConfigError, check_bool, check_choice, check_int
from ..diagnostics.counting import census, count_params
from ..nn.block import PLACEMENTS, TransformerBlock
from ..nn.ffn import ACTS, FeedForward
from ..nn.normalization import NORMS
from ._render import markdown_table
from .protocol import report_estimate_hook, report_section_hook

__all__ = ["CHAPTER_BLOCKS", "CensusResult", "act_blocks", "block_census", "run_census"]

#: The chapter's configurations: label -> TransformerBlock options.
CHAPTER_BLOCKS: dict[str, dict[str, Any]] = {
    "default (pre, rms, swiglu)": {},
    "2017 (post, layer, gelu, bias)": dict(
        norm="layer", act="gelu", placement="post", bias=True
    ),
}


def block_census(num_hiddens: int, num_heads: int, **options: Any) -> dict[str, int]:
    """`census` of an abstract `TransformerBlock(num_hiddens, num_heads, **options)`.

    `eqx.filter_eval_shape` builds the block without allocating or drawing
    weights, so the census of a d = 4096 block costs nothing.
    """
    blk = eqx.filter_eval_shape(
        lambda: TransformerBlock(
            num_hiddens, num_heads, key=jax.random.key(0), **options
        )
    )
    return census(blk)


def ffn_census(num_hiddens: int, acts: Sequence[str] = ACTS) -> dict[str, int]:
    """Parameters of `FeedForward(num_hiddens, act)` for each act (abstract)."""
    return {
        a: count_params(
            eqx.filter_eval_shape(
                lambda a=a: FeedForward(num_hiddens, a, key=jax.random.key(0))
            )
        )
        for a in acts
    }


def act_blocks(
    acts: Sequence[str],
    *,
    norm: str = "rms",
    placement: str = "pre",
    bias: bool = False,
) -> dict[str, dict[str, Any]]:
    """Label -> options of the default block with each act (and the given
    norm, placement and bias), for `run_census(blocks=...)`."""
    owner = "act_blocks"
    for a in acts:
        check_choice(owner, "act", a, ACTS)
    check_choice(owner, "norm", norm, sorted(NORMS))
    check_choice(owner, "placement", placement, PLACEMENTS)
    check_bool(owner, "bias", bias)
    return {
        f"{a} ({placement}, {norm}{', bias' if bias else ''})": dict(
            act=a, norm=norm, placement=placement, bias=bias
        )
        for a in acts
    }


@dataclasses.dataclass(frozen=True)
class CensusResult:
    """Parameter counts per part.

    Attributes:
        num_hiddens, num_heads: the width d and the number of heads.
        blocks: block label -> part (`norm1`, `norm2`, `attention`, `ffn`, ...,
            `total`) -> parameters.
        ffn: act -> parameters of `FeedForward(num_hiddens, act)`.
    """

    num_hiddens: int
    num_heads: int
    blocks: dict[str, dict[str, int]]
    ffn: dict[str, int]

    def table(self) -> str:
        """Markdown: one row per block; norms summed; total in units of d^2."""
        d = self.num_hiddens
        rows = []
        for label, c in self.blocks.items():
            norms = sum(v for k, v in c.items() if "norm" in k)
            rows.append(
                (
                    label,
                    c["attention"],
                    c["ffn"],
                    norms,
                    c["total"],
                    f"{c['total'] / d**2:.2f}",
                )
            )
        return markdown_table(
            ("block", "attention", "ffn", "norms", "total", "total / d^2"), rows
        )

    def ffn_table(self) -> str:
        """Markdown: FFN parameters per act, and their ratio to 8 d^2."""
        d = self.num_hiddens
        return markdown_table(
            (f"FeedForward({d}, act)", "parameters", "/ 8 d^2"),
            [(a, n, f"{n / (8 * d * d):.4f}") for a, n in self.ffn.items()],
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: `num_hiddens`, `num_heads`, `blocks`, `ffn`."""
        return dataclasses.asdict(self)

    def figures(self, out_dir: str | Path) -> list[Path]:
        """The census has no figures (a table says it all); returns []."""
        del out_dir
        return []

    def section(self) -> str:
        """The report's Markdown section."""
        return (
            f"## Parameter census (d = {self.num_hiddens}, {self.num_heads} heads)\n\n"
            f"{self.table()}\n\n"
            "The chapter: attention 262144, FFN 524544, total 787200 = 12.01 d^2.\n\n"
            f"{self.ffn_table()}\n"
        )


def run_census(
    *,
    num_hiddens: int = 256,
    num_heads: int = 8,
    blocks: Mapping[str, Mapping[str, Any]] | None = None,
    acts: Sequence[str] = ACTS,
) -> CensusResult:
    """Count the parameters of blocks and FFNs of width `num_hiddens`.

    Args:
        num_hiddens: the width d (the chapter: 256).
        num_heads: attention heads; must divide `num_hiddens` (the chapter: 8).
        blocks: label -> `TransformerBlock` options; default `CHAPTER_BLOCKS`
            (the modern default block and the 2017 block). `act_blocks` makes
            one per act.
        acts: the acts whose `FeedForward` is counted (default: all).

    Returns:
        A `CensusResult`.
    """
    owner = "run_census"
    d = check_int(owner, "num_hiddens", num_hiddens, min=1)
    h = check_int(owner, "num_heads", num_heads, min=1)
    if d % h:
        raise ConfigError(
            f"{owner}: num_hiddens={d} is not divisible by num_heads={h}; choose "
            f"num_heads among the divisors of {d}."
        )
    for a in acts:
        check_choice(owner, "act", a, ACTS)
    configs = CHAPTER_BLOCKS if blocks is None else blocks
    return CensusResult(
        num_hiddens=d,
        num_heads=h,
        blocks={label: block_census(d, h, **opts) for label, opts in configs.items()},
        ffn=ffn_census(d, acts),
    )


@report_estimate_hook("census")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 CPU cores (abstract blocks: nothing is computed)."""
    return 5.0


@report_section_hook("census")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """The report's census of the chapter's blocks (the same at every size)."""
    del out_dir  # the census has no figures
    return run_census().section()
