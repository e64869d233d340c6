"""Planning a run before it starts: per-device memory of a layout (parameters, gradients, optimizer state by
ZeRO stage, activations with and without recompute, per pipeline stage), its pipeline bubble, and the
layouts that fit a world size and a device memory (``megacann-plan``). The formulas live in
:mod:`megacann.planning.formulas` (parameters, gradients, optimizer state) and
:mod:`megacann.planning.activations`."""

from megacann.planning.estimate import StageEstimate, bubble_fraction, estimate_stages
from megacann.planning.formulas import Layout, layout_of, unsharded_bytes
from megacann.planning.report import plan_report
from megacann.planning.search import RankedLayout, rank_layouts

__all__ = [
    "Layout",
    "RankedLayout",
    "StageEstimate",
    "bubble_fraction",
    "estimate_stages",
    "layout_of",
    "plan_report",
    "rank_layouts",
    "unsharded_bytes",
]
