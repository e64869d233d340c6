"""Token embedding with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann.layers import mappings
from megacann.layers.context import resolve_sequence_parallel
from megacann.layers.init import default_init_methods, make_parameter
from megacann.layers.sharding import InitMethod
from megacann.ops.weight_grad import embedding as deferrable_embedding


def pad_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by × tp_size``, so every TP shard has the same,
    aligned number of rows."""
    if vocab_size < 1 or tp_size < 1 or divisible_by < 1:
        raise ValueError(
            f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, tp_size={tp_size}, "
            f"divisible_by={divisible_by}"
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding of ids ``[b, s]`` into ``[b, s, embedding_dim]``, each TP rank holding a contiguous range of
    the (padded) vocabulary.

    Each rank looks up the ids in its range, writes zeros for the others, and the partial results are
    summed over the TP group; under ``sequence_parallel`` they are reduce-scattered instead, giving the
    ``[b, s/tp, embedding_dim]`` sequence shard. The weight's full shape is ``[padded_vocab, embedding_dim]``
    (``logical_size`` = ``num_embeddings``); the padding rows start at zero. Arguments left None come from
    the current :class:`~megacann.layers.context.LayerContext`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: Optional[InitMethod] = None,
        make_vocab_size_divisible_by: int = 128,
        sequence_parallel: Optional[bool] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        self.group = group
        self.tp_size = mappings.tp_world_size(group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = resolve_sequence_parallel(sequence_parallel)
        self.padded_vocab_size = pad_vocab_size(num_embeddings, self.tp_size, make_vocab_size_divisible_by)
        per_rank = self.padded_vocab_size // self.tp_size
        self.vocab_start = mappings.tp_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = make_parameter(
            (self.padded_vocab_size, embedding_dim),
            init_method or default_init_methods()[0],
            tp_rank=mappings.tp_rank(group),
            tp_size=self.tp_size,
            tp_dim=0,
            logical_size=num_embeddings,
            name=f"VocabParallelEmbedding padded vocabulary {self.padded_vocab_size}",
            dtype=dtype,
            device=device,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_vocab_size}), {self.embedding_dim}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(input_ids, self.weight, self.sequence_parallel, self.group)


def vocab_parallel_embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    sequence_parallel: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The lookup of :class:`VocabParallelEmbedding` with a given weight (this TP rank's rows of the padded
    vocabulary): what a module holding the weight under another role uses, e.g. multi-token prediction
    embedding with the last pipeline stage's tied copy held by its :class:`~megacann.layers.LMHead`.
    In a split backward's B the weight gradient waits for W (:mod:`megacann.ops.weight_grad`)."""
    tp_size = mappings.tp_world_size(group)
    if tp_size == 1:
        return deferrable_embedding(input_ids, weight)
    vocab_start = mappings.tp_rank(group) * weight.shape[0]
    outside = (input_ids < vocab_start) | (input_ids >= vocab_start + weight.shape[0])
    local_ids = (input_ids - vocab_start).masked_fill_(outside, 0)
    out = deferrable_embedding(local_ids, weight)
    out.masked_fill_(outside.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return mappings.reduce_scatter_to_sequence_parallel_region(out, group)
    return mappings.reduce_from_tensor_model_parallel_region(out, group, inplace=True)
