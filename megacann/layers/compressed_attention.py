"""DeepSeek-V4's attention block: shared-KV multi-query attention over a sliding window, plus compressed
entries of the whole past for the compressed layer types.

Every layer type reads the same local branch. Queries come through a low-rank path (``q_a_proj``, the
RMSNorm ``q_a_norm``, ``q_b_proj`` up to every head, then an unweighted RMSNorm per head); one KV head
(``kv_proj``, the RMSNorm ``kv_norm``) is read as both key and value. The trailing ``qk_rope_head_dim``
channels of queries and the KV head are rotated (interleaved pairs); since the value carries that
rotation too, the output's rope slice is rotated back (``cos, -sin``) at the query's position, so what a
key contributes depends on the distance only. Each query sees its last ``sliding_window`` tokens, and each
head has a learned sink logit (``sinks``, fp32) in its softmax; scores are scaled by ``head_dim ** -0.5``.
The heads go out through the grouped low-rank projection (``o_a_proj``, ``o_b_proj``).

``layer_type`` adds the long range (transformers' ``layer_types``):

- ``sliding_attention``: nothing more; rotary tables of the ``main`` rope (``rope_theta``).
- ``heavily_compressed_attention`` (HCA): a :class:`WindowCompressor` (``compressor``) turns every
  ``compress_rate`` tokens into one entry; a query reads every entry whose window has closed.
- ``compressed_sparse_attention`` (CSA): the overlapping compressor, and its lightning indexer
  (``compressor.indexer``, a :class:`CompressedIndexer`) picks the ``index_topk`` entries each query reads.

The compressed types use the ``compress`` rope (``compress_rope_theta`` and ``rope_scaling``, YaRN) for
their queries, keys and compressor alike. The entries join the local keys on the KV axis. The indexer's
picks are not differentiable: its parameters get no gradient from this layer (as in transformers).

Parameter names are transformers' ``DeepseekV4Attention``'s, so weights map by name. Tensor parallelism
splits the heads (``q_b_proj`` by rows, ``sinks``, whole groups of the output projection); the down
projection, the KV head, the norms and the compressor are whole on every rank and see the whole sequence
(gathered under sequence parallelism), their gradients partial per rank (``tp_partial_grad``). While
generating, the layer's ``kv_cache`` (:mod:`megacann.generation.compressed_cache`) keeps each token's
rotated KV head and compressor projections. Context parallelism runs by all-gather only
(:mod:`megacann.layers.compressed_context_parallel`). Packed documents (``segment_ids``) are refused on the
compressed types, whose windows would pool tokens of neighbouring documents.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.layers import mappings
from megacann.layers.compressed_context_parallel import (
    check_context_parallel_algo,
    context_parallel_compressed_attention,
    windowed_attention,
)
from megacann.layers.compressed_indexer import CompressedIndexer, chosen_entries_bias
from megacann.layers.context import current_layer_context
from megacann.layers.context_parallel import context_parallel_position_ids
from megacann.layers.grouped_output_projection import GroupedOutputProjection
from megacann.layers.init import default_init_methods, init_zeros, make_parameter
from megacann.layers.linear import ColumnParallelLinear
from megacann.layers.norm import RMSNorm
from megacann.layers.random import checkpoint
from megacann.layers.rotary import RotaryEmbedding, rotate_trailing
from megacann.layers.sharding import InitMethod, mark_partial_grad
from megacann.layers.window_compressor import WindowCompressor, compressed_causal_bias


class CompressedCacheLayer(Protocol):
    """One layer's cache while generating: ``attend(attention, q, kv, x, q_residual, position_ids)`` stores
    this forward's tokens and returns the attention of ``q`` ``[b, s, local heads, d]`` over its row's
    window of local keys and compressed entries (before the inverse rotation)."""

    def attend(
        self,
        attention: CompressedSparseAttention,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor: ...


SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, the statistic in fp32 (each query head, no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedSparseAttention(torch.nn.Module):
    """``forward(hidden [b, s_local, h], position_ids [b, s] | None, segment_ids [b, s] | None) -> [b, s_local, h]``.

    ``position_ids`` cover the whole sequence (default ``0 .. s-1``); under sequence parallelism ``hidden``
    is this rank's part of it. ``segment_ids`` (packed documents) only on ``sliding_attention``. Arguments
    are transformers' ``DeepseekV4Config`` keys; ``rope_scaling`` is its ``rope_parameters["compress"]``
    (read by the compressed types only), ``compress_rate`` its ``compress_rates[layer_type]``,
    ``init_std`` the compressor's and indexer's initial std. ``recompute_core_attention`` recomputes in
    backward, while training, the attention over the window and the compressed entries (the compressor and
    indexer included; default: the layer context's ``recompute == "selective"``). Left None,
    ``sequence_parallel``, the init methods, ``dtype`` and ``device`` come from the current layer context.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        head_dim: int,
        *,
        layer_type: str,
        q_lora_rank: int,
        qk_rope_head_dim: int,
        o_groups: int,
        o_lora_rank: int,
        sliding_window: int,
        rope_theta: float = 10000.0,
        compress_rope_theta: float = 160000.0,
        rope_scaling: Optional[dict[str, Any]] = None,
        compress_rate: Optional[int] = None,
        index_n_heads: Optional[int] = None,
        index_head_dim: Optional[int] = None,
        index_topk: Optional[int] = None,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        sequence_parallel: Optional[bool] = None,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        recompute_core_attention: Optional[bool] = None,
        context_parallel_algo: Optional[str] = None,
        context_parallel_group: Optional[dist.ProcessGroup] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        if recompute_core_attention is None:
            recompute_core_attention = current_layer_context().recompute == "selective"
        self.recompute_core_attention = recompute_core_attention
        if context_parallel_algo is None:
            context_parallel_algo = current_layer_context().context_parallel_algo
        self.context_parallel_algo, self.context_parallel_group = context_parallel_algo, context_parallel_group
        _check_arguments(layer_type, num_attention_heads, head_dim, qk_rope_head_dim, sliding_window, group)
        if layer_type != SLIDING:
            _check_compressed(layer_type, compress_rate, index_n_heads, index_head_dim, index_topk)
        tp, tp_rank = mappings.tp_world_size(group), mappings.tp_rank(group)
        init_method, output_init_method = default_init_methods(init_method, output_init_method)
        self.layer_type, self.head_dim, self.norm_eps = layer_type, head_dim, norm_eps
        self.local_heads, self.sliding_window = num_attention_heads // tp, sliding_window
        self.group = group
        # set by megacann.generation while it generates (megacann.generation.compressed_cache); None: off
        self.kv_cache: Optional[CompressedCacheLayer] = None
        if layer_type == SLIDING:
            self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=True)
        else:
            self.rotary = RotaryEmbedding(qk_rope_head_dim, compress_rope_theta, rope_scaling, interleaved=True)
        linear = dict(group=group, dtype=dtype, device=device)
        whole = dict(bias=False, replicated=True, sequence_parallel=sequence_parallel, init_method=init_method)
        norm = dict(sequence_parallel=False, dtype=dtype, device=device)
        self.q_a_proj = ColumnParallelLinear(hidden_size, q_lora_rank, **whole, **linear)
        self.q_a_norm = RMSNorm(q_lora_rank, norm_eps, **norm)
        self.q_b_proj = ColumnParallelLinear(
            q_lora_rank, num_attention_heads * head_dim, bias=False, sequence_parallel=False,
            init_method=init_method, **linear,
        )  # fmt: skip
        self.kv_proj = ColumnParallelLinear(hidden_size, head_dim, **whole, **linear)
        self.kv_norm = RMSNorm(head_dim, norm_eps, **norm)
        projection = GroupedOutputProjection(
            num_attention_heads * head_dim, hidden_size, o_groups, o_lora_rank, sequence_parallel=sequence_parallel,
            init_method=init_method, output_init_method=output_init_method, **linear,
        )  # fmt: skip
        # its two parts registered here, under transformers' names (o_a_proj, o_b_proj); the projection
        # itself is kept unregistered, so every parameter has one name
        self.o_a_proj, self.o_b_proj = projection.o_a_proj, projection.o_b_proj
        object.__setattr__(self, "output_projection", projection)
        self.sinks = make_parameter(
            (num_attention_heads,), init_zeros(), tp_rank=tp_rank, tp_size=tp, tp_dim=0,
            name="CompressedSparseAttention sinks (one per head)", dtype=torch.float32, device=device,
        )  # fmt: skip
        self.compressor: Optional[WindowCompressor] = None
        if layer_type != SLIDING:
            self.compressor = WindowCompressor(
                hidden_size, head_dim, compress_rate, norm_eps, init_std, overlap=layer_type == CSA,
                dtype=dtype, device=device,
            )  # fmt: skip
        if layer_type == CSA:  # transformers keeps the indexer inside the compressor
            self.compressor.indexer = CompressedIndexer(
                hidden_size, q_lora_rank, index_n_heads, index_head_dim, compress_rate, index_topk, norm_eps,
                init_std, dtype=dtype, device=device,
            )  # fmt: skip
        if tp > 1:  # whole on every rank; each rank's heads give part of their gradient
            replicated = [self.q_a_norm, self.kv_norm] + ([self.compressor] if self.compressor is not None else [])
            for module in replicated:
                for param in module.parameters():
                    mark_partial_grad(param)

    def extra_repr(self) -> str:
        return (
            f"layer_type={self.layer_type}, local_heads={self.local_heads}, head_dim={self.head_dim}, "
            f"rope_dim={self.rotary.head_dim}, sliding_window={self.sliding_window}"
        )

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        self._refuse_unsupported(segment_ids)
        x = self.q_a_proj.prepare_input(hidden)  # the whole sequence; its gradient summed over TP
        b, s, _ = x.shape
        if position_ids is None:  # under context parallelism: the global positions of this rank's tokens
            group = self._context_group()
            size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
            position_ids = context_parallel_position_ids(s * size, size, rank, x.device).expand(b, s)
        cos, sin = self.rotary(position_ids, dtype=x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj.forward_prepared(x))
        q = self.q_b_proj.forward_prepared(q_residual).unflatten(-1, (self.local_heads, self.head_dim))
        q = rotate_trailing(unweighted_rms_norm(q, self.norm_eps), cos, sin)
        kv = rotate_trailing(self.kv_norm(self.kv_proj.forward_prepared(x)).unsqueeze(2), cos, sin)
        if self.kv_cache is not None:  # generation: earlier tokens' keys and projections come from the cache
            out = self.kv_cache.attend(self, q, kv, x, q_residual, position_ids)
        elif self.recompute_core_attention and self.training:
            out = checkpoint(self.core_attention, q, kv, x, q_residual, position_ids, segment_ids)
        else:
            out = self.core_attention(q, kv, x, q_residual, position_ids, segment_ids)
        out = rotate_trailing(out, cos, -sin)  # the values' rotation undone at the query's position
        return self.output_projection(out.flatten(2))

    def core_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """``[b, s, local heads, d]``: the queries' attention over their window (and, on the compressed
        types, the compressed entries), before the values' rotation is undone."""
        group = self._context_group()
        if group is not None:
            return context_parallel_compressed_attention(self, q, kv, x, q_residual, position_ids, segment_ids, group)
        if self.compressor is None:
            return ops.scaled_dot_product_attention(
                q, kv, kv, causal=True, segment_ids=segment_ids, scale=self.head_dim**-0.5,
                sliding_window=self.sliding_window, sinks=self.sinks,
            )  # fmt: skip
        return self._attend_with_compressed(q, kv, x, q_residual, position_ids)

    def _attend_with_compressed(
        self, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Attention over the local window and the compressed entries (HCA: every closed window; CSA: the
        indexer's picks), block by block (:func:`windowed_attention`). ``q`` ``[b, s, heads, d]``, ``kv``
        ``[b, s, 1, d]``."""
        entries = self.compressor(x, self.rotary).unsqueeze(2)  # [b, T, 1, d]
        entries_read = self.entries_read(entries.shape[1], x, q_residual, position_ids)
        return windowed_attention(q, kv, 0, self.sliding_window, self.sinks, entries, entries_read)

    def entries_read(
        self,
        count: int,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
        index_keys: Optional[torch.Tensor] = None,
        row_entries: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[b, 1, s, count]``, True where a query reads a compressed entry: every closed window (HCA),
        or the indexer's picks among them (CSA; ``index_keys``: its compressed keys when a decoding cache
        has them, else compressed from ``x``; ``row_entries`` ``[b]``: how many of them each row owns,
        when rows own fewer than ``count``: the indexer ranks only those)."""
        if not self.compressor.overlap:
            return compressed_causal_bias(position_ids, count, self.compressor.compress_rate) == 0
        indexer = self.compressor.indexer
        with torch.no_grad():  # picks are indices: no gradient reaches the scores, so save nothing for them
            if row_entries is None:
                picks = indexer(x, q_residual, position_ids, self.rotary, index_keys)
            else:
                picks = indexer.forward_rows(x, q_residual, position_ids, self.rotary, index_keys, row_entries)
        return chosen_entries_bias(picks, count) == 0

    def _context_group(self) -> Optional[dist.ProcessGroup]:
        """The context-parallel group when it has more than one rank, else None."""
        group = self.context_parallel_group or ps.get_context_parallel_group()
        return None if group is None or dist.get_world_size(group) == 1 else group

    def _refuse_unsupported(self, segment_ids: Optional[torch.Tensor]) -> None:
        if self._context_group() is not None:
            check_context_parallel_algo(self.layer_type, self.context_parallel_algo)
        if segment_ids is not None and self.compressor is not None:
            raise ValueError(
                f"CompressedSparseAttention ({self.layer_type}): packed documents (segment_ids) are not "
                "supported: its compressed windows would pool tokens of neighbouring documents; give one "
                "document per row"
            )


def _check_arguments(
    layer_type: str, heads: int, head_dim: int, rope_dim: int, window: int, group: Optional[dist.ProcessGroup]
) -> None:
    """Refuse a layer type or size the block cannot take, naming the argument."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"CompressedSparseAttention: layer_type {layer_type!r} is not one of {LAYER_TYPES}")
    tp = mappings.tp_world_size(group)
    if heads % tp:
        raise ValueError(
            f"CompressedSparseAttention: num_attention_heads {heads} is not divisible by "
            f"tensor_model_parallel_size {tp} (heads split over TP)"
        )
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(
            f"CompressedSparseAttention: qk_rope_head_dim must be an even number in [2, head_dim {head_dim}], "
            f"got {rope_dim}"
        )
    if isinstance(window, bool) or int(window) < 1:
        raise ValueError(f"CompressedSparseAttention: sliding_window must be a positive number of keys, got {window!r}")


def _check_compressed(
    layer_type: str, rate: Optional[int], index_heads: Optional[int], index_dim: Optional[int], topk: Optional[int]
) -> None:
    """The compressed types need their ``compress_rate``; the sparse one its indexer's sizes."""
    needed = {"compress_rate": rate}
    if layer_type == CSA:
        needed.update(index_n_heads=index_heads, index_head_dim=index_dim, index_topk=topk)
    missing = [key for key, value in needed.items() if value is None or value < 1]
    if missing:
        raise ValueError(f"CompressedSparseAttention ({layer_type}): {missing} must be given as positive integers")
