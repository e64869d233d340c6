"""``npu_incre_flash_attention``: the incremental (decoding) flash attention, one query token a row over a
key/value cache, with torch_npu's documented signature.

Checked limits, from the documentation: query, key and value float16 or bfloat16, of one dtype (int8
keys are the quantised form, not modelled); key and value of one shape; ``num_heads`` a multiple of
``num_key_value_heads`` (0: as many as ``num_heads``); ``atten_mask`` bool, int8 or uint8, 1 = the key is
left out; tensors contiguous. The fake models the ``BSH`` layout (query ``[B, 1, num_heads * D]``, key and
value ``[B, S, num_key_value_heads * D]``), a mask of shape ``[B, 1, 1, S]``, head dim up to 512, and no
quantisation, paging, ``pse_shift`` or ``actual_seq_lengths``; a query row whose mask leaves out every key
(undefined on the device) is an AssertionError.
"""

from __future__ import annotations

import torch

from .contract import Release

INCRE_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
MAX_HEAD_DIM = 512


def kernels(npu, release: Release) -> list:
    """``[npu_incre_flash_attention]``, or nothing for a release without it."""

    def npu_incre_flash_attention(
        query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None, actual_seq_lengths=None,
        antiquant_scale=None, antiquant_offset=None, block_table=None, dequant_scale1=None, quant_scale1=None,
        dequant_scale2=None, quant_scale2=None, quant_offset2=None, kv_padding_size=None, num_heads=1,
        scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1,
    ):  # fmt: skip
        unmodelled = (padding_mask, pse_shift, actual_seq_lengths, antiquant_scale, antiquant_offset, block_table)
        quant = (dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2, kv_padding_size)
        assert all(t is None for t in unmodelled + quant), "the fake models no quantisation, paging or pse"
        assert input_layout in ("BSH", "BNSD", "BSND"), f"input_layout must be BSH, BNSD or BSND, got {input_layout!r}"
        assert input_layout == "BSH", "the fake models the BSH layout"
        assert query.dtype in INCRE_DTYPES, f"query must be float16 or bfloat16, got {query.dtype}"
        assert key.dtype == value.dtype == query.dtype, "query, key and value: one dtype"
        assert key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} must match"
        assert all(t.is_contiguous() for t in (query, key, value)), "non-contiguous tensors are not supported"
        kv_heads = num_key_value_heads or num_heads
        assert num_heads % kv_heads == 0, f"num_heads {num_heads} is not a multiple of {kv_heads} kv heads"
        b, s_q, hidden = query.shape
        assert s_q == 1, f"incremental attention takes one query token a row, got {s_q}"
        assert hidden % num_heads == 0, f"query hidden {hidden} is not num_heads {num_heads} x head dim"
        d = hidden // num_heads
        assert d <= MAX_HEAD_DIM, f"head dim {d} over {MAX_HEAD_DIM}"
        s_kv = key.shape[1]
        assert key.dim() == 3 and key.shape[0] == b and key.shape[2] == kv_heads * d, (
            f"key must be [B, S, num_key_value_heads * D] = [{b}, S, {kv_heads * d}], got {tuple(key.shape)}"
        )
        q = query.double().view(b, num_heads, d)
        k = key.double().view(b, s_kv, kv_heads, d).repeat_interleave(num_heads // kv_heads, dim=2)
        v = value.double().view(b, s_kv, kv_heads, d).repeat_interleave(num_heads // kv_heads, dim=2)
        scores = torch.einsum("bhd,bshd->bhs", q, k) * scale_value
        if atten_mask is not None:
            assert atten_mask.dtype in MASK_DTYPES, f"atten_mask must be bool, int8 or uint8, got {atten_mask.dtype}"
            assert atten_mask.shape == (b, 1, 1, s_kv), f"atten_mask must be [B, 1, 1, S], got {atten_mask.shape}"
            left_out = atten_mask.view(b, 1, s_kv).bool()
            assert not bool(left_out.all(-1).any()), "a row whose mask leaves out every key"
            scores = scores.masked_fill(left_out, float("-inf"))
        out = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v)
        return out.reshape(b, 1, hidden).to(query.dtype)

    return [npu_incre_flash_attention] if release.incre_attention else []
