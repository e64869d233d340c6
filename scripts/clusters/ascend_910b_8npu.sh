#!/usr/bin/env bash
# One Ascend 910B node with 8 NPUs (add --nnodes/--node_rank/--master_addr on each node for several).
#   bash scripts/clusters/ascend_910b_8npu.sh --config R.yaml [run_pretrain.sh options] [section.key=value ...]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC1091
source "$HERE/env_ascend_910b.sh"
exec bash "$HERE/../run_pretrain.sh" "$@"
