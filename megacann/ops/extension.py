"""Load megacann's C++ CPU kernels (``csrc/``): the build made at install, else a build on first use.

Order: ``megacann._C`` (compiled by ``pip install`` when torch and a C++ compiler were present), then a
just-in-time build of the sources with ``torch.utils.cpp_extension.load`` (cached under
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, in a folder named after this CPU, the
torch version and the flags, so a shared cache never hands one CPU's build to another; later processes
only load the library). When neither works, the PyTorch reference ops run and one log line says why.

Both builds are portable by default: no ``-march``, so the library runs on any CPU of the architecture
(a binary tuned for one CPU dies with SIGILL on an older one, which is no ImportError and so nothing
falls back). On x86-64 the loops of ``csrc/kernels_isa.cpp`` are compiled twice more, for x86-64-v3
(AVX2 + FMA) and x86-64-v4 (AVX-512), into objects linked into the same library; the best variant this
CPU runs is chosen at load (:mod:`megacann.ops.isa`). That file includes no torch, so the extra builds
take seconds. ``MEGACANN_CPP_NATIVE=1`` tunes the whole build for the building CPU (``-march=native``,
512-bit vectors where it has them) and ``MEGACANN_CPU_ARCH`` names a target instead (e.g.
``x86-64-v3``); both build no variants.

``MEGACANN_CPP``: ``auto`` (default, the order above), ``jit`` (skip the installed build), ``off`` (never
load: reference ops only).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Optional

logger = logging.getLogger("megacann.ops")

SOURCES = (
    "ops.cpp",
    "isa.cpp",
    "kernels_isa.cpp",
    "rms_norm.cpp",
    "rotary.cpp",
    "swiglu.cpp",
    "cross_entropy.cpp",
    "moe.cpp",
    "decode_attention.cpp",
)
HEADERS = ("common.h", "kernels.h")
ISA_SOURCE = "kernels_isa.cpp"
# the kernel variants beyond the baseline, by the name megacann.ops.isa knows them by: their -march flags
ISA_VARIANT_FLAGS = {
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
}
JIT_NAME = "megacann_C"
MODES = ("auto", "jit", "off")


def target_arch() -> Optional[str]:
    """The ``-march`` to build for: ``MEGACANN_CPU_ARCH`` if set, ``native`` with ``MEGACANN_CPP_NATIVE=1``,
    else None (the compiler's portable baseline)."""
    arch = os.environ.get("MEGACANN_CPU_ARCH", "").strip()
    if arch:
        return arch
    return "native" if os.environ.get("MEGACANN_CPP_NATIVE", "0").strip() == "1" else None


def compile_flags() -> list[str]:
    """C++ flags for both builds: -O3 without debug info, OpenMP (ATen's parallel_for), `omp simd`
    reductions, no floating-point contraction (so fp32 results match PyTorch's), no FP-trap semantics
    (lets GCC vectorise selects); an instruction set beyond the baseline only when asked (:func:`target_arch`)."""
    flags = ["-O3", "-g0", "-fopenmp", "-fopenmp-simd", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]
    arch = target_arch()
    if arch:
        flags.append(f"-march={arch}")
        if platform.machine().lower() in ("x86_64", "amd64"):
            flags.append("-mprefer-vector-width=512")  # full-width AVX-512 where the target has it
    return flags


def isa_variants() -> dict[str, list[str]]:
    """The kernel variants to build beside the baseline: on x86-64 AVX2 and AVX-512 unless
    ``MEGACANN_CPU_ARCH`` / ``MEGACANN_CPP_NATIVE`` tune the whole build (then none); ``MEGACANN_CPP_ISA_BUILD=0``
    builds none."""
    if platform.machine().lower() not in ("x86_64", "amd64") or target_arch() is not None:
        return {}
    if os.environ.get("MEGACANN_CPP_ISA_BUILD", "1").strip() == "0":
        return {}
    return dict(ISA_VARIANT_FLAGS)


def isa_define(variant: str) -> str:
    """The macro telling csrc/isa.cpp that ``variant`` is linked in."""
    return f"-DMEGACANN_HAVE_ISA_{variant.upper()}"


def isa_compile_command(compiler: str, source: str, obj: str, variant: str) -> list[str]:
    """The command compiling ``kernels_isa.cpp`` for one variant into a position-independent object."""
    base = [flag for flag in compile_flags() if flag != "-fopenmp"]  # loops only: no OpenMP runtime
    return [compiler, "-std=c++17", "-c", "-fPIC", *base, *ISA_VARIANT_FLAGS[variant],
            f"-DMEGACANN_ISA={variant}", source, "-o", obj]  # fmt: skip


def build_isa_objects(sources: Path, out_dir: Path, compiler: Optional[str] = None) -> dict[str, Path]:
    """Compile the variants of :func:`isa_variants` into ``out_dir`` (concurrently; an object newer than its
    sources is kept); returns those that built. A variant the compiler refuses is left out with one log line:
    the library then runs the baseline loops there."""
    import subprocess

    compiler = compiler or os.environ.get("CXX", "c++")
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = [sources / ISA_SOURCE, sources / "kernels.h"]
    newest = max(p.stat().st_mtime for p in inputs)
    jobs = {}
    for variant in isa_variants():
        obj = out_dir / f"kernels_{variant}.o"
        if obj.is_file() and obj.stat().st_mtime >= newest:
            jobs[variant] = (obj, None)
            continue
        command = isa_compile_command(compiler, str(sources / ISA_SOURCE), str(obj), variant)
        jobs[variant] = (obj, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    built = {}
    for variant, (obj, proc) in jobs.items():
        if proc is not None:
            output, _ = proc.communicate()
            if proc.returncode != 0:
                first = output.strip().splitlines()[0] if output.strip() else f"exit {proc.returncode}"
                logger.warning("megacann: %s kernel variant not built (%s)", variant, first)
                continue
        built[variant] = obj
    return built


def cpu_identity(cpuinfo: Optional[str] = None) -> str:
    """The machine architecture, CPU model and feature flags (from ``/proc/cpuinfo`` where it exists):
    what decides whether a compiled library runs here."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    wanted = ("model name", "flags", "features", "cpu implementer", "cpu architecture", "cpu part", "isa")
    seen: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first core's values (all cores of one machine share a build)
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in wanted and key not in seen:
            seen[key] = " ".join(sorted(value.split())) if key in ("flags", "features", "isa") else value.strip()
    fields = [platform.machine(), platform.processor()] + [f"{k}={seen[k]}" for k in sorted(seen)]
    return "\n".join(fields)


def jit_name(cpuinfo: Optional[str] = None) -> str:
    """The JIT build's name (and so its cache folder): ``megacann_C_`` and a hash of the CPU
    (:func:`cpu_identity`), the torch version and the compile flags."""
    import torch

    key = "\n".join([cpu_identity(cpuinfo), torch.__version__, " ".join(compile_flags()), *isa_variants()])
    return f"{JIT_NAME}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


LINK_FLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def source_dir() -> Optional[Path]:
    """``csrc/`` of a source checkout, or the copy installed beside the package (``megacann/csrc``)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "csrc", package / "csrc"):
        if all((candidate / name).is_file() for name in SOURCES + HEADERS):
            return candidate
    return None


def _import_installed() -> bool:
    try:
        importlib.import_module("megacann._C")
        return True
    except ImportError:  # not built at install, or built against another torch
        return False


def _build_jit() -> None:
    """Compile and load the kernels now; raises with the reason when that is not possible."""
    sources = source_dir()
    if sources is None:
        raise RuntimeError("the csrc/ sources are not installed")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler found (CXX={compiler})")
    from torch.utils.cpp_extension import get_default_build_root, load

    logger.info("building megacann C++ kernels from %s (first use; cached afterwards)", sources)
    name = jit_name()
    build_dir = Path(get_default_build_root()) / name
    variants = build_isa_objects(sources, build_dir / "isa", compiler)
    load(
        name=name,
        sources=[str(sources / source) for source in SOURCES],
        extra_cflags=compile_flags() + [isa_define(v) for v in variants],
        extra_ldflags=LINK_FLAGS + [str(obj) for obj in variants.values()],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


def load() -> bool:
    """True when the ``torch.ops.megacann`` kernels are registered in this process. The first call does
    the work; a failure is logged once (one line) and remembered."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        mode = os.environ.get("MEGACANN_CPP", "auto").strip().lower()
        if mode not in MODES:
            raise ValueError(f"MEGACANN_CPP={mode!r}; expected one of {MODES}")
        ok, reason = False, "MEGACANN_CPP=off"
        if mode == "auto" and _import_installed():
            ok = True
        elif mode != "off":
            try:
                _build_jit()
                ok = True
            except Exception as err:  # a missing compiler or a failed build must never break the caller
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not ok:
            level = logging.INFO if mode == "off" else logging.WARNING
            logger.log(level, "megacann: C++ CPU kernels unavailable (%s); using the PyTorch reference ops", reason)
        _state["ok"] = ok
        return ok
