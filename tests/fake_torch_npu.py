"""A stand-in ``torch_npu`` for testing megacann's NPU route on CPU.

Each function has torch_npu's documented signature (an unknown keyword argument is a TypeError, as on the
real module), records its call (name, and the positional and keyword arguments as passed), checks the
documented limits (layouts, ``sparse_mode`` values, head counts against shapes, ``keep_prob`` in (0, 1],
head dims, dtypes, list lengths, row counts) and computes what the documentation says the kernel computes,
written here independently of megacann's reference ops. A wrong call therefore gives a wrong result, a
TypeError or an AssertionError, not a silent pass.

``make_fake_torch_npu(old_api=...)`` plays an older release, one missing feature at a time (:data:`OLD_APIS`):

- ``True`` / ``"cann7.0"`` (``__version__`` "2.1.0"): ``npu_rotary_mul`` has no ``rotary_mode`` (half mode
  only), ``npu_grouped_matmul`` no ``group_type`` / ``group_list_type``, ``npu_fusion_attention`` no TND
  layout and no ``actual_seq_qlen`` / ``actual_seq_kvlen`` (the CANN 7.0 documentation of the operator);
- ``"cann8.0.rc1"``: the TND layout but no ``actual_seq_*`` (the CANN 8.0.RC1 documentation);
- ``"group_type_2_refused"``: the newest signatures, but ``npu_grouped_matmul(group_type=2)`` raises the
  RuntimeError some CANN builds give ("group_type currently only support -1 and 0, current value is 2").

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

import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Union

import fake_npu_quant
import torch
import torch.nn.functional as F

COMPRESSED = 2048
NEW_VERSION, OLD_VERSION = "2.6.0", "2.1.0"
MAX_INT = 2147483647
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
SPARSE_MODES = tuple(range(9))  # documented: 0 .. 8
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_CE_ROWS = 200_000  # npu_cross_entropy_loss: at most 200,000 rows
MAX_GMM_WEIGHTS = 128  # npu_grouped_matmul: at most 128 tensors in a list


@dataclass(frozen=True)
class Release:
    """What the played torch_npu (with its CANN) offers."""

    version: str = NEW_VERSION
    rotary_mode: bool = True  # npu_rotary_mul(..., rotary_mode=)
    group_type: bool = True  # npu_grouped_matmul(..., group_type=, group_list_type=)
    tnd: bool = True  # npu_fusion_attention's TND layout
    actual_seq: bool = True  # npu_fusion_attention(..., actual_seq_qlen=, actual_seq_kvlen=)
    group_type_2: bool = True  # group_type=2 accepted when called


OLD_APIS = {
    False: Release(),
    True: Release(OLD_VERSION, rotary_mode=False, group_type=False, tnd=False, actual_seq=False),
    "cann7.0": Release(OLD_VERSION, rotary_mode=False, group_type=False, tnd=False, actual_seq=False),
    "cann8.0.rc1": Release(actual_seq=False),
    "group_type_2_refused": Release(group_type_2=False),
}
GROUP_TYPE_2_REFUSAL = "group_type currently only support -1 and 0, current value is 2"


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    drawn: tuple = ()  # attention with dropout: the (seed, offset) drawn, kept even if the call stops early


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x):
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


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


def _check_attention(query, key, value, head_num, input_layout, keep_prob, sparse_mode):
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


def _strict(npu, fn):
    """Wrap a fake kernel: bind the call to its documented signature (TypeError on anything else), record
    it as passed, run it, keep the result on the record."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        signature.bind(*args, **kwargs)
        call = Call(fn.__name__, args, kwargs)
        npu.calls.append(call)
        call.result = fn(*args, **kwargs)
        return call.result

    return kernel


def make_fake_torch_npu(old_api: Union[bool, str] = False) -> types.ModuleType:
    """A fresh fake module (``calls`` starts empty); ``old_api`` names the older release it plays
    (:data:`OLD_APIS`; ``True``: CANN 7.0 with torch_npu 2.1.0's signatures)."""
    release = OLD_APIS[old_api]
    npu = types.ModuleType("torch_npu")
    npu.__version__ = release.version
    npu.calls = []

    def npu_rms_norm(self, gamma, epsilon=1e-6):
        assert self.dtype in FLOAT_DTYPES and gamma.shape == self.shape[-1:], "gamma must match the last dim"
        xf = self.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(self.dtype), rstd

    def _rotary(x, r1, r2, rotary_mode):
        assert x.dim() == 4 and r1.dim() == 4 and r2.shape == r1.shape, "4-D tensors expected"
        assert x.dtype in FLOAT_DTYPES and r1.dtype == x.dtype and r2.dtype == x.dtype, "tables in x's dtype"
        assert rotary_mode in ("half", "interleave"), f"rotary_mode must be half or interleave, got {rotary_mode!r}"
        b, n, d = x.shape[0], x.shape[2], x.shape[3]  # BSND, as megacann passes it
        assert d % 2 == 0 and d < 896, f"head dim must be even and below 896, got {d}"
        assert (b < 1000 and n < 1000) if rotary_mode == "half" else b * n < 1000, f"b={b}, n={n} over the limits"
        rotated = _rotate_half(x) if rotary_mode == "half" else _rotate_pairs(x)
        return x * r1 + rotated * r2

    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
        return _rotary(input, r1, r2, rotary_mode)

    def npu_rotary_mul_old(x, r1, r2):
        return _rotary(x, r1, r2, "half")

    def npu_swiglu(input, dim=-1):
        assert input.dtype in FLOAT_DTYPES and input.shape[dim] % 2 == 0, "swiglu: an even split dim"
        a, b = input.chunk(2, dim=dim)
        return F.silu(a) * b

    def npu_fusion_attention(
        query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
        keep_prob=1.0, pre_tockens=MAX_INT, next_tockens=MAX_INT, inner_precise=0, prefix=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    ):  # fmt: skip
        assert release.tnd or input_layout != "TND", "input_layout must be one of BSH, SBH, BSND, BNSD here"
        _check_attention(query, key, value, head_num, input_layout, keep_prob, sparse_mode)
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
        _check_attention(query, key, value, head_num, input_layout, keep_prob, sparse_mode)
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

    def npu_cross_entropy_loss(
        input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
        lse_square_scale_for_zloss=0.0, return_zloss=False,
    ):  # fmt: skip
        assert input.dim() == 2 and target.dtype == torch.int64 and target.shape == input.shape[:1]
        assert input.dtype in FLOAT_DTYPES and input.shape[0] <= MAX_CE_ROWS, f"at most {MAX_CE_ROWS} rows"
        assert weight is None and label_smoothing == 0.0 and not return_zloss, "the fake models the plain loss"
        assert bool(((target >= 0) & (target < input.shape[1])).all()), "targets must lie in [0, C)"
        log_prob = torch.log_softmax(input.float(), dim=-1)
        loss = -log_prob.gather(1, target.unsqueeze(1)).squeeze(1)
        if ignore_index >= 0:  # documented: a negative ignore_index ignores nothing
            loss = loss.masked_fill(target == ignore_index, 0.0)
        assert reduction == "none", "the fake models reduction='none'"
        return loss.to(input.dtype), log_prob.to(input.dtype), torch.empty(0), torch.empty(0)

    def npu_apply_adam_w(
        beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm, amsgrad, maximize,
        *, out,
    ):  # fmt: skip
        var, m, v = out
        assert not amsgrad and not maximize and max_grad_norm is None
        assert var.dtype in FLOAT_DTYPES and grad.shape == var.shape == m.shape == v.shape
        # the ApplyAdamW formula (the powers passed in are one step behind: the kernel multiplies once more)
        bias1, bias2 = 1 - beta1_power * beta1, 1 - beta2_power * beta2
        var.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        var.addcdiv_(m, (v / bias2).sqrt_().add_(epsilon), value=-lr / bias1)
        return var, m, v

    def _gmm(x, weight, group_list, split_item, group_type, group_list_type):
        assert isinstance(x, list) and isinstance(weight, list) and len(x) == 1, "lists of tensors expected"
        assert len(weight) <= MAX_GMM_WEIGHTS, f"at most {MAX_GMM_WEIGHTS} weights in a list, got {len(weight)}"
        assert all(t.dtype in FLOAT_DTYPES and t.dtype == x[0].dtype for t in weight), "x and weights: one dtype"
        assert group_list.dtype == torch.int64 and group_list_type in (0, 1)
        sizes = group_list.tolist()
        if group_list_type == 0:  # cumulative ends
            sizes = [end - start for start, end in zip([0, *sizes[:-1]], sizes)]
        if group_type == 0:  # groups split x's rows (M); one [K, N] weight per group; one output tensor
            assert split_item in (2, 3) and len(weight) == len(sizes) and sum(sizes) == x[0].shape[0]
            return [torch.cat([rows @ w for rows, w in zip(x[0].split(sizes, 0), weight)], 0)]
        # groups split the contraction (K): x [N_in, K], weight [K, N_out] -> [groups, N_in, N_out]
        if group_type == 2 and not release.group_type_2:
            raise RuntimeError(f"npu_grouped_matmul: {GROUP_TYPE_2_REFUSAL}")
        assert group_type == 2 and split_item == 3 and len(weight) == 1 and sum(sizes) == x[0].shape[1]
        pieces = zip(x[0].split(sizes, 1), weight[0].split(sizes, 0))
        return [torch.stack([a @ b for a, b in pieces])]

    def npu_grouped_matmul(
        x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
        per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
        activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
        output_dtype=None, tuning_config=None,
    ):  # fmt: skip
        assert bias is None and scale is None and output_dtype is None, "the fake models the plain product"
        return _gmm(x, weight, group_list, split_item, group_type, group_list_type)

    def npu_grouped_matmul_old(
        x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
        group_list=None, split_item=0, output_dtype=None,
    ):  # fmt: skip
        assert bias is None and scale is None and output_dtype is None, "the fake models the plain product"
        return _gmm(x, weight, group_list, split_item, 0, 0)  # cumulative ends, rows split

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

    def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
        assert not padded_mode and tokens.dim() == 2 and indices.dim() in (1, 2)
        top_k = 1 if indices.dim() == 1 else indices.shape[1]
        first = torch.argsort(indices.reshape(-1), stable=True)  # the documented formula
        sorted_out = torch.argsort(first, stable=True)
        permuted = torch.empty(first.numel(), tokens.shape[1], dtype=tokens.dtype)
        permuted[sorted_out] = tokens[torch.arange(first.numel()) // top_k]
        return permuted, sorted_out.to(torch.int32)

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        assert not padded_mode and sorted_indices.dtype == torch.int32
        assert probs is None or probs.dtype == permuted_tokens.dtype, "probs in the tokens' dtype"
        top_k = 1 if probs is None else probs.shape[1]
        copies = permuted_tokens[sorted_indices.long()].reshape(-1, top_k, permuted_tokens.shape[1])
        weights = torch.ones(copies.shape[:2], dtype=copies.dtype) if probs is None else probs
        return (copies * weights.unsqueeze(-1)).sum(1)

    rotary = npu_rotary_mul if release.rotary_mode else npu_rotary_mul_old
    gmm = npu_grouped_matmul if release.group_type else npu_grouped_matmul_old
    attention = npu_fusion_attention if release.actual_seq else npu_fusion_attention_no_seq
    rotary.__name__, gmm.__name__, attention.__name__ = "npu_rotary_mul", "npu_grouped_matmul", "npu_fusion_attention"
    for fn in (
        npu_rms_norm,
        rotary,
        npu_swiglu,
        attention,
        npu_fusion_attention_grad,
        npu_cross_entropy_loss,
        npu_apply_adam_w,
        gmm,
        npu_moe_token_permute,
        npu_moe_token_unpermute,
        *fake_npu_quant.kernels(npu, release),
    ):
        setattr(npu, fn.__name__, _strict(npu, fn))
    return npu


def forget_npu_checks() -> None:
    """Drop megacann's cached torch_npu import and NPU availability answers (after swapping the module)."""
    from megacann import accelerator
    from megacann.ops import npu_api, registry

    accelerator.import_torch_npu.cache_clear()
    npu_api.forget()
    for key in [k for k in registry._AVAILABLE if k[1] in ("npu", "torch_npu")]:
        del registry._AVAILABLE[key]
    registry._CACHE.clear()


def route_cpu_to_npu() -> None:
    """Make every megacann op called on CPU tensors resolve as on an NPU (for a whole model on the fake):
    each public op function looks its implementation up through its own ``_resolve``."""
    from megacann import ops
    from megacann.ops import registry

    def as_npu(op: str, device_type: str):
        return registry.resolve(op, "npu" if device_type == "cpu" else device_type)

    for name in registry.ops():
        fn = getattr(ops, name, None)
        if fn is not None and hasattr(fn, "spec"):
            fn.__globals__["_resolve"] = as_npu
