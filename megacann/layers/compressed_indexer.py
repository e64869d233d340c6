"""DeepSeek-V4's lightning indexer over compressed entries: which compressed KV entries each query reads.

Compressed sparse attention lets query ``t`` read only ``topk`` of the compressed entries. The indexer
compresses the sequence itself with overlapping windows (a :class:`WindowCompressor` at its own small
``head_dim``), projects the query's low-rank residual to ``num_heads`` indexer heads (rotated at the query's
position), and scores entry ``w`` as ``Σ_h weight_h(x_t) · ReLU(q_th · k_w) / sqrt(head_dim · num_heads)``
(``weight`` a projection of the hidden state). Entries whose window has not closed at ``t`` are never
chosen: their score is ``-inf`` and a pick among them is returned as ``-1``.

Like the compressor it reads the whole sequence with replicated parameters (no split under TP yet).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from megacann.layers.init import init_normal, make_parameter
from megacann.layers.rotary import RotaryEmbedding, rotate_trailing
from megacann.layers.window_compressor import WindowCompressor, compressed_causal_bias


def chosen_entries_bias(chosen: torch.Tensor, num_entries: int) -> torch.Tensor:
    """``[b, 1, s, num_entries]`` attention bias from the indexer's picks ``chosen`` ``[b, s, k]``: 0 for the
    entries a query picked, ``-inf`` for the rest (a ``-1`` pick opens nothing)."""
    b, s, _ = chosen.shape
    slots = torch.where(chosen >= 0, chosen, num_entries)  # -1 -> a spare column, cut off below
    bias = torch.full((b, 1, s, num_entries + 1), float("-inf"), device=chosen.device)
    return bias.scatter(-1, slots.unsqueeze(1), 0.0)[..., :num_entries]


class CompressedIndexer(WindowCompressor):
    """``forward(hidden [b, s, h], q_residual [b, s, q_rank], position_ids [b, s], rotary) -> [b, s, k]`` entry
    ids (``-1``: none), ``k = min(topk, entries)``. Parameters: the overlapping compressor's (transformers'
    names), ``q_b_proj.weight`` ``[num_heads · head_dim, q_rank]`` and ``scorer.weights_proj.weight``
    ``[num_heads, h]``."""

    def __init__(
        self,
        hidden_size: int,
        q_rank: int,
        num_heads: int,
        head_dim: int,
        compress_rate: int,
        topk: int,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__(hidden_size, head_dim, compress_rate, norm_eps, init_std, True, dtype, device)
        self.num_heads, self.topk = num_heads, topk
        shapes = {"q_b_proj": (num_heads * head_dim, q_rank), "scorer": (num_heads, hidden_size)}
        for name, shape in shapes.items():
            holder = torch.nn.Module()
            weight = make_parameter(shape, init_normal(init_std), tp_rank=0, tp_size=1,
                                    name=f"CompressedIndexer {name}", dtype=dtype, device=device)  # fmt: skip
            if name == "scorer":  # transformers' scorer.weights_proj
                holder.weights_proj = torch.nn.Module()
                holder.weights_proj.weight = weight
            else:
                holder.weight = weight
            setattr(self, name, holder)

    def index_scores(
        self,
        hidden: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
        rotary: RotaryEmbedding,
        keys: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[b, s, entries]`` fp32 scores, ``-inf`` for the entries query ``t`` may not read yet. ``keys``
        ``[b, T, head_dim]``: the compressed keys when the caller has them (a decoding cache), else
        compressed from ``hidden``."""
        keys = (super().forward(hidden, rotary) if keys is None else keys).float()  # [b, T, d]
        b, s, _ = hidden.shape
        q = F.linear(q_residual, self.q_b_proj.weight).view(b, s, self.num_heads, self.head_dim)
        cos, sin = rotary(position_ids, dtype=q.dtype)
        q = rotate_trailing(q, cos, sin, rotary.interleaved)
        scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), keys)) * self.head_dim**-0.5
        weights = F.linear(hidden, self.scorer.weights_proj.weight).float() * self.num_heads**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        return scores + compressed_causal_bias(position_ids, keys.shape[1], self.compress_rate)[:, 0]

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
        rotary: RotaryEmbedding,
        keys: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        scores = self.index_scores(hidden, q_residual, position_ids, rotary, keys)
        picked = scores.topk(min(self.topk, scores.shape[-1]), dim=-1)
        return picked.indices.masked_fill(picked.values == float("-inf"), -1)

    def forward_rows(
        self,
        hidden: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
        rotary: RotaryEmbedding,
        keys: torch.Tensor,
        row_entries: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` for rows that own different numbers of the ``keys`` (a decoding cache's
        left-padded rows: row ``i``'s first ``row_entries[i]``, the rest pooled past its end): each row
        ranks only its own, so its picks are those it gets alone (``topk`` breaks ties among equal scores,
        e.g. every head's ReLU off, by how many entries it ranks). ``[b, s, min(topk, T)]``, ``-1`` padded."""
        b, s = hidden.shape[:2]
        picks = torch.full((b, s, min(self.topk, keys.shape[1])), -1, dtype=torch.long, device=hidden.device)
        for count in row_entries.unique().tolist():
            rows = (row_entries == count).nonzero().squeeze(1)
            chosen = self(hidden[rows], q_residual[rows], position_ids[rows], rotary, keys[rows, :count])
            picks[rows, :, : chosen.shape[-1]] = chosen
        return picks

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_heads={self.num_heads}, topk={self.topk}"
