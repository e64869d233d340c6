#!/usr/bin/env bash
# The GRPO demonstration of docs/rl.md, end to end on one CPU process:
#   1. a string-reversal task (words of 3 to 5 letters, 3,000 training and 300 held-out test questions) and
#      its GRPO prompts (examples/rl/make_prompts.py), written once per OUT_DIR;
#   2. a weak SFT model: SFT_STEPS steps of sft_tiny.yaml (shrunk as in examples/dpo/demo.sh) from a
#      seed-drawn model, stopped early, so that it answers some held-out questions right, not most;
#   3. GRPO from it: RL_STEPS steps of grpo_tiny.yaml, exact-match reward, 8 prompts x 8 responses a step,
#      dynamic sampling (groups whose 8 responses all score the same are dropped and resampled);
#   4. the control: SFT continued from the same weak model on the right answers for the same RL_STEPS
#      optimizer steps, 64 answers a step (as many as GRPO's responses), at the weak SFT's own rate;
#   5. held-out exact-match accuracy (greedy, megacann's generator) of the three, as one line
#      (examples/rl/report.py; `report.py --table OUT_DIR` gathers the seeds).
#
#   bash examples/rl/demo.sh [OUT_DIR] [SEED]          (defaults: output/rl_demo 1234)
#   bash examples/rl/demo.sh --help
#
# SEED is the `seed` key of all three runs (initial weights, data order, rollout sampling); each seed's runs
# go to OUT_DIR/seed<SEED>/, beside the task they share. Environment: SFT_STEPS (110), RL_STEPS (400),
# RL_LR (GRPO's learning rate, 3e-4); OMP_NUM_THREADS defaults to 1 (much faster than 2 on a loaded
# 2-core machine). docs/rl.md ("Demonstration") gives the results over three seeds and reads them.
# Run from the repository root with megacann installed (make test fills .venv).
set -euo pipefail

case "${1:-}" in -h|--help) sed -n '2,21p' "$0"; exit 0 ;; esac
OUT=${1:-output/rl_demo}
SEED=${2:-1234}
SFT_STEPS=${SFT_STEPS:-110}
RL_STEPS=${RL_STEPS:-400}
RL_LR=${RL_LR:-3e-4}
PYTHON=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RUN="$OUT/seed$SEED"
MODEL=(model.hidden_size=128 model.num_layers=2 model.num_attention_heads=4 model.num_key_value_heads=2
       model.ffn_hidden_size=352 data.seq_length=32 data.num_workers=0 seed="$SEED")
SFT=(--config "$ROOT/examples/configs/llama/sft_tiny.yaml" "${MODEL[@]}" data.path="$OUT/task/train.jsonl"
     optim.lr=3e-3 optim.scheduler=constant logging.log_interval=50)
mkdir -p "$RUN"

evaluate() {  # evaluate NAME MODEL: held-out accuracy of MODEL into RUN/eval_NAME.json
    "$PYTHON" "$ROOT/examples/sft/evaluate.py" --model "$2" --tokenizer byte --data "$OUT/task/test.jsonl" \
        --template plain --max_new_tokens 8 --output "$RUN/eval_$1.json" > /dev/null
}

if [ ! -f "$OUT/task/task.json" ]; then
    "$PYTHON" "$ROOT/examples/sft/make_task.py" --task reverse --min_length 3 --max_length 5 --train 3000 \
        --valid 100 --test 300 --output "$OUT/task"
    "$PYTHON" "$ROOT/examples/rl/make_prompts.py" --task_dir "$OUT/task" --output "$OUT/prompts"
fi

# the weak SFT model: 64 questions a step (packed) at a constant lr 3e-3, stopped early
bash "$ROOT/scripts/run_sft.sh" "${SFT[@]}" experiment.output_dir="$RUN/sft" data.batch_size=64 \
    optim.warmup_steps=10 optim.max_steps="$SFT_STEPS" logging.ckpt_interval="$SFT_STEPS" \
    logging.eval_interval="$SFT_STEPS"
evaluate sft "$RUN/sft"

# GRPO: 8 prompts x 8 responses a step (32 rows x 2 accumulation steps), exact match, dynamic sampling
bash "$ROOT/scripts/run_grpo.sh" --config "$ROOT/examples/configs/llama/grpo_tiny.yaml" "${MODEL[@]}" \
    model.init_from="$RUN/sft" rl.prompts="$OUT/prompts/train.jsonl" rl.max_new_tokens=8 \
    rl.filter_groups=true rl.filter_shortfall=fill experiment.output_dir="$RUN/grpo" data.batch_size=32 \
    optim.lr="$RL_LR" optim.max_steps="$RL_STEPS" logging.ckpt_interval="$RL_STEPS" logging.log_interval=10
evaluate grpo "$RUN/grpo"

# the control: as many optimizer steps of SFT on the right answers, 64 unpacked answers a step
bash "$ROOT/scripts/run_sft.sh" "${SFT[@]}" model.init_from="$RUN/sft" experiment.output_dir="$RUN/control" \
    data.batch_size=64 data.pack_sft=false optim.warmup_steps=0 optim.max_steps="$RL_STEPS" \
    logging.ckpt_interval="$RL_STEPS" logging.eval_interval="$RL_STEPS"
evaluate control "$RUN/control"

"$PYTHON" "$ROOT/examples/rl/report.py" --seed_dir "$RUN"
