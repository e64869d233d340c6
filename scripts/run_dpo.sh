#!/usr/bin/env bash
# Check a DPO recipe, then launch megacann preference optimisation under torchrun (one process per device).
#
#   bash scripts/run_dpo.sh --config R.yaml [--nproc_per_node N] [--resume_from DIR|latest] [--dry_run]
#        [--print_only] [model.init_from=DIR] [lora=true ...] [dpo.beta=0.1 dpo.loss_type=sigmoid ...]
#
# The same launcher as scripts/run_pretrain.sh (every option there works here) with train_mode=dpo forced:
# JSONL preference pairs (prompt, chosen, rejected), a reference policy (dpo.reference), the DPO defaults
# for what the recipe leaves unset (optim.lr 1e-6, optim.warmup_ratio 0.1). See docs/finetuning.md.
set -euo pipefail

case "${1:-}" in -h|--help) sed -n '2,9p' "$0"; exit 0 ;; esac
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megacann.launch "$@" train_mode=dpo
