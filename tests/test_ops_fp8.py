"""FP8 scaling recipes and the ``fp8_linear`` op: quantisation within each format's error bound (against
float64), products equal to an independent block-by-block quantiser written here, ``torch._scaled_mm`` equal
to the reference, tensor-parallel shards equal to one process (and a skipped amax reduction caught), errors
naming what is wrong."""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_on_ranks

import megacann.ops as ops
from megacann.ops import fp8_formats as fmt
from megacann.ops import registry

RECIPES = fmt.RECIPES
# half the spacing of the smallest subnormals (e4m3: 2^-9, e5m2: 2^-16), relative to a block's scale
HALF_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def _spread(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over six orders of magnitude, both signs, some exact zeros: every rounding regime."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.exp(
        torch.empty(rows, cols, dtype=torch.float64).uniform_(-7, 7, generator=g)
    )
    t[0, :3] = 0.0
    return t


def _blocks(shape, block):
    rows, cols = shape
    br = rows if block[0] is None else block[0]
    bc = cols if block[1] is None else block[1]
    for r in range(0, rows, br):
        for c in range(0, cols, bc):
            yield slice(r, r + br), slice(c, c + bc)


def _independent_fake_quant(t: torch.Tensor, fmt_name: str, block, power_of_two: bool) -> torch.Tensor:
    """Block by block, written without the library's helpers: scale = amax / fmax in fp32 (1 for a zero
    block; MX: the next power of two up), round to the format, multiply back (rounded to fp32)."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt_name]
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt_name]
    out = torch.empty_like(t, dtype=torch.float64)
    for rs, cs in _blocks(t.shape, block):
        piece = t[rs, cs].double()
        amax = piece.abs().max().item()
        scale = amax / fmax if amax > 0 else 1.0
        if power_of_two:
            scale = 2.0 ** math.ceil(math.log2(scale))
        scale = torch.tensor(scale, dtype=torch.float32).double()  # the library keeps scales in fp32
        q = (piece.float() / scale.float()).clamp(-fmax, fmax).to(dtype)
        out[rs, cs] = (q.double() * scale).float()  # the exact product, rounded once to fp32 as dequantising does
    return out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("role", ["activation", "weight"])
def test_quantisation_error_within_the_format_bound(recipe, fmt_name, role):
    t = _spread(256, 256, seed=3)
    block = fmt.block_shape(recipe, role)
    q = fmt.quantize(t.float(), fmt_name, block, power_of_two=fmt.power_of_two_scales(recipe))
    got = q.dequantize().double()
    scale = fmt.expand_scale(q.scale, q.block).double()
    bound = torch.maximum(fmt.relative_error_bound(fmt_name) * t.abs(), HALF_SUBNORMAL[fmt_name] * scale)
    # fp32 input rounding adds at most 2^-24 relative
    assert torch.all((got - t).abs() <= bound * (1 + 1e-6) + t.abs() * 2.0**-24)
    assert torch.all(got[0, :3] == 0)
    # every block's scale puts its largest magnitude within the format, and saturates nothing
    assert torch.all(q.data.float().abs() <= fmt.fp8_max(fmt_name))
    if fmt.power_of_two_scales(recipe):
        assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)
    else:  # the largest element of each block lands on the format's largest value
        amax_q = fmt.block_amax(q.data.float(), q.block)
        nonzero = fmt.block_amax(t.float(), q.block) > 0
        assert torch.all(amax_q[nonzero] == fmt.fp8_max(fmt_name))


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantisation_equals_an_independent_block_quantiser(recipe):
    t = _spread(256, 160, seed=5).float()
    for role in ("activation", "weight"):
        block = fmt.block_shape(recipe, role)
        pow2 = fmt.power_of_two_scales(recipe)
        got = fmt.quantize(t, "e4m3", block, power_of_two=pow2, pad=(True, True)).dequantize().double()
        assert torch.equal(got, _independent_fake_quant(t, "e4m3", block, pow2))


def _expected_linear(x, w, b, dy, recipe):
    """Forward and gradients from the independent quantiser: each product's operands quantised along its
    own reduction dimension (e4m3 forward, e5m2 output gradient), products in float64."""
    pow2 = fmt.power_of_two_scales(recipe)

    def q(t, fmt_name, role):
        return _independent_fake_quant(t, fmt_name, fmt.block_shape(recipe, role), pow2)

    y = q(x, "e4m3", "activation") @ q(w, "e4m3", "weight").t() + b.double()
    dx = q(dy, "e5m2", "gradient") @ q(w.t(), "e4m3", "weight").t()
    dw = q(dy.t(), "e5m2", "gradient") @ q(x.t(), "e4m3", "activation").t()
    return y, dx, dw, dy.double().sum(0)


@pytest.mark.parametrize("impl", ["reference", "scaled_mm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_equals_the_quantised_products(recipe, impl):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 20, 128, generator=g)  # 40 tokens: the weight gradient's blocks are padded
    w = torch.randn(256, 128, generator=g) * 0.05
    b = torch.randn(256, generator=g)
    dy = torch.randn(2, 20, 256, generator=g)
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    registry.pin("fp8_linear", impl)
    try:
        y = ops.fp8_linear(xx, ww, bb, recipe=recipe)
    finally:
        registry.pin("fp8_linear", None)
    y.backward(dy)
    ey, edx, edw, edb = _expected_linear(x.reshape(-1, 128), w, b, dy.reshape(-1, 256), recipe)
    for got, want in ((y.reshape(-1, 256), ey), (xx.grad.reshape(-1, 128), edx), (ww.grad, edw), (bb.grad, edb)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # FP8 moves the product, but not far: within a few per cent of the exact one
    exact = torch.nn.functional.linear(x, w, b)
    assert 1e-3 < ((y - exact).norm() / exact.norm()).item() < 0.06


def test_scaled_mm_is_chosen_on_cpu():
    assert registry.selected("fp8_linear", "cpu") == "scaled_mm"


def test_bad_recipes_formats_and_shapes_are_named():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(fmt.Fp8Error, match="unknown FP8 recipe 'fp4'.*tensorwise, rowwise, blockwise, mxfp8"):
        ops.fp8_linear(x, w, recipe="fp4")
    with pytest.raises(fmt.Fp8Error, match="unknown FP8 format 'e3m4'"):
        ops.fp8_linear(x, w, forward_format="e3m4")
    with pytest.raises(fmt.Fp8Error, match="parallel must be 'column', 'row' or None, got 'diagonal'"):
        ops.fp8_linear(x, w, parallel="diagonal")
    # a split reduction dimension (row-parallel input) must hold whole 128-wide tiles on every rank
    with pytest.raises(
        fmt.Fp8Error, match=r"forward operand A \(activation\): FP8 blocks of 1 x 128 do not divide.*64"
    ):
        ops.fp8_linear(x, w, recipe="blockwise", parallel="row")


def _tp_check(recipe, parallel, reduce_amax):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 256, generator=g)
    w = torch.randn(256, 256, generator=g) * 0.05
    w[:128] *= 3.0  # the shards' largest values differ: a scale taken from one shard is wrong
    x[:, :128] *= 5.0
    dy = torch.randn(24, 256, generator=g)
    full_x, full_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_full = ops.fp8_linear(full_x, full_w, recipe=recipe)
    y_full.backward(dy)

    part = slice(rank * 128, (rank + 1) * 128)
    group = dist.group.WORLD if reduce_amax else None
    if parallel == "column":
        lx, lw = x.clone().requires_grad_(), w[part].clone().requires_grad_()
        y = ops.fp8_linear(lx, lw, recipe=recipe, parallel="column", group=group)
        y.backward(dy[:, part])
        pieces = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(pieces, y.detach().contiguous())
        y_joined = torch.cat(pieces, dim=1)
        dx = lx.grad.clone()
        dist.all_reduce(dx)
        dx_mine, dw_mine = dx, lw.grad
        want = (y_full, full_x.grad, full_w.grad[part])
    else:
        lx, lw = x[:, part].clone().requires_grad_(), w[:, part].clone().requires_grad_()
        y = ops.fp8_linear(lx, lw, recipe=recipe, parallel="row", group=group)
        y.backward(dy)
        y_joined = y.detach().clone()
        dist.all_reduce(y_joined)
        dx_mine, dw_mine = lx.grad, lw.grad
        want = (y_full, full_x.grad[:, part], full_w.grad[:, part])
    got = (y_joined, dx_mine, dw_mine)
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_tensor_parallel_fp8_equals_one_process_and_a_skipped_amax_reduction_does_not(parallel):
    for recipe in RECIPES:
        errors = run_on_ranks(_tp_check, world_size=2, args=(recipe, parallel, True), timeout=120)
        for rank_errors in errors:
            assert max(rank_errors) < 1e-5, (recipe, parallel, rank_errors)
    # the classic bug: each rank scales its shard of one tensor by its own amax
    skipped = run_on_ranks(_tp_check, world_size=2, args=("tensorwise", parallel, False), timeout=120)
    assert max(max(e) for e in skipped) > 1e-3


def test_delayed_scaling_records_this_step_and_scales_by_earlier_steps():
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(8, 32, generator=g)
    history = torch.zeros(1 + 4, 3)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = ops.fp8_linear(xx, ww, amax_history=history)
    y.backward(dy)
    # no earlier step: the scales are this use's own, so the result is current scaling's
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    yc = ops.fp8_linear(xc, wc)
    yc.backward(dy)
    assert torch.equal(y, yc) and torch.equal(xx.grad, xc.grad) and torch.equal(ww.grad, wc.grad)
    assert history[0].tolist() == [x.abs().max().item(), w.abs().max().item(), dy.abs().max().item()]
    assert torch.all(history[1:] == 0)
    # an earlier step saw 3x larger values: its amax sets the scale (not a power of two: other roundings)
    history.zero_()
    history[2] = torch.tensor([3 * x.abs().max().item(), w.abs().max().item(), dy.abs().max().item()])
    with torch.no_grad():  # evaluation: scaled by the history, nothing recorded
        y_delayed = ops.fp8_linear(x, w, amax_history=history)
    assert torch.all(history[0] == 0)
    x_coarse = fmt.quantize(x, "e4m3", (None, None), amax=history[2, :1].reshape(1, 1)).dequantize()
    w_q = fmt.quantize(w, "e4m3", (None, None)).dequantize()
    torch.testing.assert_close(y_delayed, x_coarse @ w_q.t(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y_delayed, yc)
    # a value beyond the history's amax saturates at the format's largest value
    history[2, 0] = x.abs().max().item() / 2
    big = fmt.quantize(x, "e4m3", (None, None), amax=history[2, :1].reshape(1, 1))
    assert big.data.float().abs().max().item() == 448.0


def test_delayed_scaling_is_refused_for_block_recipes_and_bad_buffers():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(fmt.Fp8Error, match="delayed scaling .* takes the tensorwise recipe, not 'rowwise'"):
        ops.fp8_linear(x, w, recipe="rowwise", amax_history=torch.zeros(5, 3))
    with pytest.raises(fmt.Fp8Error, match=r"amax_history must be \[1 \+ history length, 3\], got \(5, 2\)"):
        ops.fp8_linear(x, w, amax_history=torch.zeros(5, 2))
