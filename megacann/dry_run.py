"""The dry run: what a recipe would do (rank layout, batch, model size) without any device or collective."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, TextIO

from megacann.config import MegacannConfig
from megacann.models import padded_vocab_size, prepare_model_config
from megacann.models.mtp import mtp_depths
from megacann.pipeline import chunk_placements, pipeline_bubble_fraction
from megacann.pipeline.overlap import overlap_wanted
from megacann.pipeline.partition import recipe_placement
from megacann.pipeline.schedule_spec import schedule_for
from megacann.pipeline.simulate import schedule_summary
from megacann.rank_layout import RankLayout, rank_layout

GROUP_TITLES = (
    ("tp", "tensor-parallel"),
    ("pp", "pipeline"),
    ("dp", "data-parallel"),
    ("cp", "context-parallel"),
    ("dp_cp", "data x context-parallel (gradient reduction)"),
    ("ep", "expert-parallel"),
    ("embedding", "embedding (first+last stage)"),
)


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _fmt_groups(groups: list[list[int]]) -> str:
    return " ".join("[" + ",".join(str(r) for r in g) + "]" for g in groups)


def _fmt_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def _fmt_layers(ids: list[int]) -> str:
    if not ids:
        return "no layers"
    return f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}"


def describe_pipeline(cfg: MegacannConfig, layout: RankLayout) -> list[str]:
    """Which layers (and embedding, final norm, head) each pipeline stage and virtual chunk holds."""
    d, m = cfg.distributed, cfg.model
    pp, vpp, micro = d.pipeline_parallel_size, d.virtual_pipeline_size or 1, cfg.optim.grad_accum_steps
    in_flight: list[int] = []
    if pp == 1:
        schedule = "no pipelining (gradient accumulation)"
    else:
        how = "at once on two threads" if overlap_wanted(cfg) else "back to back"  # dualpipev_overlap
        name = schedule_for(d.pipeline_schedule, vpp).label.format(chunks=vpp, overlap=how)
        bubble, in_flight = schedule_summary(pp, micro, vpp, d.pipeline_schedule)
        if d.pipeline_schedule is None:
            bubble = pipeline_bubble_fraction(pp, micro, vpp)  # the simulator's figure, by the formula
        schedule = f"{name}, {micro} micro-batches, bubble {bubble:.1%}"
    lines = [f"-- pipeline: {pp} stage{'s' if pp > 1 else ''}, {schedule}"]
    tied = m.tie_word_embeddings
    head_beside_embedding = pp > 1 and recipe_placement(cfg).loss_stage(pp) == 0  # the V: both on stage 0
    for stage in range(pp):
        ranks = sorted(group[stage] for group in layout.groups["pp"])
        chunks = []
        placements = chunk_placements(cfg, stage)
        for placement in placements:
            parts = []
            if placement.pre_process:
                parts.append("embedding")
            parts.append(_fmt_layers(list(placement.layer_ids)))
            if placement.post_process:
                # the V holds the embedding in chunk 0 of this stage: its copies' gradients are summed here
                original = "chunk 0's" if head_beside_embedding else "stage 0's"
                if not tied:
                    head = "lm_head"
                elif pp == 1:
                    head = "lm_head = embedding (tied)"
                elif head_beside_embedding:
                    head = "lm_head (copy of chunk 0's tied embedding, gradients summed with it on this stage)"
                else:
                    head = "lm_head (copy of stage 0's tied embedding, gradients summed over the embedding group)"
                parts += ["final norm", head, "loss"]
                depths = mtp_depths(m)
                if depths:  # multi-token prediction: on the last stage, with the embedding it needs
                    copy = f", its embedding a copy of {original}" if pp > 1 and not tied else ""
                    parts.append(f"{depths} multi-token prediction depth{'s' if depths > 1 else ''}{copy}")
            chunks.append((f"chunk {len(chunks)}: " if len(placements) > 1 else "") + ", ".join(parts))
        peak = f"; at most {in_flight[stage]} micro-batch chunks in flight" if in_flight else ""
        lines.append(f"stage {stage} (ranks {_fmt_ranks(ranks)}): " + " | ".join(chunks) + peak)
    return lines


def describe_context_parallel(cfg: MegacannConfig) -> list[str]:
    """Each cp rank's share of a sequence (none without context parallelism)."""
    d = cfg.distributed
    cp, seq = d.context_parallel_size, cfg.data.seq_length
    if cp == 1:
        return []
    chunk, share = seq // (2 * cp), seq // cp
    line = (
        f"-- context parallel: cp {cp}, attention by {d.context_parallel_algo}; each sequence of {seq} tokens is "
        f"cut into {2 * cp} chunks of {chunk}, cp rank i holds chunks i and {2 * cp - 1}-i: {share} tokens per "
        f"rank ({1 / cp:.3g} of the activations)"
    )
    if d.sequence_parallel_active:
        line += f", {share // d.tensor_parallel_size} per rank between tensor-parallel layers (sequence parallel)"
    return [line, "the cp ranks of a data-parallel rank read the same samples; gradients are summed over dp x cp"]


def describe(cfg: MegacannConfig, recipe_path: Optional[str] = None) -> str:
    """The dry run's report as text."""
    spec = prepare_model_config(cfg)
    d, m = cfg.distributed, cfg.model
    smallest = d.tensor_parallel_size * d.pipeline_parallel_size * d.context_parallel_size * (d.data_parallel_size or 1)
    world = d.world_size or int(os.environ.get("WORLD_SIZE", 0)) or smallest  # unknown: the layout's smallest
    layout = rank_layout(
        world, d.tensor_parallel_size, d.pipeline_parallel_size, d.context_parallel_size, d.expert_parallel_size
    )
    lines = [f"== megacann dry run: {cfg.experiment.name}" + (f" ({recipe_path})" if recipe_path else "")]
    lines += ["-- resolved recipe", cfg.to_yaml().rstrip()]
    lines += [
        "-- parallel layout (rank order tp-cp-ep-dp-pp)",
        f"world {world} = tp {layout.tensor_model_parallel_size} x pp {layout.pipeline_model_parallel_size} "
        f"x dp {layout.data_parallel_size}"
        + (f" x cp {layout.context_parallel_size}" if layout.context_parallel_size > 1 else "")
        + (f" (ep {layout.expert_model_parallel_size} within dp)" if layout.expert_model_parallel_size > 1 else ""),
    ]
    for kind, title in GROUP_TITLES:
        groups = layout.groups[kind]
        if kind in ("cp", "ep") and len(groups[0]) == 1 or kind == "dp_cp" and layout.context_parallel_size == 1:
            continue
        lines.append(f"{title} groups ({len(groups)}): {_fmt_groups(groups)}")
    tokens = cfg.global_batch_size * cfg.data.seq_length
    lines += [
        "-- batch",
        f"micro-batch {cfg.data.batch_size} x data-parallel {layout.data_parallel_size} x grad_accum_steps "
        f"{cfg.optim.grad_accum_steps} = global batch {cfg.global_batch_size} sequences "
        f"({_fmt_int(tokens)} tokens at seq_length {cfg.data.seq_length})",
    ]
    lines += describe_context_parallel(cfg)
    lines += describe_pipeline(cfg, layout)
    lines.append("-- model")
    if m.vocab_size:
        total = spec.total_parameters(m)
        padded = padded_vocab_size(m.vocab_size, d.tensor_parallel_size, m.make_vocab_size_divisible_by)
        with_padding = spec.total_parameters(dataclasses.replace(m, vocab_size=padded))
        lines.append(
            f"{m.type}: {_fmt_int(total)} parameters ({total / 1e9:.2f} B); vocabulary {m.vocab_size} "
            f"padded to {padded} for tp {d.tensor_parallel_size}: {_fmt_int(with_padding)}"
        )
        active = spec.parameters_per_token(m)
        if active != total:
            lines.append(f"active per token: {_fmt_int(active)} parameters ({active / 1e9:.2f} B)")
        if cfg.lora:
            from megacann.training.finetune import lora_parameter_counts

            trainable, adapted = lora_parameter_counts(cfg, spec)
            lines.append(
                f"LoRA rank {cfg.lora_rank} on {cfg.lora_target_modules}: {_fmt_int(trainable)} trainable of "
                f"{_fmt_int(adapted)} ({100 * trainable / adapted:.2f}%); the base is frozen"
            )
    else:
        lines.append(f"{m.type}: parameter count needs the vocabulary size (taken from the tokenizer at run time)")
    lines.append(
        f"layers {m.num_layers}, hidden {m.hidden_size}, heads {m.num_attention_heads} (kv {m.kv_heads}), "
        f"ffn {m.ffn_size}, precision {m.precision}"
    )
    own_formulas = spec.rank_parameters is not None and spec.rank_parameters.activations is not None
    if m.vocab_size and spec.architecture is None and not own_formulas:
        static_only = spec.rank_parameters is not None  # planning.static_memory: weights, gradients, optimizer
        lines.append(
            f"-- memory per device: megacann-plan gives model.type {m.type!r} weights, gradients and optimizer "
            "state per stage, not its activations"
            if static_only
            else f"-- memory per device: megacann-plan has no formulas for model.type {m.type!r} yet"
        )
        if cfg.train_mode == "grpo":  # the rollouts' cache needs only the family's decode cache layout
            from megacann.planning.rl import generation_cache_line

            lines.append(generation_cache_line(cfg))
    elif m.vocab_size:
        lines += describe_memory(cfg, layout.data_parallel_size, spec.total_parameters(m))
    from megacann.planning.generation import generation_cache_lines

    lines += generation_cache_lines(cfg, d.tensor_parallel_size)
    return "\n".join(lines)


def describe_memory(cfg: MegacannConfig, dp: int, params: int) -> list[str]:
    """Per-device bytes of the recipe's layout, stage by stage, as ``megacann-plan`` estimates them: weights,
    gradients, optimizer state (by ZeRO stage), activations, and what offload keeps in host memory."""
    from megacann.planning import layout_of
    from megacann.planning.report import layout_lines

    lines = ["-- memory per device (megacann-plan's estimate; GB = 1e9 bytes)"]
    if cfg.lora:
        lines.append("LoRA: every parameter is counted as trained (gradients and optimizer state): an upper bound")
    return lines + layout_lines(cfg, dataclasses.replace(layout_of(cfg), dp=dp), params)[1:]


def print_dry_run(cfg: MegacannConfig, recipe_path: Optional[str] = None, out: Optional[TextIO] = None) -> None:
    print(describe(cfg, recipe_path), file=out)
