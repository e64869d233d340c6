"""A stand-in ``torch_npu`` for testing megacann's NPU route on CPU.

Each function records its call (name, positional and keyword arguments) and computes what torch_npu's
documentation says the kernel computes, written here independently of megacann's reference ops, and
checks the documented argument contract (layouts, mask shape and dtype, table shapes and dtypes). A
wrong layout or mask therefore gives a wrong result or an AssertionError, not a silent pass.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

COMPRESSED = 2048


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x):
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def _attend(q, k, v, scale, masked):
    """q [n, sq, d], k/v [n, skv, d], masked [sq, skv] (True = masked) or None."""
    scores = torch.einsum("nqd,nkd->nqk", q.double(), k.double()) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("nqk,nkd->nqd", scores.softmax(-1), v.double())


def _band(n: int, pre: int, nxt: int) -> torch.Tensor:
    """Band mode's mask as documented (True = masked): keys more than ``pre`` before or ``nxt`` after the
    query's own position are out."""
    ones = torch.ones(n, n, dtype=torch.bool)
    return ones.triu(nxt + 1) | ones.tril(-pre - 1)


def make_fake_torch_npu() -> types.ModuleType:
    npu = types.ModuleType("torch_npu")
    npu.calls = []

    def record(name, args, kwargs):
        npu.calls.append(Call(name, args, kwargs))

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        record("npu_rms_norm", (x, gamma), {"epsilon": epsilon})
        assert gamma.shape == x.shape[-1:], "gamma must match the last dim of x"
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        record("npu_rotary_mul", (x, r1, r2), {"rotary_mode": rotary_mode})
        assert x.dim() == 4 and r1.dim() == 4 and r2.shape == r1.shape, "4-D tensors expected"
        assert r1.dtype == x.dtype and r2.dtype == x.dtype, "tables must have x's dtype"
        assert rotary_mode in ("half", "interleave")
        rotated = _rotate_half(x) if rotary_mode == "half" else _rotate_pairs(x)
        return x * r1 + rotated * r2

    def npu_swiglu(x, dim=-1):
        record("npu_swiglu", (x,), {"dim": dim})
        a, b = x.chunk(2, dim=dim)
        return F.silu(a) * b

    def npu_fusion_attention(query, key, value, head_num, input_layout, **kw):
        record("npu_fusion_attention", (query, key, value, head_num, input_layout), kw)
        if input_layout == "BNSD":
            return _bnsd_attention(query, key, value, **kw)
        mask, mode = kw.get("atten_mask"), kw.get("sparse_mode", 0)
        scale, keep_prob = kw.get("scale", 1.0), kw.get("keep_prob", 1.0)
        assert keep_prob == 1.0, "the fake does not draw dropout"
        assert input_layout in ("BSND", "TND"), input_layout
        assert mask is None or mask.dtype == torch.bool, "atten_mask must be bool (True = masked)"
        pre, nxt = kw.get("pre_tockens", 2147483647), kw.get("next_tockens", 2147483647)
        if mode in (2, 3, 4):
            assert mask is not None and mask.shape == (COMPRESSED, COMPRESSED), "compressed causal mask expected"
            assert torch.equal(mask, torch.ones_like(mask).triu(1)), "causal mask must be True above the diagonal"
        assert query.shape[-2] == head_num and head_num % key.shape[-2] == 0
        group = head_num // key.shape[-2]
        k, v = key.repeat_interleave(group, dim=-2), value.repeat_interleave(group, dim=-2)

        def causal(n):
            return torch.ones(n, n, dtype=torch.bool).triu(1) if mode in (2, 3) else _band(n, pre, nxt)

        if input_layout == "TND":
            lens = kw["actual_seq_qlen"]
            assert lens == kw["actual_seq_kvlen"] and lens[-1] == query.shape[0], "cumulative lengths expected"
            assert mode in (0, 3, 4)
            out = torch.empty(query.shape, dtype=torch.float64)
            for start, end in zip([0, *lens[:-1]], lens):
                seq = slice(start, end)
                masked = causal(end - start) if mode in (3, 4) else None
                out[seq] = _attend(
                    query[seq].transpose(0, 1), k[seq].transpose(0, 1), v[seq].transpose(0, 1), scale, masked
                ).transpose(0, 1)
        else:
            b, s = query.shape[:2]
            assert kw.get("actual_seq_qlen") is None
            if mode in (2, 3, 4):
                masked = causal(s).expand(b, head_num, s, s)
            elif mask is not None:
                masked = mask.expand(b, head_num, s, s)  # [s, s] or [b, 1, s, s]
            else:
                masked = torch.zeros(b, head_num, s, s, dtype=torch.bool)
            out = torch.stack(
                [
                    _attend(query[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), scale, masked[i])
                    for i in range(b)
                ]
            ).transpose(1, 2)
        empty = torch.empty(0)
        return out.to(query.dtype), empty, empty, empty, 0, 0, 0

    def _bnsd_attention(query, key, value, **kw):
        """BNSD with no mask or the compressed causal mask (sparse_mode 2): output and the rows' softmax
        max and sum, each value repeated over a last dim of 8, fp32."""
        scores, v = _bnsd_scores(query, key, value, kw)
        row_max = scores.amax(-1, keepdim=True)
        row_sum = (scores - row_max).exp().sum(-1, keepdim=True)
        out = ((scores - row_max).exp() / row_sum) @ v
        stats = [t.float().expand(*t.shape[:-1], 8) for t in (row_max, row_sum)]
        return out.to(query.dtype), *stats, torch.empty(0), 0, 0, 0

    def _bnsd_scores(query, key, value, kw):
        mode, mask = kw.get("sparse_mode", 0), kw.get("atten_mask")
        assert mode in (0, 2) and (mode == 2) == (mask is not None), "BNSD blocks: no mask, or causal mode 2"
        group = query.shape[1] // key.shape[1]
        k, v = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
        scores = query.double() @ k.transpose(-1, -2) * kw.get("scale", kw.get("scale_value", 1.0))
        if mode == 2:
            assert mask.shape == (COMPRESSED, COMPRESSED) and torch.equal(mask, torch.ones_like(mask).triu(1))
            n, m = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
        return scores, v

    def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, **kw):
        """Flash backward from the given softmax statistics (lse = max + log sum) and forward output."""
        record("npu_fusion_attention_grad", (query, key, value, dy, head_num, input_layout), kw)
        assert input_layout == "BNSD" and query.shape[1] == head_num
        scores, v = _bnsd_scores(query, key, value, kw)
        lse = (kw["softmax_max"][..., :1] + kw["softmax_sum"][..., :1].log()).double()
        probs, dout = (scores - lse).exp(), dy.double()
        delta = (dout * kw["attention_in"].double()).sum(-1, keepdim=True)
        dscores = probs * (dout @ v.transpose(-1, -2) - delta) * kw["scale_value"]
        group = query.shape[1] // key.shape[1]

        def per_kv(t):
            return t.unflatten(1, (key.shape[1], group)).sum(2)

        dq = dscores @ key.double().repeat_interleave(group, 1)
        dk, dv = per_kv(dscores.transpose(-1, -2) @ query.double()), per_kv(probs.transpose(-1, -2) @ dout)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0)

    def npu_cross_entropy_loss(
        input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0, **kw
    ):
        record(
            "npu_cross_entropy_loss",
            (input, target),
            {
                "weight": weight,
                "reduction": reduction,
                "ignore_index": ignore_index,
                "label_smoothing": label_smoothing,
                **kw,
            },
        )
        assert input.dim() == 2 and target.dtype == torch.int64 and target.shape == input.shape[:1]
        assert bool(((target >= 0) & (target < input.shape[1])).all()), "targets must lie in [0, C)"
        log_prob = torch.log_softmax(input.float(), dim=-1)
        loss = -log_prob.gather(1, target.unsqueeze(1)).squeeze(1)
        if ignore_index >= 0:  # documented: a negative ignore_index ignores nothing
            loss = loss.masked_fill(target == ignore_index, 0.0)
        assert reduction == "none"
        return loss.to(input.dtype), log_prob.to(input.dtype), torch.empty(0), torch.empty(0)

    def npu_apply_adam_w(
        beta1_power, beta2_power, lr, weight_decay, beta1, beta2, eps, grad, max_grad_norm, amsgrad, maximize, *, out
    ):
        record(
            "npu_apply_adam_w",
            (beta1_power, beta2_power, lr, weight_decay, beta1, beta2, eps, grad, max_grad_norm, amsgrad, maximize),
            {"out": out},
        )
        var, m, v = out
        assert not amsgrad and not maximize and max_grad_norm is None
        # the ApplyAdamW formula (the powers passed in are one step behind: the kernel multiplies once more)
        bias1, bias2 = 1 - beta1_power * beta1, 1 - beta2_power * beta2
        var.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        var.addcdiv_(m, (v / bias2).sqrt_().add_(eps), value=-lr / bias1)
        return var, m, v

    def npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, **kw):
        record("npu_grouped_matmul", (x, weight), {"group_list": group_list, "split_item": split_item,
               "group_type": group_type, "group_list_type": group_list_type, **kw})  # fmt: skip
        assert isinstance(x, list) and isinstance(weight, list) and len(x) == 1, "lists of tensors expected"
        assert group_list.dtype == torch.int64 and group_list_type in (0, 1)
        sizes = group_list.tolist()
        if group_list_type == 0:  # cumulative ends
            sizes = [end - start for start, end in zip([0, *sizes[:-1]], sizes)]
        if group_type == 0:  # groups split x's rows (M); one [K, N] weight per group; one output tensor
            assert split_item in (2, 3) and len(weight) == len(sizes) and sum(sizes) == x[0].shape[0]
            return [torch.cat([rows @ w for rows, w in zip(x[0].split(sizes, 0), weight)], 0)]
        # groups split the contraction (K): x [N_in, K], weight [K, N_out] -> [groups, N_in, N_out]
        assert group_type == 2 and split_item == 3 and len(weight) == 1 and sum(sizes) == x[0].shape[1]
        pieces = zip(x[0].split(sizes, 1), weight[0].split(sizes, 0))
        return [torch.stack([a @ b for a, b in pieces])]

    def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
        record(
            "npu_moe_token_permute", (tokens, indices), {"num_out_tokens": num_out_tokens, "padded_mode": padded_mode}
        )
        assert not padded_mode and tokens.dim() == 2 and indices.dim() in (1, 2)
        top_k = 1 if indices.dim() == 1 else indices.shape[1]
        first = torch.argsort(indices.reshape(-1), stable=True)  # the documented formula
        sorted_out = torch.argsort(first, stable=True)
        permuted = torch.empty(first.numel(), tokens.shape[1], dtype=tokens.dtype)
        permuted[sorted_out] = tokens[torch.arange(first.numel()) // top_k]
        return permuted, sorted_out.to(torch.int32)

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        record("npu_moe_token_unpermute", (permuted_tokens, sorted_indices, probs), {"padded_mode": padded_mode})
        assert not padded_mode and sorted_indices.dtype == torch.int32
        assert probs is None or probs.dtype == permuted_tokens.dtype, "probs in the tokens' dtype"
        top_k = 1 if probs is None else probs.shape[1]
        copies = permuted_tokens[sorted_indices.long()].reshape(-1, top_k, permuted_tokens.shape[1])
        weights = torch.ones(copies.shape[:2], dtype=copies.dtype) if probs is None else probs
        return (copies * weights.unsqueeze(-1)).sum(1)

    for fn in (
        npu_rms_norm,
        npu_rotary_mul,
        npu_swiglu,
        npu_fusion_attention,
        npu_fusion_attention_grad,
        npu_cross_entropy_loss,
        npu_apply_adam_w,
        npu_grouped_matmul,
        npu_moe_token_permute,
        npu_moe_token_unpermute,
    ):
        setattr(npu, fn.__name__, fn)
    return npu
