"""Causal self-attention with grouped-query attention, split across tensor-parallel ranks by heads.

Query heads are split evenly across TP ranks. Key/value heads are split too when their number divides
the TP size; otherwise (fewer kv heads than ranks, e.g. MQA) the k/v projections are replicated on every
rank, marked ``tp_partial_grad``, and each rank computes only the kv heads its query heads read. The
core attention runs through :func:`megacann.ops.scaled_dot_product_attention`, so fused kernels slot in.

Parameter names follow Hugging Face LLaMA: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (or one fused
``qkv_proj`` whose full weight is ``cat(q_proj, k_proj, v_proj)`` along the output rows). With ``qk_norm``
(Qwen3, OLMo-2 style per-head norms) ``q_norm`` and ``k_norm`` are RMSNorms of size ``head_dim`` applied to
every query and key head before RoPE; every TP rank holds them whole and normalises only its own heads,
so their gradients are partial per rank (``tp_partial_grad``) and summed over the TP group.

Under context parallelism (a context-parallel group of more than one rank) the layer holds this rank's
sequence chunks and the core attention runs over the whole group with ``context_parallel_algo``
(:mod:`megacann.layers.context_parallel`); everything else is unchanged.

Arguments left None (``sequence_parallel``, ``recompute_core_attention``, ``context_parallel_algo``, the
init methods, ``dtype``, ``device``) come from the current :class:`~megacann.layers.context.LayerContext`.
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.layers import mappings
from megacann.layers.context import current_layer_context
from megacann.layers.context_parallel import CONTEXT_PARALLEL_ALGORITHMS, context_parallel_attention
from megacann.layers.init import default_init_methods, make_parameter
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear
from megacann.layers.norm import RMSNorm
from megacann.layers.random import checkpoint, get_rng_tracker
from megacann.layers.sharding import InitMethod, mark_partial_grad

Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]


class KVCacheLayer(Protocol):
    """One layer's key/value cache while generating (:mod:`megacann.generation`): ``attend(attention, q,
    k, v)`` stores this step's rotated keys and values (this rank's kv heads) and returns the attention of
    ``q`` over every cached token of its row, ``[b, s, local_heads, head_dim]``."""

    def attend(self, attention: SelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def kv_heads_for_rank(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The range ``[first, end)`` of kv heads read by this rank's query heads (kv head ``j`` serves query
    heads ``j*g .. j*g+g-1``, ``g = num_heads / num_kv_heads``)."""
    local = num_heads // tp_size
    group = num_heads // num_kv_heads
    first = tp_rank * local // group
    end = ((tp_rank + 1) * local - 1) // group + 1
    return first, end


class SelfAttention(torch.nn.Module):
    """``forward(hidden [b, s_local, h], rotary=(cos, sin) | None, segment_ids=None) -> [b, s_local, h]``.

    ``rotary`` tables and ``segment_ids`` ``[b, s]`` cover the whole sequence (under sequence parallelism
    the projections gather it). ``segment_ids`` limits attention to positions with the same id (packed
    documents); attention is always causal. ``sliding_window`` W (None: none) lets each query see only its
    last W keys, itself included (Mistral), on every path: one process and each context-parallel algorithm.

    Under context parallelism ``s`` is this cp rank's share (``context_parallel_split``): ``hidden``,
    ``rotary`` (tables of the share's global positions) and ``segment_ids`` all cover those tokens, and
    ``context_parallel_algo`` (``ring``, ``allgather``, ``ulysses``; default: the layer context's) picks
    how attention crosses the ranks of ``context_parallel_group`` (default: parallel_state's cp group).
    Without an algorithm the layer refuses to run under context parallelism rather than pick one.
    ``recompute_core_attention`` (default: the context's ``recompute == "selective"``) recomputes the
    softmax attention in backward. ``qk_norm`` adds the per-head RMSNorms ``q_norm`` / ``k_norm`` (epsilon
    ``qk_norm_eps``) between the projections and RoPE. ``sinks`` (gpt-oss) adds the parameter ``sinks``, one
    learned logit per query head (split over TP with the heads) that joins each query's softmax as a column
    with no value; under context parallelism only ``ulysses`` takes it (ring and all-gather refuse it).
    ``output_gate`` (Qwen3-Next, Qwen3.5): ``q_proj`` gives each head its queries then as many gate logits,
    and the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Rotary tables narrower
    than ``head_dim`` rotate each head's first dims only and leave the rest as they are (partial rotary).
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        qkv_bias: bool = False,
        output_bias: bool = False,
        attention_dropout: float = 0.0,
        sequence_parallel: Optional[bool] = None,
        fused_qkv: bool = False,
        rotary_interleaved: bool = False,
        softmax_scale: Optional[float] = None,
        sliding_window: Optional[int] = None,
        recompute_core_attention: Optional[bool] = None,
        context_parallel_algo: Optional[str] = None,
        context_parallel_group: Optional[dist.ProcessGroup] = None,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        sinks: bool = False,
        output_gate: bool = False,
    ):
        super().__init__()
        ctx = current_layer_context()
        if context_parallel_algo is None:
            context_parallel_algo = ctx.context_parallel_algo
        if recompute_core_attention is None:
            recompute_core_attention = ctx.recompute == "selective"
        init_method, output_init_method = default_init_methods(init_method, output_init_method)
        tp, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
        heads = num_attention_heads
        kv_heads = num_key_value_heads or heads
        if head_dim is None:
            if hidden_size % heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads {heads}")
            head_dim = hidden_size // heads
        if heads % tp:
            raise ValueError(f"num_attention_heads {heads} is not divisible by tensor_model_parallel_size {tp}")
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if context_parallel_algo is not None and context_parallel_algo not in CONTEXT_PARALLEL_ALGORITHMS:
            raise ValueError(
                f"context_parallel_algo {context_parallel_algo!r} is not one of {CONTEXT_PARALLEL_ALGORITHMS}"
            )
        if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
            raise ValueError(f"sliding_window must be a positive number of keys or None, got {sliding_window!r}")
        self.sliding_window = sliding_window
        # set by megacann.generation while it generates: attention over cached keys and values (None: off)
        self.kv_cache: Optional[KVCacheLayer] = None
        kv_sharded = kv_heads % tp == 0
        if fused_qkv and output_gate:
            raise ValueError("output_gate needs fused_qkv=False (the gate comes out of q_proj)")
        if fused_qkv and not kv_sharded:
            raise ValueError(
                f"fused_qkv needs num_key_value_heads {kv_heads} divisible by tensor_model_parallel_size {tp}; "
                "use fused_qkv=False (kv projections are then replicated)"
            )
        self.head_dim, self.dropout_p, self.softmax_scale = head_dim, attention_dropout, softmax_scale
        self.rotary_interleaved = rotary_interleaved
        self.recompute_core_attention = recompute_core_attention
        self.context_parallel_algo, self.context_parallel_group = context_parallel_algo, context_parallel_group
        self.local_heads = heads // tp
        if kv_sharded:
            self.local_kv_heads, self.kv_rows = kv_heads // tp, None
            kv_index = None
        else:
            first, end = kv_heads_for_rank(heads, kv_heads, tp, rank)
            self.local_kv_heads, self.kv_rows = end - first, (first * head_dim, end * head_dim)
            group_size = heads // kv_heads
            index = [(rank * self.local_heads + j) // group_size - first for j in range(self.local_heads)]
            uniform = self.local_heads % self.local_kv_heads == 0 and index == [
                j // (self.local_heads // self.local_kv_heads) for j in range(self.local_heads)
            ]
            kv_index = None if uniform else torch.tensor(index)
        self.register_buffer("kv_index", kv_index, persistent=False)

        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        linear = dict(sequence_parallel=sequence_parallel, group=group, dtype=dtype, device=device)
        self.fused_qkv, self.output_gate = fused_qkv, output_gate
        if fused_qkv:
            self.qkv_proj = ColumnParallelLinear(
                hidden_size,
                q_size + 2 * kv_size,
                bias=qkv_bias,
                init_method=init_method,
                tp_blocks=(q_size, kv_size, kv_size),
                **linear,
            )
        else:
            q_rows = 2 * q_size if output_gate else q_size  # per head: its queries, then its gate logits
            self.q_proj = ColumnParallelLinear(hidden_size, q_rows, bias=qkv_bias, init_method=init_method, **linear)
            kv = dict(bias=qkv_bias, init_method=init_method, replicated=not kv_sharded, **linear)
            self.k_proj = ColumnParallelLinear(hidden_size, kv_size, **kv)
            self.v_proj = ColumnParallelLinear(hidden_size, kv_size, **kv)
        self.o_proj = RowParallelLinear(q_size, hidden_size, bias=output_bias, init_method=output_init_method, **linear)
        self.q_norm = self.k_norm = None
        if qk_norm:  # whole on every rank; each rank's heads give part of the gradient (under SP as well)
            norm = dict(sequence_parallel=False, dtype=dtype, device=device)
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps, **norm), RMSNorm(head_dim, qk_norm_eps, **norm)
            if tp > 1:
                mark_partial_grad(self.q_norm.weight)
                mark_partial_grad(self.k_norm.weight)
        self.sinks = None
        if sinks:
            self.sinks = make_parameter(
                (heads,), init_method, tp_rank=rank, tp_size=tp, tp_dim=0, name="attention sinks (one per head)",
                dtype=dtype, device=device,
            )  # fmt: skip

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as ``[b, s, heads, head_dim]`` views over the whole sequence, and the output gate's
        logits ``[b, s, heads * head_dim]`` (None without ``output_gate``)."""
        if self.fused_qkv:
            qkv = self.qkv_proj(hidden).unflatten(-1, (-1, self.head_dim))  # [b, s, heads, head_dim]
            return (*qkv.split([self.local_heads, self.local_kv_heads, self.local_kv_heads], dim=2), None)
        x = self.q_proj.prepare_input(hidden)
        q = self.q_proj.forward_prepared(x)
        k = self.k_proj.forward_prepared(x, self.kv_rows)
        v = self.v_proj.forward_prepared(x, self.kv_rows)
        gate = None
        if self.output_gate:
            q, gate = (t.flatten(2) for t in q.unflatten(-1, (-1, 2 * self.head_dim)).chunk(2, dim=-1))
        return (*(t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v)), gate)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``cos.shape[-1]`` dims of each head (all of them unless the tables are narrower)."""
        width = cos.shape[-1]
        if width == self.head_dim:
            return ops.apply_rotary(x, cos, sin, self.rotary_interleaved)
        rotated = ops.apply_rotary(x[..., :width], cos, sin, self.rotary_interleaved)
        return torch.cat([rotated, x[..., width:]], dim=-1)

    def _output(self, out: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """The heads' outputs ``[b, s, heads, head_dim]`` gated (``output_gate``) and projected back."""
        out = out.flatten(2)  # [b, s, heads * head_dim]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def expand_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as this rank's query heads read them: expanded per query head where they read
        kv heads unevenly (replicated kv projections), else as they are (GQA is left to the kernel)."""
        if self.kv_index is None:
            return k, v
        return k.index_select(2, self.kv_index), v.index_select(2, self.kv_index)

    def core_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_ids: Optional[torch.Tensor],
        whole_sequence: bool = False,
    ) -> torch.Tensor:
        """Softmax attention of this rank's heads (dropout from the TP-rank RNG stream), over the whole
        context-parallel group when there is one, unless ``whole_sequence`` (the caller holds whole
        sequences, e.g. a generation's prefill: nothing to exchange)."""
        p = self.dropout_p if self.training else 0.0
        cp_group = self.context_parallel_group
        if cp_group is None:
            cp_group = ps.get_context_parallel_group()
        if not whole_sequence and cp_group is not None and dist.get_world_size(cp_group) > 1:
            if p > 0.0:
                raise ValueError(
                    f"attention_dropout {self.dropout_p} is not supported under context parallelism "
                    "(context_parallel_size > 1): set it to 0"
                )
            if self.context_parallel_algo is None:
                raise ValueError(
                    f"SelfAttention runs under context parallelism ({dist.get_world_size(cp_group)} ranks) but was "
                    "built without context_parallel_algo: build the model under "
                    "megacann.models.layer_context_from_config(cfg, device) (the recipe's "
                    "distributed.context_parallel_algo) or pass context_parallel_algo='ring'|'allgather'|'ulysses'"
                )
            return context_parallel_attention(
                q,
                k,
                v,
                segment_ids,
                algo=self.context_parallel_algo,
                scale=self.softmax_scale,
                group=cp_group,
                sliding_window=self.sliding_window,
                sinks=self.sinks,
            )
        attend = dict(
            causal=True,
            segment_ids=segment_ids,
            scale=self.softmax_scale,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
        )
        if p > 0.0:
            with get_rng_tracker().fork():
                return ops.scaled_dot_product_attention(q, k, v, dropout_p=p, **attend)
        return ops.scaled_dot_product_attention(q, k, v, **attend)

    def forward(
        self, hidden: torch.Tensor, rotary: Rotary = None, segment_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        q, k, v, gate = self._project(hidden)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = self._rotate(q, *rotary), self._rotate(k, *rotary)
        if self.kv_cache is not None:  # generation: earlier tokens' keys and values come from the cache
            return self._output(self.kv_cache.attend(self, q, k, v), gate)
        k, v = self.expand_kv(k, v)
        if self.recompute_core_attention and self.training:
            out = checkpoint(self.core_attention, q, k, v, segment_ids)
        else:
            out = self.core_attention(q, k, v, segment_ids)
        return self._output(out, gate)
