"""``npu_fusion_attention`` and ``npu_fusion_attention_grad`` (training attention, the context-parallel
blocks, dropout), and the CANN 7.0 / 8.0.RC1 signature without ``actual_seq_qlen``.

Attention dropout (``keep_prob < 1``) follows the kernel's contract: the forward takes its random state
from the device generator and returns it as ``(seed, offset, numels)``; the fake draws ``seed`` with one
``torch.randint`` from the default (CPU) generator, sets ``offset = 0`` and ``numels`` = the number of
attention probabilities, and keeps probability ``p`` where ``torch.rand`` of a ``torch.Generator`` seeded
with ``seed + offset`` (drawn over all probabilities in the order of the output layout) is below
``keep_prob``, scaling kept ones by ``1 / keep_prob``. Replaying a forward with the generator state restored
(megacann's recompute does so) therefore draws the same mask; ``npu_fusion_attention_grad`` rebuilds it
from the ``seed`` / ``offset`` it is given (the BNSD blocks of context parallelism included: megacann itself
refuses attention dropout under context parallelism, so only the tests use them with dropout).
"""

from __future__ import annotations

import torch

from .contract import COMPRESSED, FLOAT_DTYPES, LAYOUTS, MAX_INT, SPARSE_MODES, Release


class _Dropout:
    """The mask stream of one attention call: ``torch.rand`` of a generator seeded ``seed + offset``."""

    def __init__(self, keep_prob: float, seed: int, offset: int):
        self.keep_prob = keep_prob
        self.gen = torch.Generator().manual_seed(seed + offset) if keep_prob < 1.0 else None

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        if self.gen is None:
            return probs
        keep = torch.rand(probs.shape, generator=self.gen, dtype=torch.float64) < self.keep_prob
        return probs * keep / self.keep_prob


def _attend(q, k, v, scale, masked, drop=None):
    """q [n, sq, d], k/v [n, skv, d], masked [sq, skv] (True = masked) or None."""
    scores = torch.einsum("nqd,nkd->nqk", q.double(), k.double()) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("nqk,nkd->nqd", probs if drop is None else drop(probs), v.double())


def _band(n: int, pre: int, nxt: int) -> torch.Tensor:
    """Band mode's mask as documented (True = masked): keys more than ``pre`` before or ``nxt`` after the
    query's own position are out."""
    ones = torch.ones(n, n, dtype=torch.bool)
    return ones.triu(nxt + 1) | ones.tril(-pre - 1)


def check_attention(query, key, value, head_num, input_layout, keep_prob, sparse_mode):
    """The documented limits shared by the forward and the backward."""
    assert input_layout in LAYOUTS, f"input_layout must be one of {LAYOUTS}, got {input_layout!r}"
    assert sparse_mode in SPARSE_MODES, f"sparse_mode must be one of {SPARSE_MODES}, got {sparse_mode}"
    assert 0.0 < keep_prob <= 1.0, f"keep_prob must lie in (0, 1], got {keep_prob}"
    assert query.dtype in FLOAT_DTYPES and key.dtype == value.dtype == query.dtype, "q/k/v: one float dtype"
    heads_dim = {"BSND": 2, "BNSD": 1, "TND": 1}.get(input_layout)
    assert heads_dim is not None, f"the fake models BSND, BNSD and TND, not {input_layout}"
    assert query.shape[heads_dim] == head_num, f"head_num {head_num} but query has {query.shape[heads_dim]} heads"
    assert head_num % key.shape[heads_dim] == 0, "query heads must be a multiple of key/value heads"
    d = query.shape[-1]
    assert d % 16 == 0 and d <= 512, f"head dim must be a multiple of 16 up to 512, got {d}"


def kernels(npu, release: Release) -> list:
    """The attention kernels of ``release`` (``npu.calls`` receives the dropout state each draws)."""

    def npu_fusion_attention(
        query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
        keep_prob=1.0, pre_tockens=MAX_INT, next_tockens=MAX_INT, inner_precise=0, prefix=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    ):  # fmt: skip
        assert release.tnd or input_layout != "TND", "input_layout must be one of BSH, SBH, BSND, BNSD here"
        check_attention(query, key, value, head_num, input_layout, keep_prob, sparse_mode)
        assert pse is None and padding_mask is None and prefix is None, "the fake models no pse/padding/prefix"
        seed, offset = (int(torch.randint(0, 2**31 - 1, (1,))), 0) if keep_prob < 1.0 else (0, 0)
        drop = _Dropout(keep_prob, seed, offset)
        npu.calls[-1].drawn = (seed, offset)
        numels = 0
        if input_layout == "BNSD":  # one mask draw over [b, n, sq, skv]; the statistics are before dropout
            scores, v = _bnsd_scores(query, key, value, atten_mask, sparse_mode, scale)
            row_max = scores.amax(-1, keepdim=True)
            row_sum = (scores - row_max).exp().sum(-1, keepdim=True)
            out = drop((scores - row_max).exp() / row_sum) @ v
            stats = [t.float().expand(*t.shape[:-1], 8) for t in (row_max, row_sum)]
            numels = scores.numel() if keep_prob < 1.0 else 0
            return out.to(query.dtype), *stats, torch.empty(0), seed, offset, numels
        mask, mode = atten_mask, sparse_mode
        assert mask is None or mask.dtype == torch.bool, "atten_mask must be bool (True = masked)"
        if mode in (2, 3, 4):
            assert mask is not None and mask.shape == (COMPRESSED, COMPRESSED), "compressed causal mask expected"
            assert torch.equal(mask, torch.ones_like(mask).triu(1)), "causal mask must be True above the diagonal"
        else:
            assert mode == 0, f"the fake models sparse_mode 0, 2, 3, 4, got {mode}"
        group = head_num // key.shape[-2]
        k, v = key.repeat_interleave(group, dim=-2), value.repeat_interleave(group, dim=-2)

        def causal(n):
            return torch.ones(n, n, dtype=torch.bool).triu(1) if mode in (2, 3) else _band(n, pre_tockens, next_tockens)

        if input_layout == "TND":
            lens = actual_seq_qlen
            assert lens is not None, "TND needs actual_seq_qlen / actual_seq_kvlen"
            assert lens == actual_seq_kvlen and lens[-1] == query.shape[0], "cumulative lengths expected"
            assert mode in (0, 3, 4)
            out = torch.empty(query.shape, dtype=torch.float64)
            for start, end in zip([0, *lens[:-1]], lens):
                seq = slice(start, end)
                masked = causal(end - start) if mode in (3, 4) else None
                numels += head_num * (end - start) ** 2
                out[seq] = _attend(
                    query[seq].transpose(0, 1), k[seq].transpose(0, 1), v[seq].transpose(0, 1), scale, masked, drop
                ).transpose(0, 1)
        else:
            b, s = query.shape[:2]
            assert actual_seq_qlen is None
            if mode in (2, 3, 4):
                masked = causal(s).expand(b, head_num, s, s)
            elif mask is not None:
                masked = mask.expand(b, head_num, s, s)  # [s, s] or [b, 1, s, s]
            else:
                masked = torch.zeros(b, head_num, s, s, dtype=torch.bool)
            numels = b * head_num * s * s
            out = torch.stack(
                [
                    _attend(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), scale, m, drop)
                    for q, kk, vv, m in zip(query, k, v, masked)
                ]
            ).transpose(1, 2)
        empty = torch.empty(0)
        return out.to(query.dtype), empty, empty, empty, seed, offset, numels if keep_prob < 1.0 else 0

    def _bnsd_scores(query, key, value, mask, mode, scale):
        assert mode in (0, 2) and (mode == 2) == (mask is not None), "BNSD blocks: no mask, or causal mode 2"
        group = query.shape[1] // key.shape[1]
        k, v = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
        scores = query.double() @ k.transpose(-1, -2) * scale
        if mode == 2:
            assert mask.shape == (COMPRESSED, COMPRESSED) and torch.equal(mask, torch.ones_like(mask).triu(1))
            n, m = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
        return scores, v

    def npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
        softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0, keep_prob=1.0,
        pre_tockens=MAX_INT, next_tockens=MAX_INT, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    ):  # fmt: skip
        """Flash backward from the given softmax statistics (lse = max + log sum) and forward output; with
        dropout, the forward's mask is drawn again from ``seed + offset`` (same shape, same order)."""
        check_attention(query, key, value, head_num, input_layout, keep_prob, sparse_mode)
        assert input_layout == "BNSD", "the fake's backward models BNSD blocks"
        assert keep_prob == 1.0 or numels > 0, "dropout: pass the forward's seed, offset and numels"
        scores, v = _bnsd_scores(query, key, value, atten_mask, sparse_mode, scale_value)
        assert keep_prob == 1.0 or numels == scores.numel(), f"numels {numels} but {scores.numel()} probabilities"
        lse = (softmax_max[..., :1] + softmax_sum[..., :1].log()).double()
        probs, dout = (scores - lse).exp(), dy.double()
        kept = _Dropout(keep_prob, seed, offset)(torch.ones_like(probs))  # 0 or 1 / keep_prob per probability
        # out = (probs * kept) @ v, so rowsum(dout * out) = rowsum(probs * dprobs) as without dropout
        delta = (dout * attention_in.double()).sum(-1, keepdim=True)
        dscores = probs * ((dout @ v.transpose(-1, -2)) * kept - delta) * scale_value
        group = query.shape[1] // key.shape[1]

        def per_kv(t):
            return t.unflatten(1, (key.shape[1], group)).sum(2)

        dq = dscores @ key.double().repeat_interleave(group, 1)
        dk, dv = per_kv(dscores.transpose(-1, -2) @ query.double()), per_kv((probs * kept).transpose(-1, -2) @ dout)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0)

    def npu_fusion_attention_no_seq(
        query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
        keep_prob=1.0, pre_tockens=MAX_INT, next_tockens=MAX_INT, inner_precise=0, prefix=None, sparse_mode=0,
        gen_mask_parallel=True, sync=False,
    ):  # fmt: skip
        """CANN 7.0 / 8.0.RC1's signature: no actual_seq_qlen / actual_seq_kvlen."""
        return npu_fusion_attention(
            query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
            pre_tockens, next_tockens, inner_precise, prefix, None, None, sparse_mode, gen_mask_parallel, sync,
        )  # fmt: skip

    attention = npu_fusion_attention if release.actual_seq else npu_fusion_attention_no_seq
    attention.__name__ = "npu_fusion_attention"
    return [attention, npu_fusion_attention_grad]
