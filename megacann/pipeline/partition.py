"""Which transformer layers live on which (virtual) pipeline stage, and building this rank's chunks."""

from __future__ import annotations

from typing import Optional, Union

import torch

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.models.spec import ChunkPlacement, ModelSpec, get_model_spec
from megacann.pipeline.overlap import LANE_ATTR
from megacann.pipeline.placement import LOOP, PLACEMENT_ATTR, Placement, V
from megacann.pipeline.schedule_spec import schedule_for, splits_backward
from megacann.pipeline.split_backward import prepare_split_backward


def stage_layer_ids(
    num_layers: int,
    pipeline_size: int,
    pipeline_rank: int,
    virtual_size: Optional[int] = None,
    virtual_rank: int = 0,
    pipeline_layers: Optional[list[int]] = None,
    v_shape: bool = False,
    placement: Optional[Placement] = None,
) -> list[int]:
    """Global layer indices held by model chunk ``virtual_rank`` of stage ``pipeline_rank``.

    Which model segment a chunk holds is the ``placement``'s (:mod:`megacann.pipeline.placement`; default
    the loop, or the V with ``v_shape``): on the loop chunk v of stage p is model segment v*pp + p, in the V
    (two chunks) chunk 0 of stage p is segment p and chunk 1 segment 2pp - 1 - p. ``pipeline_layers``
    lists the size of every segment in model order (pp x vpp entries); default: an even split.
    """
    placement = placement or (V if v_shape else LOOP)
    vpp = virtual_size or 1
    segments = pipeline_size * vpp
    if pipeline_layers is None:
        if num_layers % segments:
            raise ValueError(f"num_layers {num_layers} is not divisible by pipeline stages x virtual stages {segments}")
        pipeline_layers = [num_layers // segments] * segments
    if len(pipeline_layers) != segments or sum(pipeline_layers) != num_layers:
        raise ValueError(f"pipeline_layers {pipeline_layers} must list {segments} sizes summing to {num_layers}")
    segment = placement.segment(pipeline_size, pipeline_rank, virtual_rank, vpp)
    start = sum(pipeline_layers[:segment])
    return list(range(start, start + pipeline_layers[segment]))


def recipe_placement(cfg: MegacannConfig) -> Placement:
    """The placement of the recipe's schedule (one stage: the loop, whatever the schedule)."""
    d = cfg.distributed
    if d.pipeline_parallel_size < 2:
        return LOOP
    return schedule_for(d.pipeline_schedule, d.virtual_pipeline_size).placement


def chunk_placements(cfg: MegacannConfig, pipeline_rank: Optional[int] = None) -> list[ChunkPlacement]:
    """Where each model chunk of a pipeline stage sits (one chunk per virtual stage, two in the V of
    ``zbv`` and ``dualpipev``): its layers, and whether it holds the model's embedding and head (as the
    schedule's placement says: the last chunk of the last stage on the loop, chunk 1 of stage 0 in the V)."""
    d = cfg.distributed
    pp = d.pipeline_parallel_size
    stage = ps.get_pipeline_model_parallel_rank() if pipeline_rank is None else pipeline_rank
    placement = recipe_placement(cfg)
    vpp = placement.chunks(d.virtual_pipeline_size)
    return [
        ChunkPlacement(
            tuple(stage_layer_ids(cfg.model.num_layers, pp, stage, vpp, chunk, d.pipeline_layers, placement=placement)),
            pre_process=placement.is_model_first(stage, chunk),
            post_process=placement.is_model_last(pp, stage, chunk, vpp),
        )
        for chunk in range(vpp)
    ]


def build_model_chunks(
    cfg: MegacannConfig, spec: Optional[ModelSpec] = None, device: Optional[Union[torch.device, str]] = None
) -> list[torch.nn.Module]:
    """This rank's model chunks, built by the model family's spec (default: the recipe's ``model.type``);
    under a schedule that splits the backward, prepared for it (their products' weight gradients deferrable)."""
    spec = spec or get_model_spec(cfg.model.type)
    chunks = []
    for chunk, placement in enumerate(chunk_placements(cfg)):
        # chunk c's layers keep lane c's groups (megacann.pipeline.overlap); without lanes, the groups
        lane = chunk if ps.communication_lanes() > 1 else 0
        with ps.communication_lane(lane):
            chunks.append(spec.build(cfg, placement, device))
        setattr(chunks[-1], LANE_ATTR, lane)
        setattr(chunks[-1], PLACEMENT_ATTR, recipe_placement(cfg).kind)
    if splits_backward(cfg.distributed.pipeline_schedule):
        prepare_split_backward(chunks)
    return chunks
