"""MoE operators: token permute/unpermute against hand-written layouts, the grouped matmul's
implementations against per-group ``F.linear`` (values and gradients), and their registration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacann import ops
from megacann.ops import cpp, registry
from megacann.ops.moe import _grouped_matmul_reference, _grouped_matmul_torch, _grouped_mm_takes
from megacann.ops.moe_gather import _grouped_matmul_gather


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


@pytest.mark.parametrize("impl", [_grouped_matmul_reference, _grouped_matmul_torch, _grouped_matmul_gather])
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
        "gather",
        "reference",
        "torch_grouped_mm_cpu",
    ]
    assert registry.implementations("moe_permute") == ["torch_npu", "reference"]
    assert registry.implementations("moe_unpermute") == ["torch_npu", "cpp", "reference"]
    assert registry.selected("grouped_matmul", "cpu") == "gather"  # torch's grouped kernel only when pinned
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
