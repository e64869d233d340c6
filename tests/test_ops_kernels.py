"""The C++ CPU kernels (csrc/, registry name "cpp") against the PyTorch reference, forward and backward.

Tolerances (relative Frobenius error, ``rel_err``):
- fp32: kernel vs the fp32 reference, 1e-5 for outputs and every gradient;
- bf16: kernel vs the fp64 truth at most 1e-2 and no worse than the bf16 reference's own error (x1.25 plus
  1e-3): the kernels accumulate in fp32 and round once;
- fp64: ``torch.autograd.gradcheck`` of every kernel's backward.
Shapes are odd-sized and include non-contiguous inputs (strided views, halves of fused projections).
"""

from __future__ import annotations

import pytest
import torch
from layers_reference import rel_err

from megacann import ops
from megacann.ops import cpp, reference
from megacann.ops.moe import _unpermute_reference

pytestmark = pytest.mark.skipif(not cpp.available(), reason="megacann C++ kernels unavailable (no compiler?)")

GEN = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=GEN, dtype=torch.float64) * scale


# Each case returns (leaves, view, fixed): float64 leaf tensors (cast per test), ``view(leaves)`` -> the
# tensor arguments the op gets (strided views of the leaves for the non-contiguous variants), and the
# fixed trailing arguments. Gradients are compared on the leaves.


def rms_inputs(noncontiguous: bool):
    w = randn(33).abs() + 0.5
    if noncontiguous:
        return [randn(3, 7, 66), w], lambda t: [t[0][..., ::2], t[1]], [1e-6]
    return [randn(5, 33), w], list, [1e-6]


def rotary_inputs(noncontiguous: bool, interleaved: bool, batched_table: bool):
    b, s, h, d = 2, 7, 3, 10
    angles = randn(b if batched_table else 1, s, d // 2) * 3
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    cos, sin = angles.cos(), angles.sin()
    if not batched_table:
        cos, sin = cos[0], sin[0]
    if noncontiguous:  # every other head of a wider projection, as q/k views of a fused qkv
        return [randn(b, s, 2 * h, d)], lambda t: [t[0][:, :, 1::2]], [cos, sin, interleaved]
    return [randn(b, s, h, d)], list, [cos, sin, interleaved]


def swiglu_inputs(noncontiguous: bool, split: bool):
    if split:
        if noncontiguous:  # the two halves of one fused projection
            return [randn(3, 5, 26)], lambda t: list(t[0].chunk(2, -1)), []
        return [randn(4, 13), randn(4, 13)], list, []
    if noncontiguous:
        return [randn(9, 32)], lambda t: [t[0][:, 3:-3]], []
    return [randn(3, 5, 26)], list, []


def ce_inputs(noncontiguous: bool):
    shape = (37, 120) if noncontiguous else (2, 9, 50)
    logits = randn(*shape, scale=3.0)
    valid = 101 if noncontiguous else 50
    target = torch.randint(0, valid, shape[:-1], generator=GEN)
    target.view(-1)[::5] = -100
    view = (lambda t: [t[0][:, :valid]]) if noncontiguous else list
    return [logits], view, [target, -100]


def unpermute_inputs(noncontiguous: bool):
    tokens, top_k, hidden = 11, 3, 9
    row_id_map = torch.randperm(tokens * top_k, generator=GEN).to(torch.int32)
    probs = torch.rand(tokens, top_k, generator=GEN, dtype=torch.float64)
    if noncontiguous:  # every other column of a wider expert output
        return [randn(tokens * top_k, 2 * hidden), probs], lambda t: [t[0][:, ::2], row_id_map, t[1]], []
    return [randn(tokens * top_k, hidden), probs], lambda t: [t[0], row_id_map, t[1]], []


CASES = {
    "rms_norm": (cpp.rms_norm, reference.rms_norm, rms_inputs),
    "apply_rotary": (cpp.apply_rotary, reference.apply_rotary, rotary_inputs),
    "swiglu": (cpp.swiglu, reference.swiglu, swiglu_inputs),
    "cross_entropy": (cpp.cross_entropy, reference.cross_entropy, ce_inputs),
    "moe_unpermute": (cpp.moe_unpermute, _unpermute_reference, unpermute_inputs),
}
VARIANTS = [
    ("rms_norm", dict(noncontiguous=False)),
    ("rms_norm", dict(noncontiguous=True)),
    ("apply_rotary", dict(noncontiguous=False, interleaved=False, batched_table=False)),
    ("apply_rotary", dict(noncontiguous=True, interleaved=False, batched_table=True)),
    ("apply_rotary", dict(noncontiguous=True, interleaved=True, batched_table=False)),
    ("apply_rotary", dict(noncontiguous=False, interleaved=True, batched_table=True)),
    ("swiglu", dict(noncontiguous=False, split=False)),
    ("swiglu", dict(noncontiguous=True, split=False)),
    ("swiglu", dict(noncontiguous=True, split=True)),
    ("swiglu", dict(noncontiguous=False, split=True)),
    ("cross_entropy", dict(noncontiguous=False)),
    ("cross_entropy", dict(noncontiguous=True)),
    ("moe_unpermute", dict(noncontiguous=False)),
    ("moe_unpermute", dict(noncontiguous=True)),
]
IDS = [f"{op}-" + "-".join(k for k, v in kw.items() if v) for op, kw in VARIANTS]


def run(fn, case, dtype, grad_out=None):
    """fn's output and the leaves' gradients for ``grad_out`` (random when None), all in ``dtype``."""
    leaves, view, fixed = case
    leaves = [leaf.detach().to(dtype).requires_grad_() for leaf in leaves]
    cast_fixed = [f.to(dtype) if isinstance(f, torch.Tensor) and f.is_floating_point() else f for f in fixed]
    args = view(leaves)
    out = fn(*args, *cast_fixed)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=GEN, dtype=torch.float64)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [leaf.grad for leaf in leaves], grad_out


@pytest.mark.parametrize("op,kwargs", VARIANTS, ids=IDS)
def test_kernel_matches_reference_fp32_and_bf16(op, kwargs):
    kernel, ref, make = CASES[op]
    case = make(**kwargs)
    truth, truth_grads, grad_out = run(ref, case, torch.float64)
    out, grads, _ = run(kernel, case, torch.float32, grad_out)
    ref_out, ref_grads, _ = run(ref, case, torch.float32, grad_out)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert rel_err(out, ref_out) < 1e-5
    for g, rg in zip(grads, ref_grads):
        assert g.dtype == rg.dtype and rel_err(g, rg) < 1e-5

    out16, grads16, _ = run(kernel, case, torch.bfloat16, grad_out)
    ref16, ref_grads16, _ = run(ref, case, torch.bfloat16, grad_out)
    assert out16.dtype == ref16.dtype  # bf16 for the layers, fp32 for the loss
    for mine, theirs, exact in [(out16, ref16, truth), *zip(grads16, ref_grads16, truth_grads)]:
        assert mine.dtype == theirs.dtype
        err, ref_err = rel_err(mine, exact), rel_err(theirs, exact)
        assert err < 1e-2 and err <= 1.25 * ref_err + 1e-3, (err, ref_err)


@pytest.mark.parametrize("op,kwargs", VARIANTS, ids=IDS)
def test_kernel_gradcheck_float64(op, kwargs):
    kernel, _, make = CASES[op]
    leaves, view, fixed = make(**kwargs)
    leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    assert torch.autograd.gradcheck(lambda *xs: kernel(*view(list(xs)), *fixed), leaves, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("op,kwargs", VARIANTS, ids=IDS)
def test_without_gradients_the_kernels_give_the_same_bits_and_no_graph(op, kwargs):
    # with gradients off the ops are dispatched below autograd (megacann.ops.cpp._call): the same kernel
    kernel, _, make = CASES[op]
    leaves, view, fixed = make(**kwargs)
    leaves = [leaf.detach().float().requires_grad_() for leaf in leaves]
    cast = [f.float() if isinstance(f, torch.Tensor) and f.is_floating_point() else f for f in fixed]
    tracked = kernel(*view(leaves), *cast)
    with torch.no_grad():
        plain = kernel(*view(leaves), *cast)
    assert tracked.grad_fn is not None and plain.grad_fn is None and not plain.requires_grad
    assert torch.equal(plain, tracked.detach())


def test_registry_selects_the_kernels_on_cpu_only():
    fused = ("rms_norm", "apply_rotary", "swiglu", "cross_entropy", "vocab_parallel_head_loss", "moe_unpermute")
    for op in (*fused, "grouped_matmul"):
        assert ops.selected(op, "cpu") == "cpp"
        assert ops.selected(op, "xpu") == "reference"
    x, w = torch.randn(4, 8), torch.rand(8) + 0.5
    out = ops.rms_norm(x, w, 1e-6)
    assert rel_err(out, reference.rms_norm(x, w, 1e-6)) < 1e-6


def test_unsupported_inputs_fall_back_to_the_reference():
    x = torch.randn(4, 8, dtype=torch.float16)
    w = torch.rand(8, dtype=torch.float16) + 0.5
    assert torch.equal(cpp.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))  # fp16: not a kernel dtype
    xf = torch.randn(4, 8)
    assert torch.equal(cpp.rms_norm(xf, w.float().double(), 1e-6), reference.rms_norm(xf, w.double(), 1e-6))
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        torch.ops.megacann.rotary(torch.randn(1, 2, 1, 5), torch.ones(1, 2, 5), torch.ones(1, 2, 5), False, False)
    with pytest.raises(RuntimeError, match=r"permuted rows \(5\) must equal tokens x top_k \(6\)"):
        torch.ops.megacann.moe_unpermute(torch.randn(5, 4), torch.arange(6).int(), torch.rand(3, 2))
    with pytest.raises(RuntimeError, match=r"row_id_map entries must lie in \[0, 6\), got \[0, 6\]"):
        torch.ops.megacann.moe_unpermute(torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 6]).int(), torch.rand(3, 2))
    rows = torch.randn(7, 4)  # more rows than assignments: the reference serves
    probs, row_id_map = torch.rand(3, 2), torch.randperm(6).int()
    assert torch.equal(cpp.moe_unpermute(rows, row_id_map, probs), _unpermute_reference(rows, row_id_map, probs))
    with pytest.raises(RuntimeError, match="target must be int64"):
        torch.ops.megacann.cross_entropy_forward(torch.randn(3, 4), torch.zeros(3, dtype=torch.int32), -100)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation and autograd registration agree with the real kernels."""
    m = torch.ops.megacann
    x, w = torch.randn(3, 16, requires_grad=True), torch.rand(16, requires_grad=True)
    q = torch.randn(2, 5, 3, 8, requires_grad=True)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    gate_up = torch.randn(4, 10, requires_grad=True)
    logits = torch.randn(6, 11, requires_grad=True)
    target = torch.tensor([0, 3, -100, 10, 5, 1])
    cases = [
        (m.rms_norm_forward, (x, w, 1e-6)),
        (m.rotary, (q, cos, sin, False, False)),
        (m.swiglu_fused, (gate_up,)),
        (m.swiglu, (gate_up[:, :5], gate_up[:, 5:])),
        (m.cross_entropy_forward, (logits, target, -100)),
        (m.vocab_shard_stats, (logits.detach(), target, 4, 5, -100)),
        (m.vocab_shard_grad_, (logits.detach().clone(), target, torch.randn(6), torch.rand(6), 4, 5, -100)),
        (m.moe_unpermute, (torch.randn(6, 7, requires_grad=True), torch.randperm(6).int(), torch.rand(3, 2))),
        (m.swiglu_fused_backward_, (torch.randn(4, 5), torch.randn(4, 10))),  # the gradient over the input
        (m.moe_unpermute_backward_, (torch.randn(3, 7), torch.randn(6, 7), torch.randperm(6), torch.rand(3, 2))),
        (
            m.grouped_mm_,
            (
                [torch.empty(3, 4), torch.empty(2, 4)],
                [torch.randn(3, 5), torch.randn(2, 5)],
                [torch.randn(5, 4), torch.randn(5, 4)],
                2,
            ),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def _compile_case():
    def step(x, w, gate_up, cos, sin, logits, target):
        h = ops.rms_norm(x, w, 1e-6).view(2, 5, 2, 8)
        r = ops.apply_rotary(h, cos, sin)
        s = ops.swiglu(gate_up)
        return r.square().sum() + s.sum() + ops.cross_entropy(logits, target).sum()

    args = [
        torch.randn(2, 5, 16),
        torch.rand(16) + 0.5,
        torch.randn(2, 5, 12),
        torch.randn(5, 8).cos(),
        torch.randn(5, 8).sin(),
        torch.randn(10, 21),
    ]
    trained = (True, True, True, False, False, True)  # rotary tables take no gradient
    target = torch.randint(0, 21, (10,), generator=GEN)

    def run(fn):
        leaves = [a.clone().requires_grad_(t) for a, t in zip(args, trained)]
        loss = fn(*leaves, target)
        loss.backward()
        return loss.detach(), [leaf.grad for leaf, t in zip(leaves, trained) if t]

    return step, run


def test_torch_compile_graphs_hold_the_custom_ops():
    """AOT autograd traces forward and backward through the fake implementations and the registered
    autograd formulas: both graphs call the C++ ops (not decomposed, no graph break)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, list[str]] = {"forward": [], "backward": []}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind].extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)

        return compile_graph

    step, run = _compile_case()
    eager_loss, eager_grads = run(step)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    loss, grads = run(torch.compile(step, backend=backend, fullgraph=True))
    assert rel_err(loss, eager_loss) < 1e-6
    assert all(rel_err(g, e) < 1e-6 for g, e in zip(grads, eager_grads))
    for name in ("rms_norm_forward", "rotary", "swiglu_fused", "cross_entropy_forward"):
        assert any(f"megacann.{name}" in t for t in graphs["forward"]), (name, graphs["forward"])
    for name in ("rms_norm_backward", "rotary", "swiglu_fused_backward", "cross_entropy_backward"):
        assert any(f"megacann.{name}" in t for t in graphs["backward"]), (name, graphs["backward"])


def test_torch_compile_inductor_runs_the_custom_ops():
    step, run = _compile_case()
    eager_loss, eager_grads = run(step)
    torch._dynamo.reset()
    loss, grads = run(torch.compile(step, fullgraph=True))
    assert rel_err(loss, eager_loss) < 1e-6
    assert all(rel_err(g, e) < 1e-6 for g, e in zip(grads, eager_grads))
