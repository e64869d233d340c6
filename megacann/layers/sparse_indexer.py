"""The lightning indexer of DeepSeek-V3.2's sparse attention (DSA): a small scorer that picks, for every
query, the ``top_k`` earlier keys the attention reads.

A query's index score of key ``t`` is ``sum_j w_j * relu(scale * q_j . k_t)`` over ``num_heads`` indexer heads:
``q_j`` from the query latent (DeepSeek's ``q_a_layernorm(q_a_proj(x))``) through ``wq_b``, one key per
token from the hidden state through ``wk`` and a LayerNorm (``k_norm``), per-head weights ``w`` from the
hidden state through ``weights_proj`` (times ``num_heads ** -0.5``), ``scale = head_dim ** -0.5``. The first
``rope_head_dim`` columns of queries and keys carry rotate-half RoPE (not interleaved, whatever the main
attention uses). Scores are fp32.

Training (DeepSeek-V3.2's recipe): the indexer reads its inputs detached, so only its own loss trains it:
:func:`indexer_kl_loss`, the KL divergence from the main attention's distribution (its heads' probabilities
summed and renormalised, detached) to the softmax of the index scores, over the keys the attention read.

The layer is replicated on every tensor-parallel rank (it sees the whole sequence, as the latent
attention's down-projections do); the caller sums the attention target over its heads' ranks.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from megacann import ops
from megacann.layers.attention import Rotary
from megacann.layers.init import init_normal, make_parameter
from megacann.layers.linear import add_adapter_output
from megacann.layers.lora.adapter import AdapterLayout
from megacann.layers.norm import LayerNorm
from megacann.layers.sharding import InitMethod


class _Projection(torch.nn.Module):
    """A bias-free linear map whose weight is whole on every rank (its gradient complete on each). It takes
    a LoRA in its ``adapter`` slot, whole on every rank like the weight."""

    def __init__(self, in_size: int, out_size: int, init_method: InitMethod, name: str, dtype, device):
        super().__init__()
        self.weight = make_parameter(
            (out_size, in_size), init_method, tp_rank=0, tp_size=1, name=name, dtype=dtype, device=device
        )
        self.adapter: Optional[torch.nn.Module] = None

    def lora_layout(self) -> AdapterLayout:
        out_size, in_size = self.weight.shape
        return AdapterLayout(
            column=True,
            in_size=in_size,
            out_size=out_size,
            blocks=(out_size,),
            tp_rank=0,
            tp_size=1,
            shard=False,
            dtype=self.weight.dtype,
            device=self.weight.device,
            what=f"LoRA on the indexer's projection ({in_size}, {out_size})",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_adapter_output(self.adapter, F.linear(x, self.weight), x, None)


class SparseIndexer(torch.nn.Module):
    """``scores(hidden, query_latent, rotary) -> [b, s, t]`` fp32 index scores (unmasked) and
    ``select(scores, allowed) -> [b, 1, s, t]`` bool, True at each query's ``top_k`` best allowed keys.
    Parameters are named as Hugging Face's ``DeepseekV32Indexer`` (``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``)."""

    def __init__(
        self,
        hidden_size: int,
        query_latent_size: int,
        num_heads: int,
        head_dim: int,
        rope_head_dim: int,
        top_k: int,
        *,
        init_method: Optional[InitMethod] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        for key, value in (("num_heads", num_heads), ("head_dim", head_dim), ("top_k", top_k)):
            if value < 1:
                raise ValueError(f"SparseIndexer: {key} must be >= 1, got {value}")
        if rope_head_dim % 2 or not 0 <= rope_head_dim <= head_dim:
            raise ValueError(
                f"SparseIndexer: rope_head_dim {rope_head_dim} must be even and within head_dim {head_dim}"
            )
        init_method = init_method or init_normal(0.02)
        self.num_heads, self.head_dim, self.rope_head_dim, self.top_k = num_heads, head_dim, rope_head_dim, top_k
        self.softmax_scale = head_dim**-0.5
        self.wq_b = _Projection(query_latent_size, num_heads * head_dim, init_method, "indexer.wq_b", dtype, device)
        self.wk = _Projection(hidden_size, head_dim, init_method, "indexer.wk", dtype, device)
        self.k_norm = LayerNorm(head_dim, eps=1e-6, sequence_parallel=False, dtype=dtype, device=device)
        self.weights_proj = _Projection(hidden_size, num_heads, init_method, "indexer.weights_proj", dtype, device)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, top_k={self.top_k}"

    def _rotate(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """RoPE (rotate-half) on the first ``rope_head_dim`` columns of ``x`` ``[b, s, heads, head_dim]``."""
        if rotary is None or self.rope_head_dim == 0:
            return x
        rot, rest = x.split([self.rope_head_dim, self.head_dim - self.rope_head_dim], -1)
        return torch.cat([ops.apply_rotary(rot.contiguous(), rotary[0], rotary[1], False), rest], -1)

    @staticmethod
    def _tables(rotary: Rotary, tables_interleaved: bool) -> Rotary:
        """The rotary tables laid out for rotate-half (the main attention's interleaved ones re-laid)."""
        if rotary is not None and tables_interleaved:
            return tuple(torch.cat([t[..., 0::2], t[..., 0::2]], -1) for t in rotary)
        return rotary

    def keys(self, hidden: torch.Tensor, rotary: Rotary, tables_interleaved: bool = False) -> torch.Tensor:
        """The index keys ``[b, s, head_dim]`` of ``hidden`` ``[b, s, h]`` (one head, shared by the index
        heads): what a decoding cache keeps of each token for later queries."""
        k = self.k_norm(self.wk(hidden)).unsqueeze(2)
        return self._rotate(k, self._tables(rotary, tables_interleaved)).squeeze(2)

    def scores(
        self,
        hidden: torch.Tensor,
        query_latent: torch.Tensor,
        rotary: Rotary,
        tables_interleaved: bool = False,
        keys: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Index scores ``[b, s, t]`` (fp32) of every query of ``hidden`` ``[b, s, h]`` over ``keys``
        ``[b, t, head_dim]`` (None: its own, :meth:`keys`); ``rotary`` ``(cos, sin)`` of the queries, of
        width ``rope_head_dim``, laid out for interleaved pairs when ``tables_interleaved`` (the main
        attention's tables; re-laid for rotate-half here)."""
        b, s, _ = hidden.shape
        if keys is None:
            keys = self.keys(hidden, rotary, tables_interleaved)
        q = self.wq_b(query_latent).view(b, s, self.num_heads, self.head_dim)
        q = self._rotate(q, self._tables(rotary, tables_interleaved))
        # one product of all queries' heads with the keys: the keys are never repeated per query, so backward
        # keeps only the ReLU'd per-head scores beside the (small) queries and keys
        per_head = F.relu(torch.einsum("bshd,btd->bsht", q.float(), keys.float()) * self.softmax_scale)
        weights = self.weights_proj(hidden).float() * self.num_heads**-0.5  # [b, s, heads]
        return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)

    def select(self, scores: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
        """``[b, 1, s, t]`` bool: each query's ``top_k`` highest-scoring keys among the ``allowed`` ones
        (``[b, 1, s, t]`` or ``[s, t]``, True = may attend; None: all), and no other."""
        if allowed is not None:
            scores = scores.masked_fill(~_per_query(allowed, scores), float("-inf"))
        top = scores.topk(min(self.top_k, scores.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True).unsqueeze(1)
        return chosen if allowed is None else chosen & _as_4d(allowed)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape)


def _per_query(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``[b, 1, s, t]`` or ``[s, t]`` mask as ``[b, s, t]`` (broadcast to ``like``)."""
    return _as_4d(mask)[:, 0].expand_as(like)


def attention_distribution(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float, group=None
) -> torch.Tensor:
    """The attention's distribution over keys ``[b, s, t]`` (fp32, no gradient): its heads' softmax
    probabilities (``q`` ``[b, s, heads, d]``, ``k`` ``[b, t, heads, d]``, ``mask`` True = read) summed
    over the heads, over ``group`` too (heads split over tensor-parallel ranks), then renormalised."""
    with torch.no_grad():
        logits = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) * scale
        probs = torch.softmax(logits.masked_fill(~_as_4d(mask), float("-inf")), -1).sum(1)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(probs, group=group)
        return probs / probs.sum(-1, keepdim=True)


def indexer_kl_loss(scores: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over queries of ``KL(target || softmax(scores))`` over the keys ``mask`` lets each query read
    (``scores`` and ``target`` ``[b, s, t]``; ``mask`` ``[b, 1, s, t]`` or ``[s, t]``, True = read)."""
    keep = _per_query(mask, scores)
    log_q = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1).masked_fill(~keep, 0.0)
    target = target.masked_fill(~keep, 0.0)  # 0 log 0 = 0: keys not read add nothing
    return (target * (torch.log(target.clamp_min(1e-30)) - log_q)).sum(-1).mean()


__all__ = ["SparseIndexer", "attention_distribution", "indexer_kl_loss"]
