"""distributed.tp_comm_overlap: the overlapped sequence-parallel column projection equals the plain one
(all-gather, F.linear; reduce-scatter of the input gradient), values and gradients, at tp 2 (gloo); a
trainer with the key trains like one without; the key is refused where there is nothing to overlap."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks


def _compare() -> dict:
    import torch
    import torch.nn.functional as F

    from megacann import parallel_state as ps
    from megacann.layers import ColumnParallelLinear, LayerContext, mappings
    from megacann.layers.tp_overlap import overlapped_gather_linear

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group = ps.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(2, 8, 6, generator=g)  # [b, s, h], b = 2: the rank-major reorder is not a view
    weight = torch.randn(10, 6, generator=g)
    bias = torch.randn(10, generator=g)
    grad = torch.randn(2, 8, 10, generator=g)
    rank = ps.get_tensor_model_parallel_rank()
    shard = x_all[:, 4 * rank : 4 * rank + 4]
    results = []
    for overlapped in (False, True):
        x, w, b = (t.clone().requires_grad_() for t in (shard, weight, bias))
        if overlapped:
            y = overlapped_gather_linear(x, w, b, group)
        else:
            y = F.linear(mappings.gather_from_sequence_parallel_region(x, group), w, b)
        y.backward(grad)
        results.append((y.detach(), x.grad, w.grad, b.grad))
    with LayerContext(sequence_parallel=True, tp_comm_overlap=True):
        layer = ColumnParallelLinear(6, 10)
    ps.destroy_model_parallel()
    return {"results": results, "layer_overlaps": layer.comm_overlap}


def _both() -> dict:
    return {"fp32": _compare(), "low": _low_precision()}


@pytest.fixture(scope="module")
def tp2():
    """Both checks on one pair of ranks (one start)."""
    return run_on_ranks(_both, 2, timeout=300)


def test_overlapped_gather_linear_equals_the_plain_path(tp2):
    import torch

    for rank, out in enumerate(r["fp32"] for r in tp2):
        plain, overlapped = out["results"]
        assert len(plain) == len(overlapped) == 4
        for want, got in zip(plain, overlapped):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert plain[1].shape == (2, 4, 6), rank  # this rank's shard of the input gradient
        assert out["layer_overlaps"]


def test_tp_comm_overlap_is_refused_without_sequence_parallelism():
    from training_helpers import tiny_config

    from megacann.config import ConfigError

    with pytest.raises(ConfigError, match="distributed.tp_comm_overlap needs distributed.sequence_parallel: true"):
        tiny_config(["distributed.tp_comm_overlap=true", "distributed.tensor_parallel_size=2"], world_size=2)


def _low_precision() -> dict:
    """The overlapped projection in bf16 and fp16 on the fp32 GEMM route: its results, the matmuls' dtypes,
    and B leaving the weight's gradient to W (equal to the fused backward's)."""
    import torch
    from lowp_bound import Products

    from megacann import parallel_state as ps
    from megacann.layers.tp_overlap import overlapped_gather_linear
    from megacann.ops import bf16_matmul
    from megacann.ops.weight_grad import WeightGradStore, collecting

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(0)
        x_all = torch.randn(2, 8, 32, generator=g).to(dtype)
        weight = (torch.randn(24, 32, generator=g) / 4).to(dtype)
        bias = torch.randn(24, generator=g).to(dtype)
        grad = torch.randn(2, 8, 24, generator=g).to(dtype)
        x, w, b = (t.clone().requires_grad_() for t in (x_all[:, 4 * rank : 4 * rank + 4], weight, bias))
        with bf16_matmul.forced(True), Products() as products:
            y = overlapped_gather_linear(x, w, b, group)
            y.backward(grad)
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        store = WeightGradStore()
        with bf16_matmul.forced(True):
            y2 = overlapped_gather_linear(x2, w2, None, group)
            with collecting(store):
                y2.backward(grad)
            deferred = w2.grad is None and store.num_closures == 1
            store.run()
        out[str(dtype)] = {
            "inputs": (x_all, weight, bias, grad),
            "results": (y.detach(), x.grad, w.grad, b.grad),
            "products": (products.dtypes, products.low),
            "w_deferred_equal": deferred and torch.equal(w2.grad, w.grad) and torch.equal(x2.grad, x.grad),
        }
    ps.destroy_model_parallel()
    return out


def test_overlapped_projection_in_bf16_and_fp16_runs_fp32_gemms_within_the_bound(tp2):
    from lowp_bound import assert_within

    for rank, out in enumerate(r["low"] for r in tp2):
        for dtype, got in out.items():
            (x, w, b, dy), (y, dx, dw, db) = got["inputs"], got["results"]
            dtypes, low = got["products"]
            # forward: 2 chunks; backward: input and weight gradients
            assert low == [] and dtypes == {"torch.float32": 4}, (dtype, dtypes)
            assert got["w_deferred_equal"], dtype
            x, w, b, dy = (t.double() for t in (x, w, b, dy))
            xs, dys = x.reshape(-1, 32), dy.reshape(-1, 24)
            assert_within(y, x @ w.t() + b, x.abs() @ w.abs().t() + b.abs(), 32, f"{dtype} y")
            # both ranks hold the same weight and output gradient: the reduce-scatter sums two equal values
            shard = slice(4 * rank, 4 * rank + 4)
            ref, absprod = 2 * (dy @ w)[:, shard], 2 * (dy.abs() @ w.abs())[:, shard]
            assert_within(dx, ref, absprod, 24, f"{dtype} dx")
            assert_within(dw, dys.t() @ xs, dys.abs().t() @ xs.abs(), 16, f"{dtype} dw")
            assert_within(db, dys.sum(0), dys.abs().sum(0), 16, f"{dtype} db")
