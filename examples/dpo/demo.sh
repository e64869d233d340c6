#!/usr/bin/env bash
# The DPO demonstration of docs/finetuning.md, end to end on one CPU process:
#   1. write a string-reversal task with held-out test questions;
#   2. a weak SFT model: SFT_STEPS steps of sft_tiny.yaml from a seed-drawn model (no pretraining);
#   3. on-policy preference pairs: the SFT model answers the training questions greedily; each pair
#      chooses the right answer and rejects the model's own answer where it is wrong (a near miss where
#      it is right);
#   4. DPO from the SFT model with dpo_tiny.yaml: full (reference: a frozen copy) and LoRA (reference: the
#      base with adapters disabled), both with dpo.sft_loss_weight (the chosen answers' NLL, RPO-style);
#      and, as controls, plain DPO (no NLL term) and as many steps of SFT on the chosen answers alone;
#   5. export: the full DPO run to a Hugging Face directory, the LoRA run's adapters to PEFT on the exported
#      SFT model;
#   6. report exact-match accuracy on the held-out questions: SFT, the DPO runs, the controls, the exports.
#
#   bash examples/dpo/demo.sh [OUT_DIR] [SFT_STEPS] [DPO_STEPS]     (defaults: output/dpo_demo 250 90)
#
# The model is the tiny LLaMA shrunk (hidden 128, 2 layers: 0.44M parameters) so that the whole run takes
# minutes on a loaded 2-core machine; one thread per process (OMP_NUM_THREADS=1) is much faster there.
# Run from the repository root with megacann installed (make test fills .venv).
set -euo pipefail

OUT=${1:-output/dpo_demo}
SFT_STEPS=${2:-250}
DPO_STEPS=${3:-90}
PYTHON=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODEL=(model.hidden_size=128 model.num_layers=2 model.num_attention_heads=4 model.num_key_value_heads=2
       model.ffn_hidden_size=352)
SFT=(--config "$ROOT/examples/configs/llama/sft_tiny.yaml" "${MODEL[@]}" data.seq_length=32 data.num_workers=0)
DPO=(--config "$ROOT/examples/configs/llama/dpo_tiny.yaml" "${MODEL[@]}" model.init_from="$OUT/sft"
     data.path="$OUT/pairs/train.jsonl" data.batch_size=64 data.num_workers=0 optim.max_steps="$DPO_STEPS"
     logging.ckpt_interval="$DPO_STEPS" logging.eval_interval="$DPO_STEPS")
mkdir -p "$OUT"

evaluate() {  # evaluate NAME MODEL DATA [extra evaluate.py args]
    local name=$1 model=$2 data=$3
    shift 3
    "$PYTHON" "$ROOT/examples/sft/evaluate.py" --model "$model" --tokenizer byte --data "$data" \
        --template plain --max_new_tokens 8 --output "$OUT/eval_$name.json" "$@" | tail -n 1
}

"$PYTHON" "$ROOT/examples/sft/make_task.py" --task reverse --min_length 3 --max_length 6 --train 3000 \
    --valid 100 --test 300 --output "$OUT/task"
# the weak SFT model: 64 questions a step at a constant lr 3e-3, stopped early
bash "$ROOT/scripts/run_sft.sh" "${SFT[@]}" data.path="$OUT/task/train.jsonl" experiment.output_dir="$OUT/sft" \
    data.batch_size=64 optim.lr=3e-3 optim.scheduler=constant optim.warmup_steps=10 optim.max_steps="$SFT_STEPS" \
    logging.ckpt_interval="$SFT_STEPS" logging.eval_interval="$SFT_STEPS"

# on-policy pairs: the SFT model's greedy answers to the training questions
evaluate sft_train "$OUT/sft" "$OUT/task/train.jsonl" --predictions "$OUT/predictions_train.jsonl"
"$PYTHON" "$ROOT/examples/dpo/make_pairs.py" --task_dir "$OUT/task" --output "$OUT/pairs" \
    --rejected_from "$OUT/predictions_train.jsonl"

# DPO (sigmoid, beta 0.1) with the chosen answers' NLL (dpo.sft_loss_weight 1): full and LoRA
bash "$ROOT/scripts/run_dpo.sh" "${DPO[@]}" experiment.output_dir="$OUT/dpo_full" optim.lr=1e-3 dpo.sft_loss_weight=1
bash "$ROOT/scripts/run_dpo.sh" "${DPO[@]}" experiment.output_dir="$OUT/dpo_lora" optim.lr=3e-3 dpo.sft_loss_weight=1 \
    lora=true
# controls: plain DPO (no NLL term, a low lr); SFT on the chosen answers alone, the same steps at either lr
bash "$ROOT/scripts/run_dpo.sh" "${DPO[@]}" experiment.output_dir="$OUT/dpo_plain" optim.lr=5e-5
"$PYTHON" -c 'import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as g:
    for r in map(json.loads, f):
        g.write(json.dumps({"instruction": r["prompt"], "output": r["chosen"]}) + "\n")' \
    "$OUT/pairs/train.jsonl" "$OUT/chosen.jsonl"
for lr in 1e-3 5e-5; do  # dpo_full's lr and dpo_plain's
    bash "$ROOT/scripts/run_sft.sh" "${SFT[@]}" model.init_from="$OUT/sft" data.path="$OUT/chosen.jsonl" \
        experiment.output_dir="$OUT/sft_chosen_lr$lr" data.batch_size=32 data.pack_sft=false optim.lr="$lr" \
        optim.warmup_ratio=0.1 optim.max_steps="$DPO_STEPS" logging.ckpt_interval="$DPO_STEPS" \
        logging.eval_interval="$DPO_STEPS"
done

megacann-convert to-hf "$OUT/dpo_full" "$OUT/dpo_full_hf"
megacann-convert to-hf "$OUT/sft" "$OUT/sft_hf"
megacann-convert to-peft "$OUT/dpo_lora" "$OUT/adapter" --base "$OUT/sft_hf"

TEST="$OUT/task/test.jsonl"
echo "exact-match accuracy on $(wc -l < "$TEST") held-out questions:"
evaluate sft "$OUT/sft" "$TEST"
evaluate dpo_full "$OUT/dpo_full" "$TEST"
evaluate dpo_full_hf "$OUT/dpo_full_hf" "$TEST"
evaluate dpo_lora "$OUT/dpo_lora" "$TEST"
evaluate dpo_lora_peft "$OUT/sft_hf" "$TEST" --adapter "$OUT/adapter"
evaluate dpo_plain "$OUT/dpo_plain" "$TEST"
evaluate sft_chosen_lr1e-3 "$OUT/sft_chosen_lr1e-3" "$TEST"
evaluate sft_chosen_lr5e-5 "$OUT/sft_chosen_lr5e-5" "$TEST"
