#!/usr/bin/env python3
"""Exact-match accuracy of a model's greedy answers on held-out SFT questions.

    python examples/sft/evaluate.py --model out/hf --tokenizer byte --data data/add3/test.jsonl \
        --template plain [--adapter out/peft] [--predictions preds.jsonl] [--output summary.json]

``--model`` is a Hugging Face directory (``--adapter``: a PEFT LoRA directory put on it) or a megacann
checkpoint, output directory (its latest checkpoint; a LoRA run's adapters merged into their base) or
consolidated directory. Each question of the JSONL file (megacann's SFT format, docs/data.md) becomes the prompt the
training data path builds (``[BOS] + prompt`` in ``--template``, tokenized segment by segment); the answer
is generated greedily until EOS or ``--max_new_tokens``. A prediction is correct when it equals the
reference answer after stripping surrounding whitespace (and the template's answer suffix, e.g. ChatML's
``<|im_end|>``). Generation is megacann's KV-cache generator (docs/generation.md), batched with left padding
that no real token attends to.

Prints one JSON line ``{"correct", "total", "accuracy", ...}``; ``--output`` writes it to a file and
``--predictions`` writes every question with its prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from megacann.data.sft import SFTStats, read_jsonl, tokenize_conversation
from megacann.data.sft_templates import PromptTemplate, get_template
from megacann.data.tokenizer import load_tokenizer
from megacann.generation import Generator, SamplingParams
from megacann.models import get_model_spec


def prompt_ids(messages: list[dict], template: PromptTemplate, tokenizer) -> list[int]:
    """The tokens training puts before the last answer: the conversation without its last assistant turn,
    tokenized exactly as the SFT data path does (its trailing EOS dropped)."""
    ids, _ = tokenize_conversation(messages[:-1], template, tokenizer)
    return ids[:-1].tolist()


def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    eos_id: int,
    max_new_tokens: int,
    batch_size: int = 32,
    pad_id: Optional[int] = None,
) -> list[list[int]]:
    """The tokens each prompt continues with, greedily, up to (not including) EOS: megacann's KV-cache
    generator on ``model`` (a megacann model of a family with a decode path), ``batch_size`` prompts at a
    time."""
    generator = Generator(
        model,
        get_model_spec(model.config.type),
        eos_token_ids=[eos_id],
        pad_token_id=eos_id if pad_id is None else pad_id,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens)
    generated: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        for result in generator.generate(prompts[start : start + batch_size], params):
            generated.append([t for t in result.tokens if t != eos_id])
    return generated


def normalise(text: str, template: PromptTemplate) -> str:
    text = text.strip()
    suffix = template.assistant_suffix.strip()
    if suffix and text.endswith(suffix):
        text = text[: -len(suffix)].rstrip()
    return text


def exact_match(prediction: str, answer: str, template: PromptTemplate) -> bool:
    return normalise(prediction, template) == answer.strip()


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    conversations: list[list[dict]],
    template: PromptTemplate,
    max_new_tokens: int = 16,
    batch_size: int = 32,
) -> tuple[dict, list[dict]]:
    """(summary, per-question records) of greedy exact-match accuracy on ``conversations``."""
    prompts = [prompt_ids(m, template, tokenizer) for m in conversations]
    outputs = greedy_generate(model, prompts, tokenizer.eos_id, max_new_tokens, batch_size, tokenizer.pad_id)
    records = []
    for messages, tokens in zip(conversations, outputs):
        prediction, answer = tokenizer.decode(tokens), messages[-1]["content"]
        question = messages[-2]["content"] + (f"\n{messages[-2]['input']}" if messages[-2].get("input") else "")
        records.append(
            {
                "question": question,
                "answer": answer,
                "prediction": prediction,
                "tokens": tokens,
                "correct": exact_match(prediction, answer, template),
            }
        )
    correct = sum(r["correct"] for r in records)
    total = len(records)
    summary = {"correct": correct, "total": total, "accuracy": correct / total if total else 0.0}
    return summary, records


def load_model(path: str, adapter: Optional[str], precision: str, device: str) -> torch.nn.Module:
    """A Hugging Face directory (with a PEFT adapter if given), or any megacann source: a checkpoint or
    output directory (a LoRA run's comes merged into its base) or a consolidated directory."""
    from megacann.interop.hf import from_pretrained_hf
    from megacann.interop.lora_export import build_full_model
    from megacann.interop.peft import load_peft_adapter
    from megacann.interop.sources import HUGGINGFACE, resolve_weight_source

    if resolve_weight_source(path, "--model").kind != HUGGINGFACE:
        if adapter:
            raise SystemExit("evaluate: --adapter goes with a Hugging Face --model (megacann LoRA runs load merged)")
        return build_full_model(path, precision, device)
    model = from_pretrained_hf(path, precision=precision, device=device)
    if adapter:
        load_peft_adapter(model, adapter)
    return model


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", required=True, help="Hugging Face, megacann checkpoint / output or consolidated directory"
    )
    parser.add_argument("--adapter", default=None, help="PEFT LoRA directory to put on the model")
    parser.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json or a tokenizer directory")
    parser.add_argument("--data", required=True, help="JSONL questions in megacann's SFT format")
    parser.add_argument("--template", default="alpaca", help="data.prompt_template used in training")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N questions only")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--predictions", default=None, help="write every question and prediction (JSONL)")
    parser.add_argument("--output", default=None, help="write the summary (JSON)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 1:
        parser.error("--max_new_tokens and --batch_size must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    template = get_template(args.template)
    conversations = [m for _, m in read_jsonl(args.data, skip_bad_lines=False, stats=SFTStats())]
    if args.limit is not None:
        conversations = conversations[: args.limit]
    model = load_model(args.model, args.adapter, args.precision, args.device)
    if tokenizer.vocab_size > model.vocab_size:
        raise SystemExit(
            f"evaluate: the tokenizer has {tokenizer.vocab_size} tokens but {args.model} only {model.vocab_size}"
        )
    summary, records = evaluate(model, tokenizer, conversations, template, args.max_new_tokens, args.batch_size)
    summary.update(model=args.model, adapter=args.adapter, data=args.data, template=args.template)
    if args.predictions:
        with open(args.predictions, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
