"""Packaging for megacann. C++ kernels in csrc/ are added here when the fused-op registry lands."""

from setuptools import find_packages, setup

setup(
    name="megacann",
    version="0.1.0",
    description="Megatron-style model-parallel LLM training for Ascend NPUs, CUDA GPUs and CPUs",
    packages=find_packages(include=["megacann", "megacann.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.1",
        "numpy",
        "pyyaml",
        "einops",
        "regex",
        "tokenizers>=0.15",
        "safetensors",
    ],
    extras_require={
        "npu": ["torch_npu"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "dev": [
            "pytest",
            "transformers>=4.40",
            "peft>=0.10",
            "ruff",
            "matplotlib",
            "sentencepiece",
            "wandb",
            "tensorboard",
        ],
    },
    entry_points={
        "console_scripts": [
            "megacann-train=megacann.cli:train_main",
            "megacann-preprocess=megacann.data.preprocess:main",
            "megacann-convert=megacann.convert:main",
            "megacann-plan=megacann.cli:plan_main",
        ],
    },
)
