"""The file names of every weights directory megacann reads or writes, each defined once.

Names a checkpoint writes itself (``megacann.json``, ``config.yaml``, ``latest``, ``COMPLETE``) belong to
:mod:`megacann.checkpoint`, and the tokenizer's (``tokenizer/``, ``generation_config.json``) to
:mod:`megacann.data.tokenizer_files`; they are named here again only by import, so that interop code finds
all of them in one place.
"""

from __future__ import annotations

from megacann.checkpoint.files import LATEST_FILE
from megacann.checkpoint.metadata import DCP_METADATA, INFO_FILE, RECIPE_FILE
from megacann.data.tokenizer_files import GENERATION_CONFIG_FILE, TOKENIZER_DIR

WEIGHTS_FILE = "model.safetensors"  # a consolidated or Hugging Face directory's weights, in one file
SAFETENSORS_INDEX = "model.safetensors.index.json"  # a sharded Hugging Face directory's weight map
CONSOLIDATED_CONFIG = "model_config.json"  # a consolidated directory's model settings (megacann names)
HF_CONFIG = "config.json"  # a Hugging Face directory's model settings
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter's settings
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a PEFT adapter's tensors

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "CONSOLIDATED_CONFIG",
    "DCP_METADATA",
    "GENERATION_CONFIG_FILE",
    "HF_CONFIG",
    "INFO_FILE",
    "LATEST_FILE",
    "RECIPE_FILE",
    "SAFETENSORS_INDEX",
    "TOKENIZER_DIR",
    "WEIGHTS_FILE",
]
