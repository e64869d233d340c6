#!/usr/bin/env python3
"""Pretrain a GPT model from a recipe; one process per device under torchrun.

    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --config examples/configs/gpt/tiny.yaml [section.key=value ...]

The recipe says everything (model size, data, optimizer, parallel layout); this script checks that it
describes a GPT model and hands it to the trainer.
"""

import sys

from megacann.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:], expected_model_type="gpt"))
