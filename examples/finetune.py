#!/usr/bin/env python3
"""Fine-tune a model from a recipe (``train_mode: sft`` is forced); one process per device under torchrun.

    python examples/finetune.py --config examples/configs/llama/sft_tiny.yaml model.init_from=output/base
    python examples/finetune.py --config examples/configs/llama/sft_tiny.yaml model.init_from=... lora=true
    torchrun --nproc_per_node 2 examples/finetune.py --config ... distributed.tensor_parallel_size=2

The recipe names the instruction data (JSONL, docs/data.md), the weights to start from (``model.init_from``:
a megacann checkpoint or output directory, a consolidated directory or a Hugging Face directory) and,
with ``lora: true``, the adapters; this script hands it to the trainer as a fine-tuning run. See
docs/finetuning.md.
"""

import sys

from megacann.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main([*sys.argv[1:], "train_mode=sft"]))
