"""The CPU benchmark of the training issue: megacann vs transformers' LlamaForCausalLM on a d512 x 8-layer
LLaMA, seq 512, micro-batch 8, fp32 and bf16, same threads, alternating runs. Goal: megacann >= 1.3x.

    python benchmarks/cpu_train_step.py [--steps 3 --rounds 2 --threads N]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_vs_transformers import main  # noqa: E402

if __name__ == "__main__":
    main(["--preset", "cpu", "--device", "cpu", *sys.argv[1:]])
