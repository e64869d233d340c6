"""Gated DeltaNet, the linear-attention block of Qwen3-Next and Qwen3.5, split across tensor-parallel ranks
by heads.

As transformers' ``Qwen3_5GatedDeltaNet`` defines it: one fused projection gives the queries, keys and
values (``in_proj_qkv``), which pass a short causal depthwise convolution with SiLU (``conv1d``);
queries and keys are L2-normalised; ``in_proj_b`` gives the write strength ``beta = sigmoid(b)`` and
``in_proj_a`` the decay ``g = -exp(A_log) · softplus(a + dt_bias)`` of each value head; the gated delta
rule (:func:`megacann.ops.gated_delta_rule`) mixes the tokens; each head's output is RMS-normalised
(``norm``) and gated by ``silu(z)`` (``in_proj_z``); ``out_proj`` returns to the hidden size. Parameter
names are Hugging Face's. With more value heads than key heads, each key head serves consecutive value
heads (grouped value attention).

Under tensor parallelism every projection except ``out_proj`` is column-parallel (the fused one with
``tp_blocks`` q | k | v, the convolution split alike), ``A_log`` and ``dt_bias`` are split by value head,
``out_proj`` is row-parallel; ``norm`` is whole on every rank (its gradient partial, summed over TP).
Sequence parallelism gathers the sequence in the projections as the attention layers do.

Packed documents (``segment_ids`` ``[b, s]``, as :class:`~megacann.layers.SelfAttention` takes them):
the recurrent state and the convolution restart at each document, so packed output and gradients equal
the documents run one by one. Under context parallelism each rank holds its share of the sequence
(:mod:`megacann.layers.context_parallel`); the convolution's left context and the recurrent state cross
the ranks in sequence order (:mod:`megacann.layers.context_parallel.recurrent_state`).

Decoding: :meth:`GatedDeltaNet.new_cache` makes a :class:`GatedDeltaNetCache` (the recurrent state and the
convolution's last inputs); ``forward(hidden, cache=cache)`` runs a prompt or one new token from it and
leaves the cache at the last token. While generating, ``kv_cache`` (set by :mod:`megacann.generation`, as
on the attention layers) runs the rule from each row's cache (:meth:`GatedDeltaNet.cached_rule`, left
padding kept out of the state), whichever family the layer is in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from megacann import ops
from megacann import parallel_state as ps
from megacann.layers import mappings
from megacann.layers.context_parallel import recurrent_state
from megacann.layers.init import default_init_methods, init_ones, make_parameter
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear
from megacann.layers.norm import RMSNorm
from megacann.layers.sharding import InitMethod, mark_partial_grad
from megacann.layers.short_convolution import ShortConvolution
from megacann.ops.gated_delta import note_npu_route

L2_EPS = 1e-6  # transformers' and flash-linear-attention's epsilon of the query / key L2 norm


def _log_uniform(tensor: torch.Tensor, low: float, high: float) -> torch.Tensor:
    with torch.no_grad():
        return tensor.uniform_(low, high).log_()


def init_log_uniform(low: float = 0.01, high: float = 16.0) -> InitMethod:
    """``log(U(low, high))``: transformers' draw of ``A_log`` (decay rates between 0.01 and 16)."""
    return functools.partial(_log_uniform, low=low, high=high)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 when it is of a lower precision (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last dim, in fp32 (as transformers and flash-linear-attention)."""
    x = at_least_fp32(x)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def documents(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed documents of ``segment_ids`` ``[rows, s]`` flattened to one row: ``cu_seqlens`` (every
    document's start, and the end), and for each row the index of its first and of its last document."""
    rows, s = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    flat = starts.flatten().nonzero().squeeze(1)
    cu_seqlens = torch.cat([flat, flat.new_tensor([rows * s])]).to(torch.int32)
    per_row = starts.sum(1)
    last = per_row.cumsum(0) - 1
    return cu_seqlens, last - per_row + 1, last


@dataclass
class GatedDeltaNetCache:
    """What decoding keeps per layer: the convolution's last inputs ``[b, kernel-1, channels]`` and the
    recurrent state ``[b, heads, dk, dv]`` (fp32), both of this rank's heads."""

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[2, b, ...]`` (a rank's two context-parallel chunks) -> ``[2b, ...]``."""
    return t.flatten(0, 1)


class GatedDeltaNet(torch.nn.Module):
    """``forward(hidden [b, s_local, h], segment_ids=None, cache=None) -> [b, s_local, h]``.

    ``segment_ids`` ``[b, s]`` (the whole sequence under sequence parallelism, this rank's share under
    context parallelism) marks packed documents. ``cache``: start from and update a decoding cache
    (no packed documents, no context parallelism). Arguments left None come from the current
    :class:`~megacann.layers.context.LayerContext`, as for the other layers.
    """

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
        sequence_parallel: Optional[bool] = None,
        context_parallel_group: Optional[dist.ProcessGroup] = None,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        tp = mappings.tp_world_size(group)
        if num_value_heads % num_key_heads:
            raise ValueError(
                f"GatedDeltaNet: linear_num_value_heads {num_value_heads} is not a multiple of "
                f"linear_num_key_heads {num_key_heads}"
            )
        if num_key_heads % tp:
            raise ValueError(
                f"GatedDeltaNet: linear_num_key_heads {num_key_heads} is not divisible by "
                f"tensor_model_parallel_size {tp}"
            )
        init_method, output_init_method = default_init_methods(init_method, output_init_method)
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.local_key_heads, self.local_value_heads = num_key_heads // tp, num_value_heads // tp
        self.context_parallel_group = context_parallel_group
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        blocks = (key_dim, key_dim, value_dim)
        made = dict(group=group, dtype=dtype, device=device)
        linear = dict(sequence_parallel=sequence_parallel, bias=False, init_method=init_method, **made)
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, sum(blocks), tp_blocks=blocks, **linear)
        self.in_proj_z = ColumnParallelLinear(hidden_size, value_dim, **linear)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_value_heads, **linear)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_value_heads, **linear)
        self.conv1d = ShortConvolution(sum(blocks), conv_kernel_size, init_method, tp_blocks=blocks, **made)
        per_head = dict(tp_rank=mappings.tp_rank(group), tp_size=tp, tp_dim=0, dtype=dtype, device=device)
        self.dt_bias = make_parameter((num_value_heads,), init_ones(), name="GatedDeltaNet dt_bias", **per_head)
        self.A_log = make_parameter((num_value_heads,), init_log_uniform(), name="GatedDeltaNet A_log", **per_head)
        self.norm = RMSNorm(value_head_dim, norm_eps, sequence_parallel=False, dtype=dtype, device=device)
        if tp > 1:  # whole on every rank, each rank normalises its own heads
            mark_partial_grad(self.norm.weight)
        self.out_proj = RowParallelLinear(
            value_dim, hidden_size, bias=False, sequence_parallel=sequence_parallel,
            init_method=output_init_method, **made,
        )  # fmt: skip
        note_npu_route(self.A_log.device.type)
        self.kv_cache = None  # while generating: the cache layer that keeps this layer's state (megacann.generation)

    def _cp_group(self) -> Optional[dist.ProcessGroup]:
        group = self.context_parallel_group or ps.get_context_parallel_group()
        return group if group is not None and dist.get_world_size(group) > 1 else None

    def new_cache(self, batch_size: int) -> GatedDeltaNetCache:
        """An empty decoding cache (zeros: no token seen yet) for this rank's heads."""
        weight = self.conv1d.weight
        conv = weight.new_zeros((batch_size, self.conv1d.context, weight.shape[0]))
        state_shape = (batch_size, self.local_value_heads, self.key_head_dim, self.value_head_dim)
        return GatedDeltaNetCache(conv, weight.new_zeros(state_shape, dtype=torch.float32))

    def _rule_inputs(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (normalised, one per value head), v, g, beta of the delta rule from the convolved q | k | v."""
        key_size = self.local_key_heads * self.key_head_dim
        q, k, v = mixed.split([key_size, key_size, mixed.shape[-1] - 2 * key_size], dim=-1)
        q, k = (l2_normalize(rearrange(t, "b s (h d) -> b s h d", d=self.key_head_dim)) for t in (q, k))
        group = self.local_value_heads // self.local_key_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        v = rearrange(v, "b s (h d) -> b s h d", d=self.value_head_dim)
        g = -at_least_fp32(self.A_log).exp() * F.softplus(at_least_fp32(a) + at_least_fp32(self.dt_bias))
        return q, k, v, g, b.sigmoid()

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm of each head (``norm(o) · silu(z)``), then the output projection."""
        z = rearrange(z, "b s (h d) -> b s h d", d=self.value_head_dim)
        gated = self.norm(core) * F.silu(at_least_fp32(z))
        return self.out_proj(rearrange(gated.to(z.dtype), "b s h d -> b s (h d)"))

    def forward(
        self,
        hidden: torch.Tensor,
        segment_ids: Optional[torch.Tensor] = None,
        cache: Optional[GatedDeltaNetCache] = None,
    ) -> torch.Tensor:
        x = self.in_proj_qkv.prepare_input(hidden)
        mixed = self.in_proj_qkv.forward_prepared(x)
        z, b, a = (proj.forward_prepared(x) for proj in (self.in_proj_z, self.in_proj_b, self.in_proj_a))
        if self.kv_cache is not None:  # generation: the cache layer runs the rule from its rows' states
            return self._output(self.kv_cache.mix(self, mixed, b, a), z)
        cp_group = self._cp_group()
        if cache is not None and (cp_group is not None or segment_ids is not None):
            raise ValueError("GatedDeltaNet: a decoding cache takes one sequence per row, without context parallelism")
        if cp_group is not None:
            return self._output(self._context_parallel_rule(mixed, b, a, segment_ids, cp_group), z)
        if cache is not None:
            return self._output(self.cached_rule(mixed, b, a, cache), z)
        q, k, v, g, beta = self._rule_inputs(self.conv1d(mixed, segment_ids), b, a)
        rule = dict(scale=self.key_head_dim**-0.5)
        if segment_ids is not None:
            cu_seqlens = documents(segment_ids)[0]
            flat = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, v, g, beta))
            core, _ = ops.gated_delta_rule(*flat, cu_seqlens=cu_seqlens, **rule)
            core = core.view(v.shape)
        else:
            core, _ = ops.gated_delta_rule(q, k, v, g, beta, **rule)
        return self._output(core, z)

    def cached_rule(
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        cache: GatedDeltaNetCache,
        real: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The delta rule's output ``[b, s, heads, dv]`` for the projections of ``s`` tokens a row, started
        from ``cache`` and leaving it at the last token. ``real`` ``[b, s]`` (bool, None: all) marks the
        tokens after a row's left padding: a padded token's inputs become zeros, so the convolution reads
        zeros before the row's first real token and the zero keys and values leave the state zero."""
        if real is not None:
            mixed = mixed * real.unsqueeze(-1).to(mixed.dtype)
        left = cache.conv_state
        q, k, v, g, beta = self._rule_inputs(self.conv1d(mixed, left=left), b, a)
        core, state = ops.gated_delta_rule(
            q, k, v, g, beta, scale=self.key_head_dim**-0.5, initial_state=cache.recurrent_state,
            output_final_state=True,
        )  # fmt: skip
        cache.conv_state = self.conv1d.last_inputs(mixed, left).detach()
        cache.recurrent_state = state.detach()
        return core

    def _context_parallel_rule(
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        segment_ids: Optional[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        """The delta rule over this rank's two chunks, started from the states the chunks before hand on.

        Each chunk is run once with its values widened by ``dk`` zero columns and a starting state
        ``[0 | I]``: the extra columns of the end state are the chunk's transition ``P`` and those of the
        output are ``P_tᵀ q_t``, so the true output is the zero-start output plus ``startᵀ P_tᵀ q_t``
        once the start is known (:func:`recurrent_state.entering_states`)."""
        if segment_ids is None:
            segment_ids = torch.zeros(mixed.shape[:2], dtype=torch.long, device=mixed.device)

        def pieces(t: torch.Tensor) -> torch.Tensor:  # [b, 2c, ...] -> [2, b, c, ...]
            return t.unflatten(1, (2, t.shape[1] // 2)).transpose(0, 1)

        chunks, ids = pieces(mixed), pieces(segment_ids)
        left, left_ids = recurrent_state.left_context(chunks, ids, self.conv1d.context, group)
        after_first = torch.tensor([c > 0 for c in recurrent_state.local_chunk_ids(group)], device=ids.device)
        continues = (left_ids[:, :, -1] == ids[:, :, 0]) & after_first[:, None]
        convolved = self.conv1d(_rows(chunks), _rows(ids), _rows(left), _rows(left_ids))
        q, k, v, g, beta = self._rule_inputs(convolved, _rows(pieces(b)), _rows(pieces(a)))
        heads, dk, dv = v.shape[2], self.key_head_dim, self.value_head_dim
        exact = torch.promote_types(v.dtype, torch.float32)  # the start is added in the op's own precision
        wide_v = torch.cat([v.to(exact), v.new_zeros((*v.shape[:3], dk), dtype=exact)], dim=-1)
        cu_seqlens, first, last = documents(_rows(ids))
        identity = torch.eye(dk, dtype=exact, device=v.device)
        start = torch.zeros((cu_seqlens.numel() - 1, heads, dk, dv + dk), dtype=exact, device=v.device)
        start[first, :, :, dv:] = identity
        flat = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, wide_v, g, beta))
        wide, ends = ops.gated_delta_rule(
            *flat, scale=dk**-0.5, initial_state=start, output_final_state=True, cu_seqlens=cu_seqlens
        )
        wide = wide.view(*v.shape[:3], dv + dk)
        local, transition = ends[last].unflatten(0, (2, -1)).split([dv, dk], dim=-1)
        entering = recurrent_state.entering_states(transition, local, continues, group)  # [2, b, h, dk, dv]
        core = wide[..., :dv] + torch.einsum("rshk,rhkv->rshv", wide[..., dv:], _rows(entering))
        return core.to(v.dtype).unflatten(0, (2, -1)).transpose(0, 1).flatten(1, 2)
