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
# A second device call, `bash benchmarks/gpu_check.sh fp8` (budgeted at 9 minutes, timeout_s 590), runs only the FP8
# lines: the 1.1B trainer step in bf16 and with each precision.fp8 recipe, compiled blocks then eager, each
# row in a process of its own (a row that fails shows its error in the table and costs the others nothing).
# tensorwise / rowwise multiply by torch._scaled_mm, blockwise / mxfp8 by the reference products
# (dequantise, fp32 GEMM), so those two measure the cost of the numerics, not FP8 speed.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MEGACANN_CACHE=${MEGACANN_CACHE:-/tmp/mc}
export OUT=${OUT:-/tmp/megacann-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
if [ "${1:-}" = fp8 ]; then
  echo "== FP8 speed: the 1.1B step, bf16 vs precision.fp8 tensorwise / rowwise / blockwise / mxfp8"
  timeout 560 python3 benchmarks/gpu_train_step.py --preset 1.1B --variants compile eager --no-anchors \
    --fp8 tensorwise rowwise blockwise mxfp8 --steps 5 --warmup 2 --budget-s 540 --min-row-s 40 \
    --out "$OUT/gpu_fp8_step.json" --log-dir "$OUT/fp8_rows" 2>&1 | grep -v "^{" | tail -16
  exit 0
fi
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
