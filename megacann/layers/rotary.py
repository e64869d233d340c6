"""Rotary position embedding (RoPE): the cos/sin tables, with Llama-3 and linear frequency scaling.

The frequencies are ``inv_freq[i] = theta^(-2i/d)`` for ``i < d/2``. For ``interleaved=False`` (the Hugging
Face LLaMA convention, "rotate_half") the tables are ``cat(f, f)`` along the last dim; for
``interleaved=True`` they are ``repeat_interleave(f, 2)``. The rotation itself is
:func:`megacann.ops.apply_rotary`.

``scaling`` follows the Hugging Face ``rope_scaling`` dict: ``{"rope_type": "llama3", "factor",
"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``, ``{"rope_type": "linear", "factor"}`` or ``{"rope_type": "yarn",
"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
"attention_factor", "truncate"}`` (DeepSeek-V3; YaRN also scales the tables by :func:`rope_attention_factor`,
as transformers does); ``"type"`` is accepted for ``"rope_type"``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unknown rope scaling type {kind!r}; supported: default, linear, llama3, yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(scaling: dict[str, Any]) -> float:
    missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
    if missing:
        raise ValueError(f"yarn rope scaling needs {missing} (got keys {sorted(scaling)})")
    return float(scaling["factor"])


def rope_attention_factor(scaling: Optional[dict[str, Any]]) -> float:
    """What YaRN multiplies the cos/sin tables by (1 for every other scaling): ``attention_factor`` when
    given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``mscale(factor)``."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = _yarn_factor(scaling), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies rotating fewer than ``beta_slow`` times over the original context
    are divided by ``factor``, those over ``beta_fast`` kept, a linear ramp between."""
    factor, old_len = _yarn_factor(scaling), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the unscaled (extrapolated) frequency
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low: float, high: float, old_len: float) -> torch.Tensor:
    """Llama 3.1: long wavelengths (> old_len/low) are divided by ``factor``, short ones (< old_len/high)
    kept, and the band between blends the two linearly in ``old_len / wavelength``."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    blend = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """RoPE on the trailing ``cos.shape[-1]`` channels of each head of ``x`` ``[b, s, heads, d]``, the leading
    ones left as they are (DeepSeek-V4's partial rotary: a head is ``[nope | rope]``)."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return ops.apply_rotary(x, cos, sin, interleaved)
    return torch.cat([x[..., :-width], ops.apply_rotary(x[..., -width:], cos, sin, interleaved)], dim=-1)


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
        self.attention_factor = rope_attention_factor(scaling)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}, interleaved={self.interleaved}"

    def forward(
        self, position_ids: torch.Tensor, dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tables = None
        if position_ids.device.type == "cpu" and position_ids.numel() and not torch.compiler.is_compiling():
            tables = self._cpu_tables(position_ids)
        if tables is not None:
            cos, sin = tables
        else:
            cos, sin = self._tables(position_ids.float())
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin ``[..., head_dim]`` at ``positions`` (fp32, any shape)."""
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.unsqueeze(-1) * inv_freq  # [..., d/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _cpu_tables(self, position_ids: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin at ``position_ids`` looked up in the tables of positions ``0 .. n-1`` kept on the
        module: the same values as computing them at each forward (elementwise the same fp32 operations),
        without a cos and a sin per token and forward (a tenth of a small model's GRPO step on CPU). The
        tables grow when a position falls outside them (found by the lookup itself, so a forward reads no
        number off the tensor while they hold); None for negative positions (computed directly)."""
        key = (self.inv_freq.data_ptr(), self.inv_freq._version)
        held = getattr(self, "_held_tables", None)
        if held is not None and held[0] == key:
            try:
                return F.embedding(position_ids, held[1][0]), F.embedding(position_ids, held[1][1])
            except IndexError:  # a position outside the tables (or a negative one)
                pass
        low, high = (int(v) for v in torch.aminmax(position_ids))
        if low < 0:
            return None
        rows = max(high + 1, 2 * held[1][0].shape[0] if held is not None and held[0] == key else 0, 64)
        self._held_tables = (key, self._tables(torch.arange(rows, dtype=torch.float32)))
        return self._cpu_tables(position_ids)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[b, s, heads, head_dim]`` with tables from :meth:`forward`."""
        return ops.apply_rotary(x, cos, sin, self.interleaved)
