"""The fused-op registry, the reference ops, and rotary embeddings against Hugging Face LLaMA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from layers_reference import dense_rmsnorm, rel_err

from megacann import ops
from megacann.layers import RotaryEmbedding
from megacann.layers.rotary import rope_inv_freq
from megacann.ops import reference, registry

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# -- registry ------------------------------------------------------------------------------------------


@pytest.fixture
def demo_op():
    calls = []

    def demo(x):
        """A test op."""

    registry.declare(demo)
    registry.register("demo", "reference")(lambda x: calls.append("reference") or x)
    yield calls
    registry._SPECS.pop("demo", None)
    registry._IMPLS.pop("demo", None)
    registry._PINNED.pop("demo", None)
    registry._CACHE.clear()


def test_registry_prefers_available_higher_priority(demo_op):
    state = {"ok": False}
    registry.register("demo", "fast", priority=10, device_types=("cpu",), available=lambda: state["ok"])(
        lambda x: demo_op.append("fast") or x
    )
    assert registry.selected("demo", "cpu") == "reference"  # not available: falls back
    registry._AVAILABLE.pop(("demo", "fast"))
    registry._CACHE.clear()
    state["ok"] = True
    assert registry.selected("demo", "cpu") == "fast"
    assert registry.selected("demo", "cuda") == "reference"  # serves cpu only
    assert registry.implementations("demo") == ["fast", "reference"]
    registry.pin("demo", "reference")
    registry.resolve("demo", "cpu")(1)
    assert demo_op == ["reference"]
    registry.pin("demo", None)
    assert registry.selected("demo", "cpu") == "fast"


def test_registry_failing_check_means_unavailable_and_errors_name_things(demo_op):
    def broken():
        raise RuntimeError("libascendcl.so: cannot open shared object file")

    registry.register("demo", "npu_kernel", priority=5, available=broken)(lambda x: x)
    assert registry.selected("demo", "npu") == "reference"
    with pytest.raises(KeyError, match="'nope'"):
        registry.resolve("nope", "cpu")
    with pytest.raises(KeyError, match="no implementation 'csrc'"):
        registry.pin("demo", "csrc")
    registry.pin("demo", "npu_kernel")
    with pytest.raises(RuntimeError, match="pinned to 'npu_kernel'"):
        registry.resolve("demo", "cpu")


def test_every_op_has_a_reference():
    for op in ("scaled_dot_product_attention", "rms_norm", "apply_rotary", "swiglu"):
        assert "reference" in registry.implementations(op)
        assert registry.selected(op, "xpu") == "reference"  # a device no fused kernel serves


# -- reference ops -------------------------------------------------------------------------------------


def test_attention_gqa_segments_and_causal():
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 6, 4, 2, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    out = ops.scaled_dot_product_attention(q, k, v, causal=True, segment_ids=seg)
    kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & (seg[:, None, :, None] == seg[:, None, None, :])
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), vv)
    assert rel_err(out, ref) < 1e-6
    plain = ops.scaled_dot_product_attention(q, k, v, causal=True)
    same = ops.scaled_dot_product_attention(q, k, v, causal=True, segment_ids=torch.zeros(b, s, dtype=torch.long))
    assert rel_err(plain, same) < 1e-6


def test_rms_norm_forward_and_backward():
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = (torch.rand(16) + 0.5).requires_grad_()
    out = ops.rms_norm(x, w, 1e-6)
    xd, wd = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = dense_rmsnorm(xd, wd, 1e-6)
    assert rel_err(out, ref) < 1e-6
    # the reference does the same ops as Hugging Face's LlamaRMSNorm in fp32 (the C++ kernel sums in
    # another order): bitwise equal
    assert torch.equal(reference.rms_norm(x, w, 1e-6), ref)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    assert rel_err(x.grad, xd.grad) < 1e-6 and rel_err(w.grad, wd.grad) < 1e-6
    low = ops.rms_norm(x.detach().bfloat16(), w.detach().bfloat16(), 1e-6)
    assert low.dtype == torch.bfloat16 and rel_err(low.float(), ref) < 1e-2


def test_swiglu_fused_and_split_agree():
    x = torch.randn(2, 3, 8)
    gate, up = x.chunk(2, -1)
    assert rel_err(ops.swiglu(x), F.silu(gate) * up) < 1e-6  # the C++ kernel's exp differs in the last bits
    assert rel_err(ops.swiglu(gate, up), F.silu(gate) * up) < 1e-6


# -- rotary --------------------------------------------------------------------------------------------


def _hf_rotary(head_dim, theta, scaling):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    config = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=256, rope_parameters=params
    )
    return modeling, modeling.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotary_matches_hugging_face_llama(scaling):
    head_dim, theta = 16, 500000.0
    modeling, hf = _hf_rotary(head_dim, theta, scaling)
    positions = torch.tensor([[0, 1, 2, 3, 100, 200], [5, 6, 7, 0, 1, 2]])
    ours = RotaryEmbedding(head_dim, theta, scaling)
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    q = torch.randn(2, 6, 3, head_dim)
    k = torch.randn(2, 6, 1, head_dim)
    hf_cos, hf_sin = hf(q, positions)
    cos, sin = ours(positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    hf_q, hf_k = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)
    assert torch.equal(ops.apply_rotary(q, cos, sin), hf_q.transpose(1, 2))
    assert torch.equal(ops.apply_rotary(k, cos, sin), hf_k.transpose(1, 2))


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_rotary_tables_read_by_lookup_equal_the_direct_computation(interleaved):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(32, 10000.0, yarn, interleaved)
    cases = (
        torch.tensor([3, 1, 40]),
        torch.randint(0, 3000, (5, 17)),
        torch.arange(7000).view(2, -1),
        torch.tensor([-3, 2]),
    )
    for positions in cases:  # the tables grow to cover the positions; negative ones are computed directly
        cos, sin = rope(positions)
        want = rope._tables(positions.float())
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])  # the same bits
        assert rope._held_tables[1][0].shape[0] > int(positions.max())
    rope.inv_freq.mul_(0.5)  # tables follow the frequencies they were made from
    cos, _ = rope(torch.tensor([[2, 9]]))
    assert torch.equal(cos, rope._tables(torch.tensor([[2.0, 9.0]]))[0])


def test_llama3_scaling_bands():
    inv = rope_inv_freq(64, 500000.0)
    scaled = rope_inv_freq(64, 500000.0, LLAMA3)
    wavelen = 2 * math.pi / inv
    high = wavelen < 64 / 4  # short wavelengths kept
    low = wavelen > 64 / 1  # long wavelengths divided by factor
    assert torch.equal(scaled[high], inv[high])
    assert torch.allclose(scaled[low], inv[low] / 8)
    mid = ~high & ~low
    assert mid.any() and ((scaled[mid] < inv[mid]) & (scaled[mid] > inv[mid] / 8)).all()
    assert torch.allclose(rope_inv_freq(8, 10000.0, {"type": "linear", "factor": 2.0}), rope_inv_freq(8) / 2)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(8, scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(8, scaling={"rope_type": "llama3", "factor": 2.0})


def test_interleaved_rotary_is_complex_multiplication():
    head_dim = 8
    rope = RotaryEmbedding(head_dim, 10000.0, interleaved=True)
    positions = torch.arange(5).unsqueeze(0)
    x = torch.randn(1, 5, 2, head_dim, dtype=torch.float64)
    cos, sin = rope(positions, dtype=torch.float64)
    out = ops.apply_rotary(x, cos, sin, interleaved=True)
    angles = positions[0, :, None].double() * rope.inv_freq.double()  # [s, d/2]
    rotated = torch.view_as_complex(x.reshape(1, 5, 2, head_dim // 2, 2)) * torch.polar(
        torch.ones_like(angles), angles
    ).unsqueeze(1)
    assert rel_err(out, torch.view_as_real(rotated).flatten(-2)) < 1e-6


def test_segment_mask_is_built_once_per_segment_tensor():
    from megacann.ops.reference import attention_mask

    seg = torch.tensor([[0, 0, 1, 1]])
    first = attention_mask(4, True, seg, seg.device)
    assert attention_mask(4, True, seg, seg.device) is first  # every layer of a step shares it
    seg[0, 1] = 1  # changed in place: rebuilt
    rebuilt = attention_mask(4, True, seg, seg.device)
    assert rebuilt is not first and rebuilt[0, 0, 1, 0] == False  # noqa: E712
    assert attention_mask(4, True, seg.clone(), seg.device) is not rebuilt
