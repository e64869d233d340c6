"""The generate call's transposed fp32 weight copies (megacann.ops.weight_copies): the products they serve
equal F.linear's within round-off, follow the weights when these change, stay out of training and of the
cases they do not serve, and the generator's tokens are the same with or without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacann import ops
from megacann.ops import bf16_matmul, weight_copies
from megacann.ops.weight_copies import call_weight_copies


def _weight(out_features: int = 512, in_features: int = 256, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    )


def _input(rows: int, in_features: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, 1, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)


def _assert_round_off(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for the order of the fp32 sums: norm-wise within 1e-6."""
    assert (out - expected).norm() <= 1e-6 * expected.norm(), ((out - expected).norm(), expected.norm())


def _copy(weight: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """The block's copy of ``weight`` (transposed fp32, or oneDNN-packed)."""
    return weight_copies._COPIES[id(weight), packed][3]


def _copies() -> dict:
    return weight_copies._COPIES


@pytest.mark.parametrize("rows", [4, 16, 64, 300])
def test_a_copy_serves_fp32_products_of_four_rows_and_more(rows):
    weight, bias, x = _weight(), torch.randn(512), _input(rows)
    with torch.no_grad(), call_weight_copies():
        out = ops.linear(x, weight, bias)
        assert list(_copies()) == [(id(weight), False)]  # the product read the copy
        copy = _copy(weight)
        assert copy.shape == (256, 512) and copy.is_contiguous()
    _assert_round_off(out, F.linear(x, weight, bias))
    assert weight_copies._COPIES is None  # dropped at the block's end


def test_one_copy_per_weight_remade_when_the_weight_changes():
    weight, x = _weight(), _input(8)
    with torch.no_grad(), call_weight_copies():
        ops.linear(x, weight)
        first = _copy(weight)
        ops.linear(x, weight)
        assert _copy(weight) is first  # made once
        weight.mul_(2.0)  # an optimizer step between two calls inside one block
        out = ops.linear(x, weight)
        assert _copy(weight) is not first
    _assert_round_off(out, F.linear(x, weight))


def test_plain_products_outside_the_block_with_gradients_few_rows_or_non_parameters():
    weight = _weight()
    small = _weight(256, 256)  # under MIN_ELEMENTS: the call's overhead would outweigh the gain
    with torch.no_grad():
        cases = ((_input(2), weight), (_input(1), weight), (_input(16), weight.detach().clone()), (_input(16), small))
        for x, w in cases:
            with call_weight_copies():
                out = ops.linear(x, w)
                assert _copies() == {}
            assert torch.equal(out, F.linear(x, w))
    with call_weight_copies():
        x = _input(16).requires_grad_()
        out = ops.linear(x, weight)  # training: the autograd product, never a copy
        assert _copies() == {} and out.grad_fn is not None
    with torch.no_grad(), call_weight_copies(enabled=False):
        assert not weight_copies.active() and torch.equal(ops.linear(_input(16), weight), F.linear(_input(16), weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_bf16_products_read_a_packed_copy_with_the_same_bits(dtype):
    weight, bias = _weight(1024, 512, dtype=dtype), torch.randn(1024).to(dtype)
    small = _weight(256, 512, dtype=dtype)  # under MIN_PACKED_ELEMENTS: F.linear
    with bf16_matmul.forced(False), torch.no_grad():
        for rows in (1, 3, 16):
            x = _input(rows, 512, dtype=dtype)
            with call_weight_copies():
                out = ops.linear(x, weight, bias)
                # fp16 keeps F.linear, and bf16 where PyTorch's own bf16 products do not go through oneDNN
                packed = [(id(weight), True)] if dtype == torch.bfloat16 and weight_copies.packs_bf16() else []
                assert list(_copies()) == packed and all(_copy(weight, True).is_mkldnn for _ in packed)
                assert torch.equal(ops.linear(x, small), F.linear(x, small)) and len(_copies()) == len(packed)
            assert out.dtype == dtype and torch.equal(out, F.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_copy_serves_low_precision_products_on_the_fp32_route_at_any_rows(dtype):
    weight, bias = _weight(48, 40, dtype=dtype), torch.randn(48).to(dtype)  # widened: any size
    with bf16_matmul.forced(True), torch.no_grad():
        for rows in (1, 2, 16):
            x = _input(rows, 40, dtype=dtype)
            with call_weight_copies():
                out = ops.linear(x, weight, bias)
                assert _copy(weight).dtype == torch.float32
            expected = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
            assert out.dtype == dtype
            torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)  # the dtype's round-off
    with bf16_matmul.forced(False), torch.no_grad(), call_weight_copies():
        x = _input(16, 40, dtype=dtype)
        assert torch.equal(ops.linear(x, weight), F.linear(x, weight)) and _copies() == {}


def test_generator_tokens_and_logprobs_with_and_without_the_copies(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from generation_helpers import prompts, tiny_hf_llama

    from megacann.generation import Generator, SamplingParams
    from megacann.interop import from_pretrained_hf
    from megacann.models import get_model_spec

    model = from_pretrained_hf(tiny_hf_llama(str(tmp_path / "hf"))).eval()
    batch, params = prompts(), SamplingParams(max_new_tokens=16)
    spec = get_model_spec("llama")
    made = []
    copy_of = weight_copies._copy_of
    monkeypatch.setattr(weight_copies, "_copy_of", lambda weight: made.append(id(weight)) or copy_of(weight))
    monkeypatch.setattr(weight_copies, "MIN_ELEMENTS", 0)  # the tiny model's weights are all small
    plain = Generator(model, spec, cpu_weight_copies=False).generate(batch, params)
    assert made == []
    copied = Generator(model, spec).generate(batch, params)
    linears = [m.weight for m in model.modules() if type(m).__name__.endswith("ParallelLinear")]
    assert {id(w) for w in linears} <= set(made)  # every projection read a copy
    assert weight_copies._COPIES is None
    for a, b in zip(plain, copied):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
