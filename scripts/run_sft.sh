#!/usr/bin/env bash
# Check an SFT recipe, then launch megacann fine-tuning under torchrun (one process per device).
#
#   bash scripts/run_sft.sh --config R.yaml [--nproc_per_node N] [--resume_from DIR|latest] [--dry_run]
#        [--print_only] [model.init_from=DIR] [lora=true lora_rank=8 ...] [section.key=value ...]
#
# The same launcher as scripts/run_pretrain.sh (every option there works here) with train_mode=sft forced:
# JSONL instruction data whose loss counts only the answers, the SFT defaults for what the recipe leaves
# unset (optim.lr 1e-5, optim.warmup_ratio 0.05), weights from model.init_from. See docs/finetuning.md.
set -euo pipefail

case "${1:-}" in -h|--help) sed -n '2,9p' "$0"; exit 0 ;; esac
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megacann.launch "$@" train_mode=sft
