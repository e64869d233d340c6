# Environment defaults for Ascend 910B NPUs (source it; every value can be set beforehand to override it).
# CANN's own environment first, when the toolkit sits in its usual place (or under ASCEND_TOOLKIT_HOME).
_cann_env="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}/set_env.sh"
if [[ -f "$_cann_env" ]]; then
  _nounset=$([[ $- == *u* ]] && echo 1 || true)
  set +u  # CANN's script reads variables that may be unset
  # shellcheck disable=SC1090
  source "$_cann_env"
  if [[ -n "$_nounset" ]]; then set -u; fi
  unset _nounset
fi
unset _cann_env
: "${HCCL_CONNECT_TIMEOUT:=1200}"   # s to set up links between devices (CANN default 120): big jobs start unevenly
: "${HCCL_EXEC_TIMEOUT:=1800}"      # s a collective waits for its peers; keep distributed.timeout_minutes above it
: "${PYTORCH_NPU_ALLOC_CONF:=expandable_segments:True}"  # less fragmentation of device memory
: "${TASK_QUEUE_ENABLE:=1}"         # torch_npu queues operator launches on a separate thread
export HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT PYTORCH_NPU_ALLOC_CONF TASK_QUEUE_ENABLE
