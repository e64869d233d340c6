#!/usr/bin/env python3
"""Turn a task with exact answers (examples/sft/make_task.py) into DPO preference pairs.

    python examples/dpo/make_pairs.py --task_dir data/rev --output data/rev_pairs

For every question of ``train.jsonl`` and ``valid.jsonl`` writes ``{"prompt": question, "chosen": the right
answer, "rejected": a wrong one}`` to ``<output>/train.jsonl`` / ``valid.jsonl`` (megacann's preference
format, docs/finetuning.md). Wrong answers are near misses a weak model makes: for a reversal, the word
itself, or the right answer with two neighbouring letters swapped or one letter changed; for a sum, the
right one with a digit changed, or off by one or ten. With ``--rejected_from PREDICTIONS`` (the
``--predictions`` file of examples/sft/evaluate.py run on training questions) the pairs are on-policy: only
the questions found there, each rejecting the model's own greedy answer where it is wrong (a near miss
where it is right); ``valid.jsonl`` is written as usual. The test questions are not touched: they stay held
out for exact-match accuracy (examples/sft/evaluate.py). The same ``--seed`` gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys


def wrong_answer(question: str, answer: str, rng: random.Random) -> str:
    """A near miss that differs from ``answer``."""
    while True:
        if question.startswith("Reverse:"):
            word = question.split(":", 1)[1].strip()
            kind = rng.choice(("unreversed", "swap", "letter"))
            candidate = list(answer)
            if kind == "unreversed":
                candidate = list(word)
            elif kind == "swap" and len(candidate) > 1:
                i = rng.randrange(len(candidate) - 1)
                candidate[i], candidate[i + 1] = candidate[i + 1], candidate[i]
            else:
                candidate[rng.randrange(len(candidate))] = rng.choice(string.ascii_lowercase)
            candidate = "".join(candidate)
        else:
            value = int(answer)
            kind = rng.choice(("digit", "one", "ten"))
            if kind == "digit":
                digits = list(answer)
                digits[rng.randrange(len(digits))] = rng.choice(string.digits)
                candidate = str(int("".join(digits)))
            else:
                candidate = str(max(0, value + rng.choice((-1, 1)) * (1 if kind == "one" else 10)))
        if candidate != answer:
            return candidate


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task_dir", required=True, help="make_task.py's output directory")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rejected_from", help="evaluate.py --predictions of training questions (on-policy pairs)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    predicted = None
    if args.rejected_from:
        with open(args.rejected_from, encoding="utf-8") as f:
            predicted = {p["question"]: p for p in map(json.loads, filter(str.strip, f))}
    os.makedirs(args.output, exist_ok=True)
    for split in ("train", "valid"):
        with open(os.path.join(args.task_dir, f"{split}.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        if split == "train" and predicted is not None:
            records = [r for r in records if r["instruction"] in predicted]
        with open(os.path.join(args.output, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for r in records:
                pair = {"prompt": r["instruction"], "chosen": r["output"]}
                guess = predicted.get(r["instruction"]) if predicted is not None and split == "train" else None
                own = guess is not None and not guess["correct"] and guess["prediction"].strip()
                pair["rejected"] = (
                    guess["prediction"].strip() if own else wrong_answer(r["instruction"], r["output"], rng)
                )
                f.write(json.dumps(pair) + "\n")
        print(f"make_pairs: {len(records)} pairs -> {os.path.join(args.output, split + '.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
