"""Implementations of :func:`megacann.ops.gated_delta_rule`, the linear attention of Gated DeltaNet
(Qwen3-Next, Qwen3.5).

- ``reference`` (any device): the recurrence token by token, the definition the others are tested
  against. Also what a decoding step runs on CPU (one token: nothing to chunk).
- ``chunked`` (cpu, cuda): the chunked matrix form. Within a chunk of :data:`CHUNK` tokens the delta
  updates are gathered in a WY / UT representation (one unit-lower-triangular solve per chunk gives every
  token's correction ``delta`` from the state at the chunk start), so the chunk costs a handful of matrix
  products; between chunks only the state passes. Packed sequences are laid end to end, each padded to
  whole chunks, and the state restarts where a sequence begins. Autograd differentiates through it (the
  solve included), so forward and backward are plain PyTorch.
- ``fla`` (cuda): flash-linear-attention's Triton kernels (``fla.ops.gated_delta_rule``; the optional
  package ``fla-core``), used when it imports: ``chunk_gated_delta_rule`` for training and prefill,
  ``fused_recurrent_gated_delta_rule`` for a decoding step without gradients.
- NPU: torch_npu ships no gated-delta kernel that megacann can check, so NPUs run the reference;
  :func:`note_npu_route` says so once when a layer is built there.

Every implementation computes in fp32 (fp64 for fp64 inputs) and returns ``o`` in ``v``'s dtype.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megacann.ops.registry import REFERENCE, logger, register

CHUNK = 64  # tokens per chunk of the chunked form (as flash-linear-attention and transformers)
_NOTED: set[str] = set()


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when any input is fp64, else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _spans(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every sequence: each row of ``q``, or the packed ones of ``cu_seqlens``."""
    b, s = q.shape[:2]
    if cu_seqlens is None:
        return [(row, 0, s) for row in range(b)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if b != 1:
        raise ValueError(f"gated_delta_rule: cu_seqlens packs sequences into one row, but the batch has {b} rows")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != s or any(e < a for a, e in zip(bounds, bounds[1:])):
        raise ValueError(f"gated_delta_rule: cu_seqlens must rise from 0 to the sequence length {s}, got {bounds}")
    return [(0, a, e) for a, e in zip(bounds, bounds[1:])]


def _start_state(initial_state: Optional[torch.Tensor], n: int, shape: tuple[int, ...], like: torch.Tensor):
    """Sequence ``n``'s starting state in the compute dtype (zeros without ``initial_state``)."""
    if initial_state is None:
        return like.new_zeros(shape)
    return initial_state[n].to(like.dtype)


def _check_states(initial_state: Optional[torch.Tensor], count: int, shape: tuple[int, ...]) -> None:
    if initial_state is not None and tuple(initial_state.shape) != (count, *shape):
        raise ValueError(
            f"gated_delta_rule: initial_state has shape {tuple(initial_state.shape)}, expected {(count, *shape)} "
            "(one state per sequence)"
        )


@register("gated_delta_rule", REFERENCE)
def gated_delta_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The recurrence, one token at a time: decay the state, correct it towards ``v_t`` along ``k_t`` by
    ``beta_t``, read it with ``q_t``."""
    dt = compute_dtype(q, k, v, g, beta)
    heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    spans = _spans(q, cu_seqlens)
    _check_states(initial_state, len(spans), (heads, dk, dv))
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    outputs, finals = [], []
    for n, (row, start, end) in enumerate(spans):
        state = _start_state(initial_state, n, (heads, dk, dv), v)
        steps = []
        for t in range(start, end):
            state = state * g[row, t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, k[row, t])
            delta = (v[row, t] - predicted) * beta[row, t][:, None]
            state = state + k[row, t][:, :, None] * delta[:, None, :]
            steps.append(torch.einsum("hkv,hk->hv", state, q[row, t] * scale))
        outputs.append(torch.stack(steps) if steps else v.new_zeros((0, heads, dv)))
        finals.append(state)
    out = torch.cat(outputs).unsqueeze(0) if cu_seqlens is not None else torch.stack(outputs)
    return out, (torch.stack(finals) if output_final_state else None)


@dataclass
class _Layout:
    """Where each sequence sits once padded to whole chunks: ``lanes`` streams scanned side by side (one
    per row, or one for packed sequences), ``begins[i]`` / ``ends[i]``: the sequences (one per lane) that
    start / finish at chunk ``i``."""

    lanes: int
    chunks: int
    begins: dict[int, list[int]]
    ends: dict[int, list[int]]
    gather: Optional[torch.Tensor] = None  # packed: the token behind each padded position (pad: one past the end)
    scatter: Optional[torch.Tensor] = None  # packed: the padded position of each token


def _layout(spans: list[tuple[int, int, int]], packed: bool, seq_len: int, chunk: int, device) -> _Layout:
    if not packed:
        chunks = math.ceil(seq_len / chunk)
        every = list(range(len(spans)))
        return _Layout(len(spans), chunks, {0: every}, {chunks - 1: every})
    gather, begins, ends, first = [], {}, {}, 0
    for n, (_, start, end) in enumerate(spans):
        count = math.ceil((end - start) / chunk)
        if count == 0:  # an empty sequence keeps its starting state
            continue
        begins[first], ends[first + count - 1] = [n], [n]
        gather += list(range(start, end)) + [seq_len] * (count * chunk - (end - start))
        first += count
    gather_index = torch.tensor(gather, dtype=torch.long, device=device)
    scatter = (gather_index < seq_len).nonzero().squeeze(1)
    return _Layout(1, first, begins, ends, gather_index, scatter)


def _to_chunks(x: torch.Tensor, layout: _Layout, chunk: int) -> torch.Tensor:
    """``[b, s, h, ...]`` → ``[lanes, h, chunks, chunk, ...]``, padded with zeros (a zero token leaves the
    state as it is: no decay, ``beta`` 0)."""
    if layout.gather is not None:
        flat = torch.cat([x[0], x.new_zeros((1, *x.shape[2:]))])
        x = flat.index_select(0, layout.gather).unsqueeze(0)
    else:
        pad = layout.chunks * chunk - x.shape[1]
        x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], dim=1) if pad else x
    x = x.reshape(x.shape[0], layout.chunks, chunk, *x.shape[2:])
    return x.movedim(3, 1)  # heads before chunks


def _from_chunks(y: torch.Tensor, layout: _Layout, seq_len: int) -> torch.Tensor:
    """Inverse of :func:`_to_chunks` for ``[lanes, h, chunks, chunk, d]`` outputs: ``[b, s, h, d]``."""
    y = y.movedim(1, 3).flatten(1, 2)
    if layout.scatter is not None:
        return y[0].index_select(0, layout.scatter).unsqueeze(0)
    return y[:, :seq_len]


@register("gated_delta_rule", "chunked", priority=5, device_types=("cpu", "cuda"))
def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunked form (module docstring); a decoding step (one token, no gradient) runs the recurrence."""
    options = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    if q.shape[1] == 0 or (q.shape[1] == 1 and not torch.is_grad_enabled()):
        return gated_delta_reference(q, k, v, g, beta, cu_seqlens=cu_seqlens, **options)
    dt = compute_dtype(q, k, v, g, beta)
    heads, dk, dv, seq_len = q.shape[2], q.shape[3], v.shape[3], q.shape[1]
    scale = dk**-0.5 if scale is None else scale
    spans = _spans(q, cu_seqlens)
    _check_states(initial_state, len(spans), (heads, dk, dv))
    layout = _layout(spans, cu_seqlens is not None, seq_len, chunk_size, q.device)
    q, k, v = (_to_chunks(t.to(dt), layout, chunk_size) for t in (q, k, v))  # [lanes, h, chunks, C, d]
    g, beta = (_to_chunks(t.to(dt), layout, chunk_size) for t in (g, beta))  # [lanes, h, chunks, C]
    q = q * scale

    log_decay = g.cumsum(-1)  # decay from the chunk start to each token (log)
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(later, -math.inf).exp()
    k_beta = k * beta[..., None]
    # Token t's correction depends on the corrections of the earlier tokens of its chunk through
    # beta_t k_tᵀ k_s (decayed): a unit-lower-triangular system, solved for the values and for the keys
    # that read the chunk's starting state.
    system = ((k_beta @ k.transpose(-1, -2)) * pair_decay).tril(-1)
    system = system + torch.eye(chunk_size, dtype=dt, device=q.device)
    rhs = torch.cat([v * beta[..., None], k_beta * log_decay.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, state_keys = solved.split([dv, dk], dim=-1)
    within = (q @ k.transpose(-1, -2)) * pair_decay  # causal attention inside the chunk, decayed
    q_from_start = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    state = q.new_zeros((layout.lanes, heads, dk, dv))
    outputs, finals = [], {}
    # per-chunk views by unbind: its backward stacks the chunks' gradients once, where indexing chunk by
    # chunk would give each chunk a gradient the size of the whole tensor (quadratic in the length)
    per_chunk = zip(*(t.unbind(2) for t in (new_values, state_keys, q_from_start, within, k_to_end, chunk_decay)))
    for i, (values_i, keys_i, q_i, within_i, k_i, decay_i) in enumerate(per_chunk):
        if i in layout.begins:
            starts = [_start_state(initial_state, n, (heads, dk, dv), q) for n in layout.begins[i]]
            state = torch.stack(starts)
        delta = values_i - keys_i @ state
        outputs.append(q_i @ state + within_i @ delta)
        state = state * decay_i + k_i.transpose(-1, -2) @ delta
        for lane, n in enumerate(layout.ends.get(i, ())):
            finals[n] = state[lane]
    out = _from_chunks(torch.stack(outputs, dim=2), layout, seq_len).to(v.dtype)
    if not output_final_state:
        return out, None
    for n in range(len(spans)):
        if n not in finals:  # an empty sequence
            finals[n] = _start_state(initial_state, n, (heads, dk, dv), q)
    return out, torch.stack([finals[n] for n in range(len(spans))])


def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None and importlib.import_module("fla.ops.gated_delta_rule")


@register("gated_delta_rule", "fla", priority=20, device_types=("cuda",), available=_fla_available)
def gated_delta_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash-linear-attention's kernels (same layouts and state orientation as this op). Its kernels take
    q, k, v and beta in one dtype (``v``'s here: a layer hands q and k over normalised in fp32), the decay
    in fp32 and ``cu_seqlens`` as int64."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    decoding = q.shape[1] == 1 and not torch.is_grad_enabled()
    kernel = fused_recurrent_gated_delta_rule if decoding else chunk_gated_delta_rule
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.long)
    out, state = kernel(
        q.to(v.dtype),
        k.to(v.dtype),
        v,
        g=g.float(),
        beta=beta.to(v.dtype),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return out.to(v.dtype), state


def note_npu_route(device_type: str) -> None:
    """Say once per process that NPUs run the reference gated delta rule (no torch_npu kernel is used)."""
    if device_type == "npu" and device_type not in _NOTED:
        _NOTED.add(device_type)
        logger.warning(
            "megacann.ops: gated_delta_rule runs its PyTorch reference on npu (token by token): torch_npu "
            "provides no gated-delta kernel megacann can verify"
        )
