"""Layouts for a world size and a device memory: every (tp, pp, vpp, dp, ZeRO, recompute, micro-batch) the
recipe's validation accepts (with the recipe's context-parallel size; for an MoE family also every
expert-parallel size that divides both dp and the number of experts), at the recipe's global batch, kept
when its largest stage fits, and ranked by a relative step-time estimate.

The estimate is deliberately simple and says what it counts: compute grows by the recompute's extra
FLOPs, the pipeline idles its bubble, and each doubling of TP costs ``TP_COST_PER_DOUBLING`` (its
all-reduces run in every layer; keep TP inside a node, as the search does). Data-parallel and ZeRO
traffic is the same for ZeRO 0/1/2 (a reduce-scatter and an all-gather move what one all-reduce moves), so
ZeRO-1/2 change memory, not the estimate; ZeRO-3 gathers the weights again for the backward (1.5 times the
traffic), costed ``ZERO3_COST``; a layout that fits only with the optimizer in host memory is listed with
``optim.offload_optimizer`` on, costed ``OFFLOAD_COST`` (both flat guesses). Ties go to the larger micro-batch (devices run larger matrix
multiplies more efficiently), then to the layout with more memory to spare. Expert parallelism's
all-to-alls are not in the estimate either: among layouts otherwise alike, ties go to the one that fits
with more to spare.

Pipeline schedules: every pipeline layout is tried with each ``distributed.pipeline_schedule`` (``1f1b``,
``interleaved`` at two chunks per stage, ``zb1p``, ``zbv``, ``dualpipev``) the trainer's own pipeline rules
accept (:func:`megacann.pipeline.check_pipeline_config`: layer counts, micro-batches, the V's refusals), and
listed once, with the fastest schedule that fits: the bubble is the dry run's (closed form for 1F1B and
interleaved, the simulator's for the split-backward ones), the memory the dry run's per-schedule estimate
(micro-batches in flight replayed from the schedule's plan, the V's placement with the head on stage 0). A
split backward (B and W apart) costs ``SPLIT_BACKWARD_COST`` more compute (measured); the V schedules' extra
transfers and DualPipeV's overlap are not in the estimate (as built, dualpipev never beats zbv in it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Optional

from megacann.config import ConfigError, MegacannConfig
from megacann.config.advice import quiet_advice
from megacann.pipeline.rules import validate_pipeline_config
from megacann.pipeline.schedule_spec import get_schedule, registered_schedules, splits_backward
from megacann.planning.estimate import StageEstimate, bubble_fraction, estimate_stages, recompute_extra_flops
from megacann.planning.formulas import Layout, layout_of, moe_structure
from megacann.training.recipe import prepare_recipe

TP_COST_PER_DOUBLING = 0.05
# optimizer offload: the update on the CPU and the copies over the host link, a flat guess per step (measure
# yours with benchmarks/offload.py); tried only for layouts that do not fit without it
OFFLOAD_COST = 0.25
ZERO3_COST = 0.1
# B + W cost 1.00-1.10x a fused backward (benchmarks/split_backward.py, docs/pipeline.md); the backward is
# about two thirds of a step's compute
SPLIT_BACKWARD_COST = 0.02
ZERO_STAGES = (0, 1, 2, 3)  # a stage the recipe's validation refuses is skipped like any other bad layout
HEADROOM = 0.10  # of device memory left for the runtime, temporary buffers and fragmentation
RECOMPUTE = ("none", "selective", "full")


@dataclass
class RankedLayout:
    layout: Layout
    stages: list[StageEstimate]
    time_factor: float
    extra_flops: float = 0.0  # recompute's extra compute share

    @property
    def largest(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.total)

    def reason(self, budget: float) -> str:
        """One line: why this layout, in numbers."""
        big = self.largest
        lay = self.layout
        bubble = bubble_fraction(lay)
        parts = [f"{big.total / 1e9:.1f} of {budget / 1e9:.1f} GB (stage {big.stage} largest)"]
        if lay.pp > 1:
            parts.append(f"{lay.schedule or 'pipeline'} bubble {bubble:.0%}")
        else:
            parts.append("no pipeline bubble")
        if lay.recompute != "none":
            parts.append(f"{lay.recompute} recompute +{self.extra_flops:.0%} compute")
        if lay.zero:
            over = f"dp {lay.dp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "")
            if lay.ep > 1:
                over += f", the experts' over dp / ep {lay.dp // lay.ep}" + (f" x cp {lay.cp}" if lay.cp > 1 else "")
            what = {1: "optimizer", 2: "optimizer and grads", 3: "weights, grads and optimizer"}[lay.zero]
            if lay.zero_group:
                over = f"groups of {lay.zero_shards} (hybrid)"
            parts.append(f"ZeRO-{lay.zero} shards {what} over {over}")
        if lay.offload_optimizer:
            parts.append(f"optimizer in host memory ({big.host_optimizer / 1e9:.1f} GB)")
        if lay.offload_layers:
            parts.append(f"{len(lay.offload_layers)} layers' activations in host memory")
        parts.append(f"est. time x{self.time_factor:.2f}")
        if lay.pp > 1 and lay.schedule:
            parts.append(f"sets distributed.pipeline_schedule: {lay.schedule}")
        return "; ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_config(cfg: MegacannConfig, layout: Layout, world: int) -> MegacannConfig:
    """A copy of the recipe with ``layout`` applied and validated for ``world`` ranks (ConfigError if not)."""
    new = copy.deepcopy(cfg)
    d = new.distributed
    d.world_size, d.data_parallel_size = world, None
    d.tensor_parallel_size, d.pipeline_parallel_size = layout.tp, layout.pp
    d.context_parallel_size = layout.cp
    d.expert_parallel_size = layout.ep
    d.virtual_pipeline_size = layout.vpp if layout.vpp > 1 else None
    d.pipeline_schedule = layout.schedule if layout.pp > 1 else None
    d.zero_optimization = layout.zero
    new.optim.offload_optimizer = layout.offload_optimizer
    d.sequence_parallel = layout.sequence_parallel
    d.pipeline_layers = None
    d.parallel_mode = "hybrid"
    new.model.activation_checkpointing = layout.recompute
    new.data.batch_size, new.optim.grad_accum_steps = layout.micro_batch, layout.num_microbatches
    with quiet_advice():
        prepare_recipe(new, world_size=world)
    return new


def schedule_config(cfg: MegacannConfig, layout: Layout) -> MegacannConfig:
    """``cfg`` (validated for a layout that differs from ``layout`` only in its pipeline schedule) with
    ``layout``'s schedule, checked by the trainer's pipeline rules (ConfigError if they refuse it). Shares
    everything but the distributed section with ``cfg``: the schedule changes nothing else."""
    new = copy.copy(cfg)
    new.distributed = copy.copy(cfg.distributed)
    new.distributed.pipeline_schedule = layout.schedule
    new.distributed.virtual_pipeline_size = layout.vpp if layout.vpp > 1 else None
    validate_pipeline_config(new)
    return new


def schedule_variants(layout: Layout) -> list[Layout]:
    """``layout`` with each registered pipeline schedule at the fewest chunks per stage it runs (interleaved
    at two): what the search tries for one pipeline layout (the trainer's rules may refuse some)."""
    if layout.pp == 1:
        return [layout]
    return [replace(layout, vpp=get_schedule(s).min_virtual_size, schedule=s) for s in registered_schedules()]


def candidate_layouts(cfg: MegacannConfig, world: int, devices_per_node: int = 8) -> Iterator[Layout]:
    """Layouts of ``world`` ranks at the recipe's global batch (TP within a node; ZeRO only with dp > 1;
    the recipe's context-parallel size, which the sequence length calls for, is kept; expert parallelism
    of MoE families divides dp and the experts), one per pipeline layout: 1F1B (its schedule variants:
    :func:`schedule_variants`)."""
    global_batch = cfg.global_batch_size
    cp = cfg.distributed.context_parallel_size
    moe = moe_structure(cfg.model)
    recipe = layout_of(cfg)  # offload choices and a hybrid-sharding group are kept as the recipe has them
    kept = (recipe.offload_optimizer, recipe.offload_layers, recipe.zero_group)
    if world % cp:
        return
    for tp in (t for t in _divisors(world // cp) if t <= devices_per_node):
        for pp in _divisors(world // (cp * tp)):
            dp = world // (cp * tp * pp)
            if global_batch % dp:
                continue
            experts = [ep for ep in _divisors(dp) if moe.num_experts % ep == 0] if moe else [1]
            schedule = "1f1b" if pp > 1 else None
            for ep in experts:
                for micro_batch in _divisors(global_batch // dp):
                    m = global_batch // (dp * micro_batch)
                    for zero in ZERO_STAGES if dp > 1 else (0,):
                        for recompute in RECOMPUTE:
                            yield Layout(
                                tp,
                                pp,
                                dp,
                                1,
                                zero,
                                recompute,
                                micro_batch,
                                m,
                                tp > 1,
                                zero == 2,
                                cp,
                                ep,
                                *kept,
                                schedule=schedule,
                            )


def time_factor(cfg: MegacannConfig, layout: Layout, bubble: Optional[float] = None) -> float:
    """Step time relative to an ideal layout (no recompute, no bubble, no TP); ``bubble`` instead of the
    layout's schedule's."""
    return _time(recompute_extra_flops(cfg, layout.recompute), layout, bubble)


def _time(recompute_extra: float, layout: Layout, bubble: Optional[float] = None) -> float:
    compute = 1.0 + recompute_extra + (OFFLOAD_COST if layout.offload_optimizer else 0)
    compute += ZERO3_COST if layout.zero >= 3 else 0
    compute += SPLIT_BACKWARD_COST if splits_backward(layout.schedule) and layout.pp > 1 else 0
    bubble = bubble_fraction(layout) if bubble is None else bubble
    return compute / (1.0 - bubble) * (1.0 + TP_COST_PER_DOUBLING * math.log2(layout.tp))


def rank_layouts(
    cfg: MegacannConfig, world: int, device_memory: float, devices_per_node: int = 8, headroom: float = HEADROOM
) -> list[RankedLayout]:
    """Layouts whose largest stage fits ``device_memory`` bytes less ``headroom``, fastest estimate first;
    a pipeline layout once, with the fastest schedule that fits (the optimizer in host memory only when no
    schedule fits without)."""
    budget = device_memory * (1.0 - headroom)
    ranked = []
    refused_stages: set[int] = set()  # ZeRO stages the recipe's validation refuses whatever the layout
    for base in candidate_layouts(cfg, world, devices_per_node):
        if base.zero in refused_stages:
            continue
        try:
            candidate = layout_config(cfg, base, world)
        except (ConfigError, ValueError) as err:
            if "distributed.zero_optimization must be" in str(err):
                refused_stages.add(base.zero)
            continue
        chosen = fastest_schedule(candidate, base, budget)
        if chosen is None:
            continue
        layout, variant_cfg, stages = chosen
        if layout.zero == 2 and stages == estimate_stages(
            variant_cfg, replace(layout, zero=1, overlap_grad_reduce=False)
        ):
            continue  # ZeRO-2 saves nothing here (gradients accumulate in full): ZeRO-1 is listed
        extra = recompute_extra_flops(variant_cfg, layout.recompute)
        ranked.append(RankedLayout(layout, stages, _time(extra, layout), extra))
    ranked.sort(key=lambda r: (round(r.time_factor, 4), -r.layout.micro_batch, r.largest.total))
    return ranked


def fastest_schedule(
    candidate: MegacannConfig, base: Layout, budget: float
) -> Optional[tuple[Layout, MegacannConfig, list[StageEstimate]]]:
    """(layout, its config, its stages) of the fastest schedule of ``base`` (validated as ``candidate``)
    whose largest stage fits ``budget``; with the optimizer in host memory when none fits without.

    Best first, each step as late as it can be: a variant is validated and its memory estimated only when
    no other could be faster, and a split-backward schedule's bubble simulated only once it fits (until
    then it is timed with :func:`_bubble_bound`). A schedule the trainer refuses, or whose memory the
    planner has no formulas for (a family's own layers under a split backward), is left out."""
    extra = recompute_extra_flops(candidate, base.recompute)
    variants = enumerate(schedule_variants(base))
    queue = [_Variant(v, k, _time(extra, v, _bubble_bound(v) if _simulated(v) else None)) for k, v in variants]
    tried: list[_Variant] = []
    while queue:
        queue.sort(key=lambda v: (v.time, v.order))
        head = queue[0]
        if head.config is None:
            try:
                head.config = candidate if head.layout == base else schedule_config(candidate, head.layout)
            except ConfigError:
                queue.pop(0)  # the trainer's pipeline rules refuse this schedule here
            continue
        if head.stages is None:
            try:
                head.stages = estimate_stages(head.config, head.layout)
            except ConfigError:  # no formulas for this schedule (a family's own layers under a split backward)
                queue.pop(0)
                continue
            if max(s.total for s in head.stages) > budget:
                tried.append(queue.pop(0))
            continue
        if not head.exact:
            head.time, head.exact = _time(extra, head.layout), True
            continue
        return head.layout, head.config, head.stages
    # does one fit with the optimizer in host memory (which frees the optimizer's bytes only)? fastest first
    offloadable = [v for v in tried if not v.layout.offload_optimizer]
    offloadable = [v for v in offloadable if max(s.total - s.optimizer for s in v.stages) <= budget]
    for v in sorted(offloadable, key=lambda v: (_time(extra, replace(v.layout, offload_optimizer=True)), v.order)):
        layout = replace(v.layout, offload_optimizer=True)
        config = copy.copy(v.config)
        config.optim = copy.copy(config.optim)
        config.optim.offload_optimizer = True
        stages = estimate_stages(config, layout)
        if max(s.total for s in stages) <= budget:
            return layout, config, stages
    return None


def _bubble_bound(layout: Layout) -> float:
    """A lower bound of the simulated bubble of a split-backward schedule, without simulating: every stage
    is busy 3m units (forward, B and W one each; a V chunk half of that each, two chunks), and the last
    stage cannot start before its first input has passed the p - 1 stages before it (a unit each, half a
    unit for a V chunk), so it idles at least that share of the step. zbv reaches it at p 2 to 4 from m = p
    (tested for p 2-8), so where zbv fits the search rarely simulates dualpipev."""
    p, m = layout.pp, layout.num_microbatches
    wait = (p - 1) * get_schedule(layout.schedule).placement.chunk_time_fraction
    return wait / (3 * m + wait)


def _simulated(layout: Layout) -> bool:
    return layout.pp > 1 and splits_backward(layout.schedule)


@dataclass
class _Variant:
    """One schedule of a pipeline layout while the search weighs it."""

    layout: Layout
    order: int
    time: float  # exact once ``exact``; before, a lower bound (:func:`_bubble_bound`)
    config: Optional[MegacannConfig] = None  # once validated
    stages: Optional[list[StageEstimate]] = None  # once estimated
    exact: bool = False

    def __post_init__(self) -> None:
        self.exact = not _simulated(self.layout)
