"""The fake torch_npu (tests/fake_torch_npu/) holds megacann to torch_npu's documented contract, and
megacann copes with an older torch_npu:

- every fake kernel has the documented signature (an unknown keyword is a TypeError) and checks the
  documented limits (layouts, sparse modes, head counts, keep_prob, head dims, dtypes, list lengths, rows);
- with an older API (no ``rotary_mode``, no ``group_type``) the two ops that need it fall back to their
  next implementation, each with one log line naming the op, the torch_npu version and the missing
  argument, while the other ops keep their NPU kernels (packed attention without ``actual_seq_qlen``:
  tests/test_npu_old_releases.py);
- attention dropout draws its mask from a seed taken from the generator, so a recomputed forward
  (``megacann.layers.random.checkpoint``) replays the same mask.
"""

from __future__ import annotations

import logging

import pytest
import torch
from fake_torch_npu import install, make_fake_torch_npu, uninstall
from layers_reference import rel_err

from megacann.layers.random import checkpoint
from megacann.ops import npu_api, registry


@pytest.fixture
def fake_npu(monkeypatch):
    yield install(monkeypatch)
    uninstall(monkeypatch)


def _qkv(b=2, s=8, hq=4, hkv=2, d=16, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, h, d, generator=g).requires_grad_(grad) for h in (hq, hkv, hkv)]


def test_unknown_keywords_are_type_errors(fake_npu):
    q, k, v = _qkv()
    x = torch.randn(2, 4, 3, 16)
    with pytest.raises(TypeError, match="dropout"):
        fake_npu.npu_fusion_attention(q, k, v, 4, "BSND", dropout=0.1)
    with pytest.raises(TypeError, match="smoothing"):
        fake_npu.npu_cross_entropy_loss(torch.randn(3, 5), torch.zeros(3, dtype=torch.int64), smoothing=0.1)
    with pytest.raises(TypeError, match="mode"):
        fake_npu.npu_rotary_mul(x, x, x, mode="half")
    with pytest.raises(TypeError, match="eps"):
        fake_npu.npu_rms_norm(x, torch.ones(16), eps=1e-6)
    with pytest.raises(TypeError, match="axis"):
        fake_npu.npu_swiglu(x, axis=-1)
    with pytest.raises(TypeError, match="group_sizes"):
        fake_npu.npu_grouped_matmul([x[0, 0]], [torch.randn(16, 4)], group_sizes=[3])
    with pytest.raises(TypeError, match="scale"):
        fake_npu.npu_fusion_attention_grad(q, k, v, q, 4, "BNSD", scale=0.3)
    assert [c.name for c in fake_npu.calls] == []  # a refused call is not recorded


def test_documented_limits_are_enforced(fake_npu):
    q, k, v = _qkv()
    attend = fake_npu.npu_fusion_attention
    with pytest.raises(AssertionError, match="input_layout"):
        attend(q, k, v, 4, "BSDN")
    with pytest.raises(AssertionError, match="sparse_mode"):
        attend(q, k, v, 4, "BSND", sparse_mode=9)
    with pytest.raises(AssertionError, match="head_num 8 but query has 4 heads"):
        attend(q, k, v, 8, "BSND")
    for keep in (0.0, 1.5):
        with pytest.raises(AssertionError, match="keep_prob"):
            attend(q, k, v, 4, "BSND", keep_prob=keep)
    q8, k8, v8 = _qkv(d=8)
    with pytest.raises(AssertionError, match="multiple of 16 up to 512"):
        attend(q8, k8, v8, 4, "BSND")
    with pytest.raises(AssertionError, match="one float dtype"):
        attend(q, k.double(), v.double(), 4, "BSND")
    with pytest.raises(AssertionError, match="200000 rows"):
        fake_npu.npu_cross_entropy_loss(
            torch.zeros(200_001, 2), torch.zeros(200_001, dtype=torch.int64), reduction="none"
        )
    x = torch.randn(1, 2, 1001, 16)
    with pytest.raises(AssertionError, match="over the limits"):
        fake_npu.npu_rotary_mul(x, x[:1, :, :1], x[:1, :, :1])
    rows, gl = torch.randn(129, 4), torch.ones(129, dtype=torch.int64)
    with pytest.raises(AssertionError, match="at most 128 weights"):
        fake_npu.npu_grouped_matmul(
            [rows], [torch.randn(4, 2)] * 129, group_list=gl, split_item=2, group_type=0, group_list_type=1
        )
    with pytest.raises(AssertionError, match="one dtype"):
        fake_npu.npu_grouped_matmul([rows[:2]], [torch.randn(4, 2).double()] * 2, group_list=gl[:2], split_item=2, group_type=0, group_list_type=1)  # fmt: skip


def test_old_api_falls_back_per_op_with_one_line(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="megacann.ops")
    install(monkeypatch, old_api=True)
    try:
        assert registry.selected("apply_rotary", "npu") == "reference"
        assert registry.selected("grouped_matmul", "npu") != "torch_npu"
        for op in ("rms_norm", "swiglu", "scaled_dot_product_attention", "cross_entropy", "adamw_step_"):
            assert registry.selected(op, "npu") == "npu"
        assert registry.selected("moe_permute", "npu") == "torch_npu"
        registry.selection("npu")  # asking again logs nothing more: the answer is cached
        lines = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
        assert lines == [
            "megacann.ops: apply_rotary falls back from 'npu' to its next implementation: torch_npu 2.1.0 found, "
            "its npu_rotary_mul takes no 'rotary_mode' (an older API)",
            "megacann.ops: grouped_matmul falls back from 'torch_npu' to its next implementation: torch_npu 2.1.0 "
            "found, its npu_grouped_matmul takes no 'group_type' (an older API)",
            "megacann.ops: scaled_dot_product_attention falls back from 'TND with actual_seq_qlen/kvlen' to one "
            "BSND call per document: torch_npu 2.1.0 found, its npu_fusion_attention takes no 'actual_seq_qlen' "
            "(an older API)",
        ]
        x = torch.randn(2, 5, 3, 16)
        cos, sin = torch.randn(5, 16), torch.randn(5, 16)
        out = registry.resolve("apply_rotary", "npu")(x, cos, sin, True)  # interleaved: the reference serves
        assert torch.equal(out, registry._impls("apply_rotary")["reference"].fn(x, cos, sin, True))
    finally:
        uninstall(monkeypatch)
    caplog.clear()
    install(monkeypatch)  # the newest API: nothing falls back, nothing is logged
    try:
        assert registry.selected("apply_rotary", "npu") == "npu"
        assert registry.selected("grouped_matmul", "npu") == "torch_npu"
        assert not [r for r in caplog.records if "falls back" in r.getMessage()]
    finally:
        uninstall(monkeypatch)


def test_attention_dropout_is_seeded_and_replays_under_recompute(fake_npu):
    attend = registry.resolve("scaled_dot_product_attention", "npu")
    p = 0.25

    def run(recompute: bool):
        torch.manual_seed(11)
        q, k, v = _qkv(grad=True)
        fn = lambda a, b, c: attend(a, b, c, causal=True, dropout_p=p)  # noqa: E731
        out = checkpoint(fn, q, k, v) if recompute else fn(q, k, v)
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in (q, k, v)]

    plain_out, plain_grads = run(False)
    first = len(fake_npu.calls)
    out, grads = run(True)
    calls = [c for c in fake_npu.calls[first:] if c.name == "npu_fusion_attention"]
    assert len(calls) == 2  # the forward and its recompute in backward
    assert calls[0].kwargs["keep_prob"] == pytest.approx(1 - p)
    seeds = [c.drawn for c in calls]  # (the recompute may stop early, once it has what backward needs)
    assert seeds[0] == seeds[1] and calls[0].result[4:7] == (*seeds[0], 2 * 4 * 8 * 8)  # numels b*n*s*s
    assert torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))

    # independently: the mask from the returned seed, drawn over [b, n, s, s] at once
    q, k, v = (t.detach() for t in _qkv())
    seed, offset = seeds[0]
    keep = torch.rand(2, 4, 8, 8, generator=torch.Generator().manual_seed(seed + offset), dtype=torch.float64) < 1 - p
    assert 0.5 < keep.double().mean() < 0.95
    kk, vv = (t.repeat_interleave(2, 2).transpose(1, 2).double() for t in (k, v))
    scores = q.transpose(1, 2).double() @ kk.transpose(-1, -2) / 4.0
    probs = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    want = ((probs * keep / (1 - p)) @ vv).transpose(1, 2)
    assert rel_err(out, want) < 1e-6
    no_drop = attend(q, k, v, causal=True)
    assert rel_err(out, no_drop) > 1e-2  # dropout really dropped


class _CompiledOp:
    """A callable without a Python signature (like a compiled torch_npu operator), with a schema."""

    __signature__ = "unreadable"

    def __init__(self, schema):
        self._schema = schema


def test_the_api_check_reads_an_operator_schema_when_there_is_no_signature():
    new = _CompiledOp("npu::npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor")
    old = _CompiledOp("npu::npu_rotary_mul(Tensor self, Tensor r1, Tensor r2) -> Tensor")
    assert npu_api.accepts(new, "rotary_mode") is True
    assert npu_api.accepts(old, "rotary_mode") is False
    assert npu_api.accepts(_CompiledOp(None), "rotary_mode") is None  # unknown: the newest API is assumed
    assert npu_api.accepts(make_fake_torch_npu(old_api=True).npu_grouped_matmul, "group_type") is False


def test_bnsd_dropout_backward_equals_autograd_of_the_reference_with_the_same_mask(fake_npu):
    """The BNSD blocks (context parallelism's kernel calls) with dropout: the forward draws its mask once
    over [b, n, sq, skv], the backward kernel draws it again from the returned seed; both equal the
    reference attention written here (and its autograd) with that mask. megacann itself refuses attention
    dropout under context parallelism (tests/test_context_parallel_attention.py, test_context_parallel_recipe.py)."""
    b, hq, hkv, s, d, keep, scale = 2, 4, 2, 8, 16, 0.75, 0.25
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, generator=g)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # the compressed causal mask of sparse_mode 2
    torch.manual_seed(5)
    out, row_max, row_sum, _, seed, offset, numels = fake_npu.npu_fusion_attention(
        q, k, v, hq, "BNSD", atten_mask=mask, sparse_mode=2, scale=scale, keep_prob=keep
    )
    assert numels == b * hq * s * s and offset == 0

    kept = torch.rand(b, hq, s, s, generator=torch.Generator().manual_seed(seed + offset), dtype=torch.float64) < keep
    assert 0.5 < kept.double().mean() < 0.95
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    scores = qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) * scale
    probs = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    want = (probs * kept / keep) @ vr.repeat_interleave(2, 1)
    want.backward(dout.double())
    assert rel_err(out, want.detach()) < 1e-6  # fp32 results of fp64 arithmetic

    grads = fake_npu.npu_fusion_attention_grad(
        q, k, v, dout, hq, "BNSD", atten_mask=mask, sparse_mode=2, softmax_max=row_max, softmax_sum=row_sum,
        attention_in=out, scale_value=scale, keep_prob=keep, seed=seed, offset=offset, numels=numels,
    )[:3]  # fmt: skip
    for got, ref in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert got.shape == ref.shape and rel_err(got, ref) < 1e-6
    # another seed is another mask: the backward really uses the one it is given
    other = fake_npu.npu_fusion_attention_grad(
        q, k, v, dout, hq, "BNSD", atten_mask=mask, sparse_mode=2, softmax_max=row_max, softmax_sum=row_sum,
        attention_in=out, scale_value=scale, keep_prob=keep, seed=seed + 1, offset=offset, numels=numels,
    )[2]  # fmt: skip
    assert rel_err(other, vr.grad) > 1e-2
