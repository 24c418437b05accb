"""Which convolution regions compute channels-last: decided by the orchestration itself.

``capture/channels_last.py`` finds the regions of a graph (convolutions and the
layout-agnostic ops between them) and rewrites any set of them exactly; this module
chooses the set. A region's layout changes which kernels exist (a channels-last 1x1
conv is a GEMM with a packed constant weight, a channels-last depthwise conv fills
every vector lane, instance norm's reductions are no longer along rows, conversions
appear at the region's borders), so the choice is made on the quantity the BLP
minimises: the predicted time of the whole program. Each region in turn is converted
when the optimal program of the graph with it channels-last is predicted faster, by
at least ``MIN_GAIN``, than the best program so far (greedy over regions; they rarely
interact: only through the conversions between two of them). Under
``kiln.compile(..., measure=True)`` the objective sums measured kernel times, so the
layout decision is measured too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kiln.compiler.capture.channels_last import Region, find_regions, to_channels_last
from kiln.compiler.ir.graph import Graph

LayoutMode = Literal["auto", "nchw", "nhwc"]
MIN_GAIN = 0.02  # predicted gain a region must bring to switch layout (cost-model noise)


@dataclass
class LayoutChoice:
    """The graph to compile and, per region, what was decided and why (for the report)."""

    graph: Graph
    notes: list[str] = field(default_factory=list)


def describe(region: Region, graph: Graph) -> str:
    first = graph.node(region.convs[0])
    shape = "x".join(str(s) for s in graph.meta(first.inputs[0]).shape)
    return f"{len(region.convs)} convs from {first.name} ({shape}), {len(region.nodes)} ops"


def choose_layouts(
    graph: Graph,
    objective: Callable[[Graph], float],
    mode: LayoutMode = "auto",
    basis: str = "cost model",
) -> LayoutChoice:
    """The graph with the regions worth it channels-last. ``objective(graph)`` is the
    predicted time (µs) of the best program for a graph (``basis`` says of what, for
    the notes); ``mode`` ``"nchw"`` keeps every region as captured, ``"nhwc"`` converts
    all of them, ``"auto"`` decides."""
    regions = find_regions(graph)
    if not regions or mode == "nchw":
        notes = (
            [f"layout: {len(regions)} conv regions kept NCHW (layouts='nchw')"] if regions else []
        )
        return LayoutChoice(graph, notes)
    if mode == "nhwc":
        notes = [f"layout: NHWC (forced): {describe(r, graph)}" for r in regions]
        return LayoutChoice(to_channels_last(graph, regions), notes)
    best = objective(graph)
    chosen: list[Region] = []
    notes = []
    for region in regions:
        trial = objective(to_channels_last(graph, [*chosen, region]))
        keep = trial < best * (1.0 - MIN_GAIN)
        verdict = "NHWC" if keep else "NCHW"
        notes.append(
            f"layout: {verdict}: {describe(region, graph)}; predicted program "
            f"{best:.0f} us as is, {trial:.0f} us with it NHWC ({basis})"
        )
        if keep:
            chosen.append(region)
            best = trial
    return LayoutChoice(to_channels_last(graph, chosen), notes)
