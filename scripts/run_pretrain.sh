#!/usr/bin/env bash
# Check a recipe, then launch megacann pretraining under torchrun (one process per device).
#
#   bash scripts/run_pretrain.sh --config R.yaml [--nproc_per_node N]
#        [--nnodes N --node_rank R --master_addr A --master_port P | --nnodes N --rdzv_endpoint HOST:PORT --rdzv_id ID]
#        [--resume_from DIR|latest] [--dry_run] [--print_only] [section.key=value ...]
#
# --nproc_per_node defaults to this node's device count (NPUs, else CUDA GPUs; 1 process on CPU). The recipe
# and overrides are validated here, once, for the world size about to start: a config error is one message
# and exit code 2. --print_only prints the platform environment and the torchrun command and starts nothing.
# PYTHON selects the interpreter (default: python3). Per-cluster wrappers: scripts/clusters/.
set -euo pipefail

case "${1:-}" in -h|--help) sed -n '2,13p' "$0"; exit 0 ;; esac
PYTHON=${PYTHON:-python3}
# Recipes' relative paths and `-m megacann.train` resolve from the repository, installed or not.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megacann.launch "$@"
