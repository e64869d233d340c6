"""Per-device memory of a layout, stage by stage, and its pipeline bubble, from the formulas module.

Activations are counted per micro-batch in flight: the stage's own schedule plan (the one the trainer
runs, from ``megacann.pipeline.plan``) is replayed, adding a model chunk's activations at each forward and
removing them at its backward, so 1F1B's ``pp - stage`` micro-batches on stage ``stage`` and interleaving's
extra chunks come out of the real schedule, not an approximation of it. The schedule is the layout's
(``Layout.schedule``, ``distributed.pipeline_schedule``): the zero-bubble ones free a micro-batch's
activations at its B and hold from its B to its W what B leaves for W (the deferred products' inputs and
output gradients, :mod:`megacann.planning.deferred`), and the V-shaped ones (zbv, dualpipev) place chunk 1
of stage s at segment 2p - 1 - s, the head on stage 0 beside the embedding.

``train_mode: dpo`` with a reference copy (``dpo.reference`` copy, or auto without LoRA) holds the starting
weights once more, built and sharded like the policy: its weights only (no gradients, no optimizer state,
never ZeRO-sharded). Its forward pass runs under ``no_grad`` before the policy's forward-backward, so it
saves no activations. ``adapters_off`` reuses the policy; ``precomputed`` holds 4 bytes per sequence of the
data (not counted: the planner does not read the data).

DeepSeek-V3.2's indexer warm-up (``indexer_warmup``) trains the indexers alone: the stage holds every weight,
but gradients and optimizer state only for its layers' (and MTP depths') indexers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from megacann.config import ConfigError, MegacannConfig
from megacann.models import get_model_spec
from megacann.models.mtp import mtp_depths
from megacann.pipeline import pipeline_bubble_fraction, stage_layer_ids
from megacann.pipeline.placement import LOOP
from megacann.pipeline.plan import Backward, BackwardInput, BackwardWeight, Forward, build_plan
from megacann.pipeline.rules import chunks_per_stage
from megacann.pipeline.schedule_spec import find_schedule, splits_backward
from megacann.pipeline.simulate import schedule_summary
from megacann.planning import mla
from megacann.planning.activations import (
    boundary_tensor_bytes,
    chunk_extra_terms,
    layer_activation_bytes,
    pipeline_buffer_bytes,
)
from megacann.planning.deferred import chunk_held_bytes
from megacann.planning.family_activations import activation_formulas, family_chunk_terms, family_layer_bytes
from megacann.planning.formulas import (
    Layout,
    architecture,
    chunk_parameters_per_rank,
    layer_kind,
    layer_parameters_per_rank,
    padded_vocab,
    query_width,
    weight_bytes_per_param,
)
from megacann.planning.placement import placed_static_bytes
from megacann.planning.static_memory import rank_formulas, refuse_activations, static_stage


@dataclass
class StageEstimate:
    """One pipeline stage's device (any of its TP / DP ranks): what it holds, in bytes at the peak."""

    stage: int
    holds: str
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float  # peak: saved tensors and pipeline buffers of the micro-batches in flight (a split
    # backward's: from B what W keeps, chunk_held), + recompute
    in_flight: int  # most chunk-forwards waiting for their backward (or W) at once
    chunk_saved: list[float] = field(default_factory=list)  # per chunk: bytes autograd saves for one micro-batch
    chunk_buffers: list[float] = field(default_factory=list)  # per chunk: pipeline executor's tensors per micro-batch
    recompute_transient: float = 0.0  # full recompute: one layer's activations rebuilt during backward
    expert_params: int = 0  # of ``params``: routed experts' (ZeRO shards them over dp / ep x cp)
    host_optimizer: float = 0.0  # optim.offload_optimizer: masters, state and gradient staging in host memory
    host_activations: float = 0.0  # peak of the offloaded layers' saved activations in host memory
    reference: float = 0.0  # DPO's frozen reference copy: its weights, sharded like the policy's
    chunk_held: list[float] = field(default_factory=list)  # per chunk: a split backward's B leaves for W (0: none)

    @property
    def host(self) -> float:
        return self.host_optimizer + self.host_activations

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.static + self.reference + self.activations


def _describe_layers(ids: list[int]) -> str:
    if not ids:
        return "no layers"
    return f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}"


def replay_in_flight(plan, chunk_bytes: list[float], after_b: Optional[list[float]] = None) -> tuple[float, int]:
    """(peak bytes, peak count) of the micro-batches' chunks alive while ``plan`` runs: ``chunk_bytes`` per
    chunk from its forward to its backward (or B), ``after_b`` (:func:`after_b_bytes`; default: the same
    bytes) from a split backward's B to its W."""
    after = chunk_bytes if after_b is None else after_b
    return _peak(_in_flight_profile(_activation_events(plan)), [*chunk_bytes, *after])


def after_b_bytes(saved: float, buffers: float, held: float, first: bool, last: bool, boundary: float) -> float:
    """What one micro-batch of a chunk holds from its B to its W: B frees the autograd graph, so what W's
    closures keep, B's gradients and the received one (``held``, :mod:`megacann.planning.deferred`) and the
    output the executor keeps for W (``boundary``, not on the last chunk); the model's first chunk runs no B
    (its W is the fused backward): its activations and buffers stay, with the received gradient."""
    if first:
        return saved + buffers + held
    return held + (0.0 if last else boundary)


F_TO_B, B_TO_W = 0, 1  # what an event makes or frees: a chunk's activations (F to B), what B leaves for W


def _activation_events(plan) -> tuple[tuple[int, int, int], ...]:
    """(+1 or -1, chunk, F_TO_B or B_TO_W) for each action that makes or frees a micro-batch's activations
    or what its B leaves for W."""
    events = []
    for action in plan:
        if isinstance(action, Forward):
            events.append((1, action.chunk, F_TO_B))
        elif isinstance(action, BackwardInput):
            events += [(-1, action.chunk, F_TO_B), (1, action.chunk, B_TO_W)]
        elif isinstance(action, Backward):
            events.append((-1, action.chunk, F_TO_B))
        elif isinstance(action, BackwardWeight):
            events.append((-1, action.chunk, B_TO_W))
    return tuple(events)


Profile = tuple[tuple[tuple[int, ...], ...], int]


@functools.lru_cache(maxsize=1024)
def _stage_profile(
    pp: int, stage: int, num_microbatches: int, virtual: Optional[int], schedule: Optional[str]
) -> Profile:
    """A stage's plan as its in-flight profile, built once per shape: the layout search asks again for
    every memory variant of the same pipeline."""
    return _in_flight_profile(_activation_events(build_plan(pp, stage, num_microbatches, virtual, schedule=schedule)))


def _in_flight_profile(events: tuple[tuple[int, int, int], ...]) -> Profile:
    """(the counts of micro-batches alive per chunk at each moment one could peak: between F and B for
    chunks 0..chunks-1, then between B and W for each; none below another in every count; the peak total
    count of chunks whose W has not run). The peak bytes for any bytes per chunk is the largest of these
    counts weighted by them, so replaying a plan is done once per shape, not once per layout."""
    chunks = 1 + max((chunk for _, chunk, _ in events), default=0)
    alive, moments, peak_count = [0] * (2 * chunks), set(), 0
    for sign, chunk, kind in events:
        alive[kind * chunks + chunk] += sign
        if sign > 0:
            moments.add(tuple(alive))
            peak_count = max(peak_count, sum(alive))
    kept = tuple(n for n in moments if not any(o != n and all(a >= b for a, b in zip(o, n)) for o in moments))
    return kept, peak_count


def _peak(profile: Profile, chunk_bytes: list[float]) -> tuple[float, int]:
    moments, peak_count = profile
    return max((sum(n * b for n, b in zip(counts, chunk_bytes)) for counts in moments), default=0.0), peak_count


def mtp_terms(cfg: MegacannConfig, layout: Layout) -> tuple[int, int, float]:
    """(parameters, expert parameters, bytes saved per micro-batch) of the multi-token prediction depths on
    the last chunk of one TP rank: per depth a layer of the last layer's kind, its norms and projection, its
    head's input and loss; with pipeline stages and an untied head, the embedding's copy."""
    m, depths = cfg.model, mtp_depths(cfg.model)
    if not depths:
        return 0, 0, 0.0
    h, tp, last = m.hidden_size, layout.tp, m.num_layers - 1
    params, experts = chunk_parameters_per_rank(cfg, tp, [last] * depths, False, False, layout.pp, layout.ep)
    params += depths * (3 * h + 2 * h * h // tp)
    if layout.pp > 1 and not m.tie_word_embeddings:
        params += padded_vocab(cfg, tp) // tp * h
    layer = layer_activation_bytes(cfg, layout, layout.recompute, *layer_kind(m, last))
    head = sum(chunk_extra_terms(cfg, layout, False, True, False).values())
    return params, experts, depths * (layer + head)


def reference_copy_bytes(cfg: MegacannConfig, params: int) -> float:
    """Bytes of DPO's or GRPO's frozen reference copy on a device whose policy holds ``params`` parameters:
    the weights in the model's dtype when the recipe builds a copy, else 0."""
    if cfg.train_mode == "grpo":
        from megacann.config.rl_keys import reference_kind as kind_of
    elif cfg.train_mode == "dpo":
        from megacann.training.preference import reference_kind as kind_of
    else:
        return 0.0
    return float(weight_bytes_per_param(cfg) * params) if kind_of(cfg) == "copy" else 0.0


def estimate_stage(
    cfg: MegacannConfig, layout: Layout, stage: int, held_per_kind: Optional[dict] = None
) -> StageEstimate:
    """One stage's estimate (``held_per_kind``: what B leaves for W per kind of layer, shared by the stages
    of one layout)."""
    m, d = cfg.model, cfg.distributed
    pp, schedule = layout.pp, layout.schedule
    spec, recipe_spec = find_schedule(schedule), find_schedule(d.pipeline_schedule)
    placement = spec.placement if spec is not None and pp > 1 else LOOP  # the V: the head on stage 0
    vpp = placement.chunks(layout.vpp)
    recipe_chunks = chunks_per_stage(d.pipeline_schedule, d.virtual_pipeline_size)
    recipe_placement = recipe_spec.placement if recipe_spec is not None else LOOP
    same_cut = (pp, vpp, placement) == (d.pipeline_parallel_size, recipe_chunks, recipe_placement)
    pipeline_layers = d.pipeline_layers if same_cut else None
    params, experts, saved, buffers, holds, transient, stage_layers = 0, 0, [], [], [], 0.0, 0
    offloaded, host_saved, unit = set(layout.offload_layers), [], 0
    split, held, after, boundary = splits_backward(schedule), [], [], boundary_tensor_bytes(cfg, layout)
    held_per_kind = {} if held_per_kind is None else held_per_kind
    kind_of, layer_bytes, chunk_extra, layer_parameters = _layer_formulas(cfg, layout)
    for chunk in range(vpp):
        ids = stage_layer_ids(m.num_layers, pp, stage, vpp, chunk, pipeline_layers, placement=placement)
        first, last = placement.is_model_first(stage, chunk), placement.is_model_last(pp, stage, chunk, vpp)
        stage_layers += len(ids) + (mtp_depths(m) if last else 0)
        chunk_params, chunk_experts = chunk_parameters_per_rank(cfg, layout.tp, ids, first, last, pp, layout.ep)
        params, experts = params + chunk_params, experts + chunk_experts
        kinds = [kind_of(i) for i in ids]
        firsts = {kind: i for i, kind in zip(reversed(ids), reversed(kinds))}  # one layer of each kind
        layers = {kind: layer_bytes(i, layout.recompute) for kind, i in firsts.items()}
        kept = [kind for i, kind in zip(ids, kinds) if i not in offloaded]
        moved = [kind for i, kind in zip(ids, kinds) if i in offloaded]
        saved.append(sum(layers[kind] for kind in kept) + chunk_extra(ids, kinds, first, last))
        host_saved.append(sum(layers[kind] for kind in moved))
        if moved:  # an offloaded layer's activations are on the device during its forward and its backward
            transient = max(transient, *(layers[kind] for kind in moved))
        if layout.zero >= 3:  # ZeRO-3 gathers the largest layer whole (one per kind of layer to count)
            unit = max([unit] + [sum(layer_parameters(m, layout.tp, i, layout.ep)) for i in firsts.values()])
        buffers.append(pipeline_buffer_bytes(cfg, layout, first, last))
        held.append(
            chunk_held_bytes(cfg, layout, ids, first, last, held_per_kind, [k[0] for k in kinds]) if split else 0.0
        )
        if layout.recompute == "full" and ids:  # backward re-runs one layer at a time
            transient = max(transient, *(layer_bytes(i, "none") for i in firsts.values()))
        if last and mtp_depths(m):
            mtp_params, mtp_experts, mtp_saved = mtp_terms(cfg, layout)
            params, experts, saved[-1] = params + mtp_params, experts + mtp_experts, saved[-1] + mtp_saved
        after.append(after_b_bytes(saved[-1], buffers[-1], held[-1], first, last, boundary))
        parts = (["embedding"] if first else []) + [_describe_layers(ids)] + (["output layer"] if last else [])
        parts += [f"{mtp_depths(m)} MTP depths"] if last and mtp_depths(m) else []
        holds.append(" + ".join(parts))
    profile = _stage_profile(pp, stage, layout.num_microbatches, layout.vpp if layout.vpp > 1 else None, schedule)
    peak, in_flight = _peak(profile, [*(a + b for a, b in zip(saved, buffers)), *after])
    host_peak = _peak(profile, host_saved)[0]
    formulas = rank_formulas(m)
    static = (
        placed_static_bytes(cfg, layout, params, experts, unit)
        if formulas is None
        else static_stage(cfg, layout, stage)
    )
    if (
        formulas is None and architecture(m).sparse_indexer and m.indexer_warmup
    ):  # the indexers alone have gradients and states
        trained = placed_static_bytes(cfg, layout, stage_layers * mla.indexer_parameters(m))
        static.update({key: trained[key] for key in ("grads", "optimizer", "host_optimizer")})
    return StageEstimate(
        stage,
        " | ".join(holds),
        params,
        static["weights"],
        static["grads"],
        static["optimizer"],
        peak + transient,
        in_flight,
        saved,
        buffers,
        transient,
        experts,
        static["host_optimizer"],
        host_peak,
        reference_copy_bytes(cfg, params),
        held,
    )


def _layer_formulas(cfg: MegacannConfig, layout: Layout):
    """(a layer's kind, its saved bytes under a recompute mode, a chunk's bytes besides its layers, its
    parameters per rank) from the decoder formulas, or from the family's own
    (:mod:`megacann.planning.family_activations`)."""
    m = cfg.model
    formulas = rank_formulas(m)
    if formulas is None:

        def chunk_extra(ids, kinds, first, last):
            reads_rotary = any(not linear for _, linear in kinds)  # a Gated DeltaNet takes no positions
            return sum(chunk_extra_terms(cfg, layout, first, last, reads_rotary).values())

        def layer_bytes(i, recompute):
            return layer_activation_bytes(cfg, layout, recompute, *layer_kind(m, i))

        return functools.partial(layer_kind, m), layer_bytes, chunk_extra, layer_parameters_per_rank
    if activation_formulas(m) is None:
        refuse_activations(m)
    if splits_backward(layout.schedule):
        raise ConfigError(
            f"model.type {m.type!r}: megacann-plan has no formulas for what a split backward's B leaves for W "
            f"in this family's layers (distributed.pipeline_schedule {layout.schedule!r}); plan it with 1f1b or "
            "interleaved"
        )

    def family_kind(i):  # (MoE layer, kind): the first element as the decoders' (split backward's key)
        return activation_formulas(m).moe(m, i) is not None, activation_formulas(m).kind(m, i)

    def family_extra(ids, kinds, first, last):
        return sum(family_chunk_terms(cfg, layout, first, last, bool(ids)).values())

    def family_bytes(i, recompute):
        return family_layer_bytes(cfg, layout, i, recompute)

    return family_kind, family_bytes, family_extra, formulas.layer


def estimate_stages(cfg: MegacannConfig, layout: Layout) -> list[StageEstimate]:
    """Every pipeline stage's estimate (stage 0 first)."""
    held_per_kind: dict = {}
    return [estimate_stage(cfg, layout, stage, held_per_kind) for stage in range(layout.pp)]


def bubble_fraction(layout: Layout) -> float:
    """The idle share of a step the dry run prints for this layout's schedule: the closed form for 1F1B and
    interleaved 1F1B, the simulator's for the split-backward schedules (zb1p, zbv, dualpipev)."""
    if layout.pp == 1:
        return 0.0
    if splits_backward(layout.schedule):
        return schedule_summary(layout.pp, layout.num_microbatches, None, layout.schedule)[0]
    return pipeline_bubble_fraction(layout.pp, layout.num_microbatches, layout.vpp)


def recompute_extra_flops(cfg: MegacannConfig, recompute: str) -> float:
    """Extra compute of recomputation as a share of a step's (PaLM-formula) FLOPs: ``full`` repeats every
    layer's forward (2 of the 6 FLOPs per parameter and token, and a third of the attention's), ``selective``
    only the attention core's forward. The step's FLOPs are the family's (MoE: the experts a token meets)."""
    m, s = cfg.model, cfg.data.seq_length
    vocab = m.vocab_size or 0
    total = get_model_spec(m.type).flops_per_token(m, s)
    attention = 12.0 * m.num_layers * query_width(m) * s  # per token, forward + backward
    matmul = (total - attention) / 6.0
    if recompute == "full":
        layers = matmul - vocab * m.hidden_size
        return (2.0 * layers + attention / 3) / total
    if recompute == "selective":
        return (attention / 3) / total
    return 0.0
