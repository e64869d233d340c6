#!/usr/bin/env bash
# One device call's worth of GPU checks (CUDA): CUDA-only tests, the tiny recipe on CUDA in bf16, and
# megacann vs transformers at the 1.1B anchor shape in the same run. If a copy of the shared anchor script
# sits in the git-ignored .devbench/ (never commit it), its hf-eager:1.1B row runs too, on the same machine.
#   bash benchmarks/gpu_check.sh        (OUT defaults to /tmp/megacann-gpu-check)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MEGACANN_CACHE=${MEGACANN_CACHE:-/tmp/mc}
OUT=${OUT:-/tmp/megacann-gpu-check}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
echo "== CUDA-only tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_layers_cuda.py tests/test_checkpoint_cuda.py 2>&1 | tail -8
echo "== tiny recipe on CUDA, bf16"
MEGACANN_DEVICE=cuda timeout 180 bash scripts/run_pretrain.sh --config examples/configs/llama/tiny.yaml \
  model.precision=bf16 optim.max_steps=60 "experiment.output_dir=$OUT/tiny" logging.ckpt_interval=0 2>&1 \
  | grep -v "^+" | grep -E "step (1|20|40|60)/|eval|first|Error|error" | head -20
echo "== megacann vs transformers, 1.1B, bf16"
timeout 300 python3 benchmarks/train_vs_transformers.py --device cuda --preset 1.1B --precision bf16 --steps 5 --rounds 2 2>&1 | grep -v Warn | tail -4
if [ -f .devbench/anchor_gpu.py ]; then
  echo "== anchor (REFERENCE.md's table, same machine)"
  timeout 150 python3 .devbench/anchor_gpu.py hf-eager:1.1B 2>&1 | tail -3
fi
