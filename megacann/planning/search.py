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
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from megacann.config import ConfigError, MegacannConfig
from megacann.config.advice import quiet_advice
from megacann.planning.estimate import StageEstimate, bubble_fraction, estimate_stages, recompute_extra_flops
from megacann.planning.formulas import Layout, layout_of, moe_structure
from megacann.training.recipe import prepare_recipe

TP_COST_PER_DOUBLING = 0.05
# optimizer offload: the update on the CPU and the copies over the host link, a flat guess per step (measure
# yours with benchmarks/offload.py); tried only for layouts that do not fit without it
OFFLOAD_COST = 0.25
ZERO3_COST = 0.1
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
        parts.append(f"bubble {bubble:.0%}" if lay.pp > 1 else "no pipeline bubble")
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


def candidate_layouts(cfg: MegacannConfig, world: int, devices_per_node: int = 8) -> Iterator[Layout]:
    """Layouts of ``world`` ranks at the recipe's global batch (TP within a node; ZeRO only with dp > 1;
    the recipe's context-parallel size, which the sequence length calls for, is kept; expert parallelism
    of MoE families divides dp and the experts)."""
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
            for vpp, ep in ((v, e) for v in ((1, 2) if pp > 1 else (1,)) for e in experts):
                for micro_batch in _divisors(global_batch // dp):
                    m = global_batch // (dp * micro_batch)
                    for zero in ZERO_STAGES if dp > 1 else (0,):
                        for recompute in RECOMPUTE:
                            yield Layout(
                                tp, pp, dp, vpp, zero, recompute, micro_batch, m, tp > 1, zero == 2, cp, ep, *kept
                            )


def time_factor(cfg: MegacannConfig, layout: Layout) -> float:
    """Step time relative to an ideal layout (no recompute, no bubble, no TP)."""
    compute = 1.0 + recompute_extra_flops(cfg, layout.recompute) + (OFFLOAD_COST if layout.offload_optimizer else 0)
    compute += ZERO3_COST if layout.zero >= 3 else 0
    return compute / (1.0 - bubble_fraction(layout)) * (1.0 + TP_COST_PER_DOUBLING * math.log2(layout.tp))


def rank_layouts(
    cfg: MegacannConfig, world: int, device_memory: float, devices_per_node: int = 8, headroom: float = HEADROOM
) -> list[RankedLayout]:
    """Layouts whose largest stage fits ``device_memory`` bytes less ``headroom``, fastest estimate first."""
    budget = device_memory * (1.0 - headroom)
    ranked = []
    refused_stages: set[int] = set()  # ZeRO stages the recipe's validation refuses whatever the layout
    for layout in candidate_layouts(cfg, world, devices_per_node):
        if layout.zero in refused_stages:
            continue
        try:
            candidate = layout_config(cfg, layout, world)
        except (ConfigError, ValueError) as err:
            if "distributed.zero_optimization must be" in str(err):
                refused_stages.add(layout.zero)
            continue
        stages = estimate_stages(candidate, layout)
        if max(s.total for s in stages) > budget and not layout.offload_optimizer:
            layout = replace(layout, offload_optimizer=True)  # does it fit with the optimizer in host memory?
            candidate.optim.offload_optimizer = True
            stages = estimate_stages(candidate, layout)
        if max(s.total for s in stages) > budget:
            continue
        if layout.zero == 2 and stages == estimate_stages(
            candidate, replace(layout, zero=1, overlap_grad_reduce=False)
        ):
            continue  # ZeRO-2 saves nothing here (gradients accumulate in full): ZeRO-1 is listed
        extra = recompute_extra_flops(candidate, layout.recompute)
        ranked.append(RankedLayout(layout, stages, time_factor(candidate, layout), extra))
    ranked.sort(key=lambda r: (round(r.time_factor, 4), -r.layout.micro_batch, r.largest.total))
    return ranked
