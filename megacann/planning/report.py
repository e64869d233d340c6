"""megacann-plan's report: the model unsharded, the recipe's layout stage by stage, and ranked layouts."""

from __future__ import annotations

from typing import Optional

from megacann.config import ConfigError, MegacannConfig
from megacann.models import get_model_spec
from megacann.pipeline.schedule_spec import splits_backward
from megacann.planning.activations import layer_activation_bytes
from megacann.planning.estimate import StageEstimate, bubble_fraction, estimate_stages
from megacann.planning.family_activations import activation_formulas, family_layer_bytes
from megacann.planning.formulas import (
    DTYPE_BYTES,
    Layout,
    layer_kind,
    layout_of,
    moe_structure,
    optimizer_bytes_per_param,
    unsharded_bytes,
)
from megacann.planning.generation import generation_cache_lines
from megacann.planning.search import HEADROOM, rank_layouts
from megacann.planning.static_memory import rank_formulas, static_stages

GB = 1e9


def _gb(n: float) -> str:
    """GB with one decimal, or three below 1 GB (small models stay readable)."""
    return f"{n / GB:.1f}" if n >= GB else f"{n / GB:.3f}"


def stage_table(stages: list[StageEstimate]) -> list[str]:
    """One row per stage; a ``reference`` column (DPO's frozen copy, in ``total``) when the recipe builds one,
    a ``host`` column (offloaded bytes, not in ``total``) when anything is offloaded."""
    host = any(s.host for s in stages)
    reference = any(s.reference for s in stages)
    header = f"{'stage':<6}{'params/device':>15}{'weights':>9}{'grads':>8}{'optimizer':>11}"
    header += (f"{'reference':>11}" if reference else "") + f"{'activations':>13}{'total':>8}"
    lines = [header + (f"{'host':>8}" if host else "") + "  holds"]
    for s in stages:
        act = f"{_gb(s.activations)} ({s.in_flight})"
        lines.append(
            f"{s.stage:<6}{s.params:>15,}{_gb(s.weights):>9}{_gb(s.grads):>8}{_gb(s.optimizer):>11}"
            + (f"{_gb(s.reference):>11}" if reference else "")
            + f"{act:>13}{_gb(s.total):>8}"
            + (f"{_gb(s.host):>8}" if host else "")
            + f"  {s.holds}"
        )
    return lines


def reference_line(cfg: MegacannConfig, stages: list[StageEstimate]) -> Optional[str]:
    """What DPO's reference policy costs the devices (GRPO: and its generation cache; None outside them)."""
    if cfg.train_mode == "grpo":
        from megacann.planning.rl import rl_memory_lines

        return "\n".join(rl_memory_lines(cfg, _gb(max(s.reference for s in stages))))
    if cfg.train_mode != "dpo":
        return None
    from megacann.training.preference import reference_kind

    kind = reference_kind(cfg)
    if kind == "copy":
        largest = max(stages, key=lambda s: s.reference)
        return (
            f"DPO reference: a frozen copy of the starting weights, sharded like the policy: {_gb(largest.reference)} "
            f"GB on stage {largest.stage}'s devices (weights only: no gradients or optimizer state; in the total)"
        )
    return {
        "none": "DPO reference: none (simpo is reference-free)",
        "adapters_off": "DPO reference: the policy's frozen base with the adapters off: no memory of its own",
        "precomputed": "DPO reference: precomputed log-probabilities, 4 bytes per sequence of the data (not counted)",
    }[kind]


def unsharded_lines(cfg: MegacannConfig, params: int) -> list[str]:
    m = cfg.model
    u = unsharded_bytes(cfg, params)
    a = DTYPE_BYTES[m.precision]
    master = "fp32 master 4 + " if m.precision != "fp32" else ""
    state = "momentum 4" if cfg.optim.name == "sgd" else "Adam moments 8"
    total = u["weights"] + u["grads"] + u["optimizer"]
    lines = [
        f"weights {_gb(u['weights'])} GB ({m.precision}, {a} B/param) + gradients {_gb(u['grads'])} GB (fp32 "
        f"buffers, 4 B/param) + optimizer {_gb(u['optimizer'])} GB ({master}{state} B/param) = {_gb(total)} GB "
        f"({a + 4 + optimizer_bytes_per_param(cfg)} B/param)"
    ]
    if m.precision != "fp32" and cfg.optim.name != "sgd":
        lines.append(
            f"the ZeRO paper's count (2 + 2 + 12 = 16 B/param, bf16 gradients): {_gb(u['paper_total'])} GB; "
            f"for a round {params / 1e9:.0f}e9 parameters: {_gb(16 * round(params / 1e9) * 1e9)} GB"
        )
    return lines


def layout_lines(cfg: MegacannConfig, layout: Layout, params: int) -> list[str]:
    """The recipe's layout: per-stage table, largest stage, how it divides the unsharded memory, bubble."""
    stages = estimate_stages(cfg, layout)
    largest = max(stages, key=lambda s: s.total)
    u = unsharded_bytes(cfg, params)
    whole = u["weights"] + u["grads"] + u["optimizer"]
    lines = [f"-- the recipe's layout: {layout.describe()} (world {layout.world_size})"]
    lines += stage_table(stages)
    lines.append(
        f"largest: stage {largest.stage}, {_gb(largest.total)} GB per device (activations: peak of the "
        f"micro-batches in flight, their count in brackets)"
    )
    ways = layout.tp * layout.pp
    split = f"tp {layout.tp} x pp {layout.pp} split the parameters {ways} ways" if ways > 1 else "no model parallelism"
    if layout.ep > 1:
        split += f"; ep {layout.ep} spreads the routed experts"
    cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
    shards = f"dp {layout.dp}{cp}" + (
        f", the experts' by dp / ep {layout.dp // layout.ep}{cp}" if layout.ep > 1 else ""
    )
    if layout.zero_group:
        shards = f"hybrid groups of {layout.zero_shards} (replicated across groups)"
    what = "weights, gradients and optimizer state" if layout.zero >= 3 else "the optimizer state"
    zero = f"; ZeRO-{layout.zero} divides {what} by {shards}" if layout.zero else ""
    lines.append(
        f"weights + gradients + optimizer: {_gb(whole)} GB unsharded -> {_gb(largest.static)} GB on stage "
        f"{largest.stage}'s devices ({split}{zero})"
    )
    reference = reference_line(cfg, stages)
    if reference:
        lines.append(reference)
    if layout.offload_optimizer:
        lines.append(
            f"optimizer offload: fp32 masters, state and gradient staging in host memory, "
            f"{_gb(largest.host_optimizer)} GB per device on stage {largest.stage} (not in the device total)"
        )
    if layout.offload_layers:
        lines.append(
            f"activation offload: layers {list(layout.offload_layers)} keep their saved activations in host "
            f"memory, peak {_gb(max(s.host_activations for s in stages))} GB per device (not in the device total)"
        )
    for label, by_recompute in layer_kind_activations(cfg, layout).items():
        lines.append(
            f"activations per {label}layer and micro-batch: "
            + ", ".join(f"{r} {by_recompute[r] / 2**20:,.{_digits(by_recompute)}f} MiB" for r in by_recompute)
            + f" (recipe: {layout.recompute})"
        )
    if layout.cp > 1:
        share = cfg.data.seq_length // layout.cp
        lines.append(
            f"context parallel: cp {layout.cp}, {share} of every {cfg.data.seq_length} tokens per rank: "
            f"activations {1 / layout.cp:.3g} of one rank's"
        )
    if layout.pp > 1:
        m, v = layout.num_microbatches, layout.vpp
        kind = f"interleaved 1F1B ({v} chunks per stage)" if v > 1 else "1F1B"
        if splits_backward(layout.schedule):  # its bubble simulated, as the dry run prints it
            kind = layout.schedule
        lines.append(f"pipeline: {kind}, {m} micro-batches, bubble {bubble_fraction(layout):.1%}")
        if splits_backward(layout.schedule):
            held = ", ".join(f"chunk {c} {b / 2**20:,.1f} MiB" for c, b in enumerate(largest.chunk_held))
            lines.append(
                f"split backward: B leaves for W per micro-batch on stage {largest.stage}: {held} (inputs and "
                "gradients W's closures keep, the received gradient; held from B to W instead of the activations)"
            )
    else:
        lines.append("pipeline: none (no bubble)")
    return lines


def _digits(by_recompute: dict[str, float]) -> int:
    """MiB with no decimals, or three when the smallest is under 10 MiB (small models stay readable)."""
    return 0 if min(by_recompute.values()) >= 10 * 2**20 else 3


def layer_kind_activations(cfg: MegacannConfig, layout: Layout) -> dict[str, dict[str, float]]:
    """{a kind of layer's label (ending in a space): its bytes per micro-batch under none, selective and full
    recompute}: dense and MoE, attention and Gated DeltaNet layers, or the kinds a family's own formulas name."""
    m, modes = cfg.model, ("none", "selective", "full")
    formulas = activation_formulas(m)
    if formulas is not None:
        firsts = {formulas.kind(m, i): i for i in reversed(range(m.num_layers))}
        return {
            f"{kind} ": {r: family_layer_bytes(cfg, layout, i, r) for r in modes}
            for kind, i in sorted(firsts.items(), key=lambda item: item[1])
        }
    moe = moe_structure(m)
    kinds = sorted({layer_kind(m, i) for i in range(m.num_layers)})
    linear = any(is_linear for _, is_linear in kinds)
    out = {}
    for kind in kinds:  # dense layers, MoE layers; attention, Gated DeltaNet layers
        mixer = ("Gated DeltaNet " if kind[1] else "attention ") if linear else ""
        label = f"{mixer}{'MoE ' if kind[0] else 'dense ' if moe else ''}"
        out[label] = {r: layer_activation_bytes(cfg, layout, r, *kind) for r in modes}
    return out


def static_only_lines(cfg: MegacannConfig, layout: Layout, device_memory_gb: Optional[float]) -> list[str]:
    """A family with static formulas only: weights, gradients and optimizer state per stage; activations
    refused by name."""
    if device_memory_gb is not None:
        raise ConfigError(
            f"--device_memory_gb is refused for model.type {cfg.model.type!r}: ranking layouts needs activation "
            "formulas, which this family has not yet (megacann-plan gives its static memory per stage)"
        )
    lines = [f"-- the recipe's layout: {layout.describe()} (world {layout.world_size})"]
    lines.append(f"{'stage':<6}{'params/device':>15}{'weights':>9}{'grads':>8}{'optimizer':>11}{'static':>8}")
    for i, s in enumerate(static_stages(cfg, layout)):
        static = s["weights"] + s["grads"] + s["optimizer"]
        lines.append(
            f"{i:<6}{s['params']:>15,}{_gb(s['weights']):>9}{_gb(s['grads']):>8}{_gb(s['optimizer']):>11}"
            f"{_gb(static):>8}"
        )
    if cfg.train_mode == "grpo":  # the rollouts' cache, as the dry run prints it
        from megacann.planning.rl import generation_cache_line

        lines.append(generation_cache_line(cfg))
    lines.append(
        f"activations: not estimated for model.type {cfg.model.type!r} (no formulas yet for its blocks): add "
        "them to the static memory above"
    )
    return lines


def plan_report(
    cfg: MegacannConfig,
    recipe_path: Optional[str],
    world_size: int,
    device_memory_gb: Optional[float],
    devices_per_node: int = 8,
    top: int = 10,
) -> str:
    """The whole report; ``cfg`` is the validated recipe (vocab_size set)."""
    m = cfg.model
    spec = get_model_spec(m.type)
    params = spec.total_parameters(m)
    active = spec.parameters_per_token(m)
    layout = layout_of(cfg)
    lines = [
        f"== megacann plan: {cfg.experiment.name}" + (f" ({recipe_path})" if recipe_path else "") + "; GB = 1e9 bytes"
    ]
    lines.append(
        f"model: {m.type}, {params:,} parameters ({params / 1e9:.2f} B"
        + (f"; {active:,} active per token" if active != params else "")
        + f"), {m.num_layers} layers, {m.precision}; "
        f"seq {cfg.data.seq_length}, micro-batch {cfg.data.batch_size} x {cfg.optim.grad_accum_steps} per step, "
        f"global batch {cfg.global_batch_size}"
    )
    lines.append("-- on one device, nothing sharded")
    lines += unsharded_lines(cfg, params)
    if rank_formulas(m) is not None and activation_formulas(m) is None:  # static memory only: no activation formulas
        lines += static_only_lines(cfg, layout, device_memory_gb) + generation_cache_lines(cfg, layout.tp)
        return "\n".join(lines)
    lines += layout_lines(cfg, layout, params)
    lines += generation_cache_lines(cfg, layout.tp)
    if device_memory_gb is None:
        lines.append("-- give --device_memory_gb (and --world_size) to list the layouts that fit")
        return "\n".join(lines)
    budget = device_memory_gb * GB * (1 - HEADROOM)
    ranked = rank_layouts(cfg, world_size, device_memory_gb * GB, devices_per_node)
    lines.append(
        f"-- layouts of {world_size} devices with {device_memory_gb:g} GB each (budget {_gb(budget)} GB after "
        f"{HEADROOM:.0%} headroom), global batch {cfg.global_batch_size}, fastest estimate first "
        f"({len(ranked)} fit)"
    )
    if not ranked:
        lines.append("none fits: more devices, more memory per device, or a shorter sequence / smaller batch")
    for i, entry in enumerate(ranked[:top], 1):
        lines.append(f"{i:>2}. {entry.layout.describe()}: {entry.reason(budget)}")
    return "\n".join(lines)
