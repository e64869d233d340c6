"""Variable-length attention and the block attention ops (issue 28, items 1-2).

- ``attention_block`` / ``attention_block_backward``: every implementation available here (the fp32-tile
  reference, PyTorch's CPU flash kernel) equals a dense softmax written in this file: output, lse, and the
  gradients of a block split in two key halves merged by online softmax.
- ``scaled_dot_product_attention`` with packed ``segment_ids`` (and sliding windows) on the ``varlen``
  path equals the masked reference in fp32, output and gradients, and never allocates an ``[s, s]``
  tensor (a dispatch mode records every tensor an operator creates).
- The CUDA kernels run only with a CUDA device (skipped here).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megacann import ops
from megacann.ops import attention_blocks, varlen

TOL = dict(rtol=1e-5, atol=1e-6)
CPU_BLOCK_IMPLS = ("reference", "flash")
# a one-token document, an id that comes back later in the row (equal ids attend), a whole-row document
SEGMENTS = torch.tensor([[0] * 7 + [1] * 9 + [5] + [2] * 6 + [0] * 3 + [3] * 6, [4] * 32])
RUNS = torch.tensor([[0] * 7 + [1] * 9 + [5] + [2] * 6 + [6] * 3 + [3] * 6, [4] * 32])  # every id once per row
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def rectangles_at_every_length(monkeypatch):
    """The rectangles under test at every length (CPU rows up to DENSE_MAX_SEQ take one masked call
    otherwise: tested by itself below)."""
    monkeypatch.setattr(varlen, "DENSE_MAX_SEQ", 0)


@pytest.fixture
def pinned_block():
    def pin(name):
        ops.pin("attention_block", name)
        ops.pin("attention_block_backward", name)

    yield pin
    pin(None)


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _dense_block(q, k, v, scale, allowed):
    """BHSD softmax attention with kv heads repeated, ``allowed`` [sq, sk] or [b, 1, sq, sk] (True =
    attend): (output, lse), autograd-differentiable."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1)
    return scores.softmax(-1).nan_to_num() @ v, lse


def _dense(q, k, v, segments, window=None):
    """BSND causal attention restricted to equal ids (and a window), from a dense mask."""
    s = q.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(s, s, dtype=torch.bool).triu(1 - window)
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return _dense_block(qh, kh, vh, 1 / math.sqrt(q.shape[-1]), allowed)[0].transpose(1, 2)


@pytest.mark.parametrize("impl", CPU_BLOCK_IMPLS)
@pytest.mark.parametrize("case", ["causal", "whole", "gqa_band"])
def test_attention_block_equals_dense_softmax_with_lse_and_merged_gradients(pinned_block, impl, case):
    pinned_block(impl)
    s, kv_heads, scale = 12, (2 if case == "gqa_band" else 4), 0.3
    q = _randn(2, 4, s, 8, seed=1).requires_grad_()
    k = _randn(2, kv_heads, s, 8, seed=2).requires_grad_()
    v = _randn(2, kv_heads, s, 8, seed=3).requires_grad_()
    causal = case == "causal"
    band = (torch.arange(s) + 5, torch.arange(s), 4) if case == "gqa_band" else None
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if band is not None:
        diff = band[0][:, None] - band[1][None, :]
        allowed = (diff >= 0) & (diff < band[2])
    want_out, want_lse = _dense_block(q, k, v, scale, allowed)
    out, lse = ops.attention_block(q.detach(), k.detach(), v.detach(), scale=scale, causal=causal, band=band)
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == (2, 4, s)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)

    # backward of two key halves (as two ring steps) with the final out / lse equals autograd of the whole
    dout = _randn(2, 4, s, 8, seed=4)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    halves = (slice(0, s // 2), slice(s // 2, s)) if not causal else (slice(None),)
    dq = torch.zeros_like(q)
    dkv = [torch.zeros_like(k), torch.zeros_like(v)]
    merged_out, merged_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    for cols in halves:
        sub_band = None if band is None else (band[0], band[1][cols], band[2])
        kb, vb = k.detach()[:, :, cols], v.detach()[:, :, cols]
        o, m = ops.attention_block(q.detach(), kb, vb, scale=scale, causal=causal, band=sub_band)
        attention_blocks.merge_block(merged_out, merged_lse, o, m)
    torch.testing.assert_close(merged_out, want_out, **TOL)
    torch.testing.assert_close(merged_lse, want_lse, **TOL)
    for cols in halves:
        sub_band = None if band is None else (band[0], band[1][cols], band[2])
        kb, vb = k.detach()[:, :, cols], v.detach()[:, :, cols]
        grads = ops.attention_block_backward(
            q.detach(), kb, vb, merged_out, merged_lse, dout, scale=scale, causal=causal, band=sub_band
        )
        dq += grads[0]
        dkv[0][:, :, cols] += grads[1]
        dkv[1][:, :, cols] += grads[2]
    for got, expected in zip((dq, *dkv), want):
        torch.testing.assert_close(got, expected, **TOL)


def test_cpu_selects_the_flash_block_and_the_varlen_attention():
    assert ops.selected("attention_block", "cpu") == "flash"
    assert ops.selected("attention_block_backward", "cpu") == "flash"
    assert ops.selected("scaled_dot_product_attention", "cpu") == "varlen"
    assert "cuda_flash" in ops.implementations("attention_block")
    assert ops.implementations("scaled_dot_product_attention")[:2] == ["npu", "flash_varlen"]


def test_block_results_stay_fp32_for_bf16_inputs_also_as_an_fp32_op():
    q, k, v = (_randn(1, 2, 6, 8, seed=i).to(torch.bfloat16) for i in range(3))
    for fp32_ops in ([], ["attention_block", "attention_block_backward"]):
        ops.configure(True, fp32_ops)
        try:
            out, lse = ops.attention_block(q, k, v, scale=0.3, causal=True)
            grads = ops.attention_block_backward(q, k, v, out, lse, out, scale=0.3, causal=True)
        finally:
            ops.configure(True, [])
        assert [t.dtype for t in (out, lse, *grads)] == [torch.float32] * 5, fp32_ops


@pytest.mark.parametrize("impl", CPU_BLOCK_IMPLS)
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_attention_equals_the_masked_reference(pinned_block, monkeypatch, impl, window, kv_heads):
    pinned_block(impl)
    monkeypatch.setattr(varlen, "MIN_CHUNK", 3)  # windows cut documents into chunks of max(W, 3) rows
    q = _randn(2, 32, 4, 8, seed=5).requires_grad_()
    k = _randn(2, 32, kv_heads, 8, seed=6).requires_grad_()
    v = _randn(2, 32, kv_heads, 8, seed=7).requires_grad_()
    dout = _randn(2, 32, 4, 8, seed=8)
    for segments in (SEGMENTS, None) if window else (SEGMENTS,):
        out = ops.scaled_dot_product_attention(q, k, v, segment_ids=segments, sliding_window=window)
        got = torch.autograd.grad(out, (q, k, v), dout)
        ref = _dense(q, k, v, segments, window)
        want = torch.autograd.grad(ref, (q, k, v), dout)
        torch.testing.assert_close(out, ref, **TOL)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("window, sinks", [(None, False), (4, False), (None, True)])
def test_short_cpu_rows_take_one_masked_call_equal_to_the_rectangles(monkeypatch, window, sinks):
    q = _randn(2, 32, 4, 8, seed=5).requires_grad_()
    k, v = (_randn(2, 32, 2, 8, seed=i).requires_grad_() for i in (6, 7))
    sink = _randn(4, seed=9).requires_grad_() if sinks else None
    dout = _randn(2, 32, 4, 8, seed=8)
    leaves = (q, k, v) if sink is None else (q, k, v, sink)
    kw = dict(causal=True, segment_ids=SEGMENTS, attn_mask=None, dropout_p=0.0, scale=None, sliding_window=window)
    results, blocks = {}, []
    block = ops.attention_block
    monkeypatch.setattr(ops, "attention_block", lambda *a, **o: blocks.append(1) or block(*a, **o))
    for dense_max in (0, 32):  # the rectangles, then one masked call (rows of 32 tokens)
        monkeypatch.setattr(varlen, "DENSE_MAX_SEQ", dense_max)
        blocks.clear()
        out = varlen.varlen_attention(q, k, v, sinks=sink, **kw)
        results[dense_max] = (out, *torch.autograd.grad(out, leaves, dout))
        assert bool(blocks) == (dense_max == 0)
    for a, b in zip(results[32], results[0]):
        torch.testing.assert_close(a, b, **TOL)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator creates while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("window", [None, 8])
def test_varlen_path_allocates_no_s_by_s_tensor(window):
    s, docs = 256, 8  # b * s * heads * d = 256 * 2 * 4 elements per tensor, s * s = 65536
    q, k, v = (_randn(1, s, 2, 4, seed=i).requires_grad_() for i in range(3))
    segments = torch.arange(docs).repeat_interleave(s // docs).unsqueeze(0)

    def run(impl):
        ops.pin("scaled_dot_product_attention", impl)
        try:
            with _LargestTensor() as seen:
                out = ops.scaled_dot_product_attention(q, k, v, segment_ids=segments, sliding_window=window)
                out.backward(torch.ones_like(out))
        finally:
            ops.pin("scaled_dot_product_attention", None)
        return seen.largest

    assert run("reference") >= s * s  # the masked path builds the [s, s] mask: the probe sees it
    largest = run("varlen")
    doc = s // docs
    assert largest < s * s and largest <= max(q.numel(), 2 * doc * doc), largest  # per-document scores at most


def test_rectangles_follow_runs_of_equal_ids(monkeypatch):
    seg = torch.tensor([[1, 1, 2, 2, 2, 1, 3]])
    assert varlen.rectangles(seg, seg, causal=True) == [
        (0, 0, 2, 0, 2, True),
        (0, 2, 5, 2, 5, True),
        (0, 5, 6, 0, 2, False),
        (0, 5, 6, 5, 6, True),
        (0, 6, 7, 6, 7, True),
    ]
    runs = varlen.runs_of(seg)
    assert runs == [[(0, 2, 1), (2, 5, 2), (5, 6, 1), (6, 7, 3)]]
    assert varlen.clip_runs(runs, 1, 6) == [[(0, 1, 1), (1, 4, 2), (4, 5, 1)]]  # tokens 1..5, from 0
    other = torch.tensor([[2, 2, 3, 3]])
    assert varlen.rectangles(seg, other, causal=False) == [(0, 2, 5, 0, 2, False), (0, 6, 7, 2, 4, False)]
    one = torch.zeros(1, 10, dtype=torch.long)
    assert varlen.rectangles(one, one, True, window=3) == [(0, 0, 10, 0, 10, False)]  # one chunk of MIN_CHUNK
    monkeypatch.setattr(varlen, "MIN_CHUNK", 3)  # chunks of 3 query rows read the 2 keys before them too
    assert varlen.rectangles(one, one, True, window=3) == [
        (0, 0, 3, 0, 3, False),
        (0, 3, 6, 1, 6, False),
        (0, 6, 9, 4, 9, False),
        (0, 9, 10, 7, 10, False),
    ]


def _fake_varlen_attn(calls):
    """``torch.nn.attention.varlen.varlen_attn`` as documented, on the CPU: sequences ``cu[i]:cu[i+1]`` of
    ``[tokens, heads, d]``; ``window_size=(left, right)`` keeps keys ``i - left .. i + right`` (-1: no
    limit); GQA by ``enable_gqa``."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append(dict(cu=cu_q.tolist(), same=cu_k is cu_q, max=(max_q, max_k), window=window_size, gqa=enable_gqa))
        assert cu_q.dtype == torch.int32 and enable_gqa == (q.shape[1] != k.shape[1])
        out, scale = torch.empty_like(q), scale or q.shape[-1] ** -0.5
        for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
            i = torch.arange(b - a)
            diff = i[:, None] - i[None, :]
            allowed = torch.ones(b - a, b - a, dtype=torch.bool)
            left, right = window_size
            if left >= 0:
                allowed &= diff <= left
            if right >= 0:
                allowed &= -diff <= right
            qh, kh, vh = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
            out[a:b] = _dense_block(qh[None], kh[None], vh[None], scale, allowed)[0][0].transpose(0, 1).to(q.dtype)
        return out

    return varlen_attn


@pytest.mark.parametrize("window", [None, 3])
def test_flash_varlen_hands_the_kernel_cumulative_lengths_and_the_window(monkeypatch, window):
    import torch.nn.attention.varlen as torch_varlen

    calls = []
    monkeypatch.setattr(torch_varlen, "varlen_attn", _fake_varlen_attn(calls))
    q, k, v = (_randn(2, 32, h, 8, seed=h).to(torch.bfloat16) for h in (4, 2, 2))
    segments = RUNS  # the kernel takes runs as documents (like the NPU's TND): no id comes back in a row
    out = varlen.flash_varlen_attention(
        q, k, v, causal=True, segment_ids=segments, attn_mask=None, dropout_p=0.0, scale=None, sliding_window=window
    )
    assert calls == [
        dict(
            cu=[0, 7, 16, 17, 23, 26, 32, 64],
            same=True,
            max=(32, 32),
            window=(window - 1 if window else -1, 0),
            gqa=True,
        )
    ]
    ref = _dense(*(t.float() for t in (q, k, v)), segments, window)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    fp32 = [t.float() for t in (q, k, v)]  # fp32 is not flash's: the rectangles instead
    kwargs = dict(causal=True, segment_ids=segments, attn_mask=None, dropout_p=0.0, scale=None, sliding_window=window)
    torch.testing.assert_close(varlen.flash_varlen_attention(*fp32, **kwargs), ref, **TOL)
    assert len(calls) == 1


def test_cuda_flash_block_calls_fit_the_aten_schemas_on_meta_tensors():
    """The CUDA kernels' argument order and shapes, checked by PyTorch's meta functions without a GPU."""
    q = torch.empty(2, 4, 8, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 8, 64, dtype=torch.bfloat16, device="meta")
    out, lse = attention_blocks.cuda_flash_attention_block(q, k, k, scale=0.1, causal=True)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, torch.float32, (2, 4, 8), torch.float32)
    grads = attention_blocks.cuda_flash_attention_block_backward(q, k, k, out, lse, out, scale=0.1, causal=True)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, torch.float32)] + [(k.shape, torch.float32)] * 2


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_varlen_and_block_kernels_match_the_reference(dtype):
    q, k, v = (_randn(2, 32, 4, 16, seed=i, dtype=dtype).cuda().requires_grad_() for i in range(3))
    seg = SEGMENTS.cuda()
    out = ops.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=6)
    ref = _dense(*(t.float() for t in (q, k, v)), seg, 6)
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    qh, kh, vh = (t.detach().transpose(1, 2) for t in (q, k, v))
    block_out, lse = ops.attention_block(qh, kh, vh, scale=0.25, causal=True)
    want_out, want_lse = _dense_block(*(t.float() for t in (qh, kh, vh)), 0.25, torch.ones(32, 32).tril().bool().cuda())
    torch.testing.assert_close(block_out, want_out, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)


# -- extended: bf16, and the ring with each block implementation ----------------------------------------


@pytest.mark.extended
@pytest.mark.parametrize("window", [None, 16])
def test_varlen_bf16_is_as_close_to_the_fp64_truth_as_the_masked_reference(window):
    seg = torch.tensor([[0] * 100 + [1] * 60 + [2] * 96])
    q, k, v = (_randn(1, 256, h, 32, seed=h).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    truth = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _dense(*truth, seg, window)
    dout = _randn(*expected.shape, seed=9)
    want = (expected, *torch.autograd.grad(expected, truth, dout.double()))
    errors = {}
    for impl in ("reference", "varlen"):
        ops.pin("scaled_dot_product_attention", impl)
        try:
            out = ops.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=window)
            got = (out, *torch.autograd.grad(out, (q, k, v), dout.to(torch.bfloat16)))
        finally:
            ops.pin("scaled_dot_product_attention", None)
        errors[impl] = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want)]
    assert all(e < 1e-2 for e in errors["varlen"]), errors
    assert all(new <= 1.5 * old + 1e-3 for new, old in zip(errors["varlen"], errors["reference"])), errors


def _ring_each_block_impl() -> dict:
    """At cp 2: ring and all-gather attention of packed rows (with and without a window) with the block op
    pinned to each CPU implementation, against the dense attention of the whole sequence."""
    from megacann import parallel_state as ps
    from megacann.layers.context_parallel import context_parallel_attention, context_parallel_split

    ps.initialize_model_parallel(context_parallel_size=2)
    worst: dict[str, float] = {}
    q, k, v = (_randn(2, 32, h, 8, seed=h).requires_grad_() for h in (4, 2, 2))
    dout = _randn(2, 32, 4, 8, seed=11)
    for window in (None, 5):
        expected = _dense(q, k, v, SEGMENTS, window)
        want = [expected, *torch.autograd.grad(expected, (q, k, v), dout)]
        for impl in CPU_BLOCK_IMPLS:
            ops.pin("attention_block", impl)
            ops.pin("attention_block_backward", impl)
            for algo in ("ring", "allgather"):
                local = [context_parallel_split(t.detach()).requires_grad_() for t in (q, k, v)]
                out = context_parallel_attention(
                    *local, context_parallel_split(SEGMENTS), algo=algo, sliding_window=window
                )
                got = [out, *torch.autograd.grad(out, local, context_parallel_split(dout))]
                worst[f"{impl}/{algo}/w{window}"] = max(
                    ((a - context_parallel_split(b)).norm() / context_parallel_split(b).norm()).item()
                    for a, b in zip(got, want)
                )
    ops.pin("attention_block", None)
    ops.pin("attention_block_backward", None)
    ps.destroy_model_parallel()
    return worst


@pytest.mark.extended
def test_ring_and_allgather_equal_dense_attention_with_every_block_implementation():
    from dist_harness import run_on_ranks

    for worst in run_on_ranks(_ring_each_block_impl, world_size=2, timeout=300):
        assert len(worst) == 2 * len(CPU_BLOCK_IMPLS) * 2, worst
        assert all(err < 1e-5 for err in worst.values()), worst
