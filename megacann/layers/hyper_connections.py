"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): a residual of several streams.

The residual ``[b, s, h]`` becomes ``n`` streams ``[b, s, n, h]`` (:func:`expand_streams`: ``n`` copies).
Around each block (attention or MLP) a :class:`HyperConnection` reads all streams of a token and derives,
with one small projection of the flattened, RMS-normalised streams, three mixings:

- ``pre`` ``[b, s, n]`` (``sigmoid + eps``) collapses the streams into the block's input ``[b, s, h]``;
- ``post`` ``[b, s, n]`` (``2 · sigmoid``) spreads the block's output back over the streams;
- ``comb`` ``[b, s, n, n]`` mixes the old streams into the new ones. It is a softmax made (nearly) doubly
  stochastic by Sinkhorn-Knopp: columns, then rows and columns again, each normalised to sum to one, so
  the mixing neither grows nor shrinks the residual's norm however deep the stack.

The new streams are ``post ⊗ block_output + combᵀ · streams`` (:meth:`HyperConnection.mix`). At the end a
:class:`HyperHead` collapses the streams into one with its own ``pre`` weights, before the final norm.

Every token is mixed on its own and over its whole hidden vector, which every tensor-parallel rank holds:
tensor parallelism changes nothing here. Under sequence parallelism each rank mixes its share of the
tokens, so the mixing parameters' gradients are partial (marked ``tp_partial_grad``, summed over the TP
group like the norms'). The mixing runs in fp32 whatever the streams' dtype; the parameter names
(``fn``, ``base``, ``scale``; the head's ``hc_fn``, ``hc_base``, ``hc_scale``) are transformers' own.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from megacann.layers.context import resolve_sequence_parallel
from megacann.layers.init import init_normal, init_ones, init_zeros, make_parameter
from megacann.layers.sharding import InitMethod, mark_partial_grad


def expand_streams(x: torch.Tensor, num_streams: int) -> torch.Tensor:
    """``x`` ``[b, s, h]`` as ``num_streams`` equal streams ``[b, s, num_streams, h]`` (a copy, not a view)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], num_streams, x.shape[-1]).contiguous()


def sinkhorn_project(weights: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """``weights`` ``[..., n, n]`` (positive) scaled towards a doubly-stochastic matrix: the columns made to
    sum to one, then ``iterations - 1`` times the rows and the columns (``eps`` guards each division)."""
    weights = weights / (weights.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        weights = weights / (weights.sum(dim=-2, keepdim=True) + eps)
    return weights


def _stream_features(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """A token's ``n`` streams flattened to ``[b, s, n·h]`` in fp32 and RMS-normalised (no weight)."""
    flat = streams.flatten(-2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Σ_i pre_i · stream_i``: ``[b, s, h]`` in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


class _StreamMixing(torch.nn.Module):
    """What both modules hold: the stream count, the epsilons and the parameter factory."""

    def __init__(
        self,
        hidden_size: int,
        num_streams: int,
        eps: float,
        norm_eps: float,
        sequence_parallel: Optional[bool],
        dtype: Optional[torch.dtype],
        device: Optional[Union[torch.device, str]],
    ):
        super().__init__()
        if num_streams < 1 or hidden_size < 1:
            raise ValueError(
                f"{type(self).__name__}: num_streams {num_streams} and hidden_size {hidden_size} must be >= 1"
            )
        self.hidden_size, self.num_streams = hidden_size, num_streams
        self.eps, self.norm_eps = eps, norm_eps
        self.sequence_parallel = resolve_sequence_parallel(sequence_parallel)
        self._dtype, self._device = dtype or torch.float32, device

    def _parameter(self, shape: tuple[int, ...], init: InitMethod, name: str) -> torch.nn.Parameter:
        param = make_parameter(
            shape,
            init,
            tp_rank=0,
            tp_size=1,
            name=f"{type(self).__name__} {name}",
            dtype=self._dtype,
            device=self._device,
        )
        return mark_partial_grad(param) if self.sequence_parallel else param

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, num_streams={self.num_streams}, sequence_parallel={self.sequence_parallel}"


class HyperConnection(_StreamMixing):
    """The mixing around one block. ``forward(streams [b, s, n, h]) -> (post, comb, block_input)``; after the
    block, ``mix(streams, block_output, post, comb)`` gives the next streams. Parameters (fp32 unless
    ``dtype``): ``fn`` ``[(2 + n)·n, n·h]`` (normal, ``init_std``), ``base`` ``[(2 + n)·n]`` (zeros) and
    ``scale`` ``[3]`` (ones: the pre, post and comb logits' scales)."""

    def __init__(
        self,
        hidden_size: int,
        num_streams: int = 4,
        sinkhorn_iterations: int = 20,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        sequence_parallel: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__(hidden_size, num_streams, eps, norm_eps, sequence_parallel, dtype, device)
        if sinkhorn_iterations < 1:
            raise ValueError(f"HyperConnection: sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}")
        self.sinkhorn_iterations = sinkhorn_iterations
        n = num_streams
        self.fn = self._parameter(((2 + n) * n, n * hidden_size), init_normal(init_std), "fn")
        self.base = self._parameter(((2 + n) * n,), init_zeros(), "base")
        self.scale = self._parameter((3,), init_ones(), "scale")

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``post`` ``[b, s, n]`` and ``comb`` ``[b, s, n, n]`` (fp32) and the block's input ``[b, s, h]``."""
        n = self.num_streams
        if streams.dim() != 4 or streams.shape[-2:] != (n, self.hidden_size):
            raise ValueError(
                f"HyperConnection: streams of shape {tuple(streams.shape)}, expected [b, s, {n}, {self.hidden_size}]"
            )
        mixes = F.linear(_stream_features(streams, self.norm_eps), self.fn.float())
        pre_logits, post_logits, comb_logits = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.float().split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_logits * pre_scale + pre_base) + self.eps
        post = 2 * torch.sigmoid(post_logits * post_scale + post_base)
        comb_logits = comb_logits.unflatten(-1, (n, n)) * comb_scale + comb_base.view(n, n)
        comb = sinkhorn_project(torch.softmax(comb_logits, dim=-1) + self.eps, self.sinkhorn_iterations, self.eps)
        return post, comb, _collapse(streams, pre)

    @staticmethod
    def mix(streams: torch.Tensor, block_output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The next streams ``[b, s, n, h]``: ``post_i · block_output + Σ_j comb_ji · stream_j`` (streams' dtype)."""
        dtype = streams.dtype
        spread = post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2)
        return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(_StreamMixing):
    """The last collapse: ``forward(streams [b, s, n, h]) -> [b, s, h]``, weighted by ``sigmoid + eps`` of a
    projection of the normalised streams. Parameters: ``hc_fn`` ``[n, n·h]``, ``hc_base`` ``[n]``,
    ``hc_scale`` ``[1]``."""

    def __init__(
        self,
        hidden_size: int,
        num_streams: int = 4,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        sequence_parallel: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__(hidden_size, num_streams, eps, norm_eps, sequence_parallel, dtype, device)
        n = num_streams
        self.hc_fn = self._parameter((n, n * hidden_size), init_normal(init_std), "hc_fn")
        self.hc_base = self._parameter((n,), init_zeros(), "hc_base")
        self.hc_scale = self._parameter((1,), init_ones(), "hc_scale")

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_stream_features(streams, self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return _collapse(streams, pre)
