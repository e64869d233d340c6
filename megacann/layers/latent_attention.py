"""Multi-head latent attention (MLA; DeepSeek-V2 / V3), split across tensor-parallel ranks by heads.

Queries come from the hidden state through a low-rank bottleneck (``q_a_proj`` to ``q_lora_rank``, an
RMSNorm ``q_a_layernorm``, ``q_b_proj`` up to every head) or, with ``q_lora_rank=None``, one ``q_proj``.
Keys and values share one compressed latent: ``kv_a_proj_with_mqa`` gives ``kv_lora_rank`` latent features
(normed by ``kv_a_layernorm`` and expanded per head by ``kv_b_proj`` into the head's key part without
positions, ``qk_nope_head_dim``, and its value, ``v_head_dim``) plus one rotary key of
``qk_rope_head_dim`` shared by all heads. A query head is ``[nope | rope]`` (``qk_nope_head_dim +
qk_rope_head_dim``), RoPE turns only the rope part, and the output projection ``o_proj`` reads
``heads x v_head_dim``. Names and layouts are Hugging Face's DeepseekV3Attention, so checkpoints map by name.

Tensor parallelism (as Megatron-Core's MLA): the down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and
their norms are replicated on every rank and see the whole sequence (under sequence parallelism the
shared input is gathered first); the up-projections (``q_b_proj``, ``kv_b_proj``, or ``q_proj``) are
column-parallel over heads and ``o_proj`` row-parallel. Each rank's heads give only part of the
gradient of the replicated weights, so those are marked ``tp_partial_grad`` (summed over TP).

The core attention runs through the same path as :class:`~megacann.layers.SelfAttention` (one process:
:func:`megacann.ops.scaled_dot_product_attention`; context parallelism: ring, all-gather or Ulysses).
Those kernels and algorithms take one head width for q, k and v, so when ``v_head_dim`` differs from the
q/k width the narrower side is padded with zeros (zero value columns give zero outputs, cut off after;
zero q/k columns add nothing to the scores): every algorithm carries MLA, at the cost of attention
over the wider head.

``softmax_scale`` defaults to :func:`mla_softmax_scale` (``1/sqrt(qk head width)``, times YaRN's
``mscale_all_dim`` correction squared when ``rope_scaling`` is YaRN, as transformers does). The rotary
tables ``rotary=(cos, sin)`` are of width ``qk_rope_head_dim``; ``rotary_interleaved`` rotates adjacent
pairs (DeepSeek's ``rope_interleave``: the same scores as transformers, whose interleaved rotation
differs only by a permutation applied alike to queries and keys).

While generating (``kv_cache`` set by :mod:`megacann.generation`), the layer hands the cache only the normed
latent and the rotary key of each new token; over cached tokens it decodes with ``kv_b_proj`` absorbed
into the query and the output (:meth:`LatentAttention.absorbed_attention`), never expanding them into
every head's keys and values.

Sparse attention (DeepSeek-V3.2's DSA): with ``indexer`` (a :class:`~megacann.layers.sparse_indexer.SparseIndexer`) each
query reads only the ``top_k`` keys its index scores pick (a mask of the chosen keys; under context
parallelism with ``allgather`` only, over the all-gathered keys: :mod:`megacann.layers.indexed_attention`; while generating the cache keeps each token's index key beside its
latent and each new query reads its ``top_k`` best cached tokens), and while training with ``indexer_loss_coeff`` > 0
the layer keeps the indexer's KL loss against its own (detached) attention in ``last_indexer_loss``.
``indexer_dense`` (the indexer's warm-up) attends densely and trains the indexer on the dense attention.
When ``top_k`` reaches the sequence length every key is read: the dense path, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from megacann import ops
from megacann.layers import mappings
from megacann.layers.attention import Rotary, SelfAttention
from megacann.layers.context import current_layer_context
from megacann.layers.indexed_attention import indexed_attention
from megacann.layers.init import default_init_methods
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear, add_adapter_output
from megacann.layers.norm import RMSNorm
from megacann.layers.random import checkpoint
from megacann.layers.rotary import yarn_mscale
from megacann.layers.sharding import InitMethod, mark_partial_grad
from megacann.layers.sparse_indexer import SparseIndexer


class LatentCacheLayer(Protocol):
    """One latent attention layer's cache while generating (:mod:`megacann.generation`): ``attend(attention,
    q_nope, q_rope, latent, k_rope, index=None)`` stores this step's normed latents and rotary keys (and,
    with ``index``, the indexer's keys) and returns the attention of the queries over the cached tokens of
    its row they read, ``[b, s, local heads, v_head_dim]``."""

    def attend(
        self,
        attention: LatentAttention,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        index: Optional[IndexInputs] = None,
    ) -> torch.Tensor: ...


def mla_softmax_scale(qk_head_dim: int, rope_scaling: Optional[dict[str, Any]] = None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim)²`` when
    the rope scaling is not the default one and sets ``mscale_all_dim`` (YaRN)."""
    scale = qk_head_dim**-0.5
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind != "default" and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def _pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class LatentAttention(torch.nn.Module):
    """``forward(hidden [b, s_local, h], rotary=(cos, sin) | None, segment_ids=None) -> [b, s_local, h]``,
    causal; see the module docstring. Arguments as :class:`~megacann.layers.SelfAttention`'s (those left
    None come from the current layer context); ``bias`` adds biases to ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and ``o_proj`` (Hugging Face's ``attention_bias``)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: Optional[int] = None,
        norm_eps: float = 1e-6,
        bias: bool = False,
        softmax_scale: Optional[float] = None,
        rotary_interleaved: bool = False,
        attention_dropout: float = 0.0,
        sequence_parallel: Optional[bool] = None,
        recompute_core_attention: Optional[bool] = None,
        context_parallel_algo: Optional[str] = None,
        context_parallel_group: Optional[dist.ProcessGroup] = None,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        indexer: Optional[SparseIndexer] = None,
        indexer_dense: bool = False,
        indexer_loss_coeff: float = 0.0,
    ):
        super().__init__()
        ctx = current_layer_context()
        tp = mappings.tp_world_size(group)
        if num_attention_heads % tp:
            raise ValueError(
                f"LatentAttention: num_attention_heads {num_attention_heads} is not divisible by "
                f"tensor_model_parallel_size {tp} (heads split over TP)"
            )
        for key, value in (("kv_lora_rank", kv_lora_rank), ("v_head_dim", v_head_dim), ("q_lora_rank", q_lora_rank)):
            if value is not None and value < 1:
                raise ValueError(f"LatentAttention: {key} must be >= 1, got {value}")
        if qk_rope_head_dim < 2 or qk_rope_head_dim % 2 or qk_nope_head_dim < 0:
            raise ValueError(
                f"LatentAttention: qk_rope_head_dim must be a positive even number (RoPE pairs) and "
                f"qk_nope_head_dim >= 0, got {qk_rope_head_dim} and {qk_nope_head_dim}"
            )
        if indexer is not None and (q_lora_rank is None or attention_dropout):
            raise ValueError(
                f"LatentAttention: a sparse indexer needs q_lora_rank (its queries read the query latent) and "
                f"attention_dropout 0, got {q_lora_rank} and {attention_dropout}"
            )
        init_method, output_init_method = default_init_methods(init_method, output_init_method)
        self.indexer, self.indexer_dense, self.indexer_loss_coeff = indexer, indexer_dense, indexer_loss_coeff
        self.last_indexer_loss: Optional[torch.Tensor] = None  # the weighted loss of the last training forward
        self.group = group
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.local_heads = num_attention_heads // tp
        self.softmax_scale = mla_softmax_scale(self.qk_head_dim) if softmax_scale is None else softmax_scale
        self.rotary_interleaved = rotary_interleaved
        # what SelfAttention.core_attention reads (the core attention is shared)
        self.dropout_p, self.sliding_window, self.sinks = attention_dropout, None, None
        self.context_parallel_algo = (
            ctx.context_parallel_algo if context_parallel_algo is None else context_parallel_algo
        )
        self.context_parallel_group = context_parallel_group
        if recompute_core_attention is None:
            recompute_core_attention = ctx.recompute == "selective"
        self.recompute_core_attention = recompute_core_attention
        # set by megacann.generation while it generates: attention over cached latents (None: off)
        self.kv_cache: Optional[LatentCacheLayer] = None

        linear = dict(group=group, dtype=dtype, device=device)
        down = dict(replicated=True, sequence_parallel=sequence_parallel, init_method=init_method, **linear)
        up = dict(bias=False, sequence_parallel=False, init_method=init_method, **linear)
        norm = dict(sequence_parallel=False, dtype=dtype, device=device)
        q_size = num_attention_heads * self.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if q_lora_rank is None:  # reads the sequence the kv down-projection gathers, split by heads
            self.q_proj = ColumnParallelLinear(hidden_size, q_size, **up)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden_size, q_lora_rank, bias=bias, **down)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, **norm)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, q_size, **up)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, **down)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, **norm)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_attention_heads * (qk_nope_head_dim + v_head_dim), **up)
        self.o_proj = RowParallelLinear(
            num_attention_heads * v_head_dim,
            hidden_size,
            bias=bias,
            sequence_parallel=sequence_parallel,
            init_method=output_init_method,
            **linear,
        )
        if tp > 1:  # whole on every rank; each rank's heads give part of the gradient
            for norm_layer in (self.q_a_layernorm, self.kv_a_layernorm):
                if norm_layer is not None:
                    mark_partial_grad(norm_layer.weight)

    def extra_repr(self) -> str:
        return (
            f"local_heads={self.local_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.nope}, qk_rope_head_dim={self.rope}, v_head_dim={self.v_head_dim}"
        )

    def _queries(
        self, x: torch.Tensor, rotary: Rotary, query_latent: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query heads' parts without and with positions (RoPE applied), ``[b, s, local heads, qk_nope_head_dim]``
        and ``[b, s, local heads, qk_rope_head_dim]``, from a prepared input (or its query latent)."""
        if self.q_proj is not None:
            q = self.q_proj.forward_prepared(x)
        else:
            if query_latent is None:
                query_latent = self.q_a_layernorm(self.q_a_proj.forward_prepared(x))
            q = self.q_b_proj.forward_prepared(query_latent)
        q_nope, q_rope = rearrange(q, "b s (h d) -> b s h d", d=self.qk_head_dim).split([self.nope, self.rope], -1)
        q_rope = q_rope.contiguous()
        if rotary is not None:
            q_rope = ops.apply_rotary(q_rope, rotary[0], rotary[1], self.rotary_interleaved)
        return q_nope, q_rope

    def _latent(self, x: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """What every head's keys and values come from: the normed latent ``[b, s, kv_lora_rank]`` and the
        shared rotary key ``[b, s, 1, qk_rope_head_dim]`` (RoPE applied), from a prepared input."""
        latent, k_rope = self.kv_a_proj_with_mqa.forward_prepared(x).split([self.kv_lora_rank, self.rope], -1)
        k_rope = k_rope.unsqueeze(2).contiguous()  # the shared key: one head
        if rotary is not None:
            k_rope = ops.apply_rotary(k_rope, rotary[0], rotary[1], self.rotary_interleaved)
        return self.kv_a_layernorm(latent), k_rope

    def expand_latent(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[b, s, local heads, qk width]`` and values ``[b, s, local heads, v_head_dim]`` of this
        rank's heads from the normed latent and the rotary key (:meth:`_latent`)."""
        kv = rearrange(self.kv_b_proj.forward_prepared(latent), "b s (h d) -> b s h d", h=self.local_heads)
        k_nope, v = kv.split([self.nope, self.v_head_dim], -1)
        return torch.cat([k_nope, k_rope.expand(-1, -1, self.local_heads, -1)], -1), v

    def _project(self, hidden: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k ``[b, s, local heads, qk width]`` (RoPE applied) and v ``[b, s, local heads, v_head_dim]``
        over the whole sequence."""
        # one prepared input for every projection of the hidden state: gathered under sequence
        # parallelism, its gradient summed over TP in backward
        x = self.kv_a_proj_with_mqa.prepare_input(hidden)
        q_nope, q_rope = self._queries(x, rotary)
        k, v = self.expand_latent(*self._latent(x, rotary))
        return torch.cat([q_nope, q_rope], -1), k, v

    def latent_up_projection(self) -> torch.Tensor:
        """``kv_b_proj`` as ``[local heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]`` (each head's key
        rows, then its value rows), its adapter's update (LoRA, unmerged) included; under ``precision.fp8``
        the stored weight, unquantised (decoding is not an FP8 product)."""
        weight = self.kv_b_proj.weight
        if self.kv_b_proj.adapter is not None:  # the adapter's product with the identity is its matrix
            eye = torch.eye(self.kv_lora_rank, dtype=weight.dtype, device=weight.device)
            weight = add_adapter_output(self.kv_b_proj.adapter, weight.t(), eye, None).t()
        return weight.view(self.local_heads, self.nope + self.v_head_dim, self.kv_lora_rank)

    def absorbed_attention(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of this rank's query heads over cached tokens, never expanding them into keys and
        values (DeepSeek's absorbed decoding): ``cached`` ``[b, t, kv_lora_rank + qk_rope_head_dim]``
        holds each token's normed latent c and rotary key. A head's score is ``(q_nope W_UK) . c + q_rope .
        k_rope`` (``W_UK``: its key rows of ``kv_b_proj``), its output ``(softmax . c) W_UVᵀ`` (its value
        rows): one-head attention over the cached rows, run by ``megacann.ops`` (the rope columns of
        the value side give output columns that are cut off). ``mask`` ``[b, 1, s, t]``, True = read.
        Returns ``[b, s, local heads, v_head_dim]``."""
        w_uk, w_uv = self.latent_up_projection().split([self.nope, self.v_head_dim], 1)
        q = torch.cat([torch.einsum("bshn,hnr->bshr", q_nope, w_uk), q_rope], -1)
        rows = cached.unsqueeze(2)
        out = ops.scaled_dot_product_attention(q, rows, rows, causal=False, attn_mask=mask, scale=self.softmax_scale)
        return torch.einsum("bshr,hvr->bshv", out[..., : self.kv_lora_rank], w_uv)

    def core_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_ids: Optional[torch.Tensor],
        whole_sequence: bool = False,
    ) -> torch.Tensor:
        """Softmax attention of this rank's heads, q/k and v padded to one width (see the module
        docstring), through SelfAttention's core attention (one process or the context-parallel group)."""
        width = max(self.qk_head_dim, self.v_head_dim)
        q, k, v = (_pad_heads(t, width) for t in (q, k, v))
        return SelfAttention.core_attention(self, q, k, v, segment_ids, whole_sequence)[..., : self.v_head_dim]

    def sparse_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """Softmax attention of this rank's heads over the keys ``read`` (``[b, 1, s, t]``, True = read)."""
        width = max(self.qk_head_dim, self.v_head_dim)
        q, k, v = (_pad_heads(t, width) for t in (q, k, v))
        out = ops.scaled_dot_product_attention(q, k, v, causal=False, attn_mask=read, scale=self.softmax_scale)
        return out[..., : self.v_head_dim]

    def indexed_attention(
        self, hidden: torch.Tensor, rotary: Rotary, segment_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Attention over the keys the indexer picks, ``[b, s, local heads, v_head_dim]``, on one process or
        across the context-parallel group (:func:`megacann.layers.indexed_attention.indexed_attention`);
        records the indexer's loss while training."""
        return indexed_attention(self, hidden, rotary, segment_ids)

    def dense_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The core attention over every causal key, recomputed in backward when asked."""
        if self.recompute_core_attention and self.training:
            return checkpoint(self.core_attention, q, k, v, segment_ids)
        return self.core_attention(q, k, v, segment_ids)

    def forward(
        self, hidden: torch.Tensor, rotary: Rotary = None, segment_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if self.kv_cache is not None:  # generation: earlier tokens' latents (and index keys) come from the cache
            x = self.kv_a_proj_with_mqa.prepare_input(hidden)
            query_latent, index = None, None
            if self.indexer is not None:
                query_latent = self.q_a_layernorm(self.q_a_proj.forward_prepared(x))
                index = IndexInputs(x, query_latent, rotary)
            queries = self._queries(x, rotary, query_latent)
            out = self.kv_cache.attend(self, *queries, *self._latent(x, rotary), index=index)
            return self.o_proj(rearrange(out, "b s h d -> b s (h d)"))
        if self.indexer is not None:
            out = self.indexed_attention(hidden, rotary, segment_ids)
        else:
            out = self.dense_attention(*self._project(hidden, rotary), segment_ids)
        return self.o_proj(rearrange(out, "b s h d -> b s (h d)"))


@dataclass
class IndexInputs:
    """What a sparse indexer reads of one forward while generating: the prepared input, the query latent and
    the rotary tables (the main attention's)."""

    hidden: torch.Tensor
    query_latent: torch.Tensor
    rotary: Rotary

    def keys(self, attention: LatentAttention) -> torch.Tensor:
        """This forward's index keys ``[b, s, index_head_dim]``."""
        return attention.indexer.keys(self.hidden, self.rotary, attention.rotary_interleaved)

    def scores(self, attention: LatentAttention, keys: torch.Tensor) -> torch.Tensor:
        """This forward's queries' index scores ``[b, s, t]`` over ``keys`` ``[b, t, index_head_dim]``."""
        return attention.indexer.scores(self.hidden, self.query_latent, self.rotary, attention.rotary_interleaved, keys)


def latent_attention_parameters(
    hidden_size: int,
    num_attention_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: Optional[int] = None,
    bias: bool = False,
) -> int:
    """Parameters of one :class:`LatentAttention` (whole, all ranks together)."""
    h, heads, qk = hidden_size, num_attention_heads, qk_nope_head_dim + qk_rope_head_dim
    q = h * heads * qk if q_lora_rank is None else h * q_lora_rank + q_lora_rank + q_lora_rank * heads * qk
    kv = h * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank + kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim)
    biases = (q_lora_rank or 0) + kv_lora_rank + qk_rope_head_dim + h if bias else 0
    return q + kv + heads * v_head_dim * h + biases


__all__ = ["LatentAttention", "latent_attention_parameters", "mla_softmax_scale"]
