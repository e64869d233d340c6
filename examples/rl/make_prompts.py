#!/usr/bin/env python3
"""Turn a task written by examples/sft/make_task.py into GRPO prompts with checkable answers.

    python examples/rl/make_prompts.py --task_dir data/reverse --output data/reverse_rl

Each ``{"instruction": Q, "output": A}`` line of ``<task_dir>/{train,valid,test}.jsonl`` becomes
``{"messages": [{"role": "user", "content": Q}], "answer": A}`` in ``<output>/`` under the same name: the
question as a chat turn (rendered by the recipe's ``data.prompt_template``, as in SFT) and the field the
``exact_match`` reward compares the response with.
"""

from __future__ import annotations

import argparse
import json
import os

SPLITS = ("train", "valid", "test")


def convert(source: str, target: str) -> int:
    """Write ``target`` from ``source``; returns the number of prompts."""
    count = 0
    with open(source, encoding="utf-8") as f, open(target, "w", encoding="utf-8") as out:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "instruction" not in record or "output" not in record:
                raise SystemExit(f"{source}:{line_no}: expected 'instruction' and 'output', got {sorted(record)}")
            prompt = {"messages": [{"role": "user", "content": record["instruction"]}], "answer": record["output"]}
            out.write(json.dumps(prompt) + "\n")
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task_dir", required=True, help="a folder written by examples/sft/make_task.py")
    parser.add_argument("--output", required=True, help="folder for the prompt files")
    args = parser.parse_args()
    os.makedirs(args.output, exist_ok=True)
    for split in SPLITS:
        source = os.path.join(args.task_dir, f"{split}.jsonl")
        if os.path.exists(source):
            count = convert(source, os.path.join(args.output, f"{split}.jsonl"))
            print(f"{split}: {count} prompts -> {os.path.join(args.output, split + '.jsonl')}")


if __name__ == "__main__":
    main()
