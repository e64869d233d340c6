#!/usr/bin/env bash
# Launch megacann pretraining under torchrun (one process per device).
#
#   bash scripts/run_pretrain.sh --config R.yaml [--nproc_per_node N]
#        [--nnodes N --node_rank R --master_addr A --master_port P]
#        [--resume_from DIR|latest] [--dry_run] [section.key=value ...]
#
# Overrides are forwarded to megacann-train. PYTHON selects the interpreter (default: python3).
set -euo pipefail

CONFIG=""
NPROC=1
NNODES=1
NODE_RANK=0
MASTER_ADDR=127.0.0.1
MASTER_PORT=""
FORWARD=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || { echo "run_pretrain.sh: $1 needs a value" >&2; exit 2; }; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) need_value "$@"; CONFIG=$2; shift 2 ;;
    --nproc_per_node) need_value "$@"; NPROC=$2; shift 2 ;;
    --nnodes) need_value "$@"; NNODES=$2; shift 2 ;;
    --node_rank) need_value "$@"; NODE_RANK=$2; shift 2 ;;
    --master_addr) need_value "$@"; MASTER_ADDR=$2; shift 2 ;;
    --master_port) need_value "$@"; MASTER_PORT=$2; shift 2 ;;
    --resume_from) need_value "$@"; FORWARD+=(--resume_from "$2"); shift 2 ;;
    --dry_run) FORWARD+=(--dry_run); shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) FORWARD+=("$1"); shift ;;
  esac
done

[[ -n "$CONFIG" ]] || { echo "run_pretrain.sh: --config R.yaml is required" >&2; exit 2; }
[[ -f "$CONFIG" ]] || { echo "run_pretrain.sh: recipe not found: $CONFIG" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
# Run from the repository root so that recipes' relative paths and `-m megacann.train` resolve.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

LAUNCH=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --nnodes "$NNODES")
if [[ "$NNODES" == "1" && -z "$MASTER_PORT" ]]; then
  LAUNCH+=(--standalone)
else
  LAUNCH+=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}")
fi
set -x
exec "${LAUNCH[@]}" -m megacann.train --config "$CONFIG" "${FORWARD[@]}"
