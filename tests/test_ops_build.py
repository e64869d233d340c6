"""Safe builds of the C++ kernels: portable flags unless native tuning is asked for, and a JIT cache
folder that is never shared between different CPUs (or torch versions, or flags)."""

from __future__ import annotations

import pytest

from megacann.ops import extension

XEON = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse2 avx2 avx512f\n"
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\nflags\t\t: fpu sse2 avx2\n"


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("MEGACANN_CPP_NATIVE", raising=False)
    monkeypatch.delenv("MEGACANN_CPU_ARCH", raising=False)
    return monkeypatch


def test_portable_by_default(clean_env):
    flags = extension.compile_flags()
    assert "-O3" in flags and not any(f.startswith(("-march", "-mtune", "-mprefer-vector-width")) for f in flags)
    assert extension.target_arch() is None
    clean_env.setenv("MEGACANN_CPP_NATIVE", "0")
    assert extension.compile_flags() == flags


def test_native_and_named_targets_are_opt_in(clean_env):
    clean_env.setenv("MEGACANN_CPP_NATIVE", "1")
    assert "-march=native" in extension.compile_flags()
    clean_env.setenv("MEGACANN_CPU_ARCH", "x86-64-v3")  # a named target wins over native
    assert "-march=x86-64-v3" in extension.compile_flags() and "-march=native" not in extension.compile_flags()


def test_the_jit_cache_is_keyed_by_cpu_and_flags(clean_env):
    xeon = extension.jit_name(XEON)
    assert xeon.startswith(extension.JIT_NAME + "_") and xeon.isidentifier()
    assert xeon == extension.jit_name(XEON.replace("avx2 avx512f", "avx512f  avx2"))  # flag order is no CPU
    assert extension.jit_name(EPYC) != xeon
    assert extension.jit_name(XEON.replace(" avx512f", "")) != xeon  # same model name, fewer features
    clean_env.setenv("MEGACANN_CPP_NATIVE", "1")
    assert extension.jit_name(XEON) != xeon  # native and portable builds never share a folder
    assert "model name=AMD EPYC 7763" in extension.cpu_identity(EPYC)
