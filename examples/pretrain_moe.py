#!/usr/bin/env python3
"""Pretrain a mixture-of-experts model from a recipe; one process per device under torchrun.

    torchrun --nproc_per_node 2 examples/pretrain_moe.py --config examples/configs/moe/tiny.yaml \
        distributed.expert_parallel_size=2 [section.key=value ...]

The recipe says everything (experts, routing, balancing, data, optimizer, parallel layout including
expert parallelism); this script checks that it describes an MoE model and hands it to the trainer.
"""

import sys

from megacann.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:], expected_model_type="moe"))
