"""DeepSeek-V3.2's sparse attention step of a :class:`~megacann.layers.LatentAttention` with a
:class:`~megacann.layers.sparse_indexer.SparseIndexer`: the indexer scores every causal key of each query,
the attention reads the ``top_k`` best, and while training the indexer learns the attention's distribution
(its KL loss, kept in the layer's ``last_indexer_loss``).

On one process the keys are the sequence's own. Under context parallelism (``context_parallel_algo``
``allgather`` only) each rank holds its two chunks of the load-balanced layout; the index keys and the
attention's keys and values of every rank are all-gathered into sequence order, so each local query
scores, chooses and reads exactly the keys it would on one process (causal by its global position, within
its packed document). Their gradients are reduce-scattered back to the ranks that own those tokens. The
indexer loss is each rank's mean over its own queries: every rank holds as many, so the auxiliary losses'
weighting over the data x context-parallel ranks (:func:`megacann.models.contract.aux_loss_weight`)
makes their gradients those of the one-process mean. When nothing is chosen (warm-up, or ``top_k``
covering the sequence) the dense attention runs the layer's context-parallel algorithm as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.layers import mappings
from megacann.layers.attention import Rotary
from megacann.layers.context_parallel import (
    WHOLE_SEQUENCE_ALGO,
    context_parallel_gather,
    context_parallel_position_ids,
    require_whole_sequence_algo,
)
from megacann.layers.sparse_indexer import attention_distribution, indexer_kl_loss
from megacann.ops.reference import attention_mask

if TYPE_CHECKING:
    from megacann.layers.latent_attention import LatentAttention

INDEXED_CONTEXT_PARALLEL_ALGO = WHOLE_SEQUENCE_ALGO  # the one context-parallel algorithm sparse attention runs under


def _context_group(attention: LatentAttention) -> Optional[dist.ProcessGroup]:
    """The layer's context-parallel group when it has more than one rank (after checking its algorithm), else
    None."""
    group = attention.context_parallel_group or ps.get_context_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return None
    where = "LatentAttention: a sparse indexer (DeepSeek-V3.2)"
    needs = "each query picks its keys from the whole sequence"
    require_whole_sequence_algo(where, attention.context_parallel_algo, needs)
    return group


def _whole_sequence(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``x`` ``[b, s_local, ...]`` of every cp rank in sequence order, gradients summed back to the owners."""
    return x if group is None else context_parallel_gather(x, 1, group, sum_grads=True)


def readable_keys(
    local_len: int, segment_ids: Optional[torch.Tensor], group: Optional[dist.ProcessGroup], device: torch.device
) -> torch.Tensor:
    """True where a local query may read a key of the whole sequence: ``[s_local, s]`` (causal by global
    positions), or ``[b, 1, s_local, s]`` within packed documents (``segment_ids`` ``[b, s_local]``)."""
    if group is None:
        return attention_mask(local_len, True, segment_ids, device)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = local_len * size
    positions = context_parallel_position_ids(seq_len, size, rank, device)
    mask = torch.arange(seq_len, device=device).unsqueeze(0) <= positions.unsqueeze(1)
    if segment_ids is None:
        return mask
    every = context_parallel_gather(segment_ids, 1, group)
    return (mask & (segment_ids.unsqueeze(-1) == every.unsqueeze(-2))).unsqueeze(1)


def indexed_attention(
    attention: LatentAttention, hidden: torch.Tensor, rotary: Rotary, segment_ids: Optional[torch.Tensor]
) -> torch.Tensor:
    """Attention of ``attention``'s heads over the keys its indexer picks, ``[b, s_local, local heads,
    v_head_dim]``; records the indexer's loss while training (see the module docstring)."""
    group = _context_group(attention)
    indexer = attention.indexer
    x = attention.kv_a_proj_with_mqa.prepare_input(hidden)
    query_latent = attention.q_a_layernorm(attention.q_a_proj.forward_prepared(x))
    q = torch.cat(attention._queries(x, rotary, query_latent), -1)
    k, v = attention.expand_latent(*attention._latent(x, rotary))
    seq_len = q.shape[1] * (1 if group is None else dist.get_world_size(group))
    learn = attention.training and torch.is_grad_enabled() and attention.indexer_loss_coeff > 0
    sparse = not attention.indexer_dense and indexer.top_k < seq_len
    attention.last_indexer_loss = None
    if not (learn or sparse):  # every key read: the dense path
        return attention.dense_attention(q, k, v, segment_ids)
    allowed = readable_keys(q.shape[1], segment_ids, group, q.device)
    # the indexer reads detached inputs: its own loss alone trains it; without that loss no graph is built
    # (one never run backward would keep the scores' saved tensors alive under saved-tensor hooks)
    with torch.set_grad_enabled(learn):
        index_keys = _whole_sequence(indexer.keys(x.detach(), rotary, attention.rotary_interleaved), group)
        scores = indexer.scores(x.detach(), query_latent.detach(), rotary, attention.rotary_interleaved, index_keys)
    read = indexer.select(scores, allowed) if sparse else allowed
    keys = _whole_sequence(k, group)
    if sparse:
        out = attention.sparse_attention(q, keys, _whole_sequence(v, group), read)
    else:
        out = attention.dense_attention(q, k, v, segment_ids)
    if learn:
        target = attention_distribution(q, keys, read, attention.softmax_scale, mappings.tp_group(attention.group))
        attention.last_indexer_loss = attention.indexer_loss_coeff * indexer_kl_loss(scores, target, read)
    return out


__all__ = ["INDEXED_CONTEXT_PARALLEL_ALGO", "indexed_attention", "readable_keys"]
