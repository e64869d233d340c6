"""Context parallelism: the sequence split across the ranks of the context-parallel (cp) group.

**Layout** (:mod:`.layout`). A sequence of length ``s`` is cut into ``2·cp`` equal chunks and cp rank
``i`` holds chunks ``i`` and ``2·cp-1-i`` (Megatron-Core's load-balanced layout), so every rank does the
same causal-attention work. :func:`context_parallel_split` takes a rank's share of any ``[b, s, ...]``
tensor, :func:`context_parallel_batch` of a whole micro-batch (what the pipeline schedules hand the
model), :func:`context_parallel_gather` puts the shares back in order, and
:func:`context_parallel_position_ids` names the global positions of a rank's tokens (for rotary
embeddings).

**Attention** (:mod:`.attention`). Every layer except attention works token by token, so attention is
what talks across the group (with the recurrent Gated DeltaNet, whose chunks hand their state on:
:mod:`.recurrent_state`). :func:`context_parallel_attention` takes this rank's ``q, k, v`` (and
``segment_ids`` of packed documents) in the layout above and returns this rank's output, causal, with
GQA, by one of:

- ``ring``: key/value blocks travel around the ring, overlapped with computation (:mod:`.blockwise`);
- ``allgather``: keys and values are all-gathered at once, then the same blockwise computation
  (backward gathers them again and reduce-scatters their gradients);
- ``ulysses``: all-to-all trades the sequence shards for head shards, each rank attends over the whole
  sequence with ``heads/cp`` heads, and a second all-to-all trades back (:mod:`.ulysses`).

A model picks the algorithm through its layer context (:class:`megacann.layers.LayerContext`, from the
recipe's ``distributed.context_parallel_algo``). See ``docs/context_parallel.md`` for when each wins.
"""

from megacann.layers.context_parallel.attention import (
    CONTEXT_PARALLEL_ALGORITHMS,
    WHOLE_SEQUENCE_ALGO,
    context_parallel_attention,
    require_whole_sequence_algo,
)
from megacann.layers.context_parallel.blockwise import blockwise_attention
from megacann.layers.context_parallel.layout import (
    context_parallel_batch,
    context_parallel_chunk_ids,
    context_parallel_gather,
    context_parallel_position_ids,
    context_parallel_split,
)
from megacann.layers.context_parallel.ulysses import ulysses_kv_repeat

__all__ = [
    "CONTEXT_PARALLEL_ALGORITHMS",
    "WHOLE_SEQUENCE_ALGO",
    "blockwise_attention",
    "context_parallel_attention",
    "context_parallel_batch",
    "context_parallel_chunk_ids",
    "context_parallel_gather",
    "context_parallel_position_ids",
    "context_parallel_split",
    "require_whole_sequence_algo",
    "ulysses_kv_repeat",
]
