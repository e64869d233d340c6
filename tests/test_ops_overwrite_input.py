"""Backward passes that write an op's input gradient over the input itself (``overwrite_input``): the
fused SwiGLU's gate|up and the MoE unpermute's expert outputs on the CPU kernels. Gradients equal the
plain backward's bit for bit, the gradient lives in the input's memory, and a leaf or a tensor another
node saved is never silently overwritten."""

from __future__ import annotations

import pytest
import torch

from megacann import ops
from megacann.ops import cpp

pytestmark = pytest.mark.skipif(not cpp.available(), reason="C++ kernels not built")

DTYPES = [torch.float32, torch.bfloat16]


def _swiglu_case(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(2 * 20, 16, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(24, 20, generator=gen).to(dtype)
    return x, w, grad


def _unpermute_case(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, top_k, hidden = 10, 2, 12
    x = torch.randn(tokens * top_k, 8, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(hidden, 8, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(tokens, top_k, generator=gen).requires_grad_()
    row_id_map = torch.randperm(tokens * top_k, generator=gen)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, w, probs, row_id_map, grad


def _run_swiglu(dtype, overwrite: bool):
    x, w, grad = _swiglu_case(dtype)
    gate_up = x @ w.t()  # an intermediate nothing else saves
    seen = {}
    gate_up.register_hook(lambda g: seen.update(grad_ptr=g.data_ptr()))
    out = ops.swiglu(gate_up, overwrite_input=overwrite)
    out.backward(grad)
    return out.detach(), x.grad, w.grad, seen["grad_ptr"] == gate_up.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_overwriting_backward_equals_the_plain_one_in_the_inputs_memory(dtype):
    out, gx, gw, in_place = _run_swiglu(dtype, overwrite=True)
    ref_out, ref_gx, ref_gw, ref_in_place = _run_swiglu(dtype, overwrite=False)
    assert in_place and not ref_in_place
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx) and torch.equal(gw, ref_gw)


def _run_unpermute(dtype, overwrite: bool):
    x, w, probs, row_id_map, grad = _unpermute_case(dtype)
    permuted = x @ w.t()
    seen = {}
    permuted.register_hook(lambda g: seen.update(grad_ptr=g.data_ptr()))
    out = ops.moe_unpermute(permuted, row_id_map, probs, overwrite_input=overwrite)
    out.backward(grad)
    return out.detach(), x.grad, w.grad, probs.grad, seen["grad_ptr"] == permuted.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpermute_overwriting_backward_equals_the_plain_one_in_the_inputs_memory(dtype):
    *got, in_place = _run_unpermute(dtype, overwrite=True)
    *want, ref_in_place = _run_unpermute(dtype, overwrite=False)
    assert in_place and not ref_in_place
    for mine, theirs in zip(got, want):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_a_leaf_input_is_never_overwritten():
    x = torch.randn(6, 10, requires_grad=True)
    kept = x.detach().clone()
    ops.swiglu(x, overwrite_input=True).sum().backward()
    assert torch.equal(x.detach(), kept)
    reference = x.detach().clone().requires_grad_()
    ops.swiglu(reference).sum().backward()
    assert torch.equal(x.grad, reference.grad)


def test_a_tensor_another_node_saved_fails_loudly_instead_of_reading_gradients():
    x, w, grad = _swiglu_case(torch.float32)
    gate_up = x @ w.t()
    also_saved = gate_up.sin()  # sin's backward reads gate_up; it runs after the SwiGLU's (created earlier)
    out = ops.swiglu(gate_up, overwrite_input=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out * grad).sum().add(also_saved.sum()).backward()


def test_the_in_place_ops_refuse_overlapping_or_strided_memory():
    gate_up = torch.randn(4, 10)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.megacann.swiglu_fused_backward_(torch.randn(10, 5), gate_up.t().contiguous().t())
    with pytest.raises(
        RuntimeError, match="refer to a single memory location"
    ):  # the output gradient in the memory it would overwrite
        torch.ops.megacann.swiglu_fused_backward_(gate_up.view(-1)[:20].view(4, 5), gate_up)
    permuted = torch.randn(6, 4)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.ops.megacann.moe_unpermute_backward_(permuted[:3], permuted, torch.arange(6), torch.rand(3, 2))
