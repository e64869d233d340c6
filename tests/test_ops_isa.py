"""The instruction-set variants of the C++ kernel loops (megacann/ops/isa.py): which one is chosen from a
CPU's flags, PyTorch's capability and MEGACANN_CPU_ISA (pure function), and every variant this machine
runs against the PyTorch reference at widths that fill whole vectors plus a tail, forward and backward."""

from __future__ import annotations

import pytest
import torch
from layers_reference import rel_err

from megacann.ops import cpp, extension, isa, reference

V3 = "fpu sse2 sse4_1 avx avx2 fma bmi1 bmi2 f16c movbe abm xsave"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
ALL = isa.ISA_NAMES


def flags(text: str) -> frozenset[str]:
    return isa.cpu_flags(f"processor\t: 0\nmodel name\t: some CPU\nflags\t\t: {text}\n")


def test_the_best_variant_the_cpu_runs_is_chosen():
    assert isa.choose_isa(flags(V4), ALL) == "avx2"  # AVX-512 only on request (isa.AUTO_MAX)
    assert isa.choose_isa(flags(V3), ALL) == "avx2"  # an AVX2-only EPYC
    assert isa.choose_isa(flags(V3.replace(" fma", "")), ALL) == "baseline"  # AVX2 without FMA is no x86-64-v3
    assert isa.choose_isa(flags(V4.replace(" avx512bw", "")), ALL) == "avx2"  # AVX-512F alone is no x86-64-v4
    assert isa.choose_isa(frozenset(), ALL) == "baseline"  # no /proc/cpuinfo
    assert isa.choose_isa(flags(V4), ("baseline",)) == "baseline"  # a build without variants (e.g. aarch64)
    assert isa.choose_isa(flags(V4), ("baseline", "avx2")) == "avx2"  # the compiler refused x86-64-v4


def test_pytorch_capability_caps_the_choice():
    assert isa.choose_isa(flags(V4), ALL, "AVX512") == "avx2"
    assert isa.choose_isa(flags(V4), ALL, "AVX2") == "avx2"  # ATEN_CPU_CAPABILITY=avx2
    assert isa.choose_isa(flags(V4), ALL, "DEFAULT") == "baseline"
    assert isa.choose_isa(flags(V3), ALL, "AVX512") == "avx2"  # the cap never adds what the CPU lacks
    assert isa.choose_isa(flags(V4), ALL, "SVE256") == "avx2"  # an unknown capability caps nothing


def test_a_forced_variant_wins_or_is_refused_clearly():
    assert isa.choose_isa(flags(V4), ALL, "AVX512", forced="baseline") == "baseline"
    assert isa.choose_isa(flags(V4), ALL, "DEFAULT", forced=" AVX2 ") == "avx2"  # forcing ignores the cap
    assert isa.choose_isa(flags(V4), ALL, forced="auto") == "avx2"
    assert isa.choose_isa(flags(V4), ALL, forced="avx512") == "avx512"  # AVX-512 on request
    with pytest.raises(ValueError, match=r"MEGACANN_CPU_ISA='sse9': expected one of"):
        isa.choose_isa(flags(V4), ALL, forced="sse9")
    with pytest.raises(ValueError, match=r"MEGACANN_CPU_ISA=avx512: this CPU lacks avx512bw, avx512cd"):
        isa.choose_isa(flags(V3 + " avx512f"), ALL, forced="avx512")
    with pytest.raises(ValueError, match=r"MEGACANN_CPU_ISA=avx2: this build .* has only \('baseline',\)"):
        isa.choose_isa(flags(V4), ("baseline",), forced="avx2")


def test_variants_are_built_on_x86_64_only_and_not_beside_a_tuned_build(monkeypatch):
    monkeypatch.delenv("MEGACANN_CPU_ARCH", raising=False)
    monkeypatch.delenv("MEGACANN_CPP_NATIVE", raising=False)
    monkeypatch.delenv("MEGACANN_CPP_ISA_BUILD", raising=False)
    monkeypatch.setattr(extension.platform, "machine", lambda: "x86_64")
    assert list(extension.isa_variants()) == ["avx2", "avx512"]
    command = extension.isa_compile_command("c++", "kernels_isa.cpp", "k.o", "avx2")
    assert "-march=x86-64-v3" in command and "-DMEGACANN_ISA=avx2" in command and "-fPIC" in command
    monkeypatch.setenv("MEGACANN_CPU_ARCH", "x86-64-v3")
    assert extension.isa_variants() == {}
    monkeypatch.delenv("MEGACANN_CPU_ARCH")
    monkeypatch.setattr(extension.platform, "machine", lambda: "aarch64")
    assert extension.isa_variants() == {}


needs_kernels = pytest.mark.skipif(not cpp.available(), reason="megacann C++ kernels unavailable (no compiler?)")
GEN = torch.Generator().manual_seed(0)


def wide_cases():
    """(kernel, reference, leaves, args) with last dims of 16k + tail lanes for every vector width."""
    r = lambda *s: torch.randn(*s, generator=GEN, dtype=torch.float64)  # noqa: E731
    angles = r(1, 11, 38)
    table = torch.cat((angles, angles), -1)
    target = torch.randint(0, 203, (9,), generator=GEN)
    target[::4] = -100
    return {
        "rms_norm": (cpp.rms_norm, reference.rms_norm, [r(9, 71), r(71).abs() + 0.5], lambda t: [*t, 1e-6]),
        "apply_rotary": (
            cpp.apply_rotary,
            reference.apply_rotary,
            [r(2, 11, 3, 76)],
            lambda t: [t[0], table.cos().float(), table.sin().float()],
        ),  # fmt: skip
        "swiglu": (cpp.swiglu, reference.swiglu, [r(9, 2 * 37)], list),
        "cross_entropy": (cpp.cross_entropy, reference.cross_entropy, [r(9, 203) * 3], lambda t: [t[0], target]),
    }


def forward_backward(fn, leaves, args, dtype):
    leaves = [leaf.detach().to(dtype).requires_grad_() for leaf in leaves]
    out = fn(*args(leaves))
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return [out.detach().double(), *(leaf.grad.double() for leaf in leaves)]


# the variants this build holds and this CPU runs (a skip of the others would fail CI's strict skips)
HERE = isa.built_variants() if cpp.available() else ()


@needs_kernels
@pytest.mark.parametrize("variant", HERE)
def test_each_variant_matches_the_reference(variant):
    for name, (kernel, ref, leaves, args) in wide_cases().items():
        with isa.use(variant):
            assert isa.current() == variant
            mine32 = forward_backward(kernel, leaves, args, torch.float32)
            mine16 = forward_backward(kernel, leaves, args, torch.bfloat16)
        ref32 = forward_backward(ref, leaves, args, torch.float32)
        truth = forward_backward(ref, leaves, args, torch.float64)
        ref16 = forward_backward(ref, leaves, args, torch.bfloat16)
        for i, (a, b) in enumerate(zip(mine32, ref32)):
            assert rel_err(a, b) < 1e-5, (name, variant, i)
        for i, (a, b, t) in enumerate(zip(mine16, ref16, truth)):
            assert rel_err(a, t) <= 1.25 * rel_err(b, t) + 1e-3, (name, variant, i)


@needs_kernels
def test_the_environment_forces_a_variant(monkeypatch):
    before = isa.current()
    try:
        monkeypatch.setenv(isa.ISA_ENV, "baseline")
        assert isa.select() == "baseline" == isa.current()
        monkeypatch.setenv(isa.ISA_ENV, "sse9")
        with pytest.raises(ValueError, match="MEGACANN_CPU_ISA='sse9'"):
            isa.select()
    finally:
        isa.set_isa(before)
    with pytest.raises(ValueError, match="kernel variant 'sse9'"):
        isa.set_isa("sse9")
