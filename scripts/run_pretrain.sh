#!/usr/bin/env bash
# Check a recipe, then launch megacann pretraining under torchrun (one process per device).
#
#   bash scripts/run_pretrain.sh --config R.yaml [--nproc_per_node N]
#        [--nnodes N --node_rank R --master_addr A --master_port P | --nnodes N --rdzv_endpoint HOST:PORT --rdzv_id ID]
#        [--resume_from DIR|latest] [--max_restarts K] [--dry_run] [--print_only] [section.key=value ...]
#
# --nproc_per_node defaults to this node's device count (NPUs, else CUDA GPUs; 1 process on CPU). The recipe
# and overrides are validated here, once, for the world size about to start: a config error is one message
# and exit code 2. --print_only prints the platform environment and the torchrun command and starts nothing.
# PYTHON selects the interpreter (default: python3), which must have megacann installed (`make venv`, or
# `pip install -e .`). Per-cluster wrappers: scripts/clusters/.
set -euo pipefail

case "${1:-}" in -h|--help) sed -n '2,12p' "$0"; exit 0 ;; esac
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import megacann" 2>/dev/null; then
    echo "run_pretrain.sh: error: megacann is not installed for $PYTHON: run 'make venv' and 'source .venv/bin/activate' (or 'pip install -e .' in the repository), or set PYTHON to an interpreter that has it" >&2
    exit 2
fi
exec "$PYTHON" -m megacann.launch "$@"
