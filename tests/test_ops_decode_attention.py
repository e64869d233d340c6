"""``megacann.ops.decode_attention``, a decoding step's queries over the key/value cache, per device: the
CPU route (the C++ kernel for one query token a row, ``fp32_sdpa`` otherwise) and the CUDA implementation
(run here on CPU tensors: it is PyTorch) equal masked attention written in this test; the C++ kernel reads
fp32, bf16 and fp16 caches as they lie (strided slices, every mask layout, sinks), in each compiled ISA
variant, converts every fp16 / bf16 value exactly, and refuses bad input by name; the NPU route calls ``npu_incre_flash_attention`` of the fake torch_npu
(tests/fake_torch_npu/) with the documented layout and limits, runs the reference where the kernel does not
apply, and falls back to the reference, said once, on a torch_npu without it; a generation routed as on an
NPU decodes through the kernel, once per layer and step.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from fake_torch_npu import install, make_fake_torch_npu, route_cpu_to_npu, uninstall
from layers_reference import rel_err

from megacann import ops
from megacann.ops import cpp, decode, isa, registry

B, SLOTS, HQ, HKV, D = 3, 7, 4, 2, 16


def masked_attention(q, k, v, allowed, scale, sinks=None):
    """The definition in fp64: scores of each query head against its kv head's keys, left out where
    ``allowed`` ([b, 1, s, slots]) is False, an optional sink column per head, softmax, weighted values."""
    group = q.shape[2] // k.shape[2]
    k, v = k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhst,bthd->bshd", probs, v)


def case(s=1, hkv=HKV, dtype=torch.float32, seed=0):
    """Queries, a cache and a mask in which every query reads some slots (slot 0 of its row always)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, s, HQ, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, SLOTS, hkv, D, generator=gen).to(dtype) for _ in range(2))
    allowed = torch.rand(B, 1, s, SLOTS, generator=gen) < 0.6
    allowed[..., 0] = True
    return q, k, v, allowed


SCALE = 1 / math.sqrt(D)


@pytest.fixture(autouse=True)
def every_op_fused():
    registry.configure()
    yield
    registry.configure()


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("hkv", [HKV, HQ], ids=["gqa", "mha"])
def test_the_cpu_route_is_the_masked_attention(s, hkv):
    q, k, v, allowed = case(s, hkv)
    assert registry.selected("decode_attention", "cpu") == ("cpp" if decode._has_cpp_kernel() else "fp32_sdpa")
    out = ops.decode_attention(q, k, v, attn_mask=allowed)  # scale None: 1/sqrt(d)
    assert out.shape == q.shape and rel_err(out, masked_attention(q, k, v, allowed, SCALE)) < 1e-6
    sinks = torch.randn(HQ)
    with_sinks = ops.decode_attention(q, k, v, attn_mask=allowed, scale=0.3, sinks=sinks)
    assert rel_err(with_sinks, masked_attention(q, k, v, allowed, 0.3, sinks)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_the_cpu_route_computes_half_precision_in_fp32_and_rounds_once(dtype, with_sinks):
    q, k, v, allowed = case(hkv=HKV, dtype=dtype, seed=3)
    sinks = torch.randn(HQ).to(dtype) if with_sinks else None
    out = ops.decode_attention(q, k, v, attn_mask=allowed, scale=0.3, sinks=sinks)
    assert out.dtype == dtype and out.shape == q.shape
    # one rounding of the exact attention: within half a unit in the last place (bf16 2^-9, fp16 2^-12)
    half_ulp = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    assert rel_err(out, masked_attention(q, k, v, allowed, 0.3, sinks)) < half_ulp
    fp32_sinks = None if sinks is None else sinks.float()
    # the route's fp32 implementation for this dtype: the C++ kernel for bf16, fp32_sdpa for fp16
    route = ops.decode_attention if dtype == torch.bfloat16 else decode.fp32_decode_attention
    fp32 = route(q.float(), k.float(), v.float(), attn_mask=allowed, scale=0.3, sinks=fp32_sinks)
    assert torch.equal(out, fp32.to(dtype))  # exactly the fp32 attention, rounded once


needs_kernel = pytest.mark.skipif(not decode._has_cpp_kernel(), reason="the C++ decode kernel is not built")
KERNEL = torch.ops.megacann.decode_attention if decode._has_cpp_kernel() else None
# the variants this build holds and this CPU runs
VARIANTS = isa.built_variants() if cpp.available() else ()


def cache_slice(dtype, hkv, seed, used=SLOTS, extra=5):
    """Queries and a cache that is the first ``used`` slots of a longer one (strided, as the generator
    hands it over)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, HQ, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, used + extra, hkv, D, generator=gen).to(dtype) for _ in range(2))
    return q, k[:, :used], v[:, :used]


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hkv", [1, HKV, HQ], ids=["mqa", "gqa", "mha"])
def test_the_cpp_kernel_reads_the_cache_as_it_lies(variant, dtype, hkv):
    q, k, v = cache_slice(dtype, hkv, seed=hkv)
    assert not k.is_contiguous()
    gen = torch.Generator().manual_seed(7)
    per_row = torch.rand(B, 1, 1, SLOTS, generator=gen) < 0.6
    per_row[..., 0] = True
    shared = torch.rand(1, 1, 1, SLOTS, generator=gen) < 0.6
    shared[..., 1] = True
    sinks = torch.randn(HQ, generator=gen)
    with isa.use(variant):
        for mask in (per_row, shared, None):
            for sink in (None, sinks):
                out = KERNEL(q, k, v, mask, 0.3, sink)
                assert out.dtype == torch.float32 and out.shape == q.shape
                allowed = torch.ones(B, 1, 1, SLOTS, dtype=torch.bool) if mask is None else mask.expand(B, 1, 1, SLOTS)
                # the exact attention of the values as stored: fp32 arithmetic, relative 1e-6
                assert rel_err(out, masked_attention(q, k, v, allowed, 0.3, sink)) < 1e-6, (mask is None, sink)


@needs_kernel
def test_the_cpu_route_runs_the_kernel_for_one_bf16_or_fp32_token_and_rounds_once():
    q, k, v = cache_slice(torch.bfloat16, HKV, seed=5)
    allowed = torch.rand(B, 1, 1, SLOTS, generator=torch.Generator().manual_seed(5)) < 0.5
    allowed[..., -1] = True
    out = ops.decode_attention(q, k, v, attn_mask=allowed, scale=0.25)
    assert torch.equal(out, KERNEL(q, k, v, allowed, 0.25, None).to(torch.bfloat16))
    # fp32_sdpa (PyTorch's fp32 kernel on the upcast cache) differs by fp32 rounding only: at most one bf16 unit
    theirs = decode.fp32_decode_attention(q, k, v, attn_mask=allowed, scale=0.25)
    assert ((out.float() - theirs.float()).abs() <= 2.0**-7 * theirs.float().abs().clamp_min(2.0**-126)).all()
    # a query of two tokens, or one that needs a gradient, runs fp32_sdpa
    q2, k2, v2, allowed2 = case(s=2)
    assert torch.equal(
        ops.decode_attention(q2, k2, v2, attn_mask=allowed2),
        decode.fp32_decode_attention(q2, k2, v2, attn_mask=allowed2),
    )
    leaf = q.float().requires_grad_()
    out = ops.decode_attention(leaf, k.float(), v.float(), attn_mask=allowed)
    assert out.grad_fn is not None
    # an fp16 cache runs fp32_sdpa (measured faster than the kernel's fp16 widening at batch 16)
    half = [t.half() for t in (q, k, v)]
    assert torch.equal(
        ops.decode_attention(*half, attn_mask=allowed), decode.fp32_decode_attention(*half, attn_mask=allowed)
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_widens_every_half_value_exactly(dtype):
    """One readable slot: the output is that slot's value row, so each stored value must come out exactly
    as ``Tensor.float()`` widens it: subnormals, the largest finite values, zeros of both signs, infinities."""
    info = torch.finfo(dtype)
    special = [info.tiny / 4, -info.tiny / 4, info.tiny, info.max, -info.max, 0.0, -0.0, 1 / 3, -2.5, info.eps]
    values = torch.tensor(special * (D // len(special) + 1))[:D].to(dtype)
    q, k, v = cache_slice(dtype, 1, seed=9, used=4)
    v = v.clone()
    v[:, 2, 0] = values
    only = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    only[..., 2] = True
    out = KERNEL(q, k, v, only, 1.0, None)
    assert torch.equal(out[:, 0], values.float().expand(B, HQ, D))
    v[:, 2, 0, 0] = float("inf")
    assert KERNEL(q, k, v, only, 1.0, None)[0, 0, 0, 0].item() == float("inf")


@needs_kernel
def test_a_query_with_no_readable_slot_gets_zeros_as_from_pytorch():
    q, k, v = cache_slice(torch.float32, HKV, seed=2)
    allowed = torch.ones(B, 1, 1, SLOTS, dtype=torch.bool)
    allowed[1] = False
    out = KERNEL(q, k, v, allowed, SCALE, None)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[1], decode.decode_attention(q, k, v, attn_mask=allowed)[1])


@needs_kernel
def test_the_kernel_has_a_fake_for_torch_compile():
    q, k, v = cache_slice(torch.bfloat16, HKV, seed=6)
    mask = torch.ones(B, 1, 1, SLOTS, dtype=torch.bool)
    torch.library.opcheck(KERNEL, (q, k, v, mask, 0.3, None), test_utils=("test_schema", "test_faketensor"))


@needs_kernel
def test_the_kernel_refuses_bad_input_by_name():
    q, k, v = cache_slice(torch.float32, HKV, seed=4)
    with pytest.raises(RuntimeError, match=r"attn_mask must be bool \[3 or 1, 1, 1, 7\]"):
        KERNEL(q, k, v, torch.ones(B, 1, 7, dtype=torch.bool), SCALE, None)
    with pytest.raises(RuntimeError, match="q must be \\[batch, 1, heads, head_dim\\]"):
        KERNEL(torch.cat([q, q], 1), k, v, None, SCALE, None)
    with pytest.raises(RuntimeError, match="k_cache dtype BFloat16 differs from v_cache dtype Float"):
        KERNEL(q, k.bfloat16(), v, None, SCALE, None)
    with pytest.raises(RuntimeError, match="cache dtype Double is not float32, bfloat16 or float16"):
        KERNEL(q, k.double(), v.double(), None, SCALE, None)
    with pytest.raises(RuntimeError, match="sinks must be \\[4\\]"):
        KERNEL(q, k, v, None, SCALE, torch.zeros(3))


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("hkv", [1, HKV, HQ], ids=["mqa", "gqa", "mha"])
def test_the_cuda_implementation_reads_the_cache_per_kv_head(s, hkv):
    q, k, v, allowed = case(s, hkv, seed=1)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # as strided as a layer may hand it over
    out = decode.grouped_decode_attention(q, k, v, attn_mask=allowed, scale=SCALE)
    assert rel_err(out, masked_attention(q, k, v, allowed, SCALE)) < 1e-6
    sinks = torch.randn(HQ)
    out = decode.grouped_decode_attention(q, k, v, attn_mask=allowed, scale=SCALE, sinks=sinks)
    assert rel_err(out, masked_attention(q, k, v, allowed, SCALE, sinks)) < 1e-6
    assert registry._impls("decode_attention")["grouped_sdpa"].device_types == frozenset({"cuda"})


@pytest.fixture
def fake_npu(monkeypatch):
    yield install(monkeypatch)
    uninstall(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_npu_route_calls_the_incremental_kernel_in_bsh(fake_npu, dtype):
    assert registry.selected("decode_attention", "npu") == "npu"
    q, k, v, allowed = case(dtype=dtype, seed=2)
    used = 5  # the generator passes the cache's used slots: a non-contiguous slice
    k_used, v_used, allowed = k[:, :used], v[:, :used], allowed[..., :used]
    out = registry.resolve("decode_attention", "npu")(q, k_used, v_used, attn_mask=allowed, scale=SCALE)
    (call,) = fake_npu.calls
    assert call.name == "npu_incre_flash_attention"
    query, key, value = call.args
    assert query.shape == (B, 1, HQ * D) and key.shape == value.shape == (B, used, HKV * D)
    assert torch.equal(key.view(B, used, HKV, D), k_used) and torch.equal(value.view(B, used, HKV, D), v_used)
    assert call.kwargs.keys() == {"atten_mask", "num_heads", "scale_value", "input_layout", "num_key_value_heads"}
    assert call.kwargs["input_layout"] == "BSH" and call.kwargs["scale_value"] == SCALE
    assert call.kwargs["num_heads"] == HQ and call.kwargs["num_key_value_heads"] == HKV
    mask = call.kwargs["atten_mask"]
    assert mask.dtype == torch.bool and torch.equal(mask, ~allowed.view(B, 1, 1, used))  # True = left out
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, masked_attention(q, k_used, v_used, allowed, SCALE)) < 1e-2


def test_the_npu_route_runs_the_reference_where_the_kernel_does_not_apply(fake_npu):
    for q, k, v, allowed, sinks in (
        (*case(dtype=torch.float32), None),  # fp32: the kernel takes float16 / bfloat16
        (*case(s=2, dtype=torch.bfloat16), None),  # two query tokens a row: the kernel takes one
        (*case(dtype=torch.bfloat16), torch.randn(HQ)),  # sinks: no such column in the kernel
    ):
        out = registry.resolve("decode_attention", "npu")(q, k, v, attn_mask=allowed, scale=SCALE, sinks=sinks)
        expected = masked_attention(q, k, v, allowed, SCALE, sinks)
        assert rel_err(out, expected) < (1e-6 if q.dtype == torch.float32 else 1e-2)
    assert fake_npu.calls == []


def test_a_torch_npu_without_the_kernel_falls_back_to_the_reference_said_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="megacann.ops")
    npu = install(monkeypatch, old_api="no_incre_attention")
    try:
        assert registry.selected("decode_attention", "npu") == "reference"
        registry.selection("npu")
        q, k, v, allowed = case(dtype=torch.bfloat16)
        out = registry.resolve("decode_attention", "npu")(q, k, v, attn_mask=allowed, scale=SCALE)
        assert rel_err(out, masked_attention(q, k, v, allowed, SCALE)) < 1e-2 and npu.calls == []
        lines = [r.getMessage() for r in caplog.records if "decode_attention" in r.getMessage()]
        assert lines == [
            "megacann.ops: decode_attention falls back from 'npu' to the reference (masked attention): "
            "torch_npu 2.6.0 found, it has no npu_incre_flash_attention"
        ]
    finally:
        uninstall(monkeypatch)


def test_the_fake_kernel_holds_calls_to_the_documented_limits():
    kernel = make_fake_torch_npu().npu_incre_flash_attention
    q, k = torch.randn(2, 1, 64, dtype=torch.bfloat16), torch.randn(2, 5, 32, dtype=torch.bfloat16)
    fine = dict(num_heads=4, num_key_value_heads=2, input_layout="BSH")
    assert kernel(q, k, k, **fine).shape == q.shape
    with pytest.raises(TypeError):
        kernel(q, k, k, head_num=4)  # not a parameter of the kernel
    with pytest.raises(TypeError):
        kernel(q, k, k, None)  # everything after value is keyword-only
    with pytest.raises(AssertionError, match="float16 or bfloat16"):
        kernel(q.float(), k.float(), k.float(), **fine)
    with pytest.raises(AssertionError, match="one query token a row"):
        kernel(torch.randn(2, 2, 64, dtype=torch.bfloat16), k, k, **fine)
    with pytest.raises(AssertionError, match="not a multiple of 3 kv heads"):
        kernel(q, k, k, num_heads=4, num_key_value_heads=3)
    with pytest.raises(AssertionError, match="non-contiguous"):
        kernel(q, torch.randn(2, 9, 32, dtype=torch.bfloat16)[:, :5], k, **fine)
    with pytest.raises(AssertionError, match=r"atten_mask must be \[B, 1, 1, S\]"):
        kernel(q, k, k, atten_mask=torch.zeros(2, 5, dtype=torch.bool), **fine)
    with pytest.raises(AssertionError, match="leaves out every key"):
        kernel(q, k, k, atten_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool), **fine)
    with pytest.raises(AssertionError, match="BSH, BNSD or BSND"):
        kernel(q, k, k, num_heads=4, num_key_value_heads=2, input_layout="TND")


@pytest.fixture
def routed_as_npu(fake_npu):
    """Every op called on CPU tensors resolves as on an NPU (the fake's kernels), until the test ends."""
    route_cpu_to_npu()
    yield fake_npu
    for name in registry.ops():
        getattr(ops, name).__globals__["_resolve"] = registry.resolve


@pytest.fixture
def bf16_llama(tmp_path):
    """A tiny bf16 LLaMA, loaded before the fake torch_npu is installed (transformers looks for the real one)."""
    pytest.importorskip("transformers")
    from generation_helpers import tiny_hf_llama

    from megacann.interop import from_pretrained_hf

    return from_pretrained_hf(tiny_hf_llama(str(tmp_path / "hf")), precision="bf16").eval()


def test_a_generation_routed_as_on_an_npu_decodes_through_the_kernel(bf16_llama, routed_as_npu):
    from megacann.generation import Generator, SamplingParams
    from megacann.models import get_model_spec

    model = bf16_llama
    generator = Generator(model, get_model_spec("llama"))
    prompts, params = [[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(max_new_tokens=6)
    on_npu = generator.generate(prompts, params)
    incre = [call for call in routed_as_npu.calls if call.name == "npu_incre_flash_attention"]
    assert len(incre) == 2 * 5  # each of the 2 layers at each of the 5 decoding steps
    assert [call.args[0].shape for call in incre] == [(2, 1, 64)] * 10
    assert [call.args[1].shape[1] for call in incre[::2]] == [6, 7, 8, 9, 10]  # the used slots grow
    for name in registry.ops():  # the same generation on the CPU route
        getattr(ops, name).__globals__["_resolve"] = registry.resolve
    on_cpu = generator.generate(prompts, params)
    for npu_result, cpu_result in zip(on_npu, on_cpu):
        assert npu_result.tokens == cpu_result.tokens
        assert npu_result.logprobs == pytest.approx(cpu_result.logprobs, abs=0.05)
