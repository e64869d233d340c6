#!/usr/bin/env bash
# The fine-tuning demonstration of docs/finetuning.md, end to end on one CPU process:
#   1. pretrain the tiny LLaMA on the default corpus with the byte tokenizer (the base);
#   2. write a string-reversal task with held-out test questions;
#   3. fine-tune the base on it twice: full SFT and LoRA (rank 16 on every projection, base frozen);
#   4. report exact-match accuracy on the held-out questions: base, full SFT, LoRA, and the LoRA run
#      exported in PEFT's format and evaluated on the exported Hugging Face base.
#
#   bash examples/sft/demo.sh [OUT_DIR] [SFT_STEPS]      (defaults: output/sft_demo 1500)
#
# Took 6 min on a quiet 2-core machine. Run from the repository root with megacann installed (make test fills .venv).
set -euo pipefail

OUT=${1:-output/sft_demo}
STEPS=${2:-1500}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RECIPE="$ROOT/examples/configs/llama/sft_tiny.yaml"
mkdir -p "$OUT"

evaluate() {  # evaluate NAME MODEL [extra evaluate.py args]
    local name=$1 model=$2
    shift 2
    "$PYTHON" "$ROOT/examples/sft/evaluate.py" --model "$model" --tokenizer byte --data "$OUT/task/test.jsonl" \
        --template plain --max_new_tokens 8 --output "$OUT/eval_$name.json" "$@" | tail -n 1
}

[ -d "$OUT/base" ] || megacann-train --config "$ROOT/examples/configs/llama/tiny.yaml" data.tokenizer=byte \
    experiment.output_dir="$OUT/base"
"$PYTHON" "$ROOT/examples/sft/make_task.py" --task reverse --min_length 3 --max_length 6 --output "$OUT/task"

for mode in full lora; do
    lora=false
    [ "$mode" = lora ] && lora=true
    bash "$ROOT/scripts/run_sft.sh" --config "$RECIPE" model.init_from="$OUT/base" data.path="$OUT/task/train.jsonl" \
        experiment.output_dir="$OUT/sft_$mode" optim.max_steps="$STEPS" lora=$lora
done

megacann-convert to-hf "$OUT/base" "$OUT/base_hf"
megacann-convert to-peft "$OUT/sft_lora" "$OUT/adapter"

echo "exact-match accuracy on $(wc -l < "$OUT/task/test.jsonl") held-out questions:"
evaluate base "$OUT/base"
evaluate full "$OUT/sft_full"
evaluate lora "$OUT/sft_lora"
evaluate peft "$OUT/base_hf" --adapter "$OUT/adapter"
