#!/usr/bin/env bash
# The DPO demonstration of docs/finetuning.md, end to end on one CPU process:
#   1. write a string-reversal task with held-out test questions, and preference pairs from its training
#      questions (the right answer chosen, a near miss rejected);
#   2. a weak SFT model: SFT_STEPS steps of sft_tiny.yaml from a seed-drawn model (no pretraining);
#   3. DPO from it twice with dpo_tiny.yaml: full (reference: a frozen copy) and LoRA (reference: the base
#      with adapters disabled);
#   4. export: the full DPO run to a Hugging Face directory, the LoRA run's adapters to PEFT on the exported
#      SFT model;
#   5. report exact-match accuracy on the held-out questions: SFT, the DPO runs, and their exports.
#
#   bash examples/dpo/demo.sh [OUT_DIR] [SFT_STEPS] [DPO_STEPS]     (defaults: output/dpo_demo 200 100)
#
# Run from the repository root with megacann installed (make test fills .venv).
set -euo pipefail

OUT=${1:-output/dpo_demo}
SFT_STEPS=${2:-200}
DPO_STEPS=${3:-100}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT"

evaluate() {  # evaluate NAME MODEL [extra evaluate.py args]
    local name=$1 model=$2
    shift 2
    "$PYTHON" "$ROOT/examples/sft/evaluate.py" --model "$model" --tokenizer byte --data "$OUT/task/test.jsonl" \
        --template plain --max_new_tokens 8 --output "$OUT/eval_$name.json" "$@" | tail -n 1
}

"$PYTHON" "$ROOT/examples/sft/make_task.py" --task reverse --min_length 3 --max_length 6 --train 3000 \
    --valid 100 --test 300 --output "$OUT/task"
"$PYTHON" "$ROOT/examples/dpo/make_pairs.py" --task_dir "$OUT/task" --output "$OUT/pairs"

bash "$ROOT/scripts/run_sft.sh" --config "$ROOT/examples/configs/llama/sft_tiny.yaml" data.seq_length=32 \
    data.path="$OUT/task/train.jsonl" experiment.output_dir="$OUT/sft" optim.max_steps="$SFT_STEPS" \
    logging.ckpt_interval="$SFT_STEPS" logging.eval_interval="$SFT_STEPS"

for mode in full lora; do
    settings=(lora=false)  # full DPO: the recipe's lr (1e-4); LoRA learns slower and takes 1e-3
    [ "$mode" = lora ] && settings=(lora=true optim.lr=1e-3)
    bash "$ROOT/scripts/run_dpo.sh" --config "$ROOT/examples/configs/llama/dpo_tiny.yaml" \
        model.init_from="$OUT/sft" data.path="$OUT/pairs/train.jsonl" experiment.output_dir="$OUT/dpo_$mode" \
        optim.max_steps="$DPO_STEPS" logging.ckpt_interval="$DPO_STEPS" logging.eval_interval="$DPO_STEPS" "${settings[@]}"
done

megacann-convert to-hf "$OUT/dpo_full" "$OUT/dpo_full_hf"
megacann-convert to-hf "$OUT/sft" "$OUT/sft_hf"
megacann-convert to-peft "$OUT/dpo_lora" "$OUT/adapter" --base "$OUT/sft_hf"

echo "exact-match accuracy on $(wc -l < "$OUT/task/test.jsonl") held-out questions:"
evaluate sft "$OUT/sft"
evaluate dpo_full "$OUT/dpo_full"
evaluate dpo_full_hf "$OUT/dpo_full_hf"
evaluate dpo_lora "$OUT/dpo_lora"
evaluate dpo_lora_peft "$OUT/sft_hf" --adapter "$OUT/adapter"
