"""MoE operators: token permute/unpermute against hand-written layouts, the grouped matmul's
implementations against per-group ``F.linear`` (values and gradients), the C++ grouped products' row
cuts against ``torch.mm``, and their registration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacann import ops
from megacann.ops import cpp, registry
from megacann.ops.moe import _grouped_matmul_reference, _grouped_matmul_torch, _grouped_mm_takes
from megacann.ops.moe_gather import _grouped_matmul_gather

needs_cpp = pytest.mark.skipif(not cpp.available(), reason="the C++ kernels are not built")


def _grouped_matmul_cpp(x, weights, sizes):
    if not cpp.available():
        pytest.skip("the C++ kernels are not built")
    return cpp.grouped_matmul(x, weights, sizes)


def _with_threads(threads: int, fn):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def test_permute_groups_copies_by_expert_in_token_order():
    tokens = torch.arange(4, dtype=torch.float32).unsqueeze(1).repeat(1, 3)  # token t is [t, t, t]
    expert_ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 3]])
    permuted, row_id_map = ops.moe_permute(tokens, expert_ids)
    # expert 0: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 2: tokens 0, 2; expert 3: token 3
    assert permuted[:, 0].tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert row_id_map.dtype == torch.int32
    # token t's j-th copy: (0,2)->5 (0,0)->0 (1,0)->1 (1,1)->3 (2,2)->6 (2,1)->4 (3,0)->2 (3,3)->7
    assert row_id_map.tolist() == [5, 0, 1, 3, 6, 4, 2, 7]


def test_unpermute_weights_and_sums_each_tokens_copies():
    tokens = torch.randn(5, 4, dtype=torch.float64)
    expert_ids = torch.tensor([[1, 0], [3, 1], [0, 2], [2, 3], [1, 2]])
    probs = torch.rand(5, 2, dtype=torch.float64)
    permuted, row_id_map = ops.moe_permute(tokens, expert_ids)
    scale = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)  # a different "expert" per id
    sorted_ids = expert_ids.reshape(-1).sort(stable=True).values
    out = ops.moe_unpermute(permuted * scale[sorted_ids].unsqueeze(1), row_id_map, probs)
    expected = sum(probs[:, j : j + 1] * scale[expert_ids[:, j]].unsqueeze(1) * tokens for j in range(2))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_unpermute_casts_probs_to_the_tokens_dtype():
    tokens = torch.randn(3, 8, dtype=torch.bfloat16)
    permuted, row_id_map = ops.moe_permute(tokens, torch.tensor([[0], [1], [0]]))
    assert ops.moe_unpermute(permuted, row_id_map, torch.rand(3, 1)).dtype == torch.bfloat16


def test_permute_and_unpermute_gradients_match_a_per_token_loop():
    tokens = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    expert_ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    weights = torch.randn(3, 4, 4, dtype=torch.float64)
    permuted, row_id_map = ops.moe_permute(tokens, expert_ids)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=3).tolist()
    out = ops.moe_unpermute(ops.grouped_matmul(permuted, list(weights), counts), row_id_map, probs)
    grad = torch.randn_like(out)
    dt, dp = torch.autograd.grad(out, (tokens, probs), grad)
    t2, p2 = tokens.detach().requires_grad_(), probs.detach().requires_grad_()
    loop = torch.stack([sum(p2[t, j] * F.linear(t2[t], weights[expert_ids[t, j]]) for j in range(2)) for t in range(6)])
    dt2, dp2 = torch.autograd.grad(loop, (t2, p2), grad)
    torch.testing.assert_close(out, loop, rtol=0, atol=1e-12)
    torch.testing.assert_close(dt, dt2, rtol=0, atol=1e-12)
    torch.testing.assert_close(dp, dp2, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "impl", [_grouped_matmul_reference, _grouped_matmul_torch, _grouped_matmul_gather, _grouped_matmul_cpp]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_per_group_linear(impl, dtype):
    sizes = [3, 0, 5, 8]  # an expert without tokens too
    x = torch.randn(16, 16, dtype=dtype, requires_grad=True)
    weights = [torch.randn(24, 16, dtype=dtype, requires_grad=True) for _ in sizes]
    out = impl(x, weights, sizes)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *weights], grad)
    x2 = x.detach().requires_grad_()
    w2 = [w.detach().requires_grad_() for w in weights]
    ref = torch.cat([F.linear(rows, w) for rows, w in zip(x2.split(sizes), w2)])
    ref_grads = torch.autograd.grad(ref, [x2, *w2], grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("impl", [_grouped_matmul_reference, _grouped_matmul_gather, _grouped_matmul_cpp])
def test_grouped_matmul_of_a_rank_whose_experts_got_no_token(impl):
    """Expert parallelism can leave every expert of a rank without tokens: no rows in, none out, and
    zero gradients for the weights."""
    x = torch.randn(0, 16, requires_grad=True)
    weights = [torch.randn(24, 16, requires_grad=True) for _ in range(2)]
    out = impl(x, weights, [0, 0])
    assert out.shape == (0, 24)
    grads = torch.autograd.grad(out.sum(), weights)
    assert all(torch.equal(g, torch.zeros(24, 16)) for g in grads)


@needs_cpp
@pytest.mark.parametrize("parts", [0, 1, 2, 3, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpp_grouped_products_cut_every_groups_rows_once(parts, dtype):
    """``megacann::grouped_mm_`` gives ``a[g] @ b[g]`` however the rows are cut (``parts`` pieces; 0: one per
    thread, two threads here): uneven groups, one without rows, one with K = 0 (zeros), a transposed left
    operand (the weight gradients' layout). The outputs start as NaN, so a row no piece covers fails."""
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 16, 24), (0, 16, 24), (5, 0, 24), (64, 16, 24), (1, 16, 24)]  # rows, K, N
    a = [torch.randn(m, k, generator=g).to(dtype) for m, k, _ in shapes]
    a[3] = torch.randn(16, 64, generator=g).to(dtype).t()
    b = [torch.randn(k, n, generator=g).to(dtype) for _, k, n in shapes]
    out = [torch.full((m, n), float("nan"), dtype=dtype) for m, _, n in shapes]
    _with_threads(2, lambda: torch.ops.megacann.grouped_mm_(out, a, b, parts))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    for got, x, y in zip(out, a, b):
        torch.testing.assert_close(got, x @ y, rtol=tol, atol=tol)
    assert not out[2].any()


@needs_cpp
def test_cpp_grouped_products_reject_mismatched_operands():
    op = torch.ops.megacann.grouped_mm_
    with pytest.raises(RuntimeError, match="2 outputs but 1 left and 2 right operands"):
        op([torch.empty(3, 4)] * 2, [torch.randn(3, 2)], [torch.randn(2, 4)] * 2, 0)
    with pytest.raises(RuntimeError, match=r"group 0: out \[3, 4\] != a \[3, 2\] x b \[5, 4\]"):
        op([torch.empty(3, 4)], [torch.randn(3, 2)], [torch.randn(5, 4)], 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_grouped_matmul_equals_gather_at_moe_shapes(dtype):
    """With two threads the pieces cut through groups (uneven sizes, an empty group): the output and every
    gradient equal the ``gather`` path's (one ``torch.mm`` per group) within fp32 round-off (norm-wise 1e-6:
    elementwise, 5.9e-5 apart was measured on a 2-core Xeon, above the 1e-5 bound this test had), one bf16
    rounding apart at most."""
    g = torch.Generator().manual_seed(1)
    sizes = [300, 0, 517, 1201, 64, 3]
    x = torch.randn(sum(sizes), 96, generator=g).to(dtype).requires_grad_()
    weights = [torch.randn(160, 96, generator=g).to(dtype).requires_grad_() for _ in sizes]
    grad = torch.randn(sum(sizes), 160, generator=g).to(dtype)

    def run(impl):
        out = impl(x, weights, sizes)
        return (out, *torch.autograd.grad(out, [x, *weights], grad))

    got = _with_threads(2, lambda: run(_grouped_matmul_cpp))
    want = _with_threads(2, lambda: run(_grouped_matmul_gather))
    for a, b in zip(got, want):
        if dtype == torch.float32:  # norm-wise: a weight's gradient sums up to 1201 rows in another order
            assert (a - b).norm() <= 1e-6 * b.norm(), ((a - b).norm(), b.norm())
        else:
            torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7)
    assert not got[3].any()  # (output, input gradient, weights' gradients): the expert without tokens gets 0


def test_grouped_mm_path_takes_aligned_shapes_and_falls_back_otherwise():
    w = [torch.randn(8, 16)]
    assert _grouped_mm_takes(torch.randn(4, 16), w)
    assert not _grouped_mm_takes(torch.randn(4, 6), [torch.randn(8, 6)])  # 24-byte rows
    assert not _grouped_mm_takes(torch.randn(4, 16), [torch.randn(8, 16, dtype=torch.float64)])
    assert not _grouped_mm_takes(torch.randn(4, 16, dtype=torch.float64), [torch.randn(8, 16, dtype=torch.float64)])
    x, odd = torch.randn(5, 6), [torch.randn(3, 6), torch.randn(3, 6)]
    torch.testing.assert_close(_grouped_matmul_torch(x, odd, [2, 3]), _grouped_matmul_reference(x, odd, [2, 3]))
    # the gradient of a reduction is a stride-0 tensor, which _grouped_mm's backward rejects on its own
    xs = torch.randn(6, 16, requires_grad=True)
    _grouped_matmul_torch(xs, w * 2, [2, 4]).sum().backward()
    torch.testing.assert_close(xs.grad, w[0].sum(0).expand(6, 16))


def test_moe_ops_are_registered_with_their_device_kernels():
    assert registry.implementations("grouped_matmul") == [
        "torch_npu",
        "torch_grouped_mm",
        "cpp",
        "gather",
        "reference",
        "torch_grouped_mm_cpu",
    ]
    assert registry.implementations("moe_permute") == ["torch_npu", "reference"]
    assert registry.implementations("moe_unpermute") == ["torch_npu", "cpp", "reference"]
    # torch's grouped kernel only when pinned
    assert registry.selected("grouped_matmul", "cpu") == ("cpp" if cpp.available() else "gather")
    assert registry.selected("moe_permute", "cpu") == "reference"
    assert registry.selected("moe_unpermute", "cpu") == ("cpp" if cpp.available() else "reference")
    try:
        ops.pin("grouped_matmul", "torch_grouped_mm_cpu")
        assert registry.selected("grouped_matmul", "cpu") == "torch_grouped_mm_cpu"
    finally:
        ops.pin("grouped_matmul", None)


def test_grouped_matmul_rejects_mismatched_groups():
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="group sizes add up to 4, x has 5 rows"):
        ops.grouped_matmul(x, [torch.randn(2, 4)] * 2, [1, 3])
    with pytest.raises(ValueError, match="2 weights but 3 group sizes"):
        ops.grouped_matmul(x, [torch.randn(2, 4)] * 2, [1, 3, 1])
