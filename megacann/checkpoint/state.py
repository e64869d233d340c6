"""A trainer's state as layout-free checkpoint keys.

    model/<name>                    whole logical weight, in the model's dtype
    optim/<name>/<state>            whole logical fp32 optimizer state: exp_avg, exp_avg_sq (Adam),
                                    momentum_buffer (SGD), master (only where it is a separate copy:
                                    bf16 / fp16 runs, or a ZeRO master buffer)
    progress                        step, consumed samples, skipped steps, optimizer scalars
                                    (update count, loss scaler); the LR schedule is a function of step
    rng/rank_<global rank>          every generator of that rank

``<name>`` is the global parameter name (global layer indices); a pipeline stage's copy of a tied
embedding is stored under the name it copies (``embed_tokens.weight``). Each rank contributes the pieces
it holds (see :mod:`megacann.checkpoint.pieces`), and on loading asks for exactly the pieces its own
layout needs, so any layout loads any other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megacann import parallel_state as ps
from megacann.checkpoint.pieces import Piece, logical_shape, range_pieces, tensor_pieces
from megacann.checkpoint.planner import TensorPieces
from megacann.layers.sharding import get_sharding
from megacann.models.decoder import INIT_NAME_ATTR

if TYPE_CHECKING:
    from megacann.optimizer import StateShard
    from megacann.training.trainer import Trainer

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
PROGRESS_KEY = "progress"


def rng_key(rank: int) -> str:
    return f"rng/rank_{rank:05d}"


def storage_name(name: str, param: torch.Tensor) -> str:
    """The name a parameter is stored under (a tied copy is stored as the tensor it copies)."""
    return getattr(param, INIT_NAME_ATTR, name)


def model_key(name: str, param: torch.Tensor) -> str:
    return MODEL_PREFIX + storage_name(name, param)


def optim_key(name: str, param: torch.Tensor, state: str) -> str:
    return f"{OPTIM_PREFIX}{storage_name(name, param)}/{state}"


def _tp() -> tuple[int, int]:
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _add(entries: dict[str, TensorPieces], key: str, param: torch.Tensor, dtype: torch.dtype, pieces: list[Piece]):
    entry = entries.setdefault(key, TensorPieces(logical_shape(get_sharding(param)), dtype))
    for piece in pieces:
        entry.add(piece)


def _aliases(view: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether an optimizer tensor lies in the parameter's own memory (fp32 masters without a copy)."""
    start = param.data_ptr()
    return view.dtype == param.dtype and start <= view.data_ptr() < start + param.numel() * param.element_size()


def _model_entries(trainer: Trainer) -> dict[str, TensorPieces]:
    tp_rank, tp_size = _tp()
    entries: dict[str, TensorPieces] = {}
    for name, param in trainer.named_params:
        _add(
            entries,
            model_key(name, param),
            param,
            param.dtype,
            tensor_pieces(param.data, get_sharding(param), tp_rank, tp_size),
        )
    return entries


def _shard_pieces(shard: StateShard, flat: torch.Tensor) -> list[Piece]:
    tp_rank, tp_size = _tp()
    return range_pieces(flat, shard.start, shard.end, get_sharding(shard.param), tp_rank, tp_size)


def progress(trainer: Trainer) -> dict[str, Any]:
    return {"train_state": asdict(trainer.state), "optimizer": trainer.optimizer.scalar_state()}


def save_entries(trainer: Trainer) -> dict[str, TensorPieces]:
    """Every tensor piece this rank holds, by key (views of live memory)."""
    entries = _model_entries(trainer)
    for shard in trainer.optimizer.state_shards():
        for state, flat in shard.tensors.items():
            if state == "master" and _aliases(flat, shard.param):
                continue  # the model weights themselves
            _add(
                entries, optim_key(shard.name, shard.param, state), shard.param, flat.dtype, _shard_pieces(shard, flat)
            )
    return entries


@dataclass
class LoadRequest:
    """The pieces a rank asks for, and copies to make once they are read (``(source, destination)``:
    masters that share memory with the weights are read aside, so the two never race)."""

    entries: dict[str, TensorPieces]
    copies_after: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def load_request(trainer: Trainer, stored_keys: set[str]) -> LoadRequest:
    """The pieces this rank's layout needs. A master missing from the checkpoint (it was written in
    fp32) is read from the weights; a missing key otherwise is left for validation to report."""
    request = LoadRequest(_model_entries(trainer))
    for shard in trainer.optimizer.state_shards():
        for state, flat in shard.tensors.items():
            key = optim_key(shard.name, shard.param, state)
            if state == "master":
                if _aliases(flat, shard.param):
                    if key not in stored_keys:
                        continue  # loaded with the weights
                    aside = torch.empty_like(flat)
                    request.copies_after.append((aside, flat))
                    flat = aside
                elif key not in stored_keys:
                    key = model_key(shard.name, shard.param)
            _add(request.entries, key, shard.param, flat.dtype, _shard_pieces(shard, flat))
    return request


@torch.no_grad()
def finish_load(trainer: Trainer, request: LoadRequest, loaded_progress: dict[str, Any]) -> None:
    """After the pieces were read: pending copies, model weights from masters, counters."""
    for source, destination in request.copies_after:
        destination.copy_(source)
    trainer.optimizer.reload_model_params()
    trainer.optimizer.load_scalar_state(loaded_progress["optimizer"])
    trainer.load_train_state_dict(loaded_progress["train_state"])
