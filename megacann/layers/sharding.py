"""How each parameter is split across ranks, recorded on the parameter itself.

Every parameter made by ``megacann.layers`` carries a :class:`ParamSharding`. ZeRO, gradient reduction,
checkpoint resharding and Hugging Face export read it, so none of them needs a case per layer:

- ``tp_dim``: the dimension split evenly across tensor-parallel ranks (None: replicated over TP);
- ``tp_blocks``: sizes of fused blocks along ``tp_dim`` in the full tensor, each split evenly across TP
  (e.g. a fused gate/up projection is two blocks); None means one block;
- ``tp_partial_grad``: replicated over TP, but each TP rank computes only part of its gradient (norm
  weights under sequence parallelism, kv projections replicated because kv heads < tp): the gradient
  must be summed over the TP group;
- ``logical_size``: the true size along ``tp_dim`` when the full tensor is padded (the vocabulary);
  rows past it are padding and are dropped when exporting or resharding;
- ``expert``: an expert-parallel parameter (reduced over the expert-data-parallel group);
- ``full_shape``: the shape of the whole, unsharded tensor.

Two more marks, for parameters that exist on two pipeline stages (the word embedding of the first stage
and its tied copy, the output layer of the last): both carry ``SHARED_EMBEDDING_ATTR`` (gradients summed
over the embedding group, so the two stay equal), and the copy carries ``DUPLICATE_ATTR`` (counted once in
the gradient norm; not a tensor of its own in a consolidated state). See :func:`mark_tied_across_stages`.

The module also fills a shard with its part of the parameter's initial values, drawn block by block
(:mod:`megacann.layers.block_draw`), so every layout starts from the same weights as one process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from megacann.layers.block_draw import draw_shard_

SHARDING_ATTR = "megacann_sharding"
INIT_ATTR = "megacann_init"
SHARED_EMBEDDING_ATTR = "megacann_shared_embedding"  # tied across pipeline stages: grads summed over them
DUPLICATE_ATTR = "megacann_duplicate"  # the other stage's copy of a tied parameter
# A parameter that must start equal to another one (the last stage's copy of a tied embedding) names that
# parameter here: initialisation seeds from that name, and checkpoints store the copy under it.
INIT_NAME_ATTR = "megacann_init_name"

InitMethod = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class ParamSharding:
    full_shape: tuple[int, ...]
    tp_dim: Optional[int] = None
    tp_blocks: Optional[tuple[int, ...]] = None
    tp_partial_grad: bool = False
    logical_size: Optional[int] = None
    expert: bool = False

    @property
    def is_tensor_parallel(self) -> bool:
        return self.tp_dim is not None

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape without padding (``logical_size`` along ``tp_dim``)."""
        shape = list(self.full_shape)
        if self.logical_size is not None and self.tp_dim is not None:
            shape[self.tp_dim] = self.logical_size
        return tuple(shape)

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.tp_dim] //= tp_size
        return tuple(shape)


def set_sharding(param: torch.Tensor, sharding: ParamSharding) -> torch.Tensor:
    setattr(param, SHARDING_ATTR, sharding)
    return param


def get_sharding(param: torch.Tensor) -> ParamSharding:
    """The parameter's sharding; a parameter made elsewhere counts as replicated."""
    found = getattr(param, SHARDING_ATTR, None)
    return found if found is not None else ParamSharding(tuple(param.shape))


def mark_partial_grad(param: torch.Tensor) -> torch.Tensor:
    """Flag a TP-replicated parameter whose gradient each TP rank computes only in part."""
    return set_sharding(param, replace(get_sharding(param), tp_partial_grad=True))


def mark_tied_across_stages(param: torch.Tensor, duplicate: bool) -> torch.Tensor:
    """Flag a parameter tied between the first and last pipeline stage; ``duplicate`` marks the copy."""
    setattr(param, SHARED_EMBEDDING_ATTR, True)
    if duplicate:
        setattr(param, DUPLICATE_ATTR, True)
    return param


def is_duplicate(param: torch.Tensor) -> bool:
    """True for the last stage's copy of a tied parameter (another rank holds the original)."""
    return bool(getattr(param, DUPLICATE_ATTR, False))


def _blocks(sharding: ParamSharding) -> tuple[int, ...]:
    assert sharding.tp_dim is not None
    return sharding.tp_blocks or (sharding.full_shape[sharding.tp_dim],)


def check_divisible(sharding: ParamSharding, tp_size: int, name: str = "parameter") -> None:
    if sharding.tp_dim is None:
        return
    for block in _blocks(sharding):
        if block % tp_size:
            raise ValueError(
                f"{name}: size {block} along dim {sharding.tp_dim} is not divisible by "
                f"tensor_model_parallel_size {tp_size}"
            )


def shard_tensor(full: torch.Tensor, sharding: ParamSharding, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full tensor (a copy, contiguous)."""
    if sharding.tp_dim is None or tp_size == 1:
        return full.clone()
    check_divisible(sharding, tp_size)
    pieces = []
    for block in torch.split(full, list(_blocks(sharding)), dim=sharding.tp_dim):
        pieces.append(torch.chunk(block, tp_size, dim=sharding.tp_dim)[tp_rank])
    return torch.cat(pieces, dim=sharding.tp_dim).contiguous()


def unshard_tensors(shards: list[torch.Tensor], sharding: ParamSharding) -> torch.Tensor:
    """Reassemble the full tensor from every TP rank's shard (inverse of :func:`shard_tensor`)."""
    if sharding.tp_dim is None or len(shards) == 1:
        return shards[0].clone()
    tp_size = len(shards)
    local_blocks = [b // tp_size for b in _blocks(sharding)]
    per_rank = [torch.split(s, local_blocks, dim=sharding.tp_dim) for s in shards]
    blocks = [
        torch.cat([per_rank[r][i] for r in range(tp_size)], dim=sharding.tp_dim) for i in range(len(local_blocks))
    ]
    return torch.cat(blocks, dim=sharding.tp_dim)


def init_sharded_(
    param: torch.Tensor,
    init_method: InitMethod,
    tp_rank: int,
    tp_size: int,
    generator_seed: Optional[int] = None,
) -> None:
    """Fill ``param`` with this TP rank's part of the whole tensor ``init_method`` draws block by block
    from ``generator_seed`` (None: a seed drawn from torch's CPU RNG): only the blocks this rank keeps
    are drawn, and every TP size gets the same values (:mod:`megacann.layers.block_draw`). A padded
    tensor (``logical_size`` set) is drawn at its logical size and padded with zeros, so the draw does
    not depend on the padding, which differs between TP sizes (the vocabulary)."""
    draw_shard_(param, get_sharding(param), init_method, generator_seed, tp_rank, tp_size)
