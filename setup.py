"""Packaging for megacann, with the optional C++ CPU kernels of csrc/.

The kernels (``megacann._C``) are compiled here when torch and a C++ compiler are available; if not, or if
the build fails, the install goes on without them and megacann builds them on first use (or runs the
PyTorch reference ops). ``MEGACANN_BUILD_CPP=0`` skips the build. The sources are also installed as
``megacann/csrc`` so a wheel install can build them later. The build is portable (no ``-march``) unless
``MEGACANN_CPP_NATIVE=1`` or ``MEGACANN_CPU_ARCH`` asks for more (see megacann/ops/extension.py): a
wheel may run on another CPU than the one that built it. On x86-64 the kernel loops are compiled also for
AVX2 and AVX-512 and linked into the same library, which picks the variant the CPU runs at import.

pip builds in an isolated environment without torch; to compile against the torch that will load the
kernels, this script looks for torch in the target environment's site-packages too.
"""

import importlib.util
import os
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

CSRC = "csrc"


def _load_extension_module():
    """megacann/ops/extension.py on its own (stdlib only): the source list and flags the JIT build uses too."""
    spec = importlib.util.spec_from_file_location(
        "_megacann_extension", os.path.join("megacann", "ops", "extension.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXT = _load_extension_module()


def _cpp_extension():
    """torch.utils.cpp_extension, from the build environment or the target environment, or None."""
    for extra in ([], [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        sys.path.extend(p for p in extra if p not in sys.path)
        try:
            from torch.utils import cpp_extension

            return cpp_extension
        except Exception:
            continue
    return None


class BuildPyWithSources(build_py):
    """Install csrc/ inside the package (megacann/csrc) for builds on first use."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "megacann", CSRC)
        os.makedirs(target, exist_ok=True)
        for name in EXT.SOURCES + EXT.HEADERS:
            shutil.copy2(os.path.join(CSRC, name), target)


def _extension_setup():
    """(ext_modules, cmdclass) building megacann._C, or no extension when that is not possible here."""
    cmdclass = {"build_py": BuildPyWithSources}
    if os.environ.get("MEGACANN_BUILD_CPP", "1") == "0":
        return [], cmdclass
    cpp_extension = _cpp_extension()
    compiler = os.environ.get("CXX", "c++")
    if cpp_extension is None or shutil.which(compiler) is None:
        print("megacann: torch or a C++ compiler is missing; C++ kernels will be built on first use", file=sys.stderr)
        return [], cmdclass

    class OptionalBuildExt(cpp_extension.BuildExtension):
        def build_extensions(self):
            # the x86-64 kernel variants (AVX2, AVX-512) of csrc/kernels_isa.cpp, linked into megacann._C
            from pathlib import Path

            variants = EXT.build_isa_objects(Path(CSRC), Path(self.build_temp) / "isa", compiler)
            for ext in self.extensions:
                ext.extra_objects = list(ext.extra_objects or []) + [str(obj) for obj in variants.values()]
                ext.extra_compile_args = list(ext.extra_compile_args) + [EXT.isa_define(v) for v in variants]
            super().build_extensions()

        def run(self):
            try:
                super().run()
            except Exception as err:  # never fail the install over the optional kernels
                print(f"megacann: C++ kernels not built ({err}); they will be built on first use", file=sys.stderr)

    extension = cpp_extension.CppExtension(
        "megacann._C",
        [os.path.join(CSRC, name) for name in EXT.SOURCES],
        extra_compile_args=EXT.compile_flags(),
        extra_link_args=EXT.LINK_FLAGS,
    )
    cmdclass["build_ext"] = OptionalBuildExt.with_options(use_ninja=shutil.which("ninja") is not None)
    return [extension], cmdclass


ext_modules, cmdclass = _extension_setup()

setup(
    name="megacann",
    version="0.1.0",
    description="Megatron-style model-parallel LLM training for Ascend NPUs, CUDA GPUs and CPUs",
    packages=find_packages(include=["megacann", "megacann.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
    install_requires=[
        # 2.7: dcp.save/dcp.load take no_dist (the checkpointer's single-process path); the ops' fake and
        # autograd registrations (torch.library.register_fake / register_autograd) need 2.4
        "torch>=2.7",
        "numpy",
        "pyyaml",
        "einops",
        "tokenizers>=0.15",
        "safetensors",
    ],
    extras_require={
        "npu": ["torch_npu"],
        "fla": ["fla-core"],  # flash-linear-attention: Gated DeltaNet's CUDA kernels
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "math": ["math-verify"],  # rl.reward math: mathematical answers checked symbolically
        "eval": ["lm-eval"],  # lm-evaluation-harness: the megacann model adapter (megacann.evaluation)
        "dev": [
            "pytest",
            "hypothesis",
            "transformers>=4.40",
            "peft>=0.10",
            "ruff",
            "matplotlib",
            "sentencepiece",
            "wandb",
            "tensorboard",
            "math-verify",
            "lm-eval",
            "trl",  # benchmarks/grpo_vs_trl.py only (imported there, lazily)
        ],
    },
    entry_points={
        "console_scripts": [
            "megacann-train=megacann.cli:train_main",
            "megacann-preprocess=megacann.data.preprocess:main",
            "megacann-convert=megacann.convert:main",
            "megacann-plan=megacann.cli:plan_main",
            "megacann-generate=megacann.generate:main",
        ],
    },
)
