# Environment defaults for NVIDIA GPU nodes (source it; every value can be set beforehand to override it).
: "${NCCL_DEBUG:=WARN}"                       # NCCL's own warnings, not its chatter
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"     # on a failed or timed-out collective: abort NCCL, then end the process
: "${PYTORCH_CUDA_ALLOC_CONF:=expandable_segments:True}"  # less fragmentation of device memory
export NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING PYTORCH_CUDA_ALLOC_CONF
# Several nodes: NCCL picks a network by itself; pin it when it picks wrong, e.g.
#   export NCCL_SOCKET_IFNAME=eth0 NCCL_IB_HCA=mlx5
