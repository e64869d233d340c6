"""ZeRO stages 1, 2 and 3: fp32 master weights, optimizer state, (stage 2 and 3) gradients and (stage 3)
the weights themselves sharded over data parallelism (the data-parallel x context-parallel group, the one
gradients are reduced over). How a step runs (reduce-scatter, shard update, all-gather, overlap) is in
docs/zero.md; stage 3 gathers each unit's weights around its forward and backward (``units``).

In fp32 the master weights are the parameters' own owned ranges (no copy). Checkpoints see the state
through :meth:`DistributedOptimizer.state_shards` (views) and :meth:`DistributedOptimizer.shard_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann.config import MegacannConfig
from megacann.optimizer.clip_grads import global_grad_norm
from megacann.optimizer.grad_buffer import GradBuffer, GradBuffers, reduction_group, split_by_group
from megacann.optimizer.optimizer import (
    OptimizerBase,
    StateShard,
    build_inner_optimizer,
    init_optimizer_state,
    no_weight_decay,
    state_keys,
)
from megacann.optimizer.zero.grad_buffer import ShardedGradBuffer
from megacann.optimizer.zero.hybrid import HybridGroups
from megacann.optimizer.zero.layout import ShardRange, shard_ranges, shard_slice
from megacann.optimizer.zero.param_buffer import ForwardGatherHooks, ParamBuffer
from megacann.optimizer.zero.sharded_params import ShardedParams
from megacann.optimizer.zero.units import UnitHooks, UnitTypes, unit_modules


@dataclass
class _Shard:
    """This rank's optimizer shard of one buffer: flat fp32 tensors of ``buffer.shard_numel`` elements."""

    buffer: ShardedGradBuffer
    params: ParamBuffer | ShardedParams
    ranges: list[ShardRange]
    master: Optional[torch.Tensor]  # None: fp32 parameters are their own masters
    states: dict[str, torch.Tensor] = field(default_factory=dict)

    def master_view(self, r: ShardRange) -> torch.Tensor:
        if self.master is None:
            return self.params.master_view(r.buffer_start, r.shard_start, r.numel)
        return self.master[r.shard_start : r.shard_start + r.numel]


class DistributedOptimizer(OptimizerBase):
    """ZeRO-1/2/3 over this rank's trainable parameters; the same interface as ``MixedPrecisionOptimizer``.

    ``modules`` (the model chunks) are needed for ``distributed.overlap_param_gather`` (forward hooks) and
    for stage 3 (its units: each chunk, and in it each module of the classes ``sharding_units``, the model
    family's ``ModelSpec.sharding_units``). Stage 3 shards frozen parameters (``requires_grad=False``) too.
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        cfg: MegacannConfig,
        modules: Optional[list[torch.nn.Module]] = None,
        sharding_units: UnitTypes = (),
    ):
        super().__init__(named_params, cfg)
        d = cfg.distributed
        self.stage = d.zero_stage
        if self.stage not in (1, 2, 3):
            raise ValueError(f"DistributedOptimizer implements ZeRO stages 1, 2 and 3, got zero_stage {self.stage}")
        self.overlap_param_gather = d.overlap_param_gather
        if (self.overlap_param_gather or self.stage == 3) and modules is None:
            raise ValueError(
                "distributed.overlap_param_gather and zero_optimization 3 need the model's modules for their "
                "hooks: build_optimizer(cfg, named_params, modules=model_chunks)"
            )
        unit_of = None
        if self.stage == 3:
            unit_ids = unit_modules(modules, sharding_units)[1]
            unit_of = lambda p: unit_ids[id(p)]  # noqa: E731 (a bucket never spans two units)
        self.hybrid = HybridGroups(d.zero_shard_group_size) if d.zero_shard_group_size else None
        group_for = self.hybrid.group_for if self.hybrid else reduction_group
        self.grad_buffers = GradBuffers(
            self.model_params,
            self.bucket_size,
            pad_for_zero=True,
            overlap=d.overlap_grad_reduce,
            buffer_cls=ShardedGradBuffer,
            group_for=group_for,
            keep_full=self.stage == 1,
            unit_of=unit_of,
            replica_groups=self.hybrid.replica if self.hybrid else None,
        )
        names = {id(p): n for n, p in self.named_params}
        self.shards: list[_Shard] = []
        self.frozen: list[ShardedParams] = []  # stage 3: frozen weights, sharded alike (no gradient, no state)
        for buffer in self.grad_buffers.buffers:
            params = ShardedParams(buffer, buffer.rank) if self.stage == 3 else ParamBuffer(buffer, buffer.rank)
            master = None
            if params.dtype != torch.float32:
                master = torch.zeros(buffer.shard_numel, dtype=torch.float32, device=buffer.device)
                for bucket in buffer.buckets:
                    master[shard_slice(bucket, buffer.group_size)].copy_(params.owned(bucket))
            ranges = shard_ranges(buffer, buffer.rank, buffer.group_size, names)
            self.shards.append(_Shard(buffer, params, ranges, master))
        self._build_inner_optimizer(cfg)
        self._gather_hooks = self._unit_hooks = None
        if self.stage == 3:
            frozen = [p for _, p in named_params if not p.requires_grad]
            for (expert, _), members in split_by_group(frozen).items():
                group, size = group_for(expert)
                layout = GradBuffer(members, group, self.bucket_size, pad_to=size, persistent=False, unit_of=unit_of)
                self.frozen.append(ShardedParams(layout, dist.get_rank(group) if size > 1 else 0))
            storages = [s.params for s in self.shards] + self.frozen
            self._unit_hooks = UnitHooks(modules, storages, self.overlap_param_gather, sharding_units)
        elif self.overlap_param_gather:
            self._gather_hooks = ForwardGatherHooks(modules, self.model_params, self.finish_param_sync)

    def _build_inner_optimizer(self, cfg: MegacannConfig) -> None:
        """One fp32 piece per owned range, a view of the master shard with its gradient's view as .grad;
        Adam's moments are views of flat shard tensors too."""
        self.pieces: list[tuple[_Shard, ShardRange, torch.nn.Parameter]] = []
        for shard in self.shards:
            for r in shard.ranges:
                piece = torch.nn.Parameter(shard.master_view(r))
                piece.grad = shard.buffer.reduced_grad(r.param)
                self.pieces.append((shard, r, piece))
        if not self.pieces:
            raise ValueError(
                f"data-parallel rank owns no parameter elements under ZeRO ({len(self.model_params)} trainable "
                "parameters): use fewer data-parallel ranks or zero_optimization: false"
            )
        params = [piece for _, _, piece in self.pieces]
        self.optimizer = build_inner_optimizer(params, cfg, [not no_weight_decay(r.param) for _, r, _ in self.pieces])
        keys = state_keys(self.optimizer)
        for shard in self.shards:
            shard.states = {
                k: torch.zeros(shard.buffer.shard_numel, dtype=torch.float32, device=shard.buffer.device) for k in keys
            }
        slot = {id(piece): (shard, r) for shard, r, piece in self.pieces}

        def allocate(piece: torch.Tensor, key: str) -> torch.Tensor:
            shard, r = slot[id(piece)]
            return shard.states[key][r.shard_start : r.shard_start + r.numel]

        init_optimizer_state(self.optimizer, allocate)

    # -- the step -----------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        grads = [self.grad_buffers.reduced_grad(p) for p in self.model_params]
        groups = (self.hybrid.shard[False][0], self.hybrid.shard[True][0]) if self.hybrid else None
        return global_grad_norm(self.model_params, grads, sharded_over_data_parallel=True, shard_groups=groups)

    @torch.no_grad()
    def _copy_master_to_model(self) -> None:
        """Write the updated ranges into the model's parameters and all-gather them."""
        for shard in self.shards:
            if shard.master is not None:
                for bucket in shard.buffer.buckets:
                    size = shard.buffer.group_size
                    shard.params.owned(bucket).copy_(shard.master[shard_slice(bucket, size)])
            shard.params.gather(async_op=True)  # stage 3: frees the stale gathered buckets instead
        if not self.overlap_param_gather and self.stage < 3:
            self.finish_param_sync()

    def param_tensors(self) -> list[torch.Tensor]:
        """Stage 3: this rank's weight shards, and the parameters (their storage is empty unless gathered)."""
        shards = [s.params.shard for s in self.shards if isinstance(s.params, ShardedParams)]
        return shards + list(self.model_params)

    def finish_param_sync(self, params: Optional[list[torch.nn.Parameter]] = None) -> None:
        """Wait for the parameter all-gathers in flight (those of ``params``; default all). Stage 3 gathers
        every weight and keeps it until each unit's next forward frees it (a memory peak of the whole model,
        for checkpoints and exports)."""
        for shard in self.shards:
            shard.params.wait(params)
        for frozen in self.frozen:
            frozen.wait(params)

    # -- checkpointing ------------------------------------------------------------------------------
    def state_shards(self) -> list[StateShard]:
        """The optimizer state of every parameter range this rank owns (views; see :class:`StateShard`).
        Checkpointing reads the parameters too, so the gathers in flight are waited for first (not under
        stage 3, which would gather the whole model; the checkpointer calls ``finish_param_sync`` itself)."""
        if self.stage < 3:
            self.finish_param_sync()
        return [
            StateShard(
                r.name,
                r.param,
                r.param_start,
                r.param_end,
                {
                    "master": piece.detach(),
                    **{k: v[r.shard_start : r.shard_start + r.numel] for k, v in shard.states.items()},
                },
            )
            for shard, r, piece in self.pieces
        ]

    def shard_layout(self, dp_rank: Optional[int] = None) -> list[dict[str, Any]]:
        """Per buffer: its group size, buckets and the parameter ranges ``dp_rank`` (default this rank) owns,
        as plain data; every rank can compute every other rank's layout (for resharding)."""
        names = {id(p): n for n, p in self.named_params}
        layout = []
        for shard in self.shards:
            b = shard.buffer
            rank = b.rank if dp_rank is None else dp_rank
            layout.append(
                {
                    "dp_size": b.group_size,
                    "dp_rank": rank,
                    "dtype": str(shard.params.dtype),
                    "numel": b.numel,
                    "shard_numel": b.shard_numel,
                    "buckets": [(bucket.start, bucket.end) for bucket in b.buckets],
                    "ranges": [r.describe() for r in shard_ranges(b, rank, b.group_size, names)],
                }
            )
        return layout

    def reload_model_params(self) -> None:
        """After masters were loaded in place: write them into the parameters and all-gather (waited).
        Stage 3 first keeps its ranges of frozen weights loaded into gathered buckets."""
        for frozen in self.frozen:
            frozen.absorb_gathered()
        self._copy_master_to_model()
        if self.stage < 3:
            self.finish_param_sync()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards (copies) and scalars, for a checkpoint of the same layout."""
        return {
            "zero_layout": self.shard_layout(),
            "scalars": self.scalar_state(),
            "shards": [{k: t.clone() for k, t in s.tensors.items()} for s in self.state_shards()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["zero_layout"] != self.shard_layout():
            raise ValueError("ZeRO state was saved under another layout (data-parallel size, buckets or parameters)")
        with torch.no_grad():
            for shard, saved in zip(self.state_shards(), state["shards"]):
                for key, tensor in shard.tensors.items():
                    tensor.copy_(saved[key])
        self.load_scalar_state(state["scalars"])
        self.reload_model_params()
