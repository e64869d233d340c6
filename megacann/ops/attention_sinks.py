"""Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax as an extra
column whose value is zero, so a row may give part of its weight to "nothing".

With the row's scores ``s_j`` and the head's sink logit ``z``, the weights are ``exp(s_j) / (Σ_j exp(s_j) +
exp(z))``. An implementation that already returns the output ``o`` and log-sum-exp ``L`` of the plain
softmax gets the sink's result by rescaling: ``L' = logaddexp(L, z)``, ``o' = o · exp(L − L')``. The backward of
blockwise attention then runs unchanged with ``o'`` and ``L'`` (its probabilities ``exp(s − L')`` are the
sink-aware ones, and the sink column, having no value, adds nothing to ``rowsum(dO · o')``), and the sink's
own gradient is ``dz = −Σ_rows exp(z − L') · rowsum(dO · o')``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def check_sinks(sinks: Optional[torch.Tensor], query_heads: int) -> None:
    """``sinks`` must be one logit per query head (``[hq]``)."""
    if sinks is not None and tuple(sinks.shape) != (query_heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({query_heads},), got {tuple(sinks.shape)}")


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp with the sink columns, from the plain softmax's ``out`` ``[b, hq, s, d]``
    and ``lse`` ``[b, hq, s]`` (BHSD, any float dtype; the result has their dtypes)."""
    lse_with_sink = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - lse_with_sink).unsqueeze(-1), lse_with_sink


def sinks_grad(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits ``[hq]`` given the sink-aware ``out`` and ``lse`` (BHSD) and ``dout``."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    weight = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(weight * delta).sum((0, 2)).to(sinks.dtype)


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The readable form: scores of BSND ``q`` against ``k`` (GQA expanded), masked where ``mask`` (boolean,
    True = attend, broadcastable to ``[b, hq, s, s]``) is False, the sink column appended, softmax, the
    sink column dropped, then the weighted sum of ``v``. Returns ``[b, s, hq, d]``."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    b, h, s, _ = scores.shape
    sink_column = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(vh.dtype), vh).transpose(1, 2)
