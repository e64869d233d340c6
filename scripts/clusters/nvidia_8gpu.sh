#!/usr/bin/env bash
# One node with 8 NVIDIA GPUs (add --nnodes/--node_rank/--master_addr on each node for several).
#   bash scripts/clusters/nvidia_8gpu.sh --config R.yaml [run_pretrain.sh options] [section.key=value ...]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC1091
source "$HERE/env_nvidia_gpu.sh"
exec bash "$HERE/../run_pretrain.sh" "$@"
