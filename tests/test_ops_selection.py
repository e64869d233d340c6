"""Choosing implementations: ``configure(fused_ops, fp32_ops)``, the one-line report, the fallback when the
C++ kernels cannot be built, the AdamW step, and the torch.compile'd CUDA implementations (compiled and
checked on CPU here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from layers_reference import rel_err

from megacann import ops
from megacann.ops import cpp, cuda, reference, registry

FUSED_ON_CPU = ("rms_norm", "apply_rotary", "swiglu", "cross_entropy", "vocab_parallel_head_loss")


@pytest.fixture(autouse=True)
def default_selection():
    ops.configure(True, [])
    yield
    ops.configure(True, [])


@pytest.fixture
def spy():
    """A top-priority CPU implementation of rms_norm and cross_entropy that records the dtypes it gets."""
    seen: list[tuple[str, torch.dtype]] = []

    def rms(x, weight, eps):
        seen.append(("rms_norm", x.dtype, weight.dtype))
        return reference.rms_norm(x, weight, eps)

    def ce(logits, target, ignore_index=-100):
        seen.append(("cross_entropy", logits.dtype))
        return reference.cross_entropy(logits, target, ignore_index)

    registry.register("rms_norm", "spy", priority=99, device_types=("cpu",))(rms)
    registry.register("cross_entropy", "spy", priority=99, device_types=("cpu",))(ce)
    yield seen
    for op in ("rms_norm", "cross_entropy"):
        registry._IMPLS[op].pop("spy")
    registry._CACHE.clear()


@pytest.mark.skipif(not cpp.available(), reason="megacann C++ kernels unavailable")
def test_fused_ops_true_false_and_a_list():
    assert all(ops.selected(op, "cpu") == "cpp" for op in FUSED_ON_CPU)
    ops.configure(False)
    assert all(ops.selected(op, "cpu") == "reference" for op in ops.ops())
    ops.configure(["rms_norm", "adamw_step_"])
    assert ops.selected("rms_norm", "cpu") == "cpp" and ops.selected("adamw_step_", "cpu") == "fused"
    assert ops.selected("swiglu", "cpu") == "reference" and ops.selected("cross_entropy", "cpu") == "reference"
    ops.pin("swiglu", "cpp")  # an explicit pin wins over the recipe's list
    assert ops.selected("swiglu", "cpu") == "cpp"
    ops.pin("swiglu", None)
    ops.configure(True)
    assert ops.selected("swiglu", "cpu") == "cpp"


def test_unknown_op_names_are_refused_with_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"fused_ops: unknown op name\(s\) \['rmsnorm'\]; valid op names: \[.*'rms_norm'"
    ):
        ops.configure(["rmsnorm"])
    with pytest.raises(ValueError, match=r"fp32_ops: unknown op name\(s\) \['softmax'\]; valid op names"):
        ops.configure(True, ["softmax"])
    with pytest.raises(TypeError, match="fp32_ops must be a list of op names"):
        ops.configure(True, "rms_norm")
    assert ops.fp32_ops() == []  # a refused configuration changes nothing


def test_fp32_ops_upcast_inputs_and_cast_results_back(spy):
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(8) + 0.5).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(3, 11, dtype=torch.bfloat16)
    target = torch.tensor([1, 2, -100])
    ops.rms_norm(x, w, 1e-6)
    ops.cross_entropy(logits, target)
    assert spy == [("rms_norm", torch.bfloat16, torch.bfloat16), ("cross_entropy", torch.bfloat16)]
    spy.clear()

    ops.configure(True, ["rms_norm", "cross_entropy"])
    assert ops.fp32_ops() == ["cross_entropy", "rms_norm"]
    out = ops.rms_norm(x, w, 1e-6)
    loss = ops.cross_entropy(logits, target)
    assert spy == [("rms_norm", torch.float32, torch.float32), ("cross_entropy", torch.float32)]
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32  # a loss stays fp32
    assert torch.equal(out, reference.rms_norm(x.float(), w.float(), 1e-6).bfloat16())
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    fp32_in = torch.randn(2, 8)
    assert ops.rms_norm(fp32_in, w.detach().float(), 1e-6).dtype == torch.float32  # fp32 inputs untouched
    assert ops.selection("cpu")["rms_norm"] == "spy (fp32)"


def test_selection_line_names_every_op_once(caplog):
    ops.configure(["rms_norm"], ["rms_norm"])
    with caplog.at_level("INFO", logger="megacann.ops"):
        line = ops.log_selection("cpu")
    assert "\n" not in line and line.startswith("megacann.ops on cpu: ")
    assert [r.getMessage() for r in caplog.records] == [line]
    named = [item.split("=")[0] for item in line.removeprefix("megacann.ops on cpu: ").split(", ")]
    assert sorted(named) == sorted(ops.ops())
    expected = "cpp" if cpp.available() else "reference"
    assert f"rms_norm={expected} (fp32)" in line and "swiglu=reference" in line


def test_resolving_first_inside_torch_compile_says_what_to_do():
    registry._CACHE.clear()

    def f(x, w):
        return ops.rms_norm(x, w, 1e-6)

    with pytest.raises(Exception, match=r"megacann.ops.selection\('cpu'\)"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.randn(2, 4), torch.ones(4))
    torch._dynamo.reset()


FALLBACK_SCRIPT = textwrap.dedent(
    """
    import torch
    from megacann import ops
    from megacann.ops import reference
    x, w = torch.randn(4, 16), torch.rand(16) + 0.5
    assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    ops.swiglu(torch.randn(2, 8))
    ops.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    print(ops.selection_line("cpu"))
    """
)


def run_fallback(env_overrides: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_overrides}
    return subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)


def test_without_a_compiler_the_reference_runs_and_one_line_says_so(tmp_path):
    result = run_fallback({"MEGACANN_CPP": "jit", "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "rms_norm=reference" in result.stdout and "cpp" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "megacann: C++ CPU kernels unavailable (no C++ compiler found (CXX=/nonexistent/c++)); "
        "using the PyTorch reference ops"
    ], result.stderr
    off = run_fallback({"MEGACANN_CPP": "off"})
    assert off.returncode == 0 and "rms_norm=reference" in off.stdout and off.stderr.strip() == "", off.stderr


def test_adamw_step_equals_torch_adamw():
    g = torch.Generator().manual_seed(0)
    start = torch.randn(300, generator=g)
    grads = [torch.randn(300, generator=g) for _ in range(4)]
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for impl, torch_kwargs in (("reference", {"foreach": False}), ("fused", {"fused": True})):
        param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(300), torch.zeros(300)
        torch_param = start.clone().requires_grad_()
        opt = torch.optim.AdamW([torch_param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **torch_kwargs)
        fn = registry._IMPLS["adamw_step_"][impl].fn
        for step, grad in enumerate(grads, start=1):
            fn(param, grad, exp_avg, exp_avg_sq, step=step, **hyper)
            torch_param.grad = grad.clone()
            opt.step()
        state = opt.state[torch_param]
        assert torch.equal(param, torch_param.detach()), impl  # bitwise: the same arithmetic
        assert torch.equal(exp_avg, state["exp_avg"]) and torch.equal(exp_avg_sq, state["exp_avg_sq"])
    assert ops.selected("adamw_step_", "cpu") == "fused" and ops.selected("adamw_step_", "cuda") == "fused"


def test_the_trainers_adamw_steps_through_the_registry_like_torch_adamw():
    """megacann.optimizer.RegistryAdamW (what the trainer builds for optim.name adamw): one adamw_step_ per
    tensor, bitwise torch.optim.AdamW(fused=True) on CPU, with torch's state dict (loads both ways)."""
    from megacann.optimizer import RegistryAdamW

    g = torch.Generator().manual_seed(1)
    shapes = [(5, 7), (7,)]
    ours = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]

    def groups(ps):
        return [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]

    opt = RegistryAdamW(groups(ours), lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(groups(theirs), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    calls = []
    fused = registry._IMPLS["adamw_step_"]["fused"].fn
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        registry._CACHE[("adamw_step_", "cpu")] = (
            registry._IMPLS["adamw_step_"]["fused"],
            lambda *a, **k: calls.append(k["step"]) or fused(*a, **k),
        )
        opt.step()
        registry._CACHE.clear()
        ref.step()
    assert calls == [1, 1, 2, 2, 3, 3]  # each tensor, each step, counted from 1
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    theirs_state = ref.state_dict()
    assert opt.state_dict()["state"].keys() == theirs_state["state"].keys()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state_dict()["state"][0][key], theirs_state["state"][0][key])
    resumed = RegistryAdamW(groups([p.detach().clone().requires_grad_() for p in ours]), lr=2e-3)
    resumed.load_state_dict(theirs_state)
    assert int(resumed.state_dict()["state"][1]["step"]) == 3


def test_compiled_cuda_implementations_compile_and_match_on_cpu():
    """The torch.compile'd norm / RoPE / SwiGLU registered (opt-in) for CUDA, compiled here on CPU:
    fp32 equal to the reference within 1e-5, forward and backward."""
    assert "compiled" in ops.implementations("rms_norm") and ops.selected("rms_norm", "cuda") == "reference"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g)
    angles = torch.randn(5, 4, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    w = torch.rand(8, generator=g) + 0.5
    cases = [
        (cuda.compiled_rms_norm, reference.rms_norm, (x, w), (1e-6,)),
        (cuda.compiled_apply_rotary, reference.apply_rotary, (x,), (cos, sin, False)),
        (cuda.compiled_swiglu, reference.swiglu, (x,), ()),
    ]
    torch._dynamo.reset()
    for compiled_fn, ref_fn, diff, fixed in cases:
        results = []
        for fn in (compiled_fn, ref_fn):
            leaves = [t.clone().requires_grad_() for t in diff]
            out = fn(*leaves, *fixed)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), [leaf.grad for leaf in leaves]))
        (out, grads), (ref, ref_grads) = results
        assert rel_err(out, ref) < 1e-5 and all(rel_err(a, b) < 1e-5 for a, b in zip(grads, ref_grads))
