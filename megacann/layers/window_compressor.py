"""DeepSeek-V4's KV compressors: every ``compress_rate`` tokens -> one KV entry.

Each token gives a candidate entry ``kv_proj(x)`` and a gate ``gate_proj(x) + position_bias[j]`` (``j`` its
place in the window). A closed window of ``compress_rate`` tokens becomes one entry: the candidates summed
with the softmax (over the window, per channel) of the gates, RMS-normalised (``kv_norm``), its trailing
``rope_dim`` channels rotated to the position of the window's first token. The tokens after the last closed
window give nothing (transformers' stateless mode). Query ``t`` may read entry ``w`` only once its window
has closed, ``(w + 1) · compress_rate <= t + 1``: :func:`compressed_causal_bias`. This is the heavily
compressed attention's (HCA) compressor.

With ``overlap=True`` (compressed sparse attention's compressor, and its indexer's) the windows overlap:
each token gives two candidates and two gates (projections of ``2 · head_dim``), the first half for the
entry of the next window, the second for its own window's; entry ``w`` pools the ``2 · compress_rate``
slots of window ``w - 1``'s first halves and window ``w``'s second halves (window 0's missing slots weigh
nothing).

The compressor reads the whole sequence and its parameters are replicated on every tensor-parallel rank
(one KV head); under sequence or context parallelism the caller hands it the gathered sequence.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from megacann.layers.init import init_normal, init_zeros, make_parameter
from megacann.layers.norm import RMSNorm
from megacann.layers.rotary import RotaryEmbedding, rotate_trailing


def compressed_causal_bias(position_ids: torch.Tensor, num_entries: int, compress_rate: int) -> torch.Tensor:
    """``[b, 1, s, num_entries]``: 0 where query ``t`` (at ``position_ids[b, t]``) may read entry ``w`` (its
    window closed at or before ``t``), ``-inf`` elsewhere."""
    visible = (position_ids + 1) // compress_rate  # entries closed by each query's position
    entries = torch.arange(num_entries, device=position_ids.device)
    unreadable = (entries.view(1, 1, -1) >= visible.unsqueeze(-1)).unsqueeze(1)
    return torch.zeros(unreadable.shape, device=unreadable.device).masked_fill(unreadable, float("-inf"))


class WindowCompressor(torch.nn.Module):
    """``forward(hidden [b, s, h], rotary) -> [b, s // compress_rate, head_dim]`` (``pool(*project(hidden),
    rotary)``: a decoding cache keeps the projections and pools them again). Parameters (transformers'
    names): ``kv_proj.weight`` and ``gate_proj.weight`` ``[head_dim, h]``, ``position_bias``
    ``[compress_rate, head_dim]`` (fp32), ``kv_norm.weight`` ``[head_dim]``. ``rotary`` gives the tables of
    the trailing ``rotary.head_dim`` channels (interleaved pairs, DeepSeek-V4's ``compress`` rotary).
    ``overlap``: overlapping windows (the projections and ``position_bias`` are ``2 · head_dim`` wide)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        compress_rate: int,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        overlap: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        if compress_rate < 1:
            raise ValueError(f"WindowCompressor: compress_rate must be >= 1, got {compress_rate}")
        self.head_dim, self.compress_rate, self.overlap = head_dim, compress_rate, overlap
        width = 2 * head_dim if overlap else head_dim  # each token's candidates (two series when overlapping)
        for name in ("kv_proj", "gate_proj"):  # replicated: one KV head on every TP rank
            holder = torch.nn.Module()
            holder.weight = make_parameter(
                (width, hidden_size), init_normal(init_std), tp_rank=0, tp_size=1,
                name=f"WindowCompressor {name}", dtype=dtype, device=device,
            )  # fmt: skip
            setattr(self, name, holder)
        self.position_bias = make_parameter(
            (compress_rate, width), init_zeros(), tp_rank=0, tp_size=1,
            name="WindowCompressor position_bias", dtype=torch.float32, device=device,
        )  # fmt: skip
        self.kv_norm = RMSNorm(head_dim, norm_eps, sequence_parallel=False, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        usable = hidden[:, : hidden.shape[1] // self.compress_rate * self.compress_rate]
        return self.pool(*self.project(usable), rotary)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's candidates and gates ``[b, s, width]``: what a decoding cache keeps of a token."""
        return F.linear(hidden, self.kv_proj.weight), F.linear(hidden, self.gate_proj.weight)

    def pool(self, candidates: torch.Tensor, gates: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """The entries ``[b, s // compress_rate, head_dim]`` of the closed windows of tokens projected by
        :meth:`project` (``[b, s, width]``, the first at position 0)."""
        b, s, _ = candidates.shape
        windows = s // self.compress_rate
        candidates = candidates[:, : windows * self.compress_rate].unflatten(1, (windows, self.compress_rate))
        gates = gates[:, : windows * self.compress_rate].unflatten(1, (windows, self.compress_rate))
        gates = gates + self.position_bias
        if self.overlap:
            candidates, gates = self._overlapping(candidates, 0.0), self._overlapping(gates, float("-inf"))
        weights = gates.softmax(dim=2, dtype=torch.float32).to(candidates.dtype)
        entries = self.kv_norm((candidates * weights).sum(dim=2))  # [b, windows, head_dim]
        starts = (torch.arange(windows, device=entries.device) * self.compress_rate).expand(b, -1)
        cos, sin = rotary(starts, dtype=entries.dtype)
        return rotate_trailing(entries.unsqueeze(2), cos, sin, rotary.interleaved).squeeze(2)

    def _overlapping(self, series: torch.Tensor, empty: float) -> torch.Tensor:
        """``[b, n, r, 2·d]`` -> ``[b, n, 2·r, d]``: window ``w - 1``'s first halves (``empty`` before window 0)
        then window ``w``'s second halves."""
        d = self.head_dim
        missing = series.new_full((series.shape[0], 1, self.compress_rate, d), empty)
        previous = torch.cat([missing, series[:, :-1, :, :d]], dim=1)[:, : series.shape[1]]  # none: none
        return torch.cat([previous, series[..., d:]], dim=2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, compress_rate={self.compress_rate}, overlap={self.overlap}"
