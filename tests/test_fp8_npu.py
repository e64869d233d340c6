"""``fp8_linear`` on the NPU route against the fake ``torch_npu.npu_quant_matmul`` of
tests/fake_npu_quant.py, which checks torch_npu's documented signature and limits: tensorwise and rowwise
products go to the kernel with the documented arguments (one ``scale``, or per-channel ``scale`` with
``pertoken_scale``) and equal the reference products up to the kernel's bfloat16 result; the block
recipes and a torch_npu without the kernel run the reference, each said once.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from fake_torch_npu import forget_npu_checks, make_fake_torch_npu
from layers_reference import rel_err

from megacann.ops import fp8_npu, registry
from megacann.ops.fp8 import fp8_linear

BF16_ROUNDING = 2.0**-8  # the kernel's bfloat16 result: half an ulp is 2^-9 of each element


@pytest.fixture
def fake_npu(monkeypatch):
    npu = make_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    forget_npu_checks()
    fp8_npu.forget()
    yield npu
    monkeypatch.delitem(sys.modules, "torch_npu")
    forget_npu_checks()


def _products(impl, recipe: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 64, generator=g).requires_grad_()
    w = (torch.randn(32, 64, generator=g) * 0.1).requires_grad_()
    b = torch.randn(32, generator=g).requires_grad_()
    y = impl(x, w, b, recipe=recipe)
    y.backward(torch.randn(6, 32, generator=g))
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad}


def test_the_npu_route_is_selected_where_torch_npu_has_the_kernel(fake_npu):
    assert registry.selected("fp8_linear", "npu") == "npu"
    assert registry.selected("fp8_linear", "cpu") != "npu"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tensorwise_and_rowwise_products_run_on_npu_quant_matmul(fake_npu, recipe):
    got = _products(registry.resolve("fp8_linear", "npu"), recipe)
    want = _products(fp8_linear, recipe)  # the reference products, fp32 results
    calls = [c for c in fake_npu.calls if c.name == "npu_quant_matmul"]
    assert len(calls) == 3  # forward, input gradient, weight gradient
    for call, (m, k, n) in zip(calls, [(6, 64, 32), (6, 32, 64), (32, 6, 64)]):
        x1, x2, scale = call.args
        assert x1.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and tuple(x1.shape) == (m, k)
        assert tuple(x2.shape) == (k, n) and call.result.dtype == torch.bfloat16
        assert call.kwargs["output_dtype"] == torch.bfloat16
        if recipe == "tensorwise":  # one scale: the product of both operands'
            assert tuple(scale.shape) == (1,) and call.kwargs["pertoken_scale"] is None
        else:  # per output channel, and per row of x1
            assert tuple(scale.shape) == (n,) and tuple(call.kwargs["pertoken_scale"].shape) == (m,)
    assert calls[1].args[0].dtype == torch.float8_e5m2  # the output gradient in e5m2
    for key in ("y", "dx", "dw"):
        assert rel_err(got[key], want[key]) <= BF16_ROUNDING, (key, rel_err(got[key], want[key]))
        assert rel_err(got[key], want[key]) > 0  # the kernel's bf16 result, not the reference's fp32
    assert torch.equal(got["db"], want["db"])


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipes_run_the_reference_on_npu_said_once(fake_npu, recipe, caplog):
    impl = registry.resolve("fp8_linear", "npu")
    with caplog.at_level(logging.WARNING, logger="megacann.ops"):
        got = _products(impl, recipe)
        _products(impl, recipe, seed=1)
    said = [r.getMessage() for r in caplog.records if "fp8_linear recipe" in r.getMessage()]
    assert said == [
        f"megacann.ops: fp8_linear recipe {recipe!r} runs the reference products on NPU (npu_quant_matmul takes "
        "per-tensor and per-row scales only)"
    ]
    assert not [c for c in fake_npu.calls if c.name == "npu_quant_matmul"]
    want = _products(fp8_linear, recipe)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_without_the_kernel_fp8_linear_resolves_to_the_reference_said_once(fake_npu, caplog):
    del fake_npu.npu_quant_matmul
    with caplog.at_level(logging.WARNING, logger="megacann.ops"):
        assert registry.selected("fp8_linear", "npu") == "reference"
        assert registry.selected("fp8_linear", "npu") == "reference"
    said = [r.getMessage() for r in caplog.records if "npu_quant_matmul" in r.getMessage()]
    assert len(said) == 1 and "fp8_linear falls back from 'npu'" in said[0] and "no npu_quant_matmul" in said[0]
