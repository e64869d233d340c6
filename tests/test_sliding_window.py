"""Sliding-window attention on every path equals a dense attention written here from the definition (query
``i`` sees key ``j`` when ``i - W < j <= i``, within its packed document): the reference op (the CPU
path; on a CUDA device the same SDPA call with the mask), the NPU route through the fake ``torch_npu`` (band mode,
``sparse_mode=4``), and context-parallel attention at cp 2 with ring, all-gather and Ulysses (output and
dq, dk, dv), including windows that reach across the chunk edges and steps the ring skips.
"""

from __future__ import annotations

import sys

import pytest
import torch
from dist_harness import run_on_ranks
from fake_torch_npu import COMPRESSED, make_fake_torch_npu
from layers_reference import rel_err
from test_ops_npu import _forget_npu_checks

from megacann import ops
from megacann.ops import reference, registry

B, S, HQ, HKV, D = 2, 16, 4, 2, 16
SEGMENTS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3], [5] * 7 + [7] * 9])
WINDOWS = (1, 3, 6, 16)


def _qkv(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g, dtype=dtype) for h in (HQ, HKV, HKV)]


def dense_window_attention(q, k, v, window, segments=None):
    """Softmax attention from the definition, with an explicit loop over query rows."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    out = torch.zeros_like(q)
    for i in range(q.shape[1]):
        keys = torch.arange(q.shape[1])
        seen = (keys <= i) & (keys > i - window)
        for b in range(q.shape[0]):
            ok = seen if segments is None else seen & (segments[b] == segments[b, i])
            scores = torch.einsum("hd,khd->hk", q[b, i], k[b, ok]) / D**0.5
            out[b, i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[b, ok])
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("packed", [False, True])
def test_reference_op_is_the_band(window, packed):
    q, k, v = _qkv()
    seg = SEGMENTS if packed else None
    out = ops.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=window)
    assert rel_err(out, dense_window_attention(q, k, v, window, seg)) < 1e-10
    if window < S:  # the window really changes the result
        assert rel_err(out, ops.scaled_dot_product_attention(q, k, v, segment_ids=seg)) > 1e-3


def test_window_needs_causal_attention_and_a_positive_width():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sliding_window needs causal attention"):
        ops.scaled_dot_product_attention(q, k, v, causal=False, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window must be a positive number of keys, got 0"):
        ops.scaled_dot_product_attention(q, k, v, sliding_window=0)


@pytest.fixture
def fake_npu(monkeypatch):
    npu = make_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    _forget_npu_checks()
    yield npu
    monkeypatch.delitem(sys.modules, "torch_npu")
    _forget_npu_checks()


@pytest.mark.parametrize("packed", [False, True])
def test_npu_route_is_band_mode_and_equals_the_reference(fake_npu, packed):
    q, k, v = _qkv(dtype=torch.float32)
    seg = SEGMENTS if packed else None
    attend = registry.resolve("scaled_dot_product_attention", "npu")
    for window in WINDOWS:
        out = attend(q, k, v, segment_ids=seg, sliding_window=window)
        call = fake_npu.calls[-1]
        assert call.args[4] == ("TND" if packed else "BSND")
        if window < S:  # band mode: W-1 keys behind the query, none ahead, the compressed mask
            assert call.kwargs["sparse_mode"] == 4
            assert (call.kwargs["pre_tockens"], call.kwargs["next_tockens"]) == (window - 1, 0)
            assert call.kwargs["atten_mask"].shape == (COMPRESSED, COMPRESSED)
        else:  # a window as long as the sequence is plain causal attention
            assert call.kwargs["sparse_mode"] == (3 if packed else 2) and "pre_tockens" not in call.kwargs
        ref = reference.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=window)
        assert rel_err(out, ref) < 1e-6
    explicit = torch.ones(B, 1, S, S, dtype=torch.bool)  # an explicit mask takes the window into its complement
    out = attend(q, k, v, segment_ids=seg, attn_mask=explicit, sliding_window=3)
    assert fake_npu.calls[-1].kwargs["sparse_mode"] == 0
    assert rel_err(out, reference.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=3)) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_runs_the_band_through_sdpa(packed):
    q, k, v = (t.float().cuda().requires_grad_() for t in _qkv())
    seg = SEGMENTS.cuda() if packed else None
    out = ops.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=3)
    cpu = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    expected = dense_window_attention(*cpu, 3, None if seg is None else SEGMENTS)
    assert rel_err(out.double().cpu(), expected) < 1e-4  # fp32 kernels
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.float().cuda())
    want = torch.autograd.grad(expected, cpu, grad)
    assert max(rel_err(a.double().cpu(), b) for a, b in zip(got, want)) < 1e-3


# -- context parallelism ------------------------------------------------------------------------------


def _cp_checks() -> dict:
    """At cp 2 (chunks of 4 tokens): each algorithm's output and input gradients against the dense
    attention of the whole sequence, with and without packed documents, and the steps the ring skipped."""
    from megacann import parallel_state as ps
    from megacann.layers.context_parallel import blockwise, context_parallel_attention, context_parallel_split

    ps.initialize_model_parallel(context_parallel_size=2)
    errors, skipped = {}, []
    real = blockwise._block_forward
    blockwise._block_forward = lambda *a, **kw: (skipped.append(False), real(*a, **kw))[1]
    for window in (1, 3, 5, 9):
        for packed in (False, True):
            q, k, v = (t.requires_grad_() for t in _qkv(seed=window))
            seg = SEGMENTS if packed else None
            expected = dense_window_attention(q, k, v, window, seg)
            grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9), dtype=expected.dtype)
            want = torch.autograd.grad(expected, (q, k, v), grad)
            for algo in ("ring", "allgather", "ulysses"):
                local = [context_parallel_split(t.detach()).requires_grad_() for t in (q, k, v)]
                out = context_parallel_attention(
                    *local, None if seg is None else context_parallel_split(seg), algo=algo, sliding_window=window
                )
                got = torch.autograd.grad(out, local, context_parallel_split(grad))
                worst = rel_err(out, context_parallel_split(expected.detach()))
                for a, b in zip(got, want):
                    worst = max(worst, rel_err(a, context_parallel_split(b)))
                errors[f"{algo}_w{window}_{'packed' if packed else 'causal'}"] = worst
    blockwise._block_forward = real
    return {"errors": errors, "block_computations": len(skipped)}


@pytest.fixture(scope="module")
def cp_results():
    return run_on_ranks(_cp_checks, 2, timeout=300)


def test_context_parallel_attention_carries_the_window(cp_results):
    for rank in cp_results:
        bad = {name: err for name, err in rank["errors"].items() if not err < 1e-10}
        assert not bad, bad


def test_the_ring_skips_blocks_outside_the_window(cp_results):
    # rank 0 holds positions 0-3 and 12-15, rank 1 4-7 and 8-11: each rank's step on the other's block
    # has keys at least 1 behind its queries, out of reach for W = 1 only, where it is skipped.
    # 4 windows x 2 layouts x 2 transports (ring, all-gather) x 2 steps, less the W = 1 steps skipped
    for got in cp_results:
        assert got["block_computations"] == 4 * 2 * 2 * 2 - 2 * 2
