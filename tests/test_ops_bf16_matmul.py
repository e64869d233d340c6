"""bf16 matmuls as fp32 GEMMs on CPUs without native bf16 GEMM (megacann/ops/bf16_matmul.py): when the route
is chosen (CPU flags, ONEDNN_MAX_CPU_ISA, MEGACANN_CPU_BF16_MATMUL), its numerics against a float64
reference, that autograd saves only the bf16 tensors, and that a bf16 training step really takes it.

The bound: a product of bf16 values is exact in fp32 and float64, so both routes differ from the float64
product of the same bf16 inputs only by fp32 accumulation (at most k * 2^-24 * sum|a||b| for k terms) and by
the final rounding to bf16 (at most u = 2^-8 relative). Every output and gradient element must lie within
BOUND = u * |ref| + k * 2^-22 * (|a| @ |b|) of the float64 reference (the accumulation term with a margin
of 4 for the rounding of partial sums in blocked GEMMs); the native bf16 GEMM meets the same bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_on_ranks

from megacann import ops
from megacann.ops import bf16_matmul, registry

UNIT_ROUNDOFF = 2.0**-8
AVX2 = "fpu sse2 avx avx2 fma bmi1 bmi2 f16c movbe abm xsave"
ZEN4 = AVX2 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16"


def test_the_route_is_chosen_where_the_cpu_lacks_bf16_gemm():
    choose = bf16_matmul.choose
    assert choose(AVX2.split()) is True  # an AVX2-only EPYC
    assert choose((AVX2 + " avx512f avx512bw").split()) is True  # AVX-512 without AVX512_BF16
    assert choose(ZEN4.split()) is False
    assert choose(["amx_bf16", "amx_tile"]) is False
    assert choose(["fp", "asimd", "bf16"]) is False  # an ARM CPU with the BF16 extension
    assert choose(ZEN4.split(), onednn_max_isa="AVX2") is True  # oneDNN held to AVX2 (the emulation)
    assert choose(ZEN4.split(), onednn_max_isa="avx512_core_bf16") is False
    assert choose(ZEN4.split(), setting="fp32") is True and choose(AVX2.split(), setting=" BF16 ") is False
    with pytest.raises(
        ValueError, match=r"MEGACANN_CPU_BF16_MATMUL='fast': expected one of \('auto', 'fp32', 'bf16'\)"
    ):
        choose(AVX2.split(), setting="fast")


def _bound(ref: torch.Tensor, absprod: torch.Tensor, k: int) -> torch.Tensor:
    return UNIT_ROUNDOFF * ref.abs() + k * 2.0**-22 * absprod


def _linear_case(on: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(48, 64, generator=g) / 8).bfloat16().requires_grad_()
    b = torch.randn(48, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(3, 7, 48, generator=g).bfloat16()
    with bf16_matmul.forced(on):
        assert registry.selected("linear", "cpu") == ("fp32_gemm" if on else "reference")
        y = ops.linear(x, w, b)
        y.backward(dy)
    return dict(x=x, w=w, b=b, dy=dy, y=y, dx=x.grad, dw=w.grad, db=b.grad)


@pytest.mark.parametrize("on", [True, False], ids=["fp32_gemm", "native_bf16"])
def test_linear_outputs_and_gradients_within_the_bound(on):
    r = _linear_case(on)
    x, w, dy = (r[k].detach().double().reshape(-1, r[k].shape[-1]) for k in ("x", "w", "dy"))
    checks = {  # name: (result, float64 reference, |a| @ |b|, k)
        "y": (r["y"], x @ w.t() + r["b"].double(), x.abs() @ w.abs().t() + r["b"].double().abs(), 64),
        "dx": (r["dx"], dy @ w, dy.abs() @ w.abs(), 48),
        "dw": (r["dw"], dy.t() @ x, dy.abs().t() @ x.abs(), 21),
        "db": (r["db"], dy.sum(0), dy.abs().sum(0), 21),
    }
    for name, (got, ref, absprod, k) in checks.items():
        assert got.dtype == torch.bfloat16, name
        err = (got.double().reshape(ref.shape) - ref).abs()
        assert bool((err <= _bound(ref, absprod, k)).all()), (name, float((err / _bound(ref, absprod, k)).max()))


def test_the_routes_agree_and_autograd_saves_only_bf16():
    on, off = _linear_case(True), _linear_case(False)
    for name in ("y", "dx", "dw", "db"):  # each within the bound of the same reference: a few bf16 ulps apart
        torch.testing.assert_close(on[name], off[name], rtol=4 * UNIT_ROUNDOFF, atol=1e-2)
    saved: list[torch.dtype] = []
    x = torch.randn(4, 16).bfloat16().requires_grad_()
    w = torch.randn(8, 16).bfloat16().requires_grad_()
    with (
        bf16_matmul.forced(True),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t),
    ):
        ops.linear(x, w)
    assert saved == [torch.bfloat16, torch.bfloat16]  # the fp32 copies were transient


def test_grouped_matmul_and_head_loss_take_the_route():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 32, generator=g).bfloat16().requires_grad_()
    ws = [(torch.randn(24, 32, generator=g) / 4).bfloat16().requires_grad_() for _ in range(3)]
    sizes = [4, 0, 6]
    with bf16_matmul.forced(True):
        assert registry.selected("grouped_matmul", "cpu") == "gather"
        out = ops.grouped_matmul(x, ws, sizes)
        out.float().square().sum().backward()
    xd = x.detach().double()
    ref = torch.cat([xd[:4] @ ws[0].double().t(), xd[4:] @ ws[2].double().t()])
    absprod = torch.cat([xd[:4].abs() @ ws[0].double().abs().t(), xd[4:].abs() @ ws[2].double().abs().t()])
    assert out.dtype == torch.bfloat16 and bool(((out.double() - ref).abs() <= _bound(ref, absprod, 32)).all())
    assert ws[1].grad is not None and not ws[1].grad.any() and x.grad.dtype == torch.bfloat16

    hidden = torch.randn(12, 32, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(40, 32, generator=g) / 4).bfloat16().requires_grad_()
    target = torch.randint(0, 40, (12,), generator=g)
    with bf16_matmul.forced(True):
        loss = ops.vocab_parallel_head_loss(hidden, weight, target, chunk_size=5)
        loss.sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_loss = F.cross_entropy(h64 @ w64.t(), target, reduction="none")
    ref_loss.sum().backward()
    # the logits stay fp32 on the route: the loss is as exact as fp32 accumulation
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=2 * UNIT_ROUNDOFF, atol=1e-3)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=2 * UNIT_ROUNDOFF, atol=1e-3)


def _bf16_steps() -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    matmuls = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm"}

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in matmuls:
                key = str(args[0].dtype)
                self.dtypes[key] = self.dtypes.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    result = {"selected": registry.selected("linear", "cpu")}
    cfg = tiny_config(["model.precision=bf16", "model.num_layers=2"], optim={"grad_accum_steps": 1})
    trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
    for name, on in (("fp32_gemm", True), ("native", False)):
        with bf16_matmul.forced(on), Products() as products:
            trainer.train_step()
        result[name] = products.dtypes
    ps.destroy_model_parallel()
    return result


def test_a_bf16_training_step_runs_its_matmuls_in_fp32_when_forced():
    got = run_on_ranks(_bf16_steps, 1, env={bf16_matmul.ENV: "fp32"})[0]
    assert got["selected"] == "fp32_gemm"  # MEGACANN_CPU_BF16_MATMUL=fp32 turned the route on
    # 2 layers x 4 projections (qkv, o, gate|up, down) x 3 products (forward, input and weight gradients)
    assert "torch.bfloat16" not in got["fp32_gemm"] and got["fp32_gemm"]["torch.float32"] >= 24, got
    assert got["native"].get("torch.bfloat16", 0) >= 24, got  # the control: the same step's products in bf16
