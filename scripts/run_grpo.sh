#!/usr/bin/env bash
# Check a GRPO recipe, then launch megacann reinforcement learning on rollouts under torchrun (one process
# per device).
#
#   bash scripts/run_grpo.sh --config R.yaml [--nproc_per_node N] [--resume_from DIR|latest] [--dry_run]
#        [--print_only] [model.init_from=DIR] [rl.group_size=8 rl.reward=exact_match ...]
#
# The same launcher as scripts/run_pretrain.sh (every option there works here) with train_mode=grpo forced:
# a prompts JSONL (rl.prompts), a reward (rl.reward), rollouts sampled by the training model itself, the
# GRPO defaults for what the recipe leaves unset (optim.lr 1e-6, optim.warmup_ratio 0). See docs/rl.md.
set -euo pipefail

case "${1:-}" in -h|--help) sed -n '2,10p' "$0"; exit 0 ;; esac
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megacann.launch "$@" train_mode=grpo
