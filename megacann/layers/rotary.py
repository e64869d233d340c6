"""Rotary position embedding (RoPE): the cos/sin tables, with Llama-3 and linear frequency scaling.

The frequencies are ``inv_freq[i] = theta^(-2i/d)`` for ``i < d/2``. For ``interleaved=False`` (the Hugging
Face LLaMA convention, "rotate_half") the tables are ``cat(f, f)`` along the last dim; for
``interleaved=True`` they are ``repeat_interleave(f, 2)``. The rotation itself is
:func:`megacann.ops.apply_rotary`.

``scaling`` follows the Hugging Face ``rope_scaling`` dict: ``{"rope_type": "llama3", "factor",
"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` or ``{"rope_type": "linear",
"factor"}``; ``"type"`` is accepted for ``"rope_type"``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megacann import ops

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: Optional[dict[str, Any]] = None) -> torch.Tensor:
    """The ``head_dim/2`` inverse frequencies in fp32, scaled as ``scaling`` says."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope scaling needs {missing} (got keys {sorted(scaling)})")
        return _llama3_scale(inv_freq, *(float(scaling[k]) for k in _LLAMA3_KEYS))
    raise ValueError(f"unknown rope scaling type {kind!r}; supported: default, linear, llama3")


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low: float, high: float, old_len: float) -> torch.Tensor:
    """Llama 3.1: long wavelengths (> old_len/low) are divided by ``factor``, short ones (< old_len/high)
    kept, and the band between blends the two linearly in ``old_len / wavelength``."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    blend = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """``forward(position_ids [b, s] or [s]) -> (cos, sin)``, each ``[b, s, head_dim]`` (or ``[s, head_dim]``),
    computed in fp32 and returned in ``dtype`` (default fp32)."""

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        scaling: Optional[dict[str, Any]] = None,
        interleaved: bool = False,
    ):
        super().__init__()
        self.head_dim, self.theta, self.interleaved = head_dim, theta, interleaved
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}, interleaved={self.interleaved}"

    def forward(
        self, position_ids: torch.Tensor, dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(position_ids.device)
        angles = position_ids.float().unsqueeze(-1) * inv_freq  # [..., s, d/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[b, s, heads, head_dim]`` with tables from :meth:`forward`."""
        return ops.apply_rotary(x, cos, sin, self.interleaved)
