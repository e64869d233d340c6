"""The Ascend route: torch_npu's fused CANN kernels as implementations (name ``npu``, device type ``npu``)
of the ops declared in :mod:`megacann.ops.signatures`. torch_npu is imported only when an op first
resolves on an NPU (through :func:`megacann.accelerator.import_torch_npu`), never by ``import megacann``.

Calls follow torch_npu's documented signatures:

- ``npu_rms_norm(x, gamma, epsilon=eps) -> (y, rstd)``
- ``npu_rotary_mul(x, r1, r2, rotary_mode='half'|'interleave')``: 4-D; the cos/sin tables are passed as
  ``[b or 1, s, 1, d]`` in ``x``'s dtype
- ``npu_swiglu(x, dim=-1)``: the fused gate|up form (the split form runs the reference)
- ``npu_fusion_attention(q, k, v, head_num, input_layout, ...)``: ``BSND`` for unpacked batches (causal:
  the 2048x2048 upper-triangular bool mask, True = masked, with ``sparse_mode=2``); ``TND`` for packed
  sequences (``segment_ids``), with the cumulative document ends as ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` and ``sparse_mode=3`` when causal; an explicit ``attn_mask`` goes in as its
  complement with ``sparse_mode=0``. Key/value may have fewer heads (GQA). A sliding window W uses band
  mode (``sparse_mode=4``, the same compressed mask) with ``pre_tockens=W-1`` and ``next_tockens=0``: a
  query at ``i`` keeps keys ``j`` with ``i - pre_tockens <= j <= i + next_tockens``, i.e. its last W keys
  (in TND, within each document).
- ``attention_block`` (a context-parallel step, layout ``BNSD``): ``npu_fusion_attention`` returns the
  softmax max and sum per row (``[b, n, s, 8]``, the value repeated), so ``lse = max + log(sum)``; the
  backward ``npu_fusion_attention_grad(q, k, v, dy, head_num, "BNSD", softmax_max=, softmax_sum=,
  attention_in=, scale_value=, ...)`` gets the final lse as the max and ones as the sum (``max + log 1``
  is the lse) and the final output as ``attention_in``; a causal step uses ``sparse_mode=2``. A ``band``
  (windows under context parallelism) runs the reference.
- ``npu_cross_entropy_loss(logits, target, reduction='none', ...)`` for fp32 logits (its loss has the input's
  dtype, so bf16 logits use the reference, which computes the loss in fp32)
- ``npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, eps, grad, None, False,
  False, out=(param, exp_avg, exp_avg_sq))``, where the powers are ``beta ** (step - 1)`` (the kernel
  multiplies by ``beta`` once more)

An older torch_npu whose ``npu_rotary_mul`` takes no ``rotary_mode`` leaves ``apply_rotary`` to its next
implementation, with one log line (:mod:`megacann.ops.npu_api`); one whose ``npu_fusion_attention`` takes
no ``actual_seq_qlen`` (CANN 7.0, 8.0.RC1) runs a packed batch as one ``BSND`` call per document (the same
masks: causal, band, or none), said once when the op is resolved.

A packed batch's documents are the runs of equal ``segment_ids`` in each row (what GPT packing makes);
the reference masks by equality of ids, which is the same for contiguous runs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megacann.accelerator import import_torch_npu
from megacann.constants import IGNORE_INDEX
from megacann.ops import attention_blocks, npu_api, reference
from megacann.ops.registry import register

NPU = "npu"
PRIORITY = 20
COMPRESSED_MASK_SIZE = 2048  # the optimised causal mask torch_npu expects with sparse_mode 2/3
SPARSE_NONE, SPARSE_LEFT_UP_CAUSAL, SPARSE_RIGHT_DOWN_CAUSAL, SPARSE_BAND = 0, 2, 3, 4

_causal_masks: dict[torch.device, torch.Tensor] = {}


def available() -> bool:
    return import_torch_npu() is not None


def _npu():
    return import_torch_npu()


def _npu_op(name: str, priority: int = PRIORITY):
    return register(name, NPU, priority=priority, device_types=("npu",), available=available)


@_npu_op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _npu().npu_rms_norm(x, weight, epsilon=eps)[0]


@register(
    "apply_rotary",
    NPU,
    priority=PRIORITY,
    device_types=("npu",),
    available=lambda: npu_api.supports("apply_rotary", NPU, "npu_rotary_mul", "rotary_mode"),
)
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if x.dim() != 4:
        return reference.apply_rotary(x, cos, sin, interleaved)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    r1, r2 = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)  # [b or 1, s, 1, d]
    return _npu().npu_rotary_mul(x, r1, r2, rotary_mode="interleave" if interleaved else "half")


@_npu_op("swiglu")
def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None, *, overwrite_input: bool = False) -> torch.Tensor:
    if up is not None:
        return reference.swiglu(x, up)
    return _npu().npu_swiglu(x, dim=-1)


def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed causal mask: ``[2048, 2048]`` bool, True above the diagonal (= masked)."""
    mask = _causal_masks.get(device)
    if mask is None:
        ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
        mask = _causal_masks[device] = torch.triu(ones, diagonal=1)
    return mask


def cumulative_seq_lens(segment_ids: torch.Tensor) -> list[int]:
    """End offsets (exclusive, cumulative over the flattened ``[b * s]`` tokens) of each run of equal ids
    in each row: the ``actual_seq_qlen`` of the TND layout."""
    b, s = segment_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = starts.flatten().nonzero().flatten().tolist()
    return first[1:] + [b * s]


def packed_in_one_call() -> bool:
    """Whether packed documents go to ``npu_fusion_attention`` in one TND call (it takes ``actual_seq_qlen``);
    if not, the one line saying so is logged the first time this is asked."""
    return npu_api.takes(
        "scaled_dot_product_attention", "TND with actual_seq_qlen/kvlen", "npu_fusion_attention", "actual_seq_qlen",
        "one BSND call per document",
    )  # fmt: skip


def _attention_available() -> bool:
    if not available():
        return False
    packed_in_one_call()  # asked as the op is resolved, so a fallback is said at the start of a run
    return True


def _per_document(npu, q, k, v, segment_ids, heads, mask, common) -> torch.Tensor:
    """Packed rows without TND lengths: each document (a run of equal ``segment_ids``) attends in its own
    BSND call with ``mask`` (causal, band or none), the outputs put back in place."""
    rows = []
    for row in range(q.shape[0]):
        ends = cumulative_seq_lens(segment_ids[row : row + 1])
        pieces = [
            npu.npu_fusion_attention(
                *(t[row : row + 1, start:end] for t in (q, k, v)), heads, "BSND", **mask, **common
            )[0]
            for start, end in zip([0, *ends[:-1]], ends)
        ]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


@register(
    "scaled_dot_product_attention",
    NPU,
    priority=PRIORITY,
    device_types=("npu",),
    available=_attention_available,
)
def scaled_dot_product_attention(
    q,
    k,
    v,
    *,
    causal=True,
    segment_ids=None,
    attn_mask=None,
    dropout_p=0.0,
    scale=None,
    sliding_window=None,
    sinks=None,
) -> torch.Tensor:
    if sinks is not None:
        raise ValueError(
            "scaled_dot_product_attention: sinks (attention sinks, gpt-oss) are not supported by torch_npu's "
            "npu_fusion_attention; the NPU kernel has no sink column"
        )
    b, s, heads, d = q.shape
    common = dict(scale=scale if scale is not None else 1.0 / math.sqrt(d), keep_prob=1.0 - dropout_p)
    npu = _npu()
    window = reference.effective_window(sliding_window, s, causal)
    if attn_mask is not None:
        allowed = reference.attention_mask(s, causal, segment_ids, q.device, window)
        allowed = attn_mask if allowed is None else allowed & attn_mask
        masked = dict(atten_mask=~allowed, sparse_mode=SPARSE_NONE)
        return npu.npu_fusion_attention(q, k, v, heads, "BSND", **masked, **common)[0]
    band = {}
    if window is not None:  # the last W keys: a band W-1 behind the diagonal, none ahead
        band = dict(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_BAND, pre_tockens=window - 1, next_tockens=0)
    if segment_ids is not None and not packed_in_one_call():
        mask = dict(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_LEFT_UP_CAUSAL) if causal else {}
        return _per_document(npu, q, k, v, segment_ids, heads, band or mask, common)
    if segment_ids is not None:
        lens = cumulative_seq_lens(segment_ids)
        mask = dict(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL) if causal else {}
        mask = band or mask
        flat = [t.reshape(b * s, t.shape[2], d) for t in (q, k, v)]
        out = npu.npu_fusion_attention(
            *flat, heads, "TND", actual_seq_qlen=lens, actual_seq_kvlen=lens, **mask, **common
        )[0]
        return out.view(b, s, heads, d)
    mask = dict(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_LEFT_UP_CAUSAL) if causal else {}
    return npu.npu_fusion_attention(q, k, v, heads, "BSND", **(band or mask), **common)[0]


STAT_COLUMNS = 8  # npu_fusion_attention's softmax max / sum repeat each row's value 8 times


@_npu_op("attention_block")
def attention_block(q, k, v, *, scale, causal=False, band=None) -> tuple[torch.Tensor, torch.Tensor]:
    if band is not None:
        return attention_blocks.attention_block(q, k, v, scale=scale, causal=causal, band=band)
    mask = dict(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_LEFT_UP_CAUSAL) if causal else {}
    out, row_max, row_sum = _npu().npu_fusion_attention(
        q, k, v, q.shape[1], "BNSD", scale=scale, keep_prob=1.0, **mask
    )[:3]
    acc = attention_blocks.acc_dtype(q.dtype)
    return out.to(acc), (row_max[..., 0] + row_sum[..., 0].log()).to(acc)


@_npu_op("attention_block_backward")
def attention_block_backward(
    q, k, v, out, lse, dout, *, scale, causal=False, band=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if band is not None:
        return attention_blocks.attention_block_backward(q, k, v, out, lse, dout, scale=scale, causal=causal, band=band)
    mask = dict(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_LEFT_UP_CAUSAL) if causal else {}
    row_max = lse.float().unsqueeze(-1).expand(*lse.shape, STAT_COLUMNS).contiguous()
    dq, dk, dv = _npu().npu_fusion_attention_grad(
        q, k, v, dout.to(q.dtype), q.shape[1], "BNSD", softmax_max=row_max, softmax_sum=torch.ones_like(row_max),
        attention_in=out.to(q.dtype), scale_value=scale, keep_prob=1.0, **mask,
    )[:3]  # fmt: skip
    acc = attention_blocks.acc_dtype(q.dtype)
    return dq.to(acc), dk.to(acc), dv.to(acc)


@_npu_op("cross_entropy")
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    if logits.dtype != torch.float32:
        return reference.cross_entropy(logits, target, ignore_index)
    flat_target = target.reshape(-1).long()
    ignored = flat_target == ignore_index
    # torch_npu treats a negative ignore_index as "ignore nothing": give ignored rows a valid class and
    # zero their loss (and so their gradient) afterwards
    loss = _npu().npu_cross_entropy_loss(
        logits.reshape(-1, logits.shape[-1]),
        flat_target.masked_fill(ignored, 0),
        reduction="none",
        ignore_index=ignore_index,
    )[0]
    return loss.masked_fill(ignored, 0.0).view(target.shape)


@_npu_op("adamw_step_")
def adamw_step_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
    _npu().npu_apply_adam_w(
        beta1 ** (step - 1),
        beta2 ** (step - 1),
        lr,
        weight_decay,
        beta1,
        beta2,
        eps,
        grad,
        None,
        False,
        False,
        out=(param, exp_avg, exp_avg_sq),
    )
