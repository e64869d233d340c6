"""The parts of a training state (:class:`CheckpointParts`) as layout-free checkpoint keys.

    model/<name>                    whole logical weight, in the model's dtype; also every persistent
                                    buffer of a chunk (e.g. an MoE router's balancing bias), whole on
                                    every rank that holds it
    optim/<name>/<state>            whole logical fp32 optimizer state: exp_avg, exp_avg_sq (Adam),
                                    momentum_buffer (SGD), master (only where it is a separate copy:
                                    bf16 / fp16 runs, or a ZeRO master buffer)
    progress                        step, consumed samples (the data position), the loop's own counters,
                                    optimizer scalars (update count, loss scaler)
    rng/rank_<global rank>          every generator of that rank
    objective/rank_<global rank>    the training objective's own state on that rank, when it has one
                                    (e.g. the rollouts of a GRPO phase a checkpoint falls inside)

``<name>`` is the global parameter name (global layer indices); a pipeline stage's copy of a tied
embedding is stored under the name it copies (``embed_tokens.weight``). Each rank contributes the pieces
it holds (see :mod:`megacann.checkpoint.pieces`), and on loading asks for exactly the pieces its own
layout needs, so any layout loads any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from megacann import parallel_state as ps
from megacann.checkpoint.pieces import Piece, range_pieces, tensor_pieces
from megacann.checkpoint.planner import TensorPieces
from megacann.layers.fp8 import EXPERT_HISTORY
from megacann.layers.sharding import INIT_NAME_ATTR, ParamSharding, get_sharding

if TYPE_CHECKING:
    from megacann.optimizer import OptimizerBase, StateShard


class CheckpointFiles(Protocol):
    """Files saved into each checkpoint beside the weights, e.g. the run's tokenizer (so exports carry it;
    :class:`megacann.interop.TokenizerFiles`). ``key`` names their record in ``megacann.json``; nothing is
    saved when :meth:`record` gives None. Not restored by loading."""

    key: str

    def record(self) -> Optional[dict[str, Any]]:
        """What ``megacann.json`` says about the files under ``key``, or None to save nothing."""
        ...

    def write(self, directory: str, info: dict[str, Any]) -> list[str]:
        """Write the files into the checkpoint ``directory`` being saved (``info``: its ``megacann.json``);
        returns the paths written."""
        ...


@dataclass
class CheckpointParts:
    """What a checkpoint saves and restores, named explicitly, so any training loop can use it.

    ``model``: this rank's model chunks (parameters named by their global place). ``optimizer``: a megacann
    optimizer (plain or ZeRO), or None to save weights alone. ``step`` names the checkpoint;
    ``consumed_samples`` is the data position (samples of the global order used); ``progress`` holds the
    loop's other counters (JSON-like values). Loading updates ``step``, ``consumed_samples`` and
    ``progress`` in place and restores the weights, optimizer state and every RNG of the rank.
    ``files``: what else each checkpoint holds beside the weights (:class:`CheckpointFiles`, e.g. the run's
    tokenizer, so that exports carry it); not restored by loading.

    ``objective_state``: this rank's own state of the training objective (any picklable value, e.g. the
    rollouts of a GRPO phase), or None; loading sets it to what the checkpoint holds for this rank, or None.

    ``base`` (a LoRA run's): the frozen parameters come from this base (a JSON-like reference, e.g. path
    and fingerprint of ``model.init_from``) and are not saved; the checkpoint holds the trainable
    parameters and records the base, and loading checks that the base is the same.
    """

    model: Sequence[torch.nn.Module]
    optimizer: Optional[OptimizerBase] = None
    step: int = 0
    consumed_samples: int = 0
    progress: dict[str, Any] = field(default_factory=dict)
    files: Sequence[CheckpointFiles] = ()
    base: Optional[dict[str, Any]] = None
    objective_state: Any = None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters saved and loaded: all, or with a ``base`` only the trainable ones."""
        return [
            (name, param)
            for chunk in self.model
            for name, param in chunk.named_parameters()
            if self.base is None or param.requires_grad
        ]

    def state_shards(self) -> list[StateShard]:
        return self.optimizer.state_shards() if self.optimizer is not None else []


MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
PROGRESS_KEY = "progress"


def rng_key(rank: int) -> str:
    return f"rng/rank_{rank:05d}"


def objective_key(rank: int) -> str:
    return f"objective/rank_{rank:05d}"


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
    entry = entries.setdefault(key, TensorPieces(get_sharding(param).logical_shape, dtype))
    for piece in pieces:
        entry.add(piece)


def _aliases(view: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether an optimizer tensor lies in the parameter's own memory (fp32 masters without a copy)."""
    start = param.data_ptr()
    return view.dtype == param.dtype and start <= view.data_ptr() < start + param.numel() * param.element_size()


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``module`` keeps in its ``state_dict`` (not the caches it marks non-persistent), by name."""
    found = []
    for name, buffer in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            found.append((name, buffer))
    return found


def is_expert_buffer(name: str) -> bool:
    """Whether buffer ``name`` belongs to a routed expert (its delayed-scaling history): held, like the
    expert's weights, by the ranks of the expert-parallel group that hold that expert."""
    return name.rpartition(".")[2] == EXPERT_HISTORY


def model_entries(parts: CheckpointParts) -> dict[str, TensorPieces]:
    tp_rank, tp_size = _tp()
    entries: dict[str, TensorPieces] = {}
    for name, param in parts.named_parameters():
        _add(
            entries,
            model_key(name, param),
            param,
            param.dtype,
            tensor_pieces(param.data, get_sharding(param), tp_rank, tp_size),
        )
    for chunk in parts.model:  # buffers are whole (replicated) wherever they are held
        for name, buffer in persistent_buffers(chunk):
            whole = ParamSharding(tuple(buffer.shape))
            _add(entries, MODEL_PREFIX + name, buffer, buffer.dtype, tensor_pieces(buffer, whole, 0, 1))
    return entries


def _shard_pieces(shard: StateShard, flat: torch.Tensor) -> list[Piece]:
    tp_rank, tp_size = _tp()
    return range_pieces(flat, shard.start, shard.end, get_sharding(shard.param), tp_rank, tp_size)


def progress(parts: CheckpointParts) -> dict[str, Any]:
    optimizer = parts.optimizer.scalar_state() if parts.optimizer is not None else None
    return {
        "step": parts.step,
        "consumed_samples": parts.consumed_samples,
        "progress": dict(parts.progress),
        "optimizer": optimizer,
    }


def save_entries(parts: CheckpointParts) -> dict[str, TensorPieces]:
    """Every tensor piece this rank holds, by key (views of live memory)."""
    entries = model_entries(parts)
    for shard in parts.state_shards():
        for state, flat in shard.tensors.items():
            if state == "master" and _aliases(flat, shard.param):
                continue  # the model weights themselves
            _add(
                entries, optim_key(shard.name, shard.param, state), shard.param, flat.dtype, _shard_pieces(shard, flat)
            )
    return entries


@dataclass
class LoadRequest:
    """The pieces a rank asks for. ``weights_from_masters``: model keys not read, because their weights share
    memory with fp32 masters the checkpoint stores: the masters are read straight into the weights (which
    equal their masters once loaded), so nothing is read twice or held aside (no whole copy of the masters
    at any moment of a load); under ZeRO each rank reads its owned range and the gather joins them."""

    entries: dict[str, TensorPieces]
    weights_from_masters: set[str] = field(default_factory=set)


def load_request(parts: CheckpointParts, stored_keys: set[str]) -> LoadRequest:
    """The pieces this rank's layout needs. A master missing from the checkpoint (it was written in
    fp32) is read from the weights; a missing key otherwise is left for validation to report."""
    request = LoadRequest(model_entries(parts))
    for shard in parts.state_shards():
        for state, flat in shard.tensors.items():
            key = optim_key(shard.name, shard.param, state)
            if state == "master":
                if _aliases(flat, shard.param):
                    if key not in stored_keys:
                        continue  # loaded with the weights
                    request.weights_from_masters.add(model_key(shard.name, shard.param))
                elif key not in stored_keys:
                    key = model_key(shard.name, shard.param)
            _add(request.entries, key, shard.param, flat.dtype, _shard_pieces(shard, flat))
    for key in request.weights_from_masters:
        request.entries.pop(key, None)
    return request


@torch.no_grad()
def finish_load(parts: CheckpointParts, request: LoadRequest, loaded_progress: dict[str, Any]) -> None:
    """After the pieces were read: model weights from masters, counters."""
    if parts.optimizer is not None:
        parts.optimizer.reload_model_params()
        if loaded_progress.get("optimizer") is not None:
            parts.optimizer.load_scalar_state(loaded_progress["optimizer"])
    if "train_state" in loaded_progress:  # format 2: the trainer's counters in one dict
        loaded_progress = {**loaded_progress, **loaded_progress["train_state"]}
        loaded_progress["progress"] = {"skipped_steps": loaded_progress.pop("skipped_steps", 0)}
    parts.step = loaded_progress["step"]
    parts.consumed_samples = loaded_progress["consumed_samples"]
    parts.progress = dict(loaded_progress["progress"])
