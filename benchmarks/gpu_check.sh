#!/usr/bin/env bash
# One device call's worth of GPU checks (CUDA), about 9 minutes in all, inside the 10-minute limit of one
# command (give the call timeout_s 590):
#   1. speed (~7 min): benchmarks/gpu_train_step.py, megacann's trainer step (compiled blocks and eager) at
#      the 1.1B and 125M shapes beside the comparison rows of the git-ignored .devbench/ aids (copy
#      anchor_gpu.py and limit_gpu.py there before the call; never commit them), in priority order within
#      its budget; the JSON, every row's log and the aids' own JSON land in $OUT;
#   2. the CUDA-only tests (~1 min);
#   3. the tiny recipe through the launcher on CUDA in bf16 with compiled blocks (last: cut short if time is out).
#   bash benchmarks/gpu_check.sh        (OUT defaults to /tmp/megacann-gpu-check)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MEGACANN_CACHE=${MEGACANN_CACHE:-/tmp/mc}
export OUT=${OUT:-/tmp/megacann-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
ls .devbench 2>/dev/null | sed 's/^/devbench: /'
echo "== speed: megacann vs transformers vs a hand-written LLaMA (1.1B, then 125M)"
timeout 440 python3 benchmarks/gpu_train_step.py --budget-s 420 --out "$OUT/gpu_train_step_cuda.json" \
  --log-dir "$OUT/rows" 2>&1 | grep -v "^{" | tail -25
echo "== CUDA-only tests"
timeout 75 python3 -m pytest -q -p no:cacheprovider -x tests/test_layers_cuda.py tests/test_checkpoint_cuda.py 2>&1 | tail -6
echo "== tiny recipe on CUDA, bf16, compiled blocks"
MEGACANN_DEVICE=cuda timeout 60 bash scripts/run_pretrain.sh --config examples/configs/llama/tiny.yaml \
  model.precision=bf16 precision.compile=true optim.max_steps=30 "experiment.output_dir=$OUT/tiny" \
  logging.ckpt_interval=0 logging.log_interval=10 2>&1 | grep -v "^+" | grep -E "step (1|10|20|30)/|first|Error|error" | head -12
