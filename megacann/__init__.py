"""megacann: Megatron-style model-parallel training of large language models on NPUs, GPUs and CPUs.

``import megacann`` is light: it loads no optional package (torch_npu, wandb, tensorboard, transformers).
Users import the parts they need, e.g. ``from megacann.layers import ColumnParallelLinear``.
"""

__version__ = "0.1.0"
