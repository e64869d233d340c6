#!/usr/bin/env python3
"""Write a synthetic instruction task with exact answers, for measuring what fine-tuning teaches.

    python examples/sft/make_task.py --task add --digits 3 --output data/add3
    python examples/sft/make_task.py --task reverse --min_length 3 --max_length 8 --output data/rev

Writes ``train.jsonl``, ``valid.jsonl`` and ``test.jsonl`` in megacann's SFT format (one
``{"instruction": ..., "output": ...}`` object per line; see docs/data.md) and ``task.json`` (the settings and
counts). Every question is distinct, so the valid and test questions are held out from training. Tasks:

* ``add``: ``Add: 482 + 39`` -> ``521`` (operands uniform in ``[0, 10**digits)``);
* ``reverse``: ``Reverse: kqzvt`` -> ``tvzqk`` (lowercase letters, length uniform in ``[min_length, max_length]``).

The same ``--seed`` gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys

TASKS = ("add", "reverse")
SPLITS = ("train", "valid", "test")


def make_question(task: str, rng: random.Random, args: argparse.Namespace) -> tuple[str, str]:
    """One (instruction, answer) pair."""
    if task == "add":
        a, b = rng.randrange(10**args.digits), rng.randrange(10**args.digits)
        return f"Add: {a} + {b}", str(a + b)
    length = rng.randint(args.min_length, args.max_length)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
    return f"Reverse: {word}", word[::-1]


def question_space(task: str, args: argparse.Namespace) -> int:
    if task == "add":
        return 10 ** (2 * args.digits)
    return sum(26**n for n in range(args.min_length, args.max_length + 1))


def make_splits(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Distinct questions, split into train / valid / test."""
    sizes = {"train": args.train, "valid": args.valid, "test": args.test}
    wanted = sum(sizes.values())
    space = question_space(args.task, args)
    if wanted > space // 2:  # drawing most of a small space by rejection would crawl
        raise SystemExit(
            f"make_task: {wanted} distinct questions asked, but task {args.task!r} with these settings has only "
            f"{space}; ask for at most {space // 2} or widen the task (--digits / --max_length)"
        )
    rng = random.Random(args.seed)
    seen: set[str] = set()
    records = []
    while len(records) < wanted:
        instruction, answer = make_question(args.task, rng, args)
        if instruction not in seen:
            seen.add(instruction)
            records.append({"instruction": instruction, "output": answer})
    splits, start = {}, 0
    for split in ("test", "valid", "train"):  # held-out questions first, so they do not move with --train
        splits[split] = records[start : start + sizes[split]]
        start += sizes[split]
    return {split: splits[split] for split in SPLITS}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASKS, default="add")
    parser.add_argument("--output", required=True, help="directory for train/valid/test.jsonl and task.json")
    parser.add_argument("--train", type=int, default=5000)
    parser.add_argument("--valid", type=int, default=200)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--digits", type=int, default=3, help="add: digits per operand")
    parser.add_argument("--min_length", type=int, default=3, help="reverse: shortest word")
    parser.add_argument("--max_length", type=int, default=8, help="reverse: longest word")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, least in (("train", 0), ("valid", 0), ("test", 0), ("digits", 1), ("min_length", 1)):
        if getattr(args, key) < least:
            parser.error(f"--{key} must be >= {least}, got {getattr(args, key)}")
    if args.max_length < args.min_length:
        parser.error(f"--max_length {args.max_length} is below --min_length {args.min_length}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    splits = make_splits(args)
    os.makedirs(args.output, exist_ok=True)
    for split, records in splits.items():
        with open(os.path.join(args.output, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    summary = {"settings": settings, "counts": {split: len(records) for split, records in splits.items()}}
    with open(os.path.join(args.output, "task.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"make_task: {args.task} -> {args.output}: {summary['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
