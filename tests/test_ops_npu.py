"""The NPU route against a fake ``torch_npu`` (tests/fake_torch_npu/) that records each call and computes
what the documented kernel computes: the dispatcher must call the right kernel with the documented
argument names, layouts (BSND / TND with cumulative lengths), masks (bool, True = masked), scale and
dtypes, and the results must equal megacann's reference ops. Tensors stay on the CPU; the route is
resolved for device type "npu".
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from fake_torch_npu import COMPRESSED, forget_npu_checks, make_fake_torch_npu
from layers_reference import rel_err

from megacann.ops import reference, registry
from megacann.ops.attention_blocks import attention_block as reference_block
from megacann.ops.attention_blocks import attention_block_backward as reference_block_backward

NPU_OPS = (
    "rms_norm",
    "apply_rotary",
    "swiglu",
    "scaled_dot_product_attention",
    "attention_block",
    "attention_block_backward",
    "cross_entropy",
    "adamw_step_",
)


_forget_npu_checks = forget_npu_checks


@pytest.fixture
def fake_npu(monkeypatch):
    # every op fused, none upcast to fp32: a trainer built in-process earlier (setup_runtime) may have left
    # precision.fp32_ops configured, which would hand the kernel an fp32 copy of the input
    registry.configure()
    npu = make_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    _forget_npu_checks()
    yield npu
    monkeypatch.delitem(sys.modules, "torch_npu")
    _forget_npu_checks()


def npu_op(op):
    return registry.resolve(op, "npu")


def test_without_torch_npu_the_npu_device_gets_the_reference():
    assert "torch_npu" not in sys.modules  # importing megacann.ops did not import it
    _forget_npu_checks()
    for op in NPU_OPS:
        assert registry.selected(op, "npu") == "reference"


def test_the_npu_kernels_are_selected_when_torch_npu_imports(fake_npu):
    for op in NPU_OPS:
        assert registry.selected(op, "npu") == "npu"
    assert registry.selected("rms_norm", "cpu") != "npu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_calls_npu_rms_norm(fake_npu, dtype):
    x, w = torch.randn(2, 3, 16, dtype=dtype), (torch.rand(16) + 0.5).to(dtype)
    out = npu_op("rms_norm")(x, w, 1e-5)
    call = fake_npu.calls[-1]
    assert call.name == "npu_rms_norm" and call.args[0] is x and call.args[1] is w
    assert call.kwargs == {"epsilon": 1e-5}
    assert out.dtype == dtype and rel_err(out, reference.rms_norm(x.double(), w.double(), 1e-5)) < 1e-2


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleave"])
@pytest.mark.parametrize("batched", [False, True], ids=["table-s-d", "table-b-s-d"])
def test_rotary_calls_npu_rotary_mul_with_4d_tables_in_x_dtype(fake_npu, interleaved, batched):
    b, s, h, d = 2, 5, 3, 8
    x = torch.randn(b, s, h, d, dtype=torch.bfloat16)
    angles = torch.randn(b if batched else 1, s, d // 2)
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    cos, sin = angles.cos(), angles.sin()
    if not batched:
        cos, sin = cos[0], sin[0]
    out = npu_op("apply_rotary")(x, cos, sin, interleaved)
    call = fake_npu.calls[-1]
    assert call.name == "npu_rotary_mul" and call.kwargs == {"rotary_mode": "interleave" if interleaved else "half"}
    r1, r2 = call.args[1:]
    assert r1.shape == (b if batched else 1, s, 1, d) and r1.dtype == r2.dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.apply_rotary(x, cos, sin, interleaved))


def test_swiglu_fused_calls_npu_swiglu_split_uses_the_reference(fake_npu):
    x = torch.randn(3, 4, 10)
    assert torch.allclose(npu_op("swiglu")(x), reference.swiglu(x))
    assert fake_npu.calls[-1].name == "npu_swiglu" and fake_npu.calls[-1].kwargs == {"dim": -1}
    n = len(fake_npu.calls)
    gate, up = x.chunk(2, -1)
    assert torch.equal(npu_op("swiglu")(gate, up), reference.swiglu(gate, up))
    assert len(fake_npu.calls) == n


def _qkv(b=2, s=6, hq=4, hkv=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)]


def test_causal_attention_is_bsnd_with_the_compressed_mask(fake_npu):
    q, k, v = _qkv()
    out = npu_op("scaled_dot_product_attention")(q, k, v, causal=True)
    call = fake_npu.calls[-1]
    assert call.name == "npu_fusion_attention" and call.args[3:] == (4, "BSND")
    assert all(a is t for a, t in zip(call.args[:3], (q, k, v)))  # GQA: k/v keep their 2 heads
    mask = call.kwargs["atten_mask"]
    assert mask.dtype == torch.bool and mask.shape == (COMPRESSED, COMPRESSED) and mask[0, 1] and not mask[1, 0]
    assert call.kwargs["sparse_mode"] == 2 and call.kwargs["keep_prob"] == 1.0
    assert call.kwargs["scale"] == pytest.approx(1 / math.sqrt(16))
    assert out.shape == q.shape and rel_err(out, reference.scaled_dot_product_attention(q, k, v)) < 1e-6


def test_packed_sequences_are_tnd_with_cumulative_lengths(fake_npu):
    q, k, v = _qkv()
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    for causal, mode in ((True, 3), (False, None)):
        out = npu_op("scaled_dot_product_attention")(q, k, v, causal=causal, segment_ids=seg, scale=0.3)
        call = fake_npu.calls[-1]
        assert call.args[4] == "TND" and call.args[0].shape == (12, 4, 16) and call.args[1].shape == (12, 2, 16)
        assert call.kwargs["actual_seq_qlen"] == [3, 5, 6, 12] == call.kwargs["actual_seq_kvlen"]
        assert call.kwargs.get("sparse_mode") == mode and call.kwargs["scale"] == 0.3
        assert ("atten_mask" in call.kwargs) == causal
        ref = reference.scaled_dot_product_attention(q, k, v, causal=causal, segment_ids=seg, scale=0.3)
        assert out.shape == q.shape and rel_err(out, ref) < 1e-6


def test_explicit_mask_goes_in_as_its_complement(fake_npu):
    q, k, v = _qkv(dtype=torch.bfloat16)
    allowed = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True  # every query sees at least one key
    out = npu_op("scaled_dot_product_attention")(q, k, v, causal=True, attn_mask=allowed)
    call = fake_npu.calls[-1]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert call.args[4] == "BSND" and call.kwargs["sparse_mode"] == 0
    assert torch.equal(call.kwargs["atten_mask"], ~(causal & allowed))
    ref = reference.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2


def test_cross_entropy_calls_npu_cross_entropy_loss_for_fp32(fake_npu):
    logits = torch.randn(3, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 5))
    target[0, 2] = target[2, 4] = -100
    loss = npu_op("cross_entropy")(logits, target, -100)
    call = fake_npu.calls[-1]
    assert call.name == "npu_cross_entropy_loss" and call.kwargs["reduction"] == "none"
    assert call.args[0].shape == (15, 11) and call.args[1].dtype == torch.int64 and (call.args[1] >= 0).all()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = reference.cross_entropy(ref_logits, target)
    assert loss.dtype == torch.float32 and loss[0, 2] == 0 and rel_err(loss, ref) < 1e-6
    loss.sum().backward()
    ref.sum().backward()
    assert rel_err(logits.grad, ref_logits.grad) < 1e-6 and logits.grad[0, 2].abs().sum() == 0
    n = len(fake_npu.calls)
    low = npu_op("cross_entropy")(logits.detach().bfloat16(), target, -100)
    assert len(fake_npu.calls) == n and low.dtype == torch.float32  # bf16: the fp32 reference


def test_adamw_calls_apply_adam_w_and_matches_torch(fake_npu):
    g = torch.Generator().manual_seed(0)
    param = torch.randn(40, generator=g)
    grads = [torch.randn(40, generator=g) for _ in range(3)]
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    torch_param = param.clone().requires_grad_()
    opt = torch.optim.AdamW([torch_param], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    exp_avg, exp_avg_sq = torch.zeros(40), torch.zeros(40)
    for step, grad in enumerate(grads, start=1):
        npu_op("adamw_step_")(param, grad, exp_avg, exp_avg_sq, step=step, **hyper)
        call = fake_npu.calls[-1]
        assert call.name == "npu_apply_adam_w" and call.args[:2] == (0.9 ** (step - 1), 0.95 ** (step - 1))
        assert call.args[2:7] == (0.01, 0.1, 0.9, 0.95, 1e-8) and call.args[7] is grad
        assert call.kwargs["out"][0] is param and call.kwargs["out"][1] is exp_avg
        torch_param.grad = grad.clone()
        opt.step()
    assert rel_err(param, torch_param) < 1e-6
    assert rel_err(exp_avg_sq, opt.state[torch_param]["exp_avg_sq"]) < 1e-6


def test_moe_ops_call_the_torch_npu_kernels_and_equal_the_reference(fake_npu):
    for op in ("grouped_matmul", "moe_permute", "moe_unpermute"):
        assert registry.selected(op, "npu") == "torch_npu"
    g = torch.Generator().manual_seed(0)
    tokens, expert_ids = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6, 2), generator=g)
    permuted, row_id_map = npu_op("moe_permute")(tokens, expert_ids)
    assert fake_npu.calls[-1].name == "npu_moe_token_permute"
    ref_permuted, ref_map = registry._impls("moe_permute")["reference"].fn(tokens, expert_ids)
    assert torch.equal(permuted, ref_permuted) and torch.equal(row_id_map, ref_map)

    sizes = torch.bincount(expert_ids.reshape(-1), minlength=3).tolist()
    weights = [torch.randn(5, 8, generator=g, requires_grad=True) for _ in range(3)]
    x = permuted.clone().requires_grad_()
    out = npu_op("grouped_matmul")(x, weights, sizes)
    call = fake_npu.calls[-1]
    assert call.name == "npu_grouped_matmul" and call.kwargs["group_list"].tolist() == sizes
    assert (call.kwargs["group_type"], call.kwargs["group_list_type"], call.kwargs["split_item"]) == (0, 1, 2)
    ref_x, ref_w = x.detach().clone().requires_grad_(), [w.detach().clone().requires_grad_() for w in weights]
    ref = torch.cat([rows @ w.t() for rows, w in zip(ref_x.split(sizes), ref_w)])
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    ref.backward(grad)
    assert fake_npu.calls[-1].kwargs["group_type"] == 2  # the weight gradient splits the contraction
    assert rel_err(out, ref) < 1e-6 and rel_err(x.grad, ref_x.grad) < 1e-6
    for w, r in zip(weights, ref_w):
        assert rel_err(w.grad, r.grad) < 1e-6

    probs = torch.rand(6, 2, generator=g)
    low = permuted.bfloat16()
    back = npu_op("moe_unpermute")(low, row_id_map, probs)
    call = fake_npu.calls[-1]
    assert call.name == "npu_moe_token_unpermute" and call.args[2].dtype == torch.bfloat16  # probs cast
    ref_back = registry._impls("moe_unpermute")["reference"].fn(low, row_id_map, probs)
    assert back.dtype == torch.bfloat16 and rel_err(back.float(), ref_back.float()) < 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_attention_block_takes_the_lse_from_softmax_max_and_sum(fake_npu, causal):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 16, generator=gen)
    k, v = torch.randn(2, 2, 6, 16, generator=gen), torch.randn(2, 2, 6, 16, generator=gen)
    dout = torch.randn(2, 4, 6, 16, generator=gen)
    out, lse = npu_op("attention_block")(q, k, v, scale=0.3, causal=causal)
    call = fake_npu.calls[-1]
    assert call.name == "npu_fusion_attention" and call.args[3:] == (4, "BNSD")
    assert call.kwargs.get("sparse_mode") == (2 if causal else None) and call.kwargs["scale"] == 0.3
    want_out, want_lse = reference_block(q, k, v, scale=0.3, causal=causal)
    assert rel_err(out, want_out) < 1e-6 and rel_err(lse, want_lse) < 1e-6
    grads = npu_op("attention_block_backward")(q, k, v, out, lse, dout, scale=0.3, causal=causal)
    call = fake_npu.calls[-1]
    assert call.name == "npu_fusion_attention_grad" and call.kwargs["scale_value"] == 0.3
    assert call.kwargs["softmax_max"].shape == (2, 4, 6, 8) and torch.equal(
        call.kwargs["softmax_sum"][0, 0, 0], torch.ones(8)
    )
    want = reference_block_backward(q, k, v, out, lse, dout, scale=0.3, causal=causal)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(grads, want))
