"""bf16 and fp16 matmuls as fp32 GEMMs on CPUs without native GEMM for them (megacann/ops/bf16_matmul.py):
when the route is chosen (CPU flags, ONEDNN_MAX_CPU_ISA, MEGACANN_CPU_BF16_MATMUL), its numerics against a
float64 reference (the bound: tests/lowp_bound.py), that autograd saves only the low-precision tensors, that
the layers beyond ``ops.linear`` take it (LoRA's A and B, an expert's own projection; the overlapped
tensor-parallel projection in test_tp_overlap.py), and that bf16 training steps really do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_on_ranks
from lowp_bound import UNIT_ROUNDOFF, Products, assert_chain_within, assert_within
from tiny_recipes import TINY_MOE

from megacann import ops
from megacann.ops import bf16_matmul, cpp, registry

LOW = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "fp16"]
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


def test_fp16_is_chosen_by_its_own_flags():
    choose = bf16_matmul.choose
    half = torch.float16
    assert choose(ZEN4.split(), dtype=half) is True  # AVX512_BF16 but no AVX512_FP16: fp16 routed, bf16 not
    assert choose((ZEN4 + " avx512_fp16").split(), dtype=half) is False  # Sapphire Rapids
    assert choose((ZEN4 + " avx512_fp16").split(), onednn_max_isa="AVX512_CORE_BF16", dtype=half) is True
    assert choose(["amx_fp16"], dtype=half) is False and choose(AVX2.split(), setting="bf16", dtype=half) is False
    with pytest.raises(ValueError, match="serves"):
        choose(AVX2.split(), dtype=torch.float32)


def _linear_case(on: bool, dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 64, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(48, 64, generator=g) / 8).to(dtype).requires_grad_()
    b = torch.randn(48, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(3, 7, 48, generator=g).to(dtype)
    with bf16_matmul.forced(on):
        assert registry.selected("linear", "cpu") == ("fp32_gemm" if on else "reference")
        y = ops.linear(x, w, b)
        y.backward(dy)
    return dict(x=x, w=w, b=b, dy=dy, y=y, dx=x.grad, dw=w.grad, db=b.grad)


def _check_linear(r: dict, dtype: torch.dtype) -> None:
    x, w, dy = (r[k].detach().double().reshape(-1, r[k].shape[-1]) for k in ("x", "w", "dy"))
    b = r["b"].detach().double() if r["b"] is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    checks = {  # name: (result, float64 reference, |a| @ |b|, k)
        "y": (r["y"], x @ w.t() + b, x.abs() @ w.abs().t() + b.abs(), w.shape[1]),
        "dx": (r["dx"], dy @ w, dy.abs() @ w.abs(), w.shape[0]),
        "dw": (r["dw"], dy.t() @ x, dy.abs().t() @ x.abs(), x.shape[0]),
    }
    if r["b"] is not None:
        checks["db"] = (r["db"], dy.sum(0), dy.abs().sum(0), x.shape[0])
    for name, (got, ref, absprod, k) in checks.items():
        assert got.dtype == dtype, name
        assert_within(got, ref, absprod, k, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("on", [True, False], ids=["fp32_gemm", "native"])
def test_linear_outputs_and_gradients_within_the_bound(on, dtype):
    _check_linear(_linear_case(on, dtype), dtype)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_lora_products_take_the_route_within_the_bound(dtype):
    from megacann.layers import ColumnParallelLinear
    from megacann.layers.lora import LoRAConfig, attach_lora

    layer = ColumnParallelLinear(32, 64, bias=False, tp_blocks=(32, 16, 16))  # a fused qkv
    attach_lora(
        torch.nn.ModuleDict({"qkv_proj": layer}), LoRAConfig(rank=3, alpha=6.0, target_modules=("q_proj", "v_proj"))
    )
    adapter = layer.adapter.to(dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 2)
    x = torch.randn(2, 5, 32, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(2, 5, 64, generator=g).to(dtype)
    with bf16_matmul.forced(True), Products() as products:
        y = adapter(x)  # s B A x with B laid out over q, k (zero rows), v: the TP-expanded path
        y.backward(dy)
    assert products.low == [] and products.dtypes["torch.float32"] == 6, products.dtypes  # 2 forward, 4 backward
    s = adapter.scaling
    a, bx = adapter.lora_A.detach().double(), adapter.local_b().detach().double()
    assert tuple(bx.shape) == (64, 6) and not bx[32:48].any()  # k's rows are zero, q and v have their own A
    x64, dy64 = x.detach().double().reshape(-1, 32), dy.double().reshape(-1, 64)
    checks = {  # name: (result, float64 reference, the chain's product of absolute values)
        "y": (y, s * (x64 @ a.t()) @ bx.t(), s * (x64.abs() @ a.abs().t()) @ bx.abs().t()),
        "dx": (x.grad, s * (dy64 @ bx) @ a, s * (dy64.abs() @ bx.abs()) @ a.abs()),
        "dA": (adapter.lora_A.grad, s * (dy64 @ bx).t() @ x64, s * (dy64.abs() @ bx.abs()).t() @ x64.abs()),
        "dB": (adapter.lora_B.grad, s * dy64[:, [*range(32), *range(48, 64)]].t() @ (x64 @ a.t()), None),
    }
    absq = s * dy64.abs().t() @ (x64.abs() @ a.abs().t())
    checks["dB"] = (  # B's rows: q's from its own A's columns 0-2, v's from columns 3-5
        checks["dB"][0],
        torch.cat([s * dy64[:, :32].t() @ (x64 @ a[:3].t()), s * dy64[:, 48:].t() @ (x64 @ a[3:].t())]),
        torch.cat([absq[:32, :3], absq[48:, 3:]]),
    )
    for name, (got, ref, absprod) in checks.items():
        assert got.dtype == dtype, name
        assert_chain_within(got, ref, absprod, name)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_an_experts_own_projection_takes_the_route_and_defers_its_weight_gradient(dtype):
    from megacann.layers.moe import ExpertMLP
    from megacann.ops.weight_grad import WeightGradStore, collecting
    from megacann.pipeline.split_backward import prepare_split_backward

    def init(t):
        return t.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(t.numel()))

    expert = ExpertMLP(32, 24, 0, 5, init, init, dtype=dtype)
    prepare_split_backward([expert])  # as a split-backward schedule prepares its chunks
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 32, generator=g).to(dtype).requires_grad_()
    with bf16_matmul.forced(True), Products() as products:
        expert(x).float().square().sum().backward()  # the whole expert: gate_up, swiglu, down
    assert products.low == [] and products.dtypes["torch.float32"] == 6, products.dtypes
    proj = expert.gate_up_proj
    proj.weight.grad = None
    x = x.detach().requires_grad_()
    dy = torch.randn(10, 48, generator=g).to(dtype)
    store = WeightGradStore()
    with bf16_matmul.forced(True):
        y = proj(x)
        with collecting(store):  # B of a split backward: the weight's gradient waits for W
            y.backward(dy)
        assert proj.weight.grad is None and store.num_closures == 1
        store.run()
    _check_linear(dict(x=x, w=proj.weight, b=None, dy=dy, y=y, dx=x.grad, dw=proj.weight.grad), dtype)
    fused = proj.weight.grad.clone()
    proj.weight.grad = None
    with bf16_matmul.forced(True):
        proj(x).backward(dy)
    assert torch.equal(proj.weight.grad, fused)  # W gives what the fused backward gives, bit for bit


def test_the_routes_agree_and_autograd_saves_only_bf16():
    on, off = _linear_case(True), _linear_case(False)
    for name in ("y", "dx", "dw", "db"):  # each within the bound of the same reference: a few bf16 ulps apart
        torch.testing.assert_close(on[name], off[name], rtol=4 * UNIT_ROUNDOFF[torch.bfloat16], atol=1e-2)
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
        assert registry.selected("grouped_matmul", "cpu") == ("cpp" if cpp.available() else "gather")
        out = ops.grouped_matmul(x, ws, sizes)
        out.float().square().sum().backward()
    xd = x.detach().double()
    ref = torch.cat([xd[:4] @ ws[0].double().t(), xd[4:] @ ws[2].double().t()])
    absprod = torch.cat([xd[:4].abs() @ ws[0].double().abs().t(), xd[4:].abs() @ ws[2].double().abs().t()])
    assert out.dtype == torch.bfloat16
    assert_within(out, ref, absprod, 32, "grouped")
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
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=2 * UNIT_ROUNDOFF[torch.bfloat16], atol=1e-3)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=2 * UNIT_ROUNDOFF[torch.bfloat16], atol=1e-3)


# bf16 training steps, forced onto the route and off it. "moe_tp2_overlap_lora": MoE layers with a shared
# expert at tp 2 + SP with distributed.tp_comm_overlap (qkv and the shared gate|up overlapped: no adapter on
# them) and LoRA on o_proj and every down_proj (dense, shared and the experts' grouped adapters).
STEPS = {
    "dense": (1, ["model.num_layers=2"]),
    "moe_tp2_overlap_lora": (
        2,
        [*TINY_MOE, "model.num_layers=1", "model.moe_shared_experts=1", "data.seq_length=16"]
        + ["distributed.tensor_parallel_size=2"]
        + ["distributed.sequence_parallel=true", "distributed.tp_comm_overlap=true", "lora=true", "lora_rank=4"]
        + ["lora_alpha=8.0", "lora_target_modules=[o_proj,down_proj]"],
    ),
}


QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
DOWN = ("mlp.shared_experts.down_proj", *(f"mlp.experts.{e}.down_proj" for e in range(4)))


def _bf16_steps(overrides: list) -> dict:
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.layers import ColumnParallelLinear
    from megacann.layers.lora import LoRAAdapter
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    result = {"selected": registry.selected("linear", "cpu"), "unpermute": registry.selected("moe_unpermute", "cpu")}
    cfg = tiny_config(
        ["model.precision=bf16", *overrides], world_size=dist.get_world_size(), optim={"grad_accum_steps": 1}
    )
    trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
    named = [(n, m) for chunk in trainer.model_chunks for n, m in chunk.named_modules()]
    overlapped = (n for n, m in named if isinstance(m, ColumnParallelLinear) and m.comm_overlap and m.adapter is None)
    result["overlapped"] = sorted(overlapped)
    result["adapters"] = sorted(n for n, m in named if isinstance(m, LoRAAdapter))
    for name, on in (("fp32_gemm", True), ("native", False)):
        with bf16_matmul.forced(on), Products() as products:
            trainer.train_step()
        result[name], result[name + "_low"] = products.dtypes, products.low
    ps.destroy_model_parallel()
    return result


@pytest.mark.parametrize("case", sorted(STEPS))
def test_a_bf16_training_step_runs_its_matmuls_in_fp32_when_forced(case):
    world, overrides = STEPS[case]
    for got in run_on_ranks(_bf16_steps, world, args=(overrides,), env={bf16_matmul.ENV: "fp32"}):
        assert got["selected"] == "fp32_gemm"  # MEGACANN_CPU_BF16_MATMUL=fp32 turned the route on
        if case == "dense":  # 2 layers x 4 projections (qkv, o, gate|up, down) x 3 products (forward, both gradients)
            assert "torch.bfloat16" not in got["fp32_gemm"] and got["fp32_gemm"]["torch.float32"] >= 24, got
            assert got["native"].get("torch.bfloat16", 0) >= 24, got  # the control: the same step's products in bf16
            continue
        # 1 MoE layer: q, k, v and the shared expert's gate|up overlapped; adapters on o_proj and the shared
        # and 4 experts' down_proj
        want = [f"layers.0.{p}" for p in ("mlp.shared_experts.gate_up_proj", *QKV)]
        assert got["overlapped"] == sorted(want), got["overlapped"]
        want = [f"layers.0.{p}.adapter" for p in ("self_attn.o_proj", *DOWN)]
        assert got["adapters"] == sorted(want), got["adapters"]
        # on the route no bf16 product is left with the C++ unpermute (its top-k sums are no matmul); with the
        # reference unpermute only its top-k (2) weighted sums over the hidden size (32), [T, 1, k] x [T, k, h],
        # and their two gradients (k-term products, not routed: docs/ops.md)
        if got["unpermute"] == "cpp":
            assert got["fp32_gemm_low"] == [], got["fp32_gemm_low"]
        else:
            forms = (((1, 2), (2, 32)), ((2, 1), (1, 32)), ((1, 32), (32, 2)))
            unpermute = {("bmm", (t, *a), (t, *b)) for t in range(1, 64) for a, b in forms}
            assert got["fp32_gemm_low"] and set(got["fp32_gemm_low"]) <= unpermute, got["fp32_gemm_low"]
        # projections (overlapped in 2 chunks), adapters, experts' groups, the head: 65 products when written
        assert got["fp32_gemm"]["torch.float32"] >= 50, got["fp32_gemm"]
        assert len(got["native_low"]) >= 50 + len(got["fp32_gemm_low"]), got  # the control: those in bf16
