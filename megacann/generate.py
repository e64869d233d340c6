"""``megacann-generate``: text from a model directory with the KV-cache generator, on one process.

    megacann-generate --model DIR --prompt "def main():" [sampling options]
    megacann-generate --model DIR --input prompts.jsonl --output out.jsonl [sampling options]
    megacann-generate --model DIR --chat [--template chatml] [--system TEXT] [sampling options]

``--model`` is a megacann checkpoint, output directory (its latest checkpoint), consolidated directory or
Hugging Face directory; ``--tokenizer`` (``byte``, a tokenizer.json or directory) defaults to the one saved
with the weights. Each input line is ``{"prompt": TEXT}``, optionally with its own ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop_token_ids`` and ``stop`` (the command's
options otherwise; a line without a seed gets ``--seed`` plus its line number). Each output line repeats
the prompt with ``completion`` (cut before a stop string), ``tokens``, ``logprobs`` (under the model's own
distribution) and ``finish_reason``; lines are written and flushed batch by batch, so an interrupted run
keeps every batch it finished, in input order. ``--chat`` talks with the model on stdin and stdout, the
conversation rendered by an SFT chat template, the answer streamed as it is generated; ``/exit`` or the
end of input ends it. The conversation's cache is kept across turns (``--max_len`` tokens, else the model's
``max_position_embeddings``), each turn running only its new tokens (``--no_chat_cache``: the whole
conversation each turn). ``--lora merged`` merges a LoRA run's adapters into its base; by default they stay
attached and active, unmerged, as PEFT loads them. The command runs on one process (no ``torchrun``: no
pipeline stages, so no ``num_microbatches``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from typing import Any, Optional

import torch

from megacann.data.jsonl_records import prompt_records
from megacann.errors import MegacannError
from megacann.generation import Generator, SamplingParams, StopStrings

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids", "stop")


def load_model(
    path: str, precision: str = "fp32", device: Optional[str] = None, lora: str = "merged"
) -> torch.nn.Module:
    """The whole model of any weights directory, in eval mode; a LoRA run's adapters attached and active
    on its base (``lora="unmerged"``, as PEFT loads them) or merged into it (``"merged"``)."""
    from megacann.interop import from_pretrained_hf
    from megacann.interop.lora_export import build_adapted_model, build_full_model, is_lora_checkpoint
    from megacann.interop.sources import HUGGINGFACE, resolve_weight_source

    if resolve_weight_source(path, "--model").kind == HUGGINGFACE:
        return from_pretrained_hf(path, precision=precision, device=device).eval()
    build = build_adapted_model if lora == "unmerged" and is_lora_checkpoint(path) else build_full_model
    return build(path, precision, device).eval()


def load_model_tokenizer(path: str, spec: Optional[str], vocab_size: int) -> Any:
    """``spec`` (``byte``, a file or directory), else the tokenizer saved with the weights at ``path``."""
    from megacann.data.tokenizer import load_tokenizer
    from megacann.interop.sources import CHECKPOINT, HUGGINGFACE, resolve_weight_source
    from megacann.interop.tokenizer import find_tokenizer

    if spec is not None:
        tokenizer = load_tokenizer(spec)
    else:
        found = resolve_weight_source(path, "--model")
        if found.kind == HUGGINGFACE:
            tokenizer = load_tokenizer(found.path)
        else:
            tokenizer, where = find_tokenizer(found.path, found.kind == CHECKPOINT, vocab_size)
            if tokenizer is None:
                raise ValueError(f"--tokenizer is needed: {where}")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than the model's {vocab_size}")
    return tokenizer


def read_requests(path: str, defaults: SamplingParams) -> Iterator[tuple[str, SamplingParams]]:
    """(prompt, its sampling params) of each line of the JSONL file ``path``."""
    for number, record in prompt_records(path):
        own = {key: record[key] for key in SAMPLING_KEYS if key in record}
        own.setdefault("seed", defaults.seed + number)
        try:
            yield record["prompt"], dataclasses.replace(defaults, **own)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: {err}") from None


def _batches(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacann-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="megacann checkpoint, output, consolidated or HF directory")
    parser.add_argument(
        "--tokenizer", default=None, help="'byte', a tokenizer.json or directory (default: the model's)"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt: its completion goes to stdout")
    source.add_argument("--input", help="JSONL file of prompts (with --output)")
    source.add_argument("--chat", action="store_true", help="talk with the model on stdin/stdout (/exit ends)")
    parser.add_argument("--template", default="chatml", help="--chat: an SFT template name (alpaca, chatml, plain)")
    parser.add_argument("--system", default=None, help="--chat: the system message")
    parser.add_argument(
        "--no_chat_cache",
        action="store_true",
        help="--chat: run the whole conversation each turn (default: keep its cache of --max_len tokens, "
        "else the model's max_position_embeddings, and run only each turn's new tokens)",
    )
    parser.add_argument("--output", help="JSONL file of completions")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: off")
    parser.add_argument("--top_p", type=float, default=1.0, help="1: off")
    parser.add_argument("--min_p", type=float, default=0.0, help="0: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop_token_ids", type=int, nargs="*", default=[])
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat for more)")
    parser.add_argument("--max_len", type=int, default=None, help="cache tokens a row (default: as needed)")
    parser.add_argument("--bos", action="store_true", help="start each prompt with the tokenizer's BOS")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--lora",
        choices=("unmerged", "merged"),
        default="unmerged",
        help="a LoRA run's adapters: active on the base, unmerged (as PEFT loads them), or merged into it",
    )
    return parser


def _encode(tokenizer: Any, text: str, bos: bool) -> list[int]:
    ids = list(tokenizer.encode(text))
    return [tokenizer.bos_id, *ids] if bos and tokenizer.bos_id is not None else ids


def _record(prompt: str, result: Any, completion: str) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "completion": completion,
        "tokens": result.tokens,
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
    }


def _complete(
    generator: Generator, tokenizer: Any, ids: list[list[int]], params: list[SamplingParams]
) -> list[tuple[Any, str]]:
    """Each request's result and text (cut before its stop string, if one ended it)."""
    eos = generator.eos_token_ids
    stops = StopStrings(tokenizer, [p.stop for p in params], skip=eos) if any(p.stop for p in params) else None
    results = generator.generate(ids, params, stop_check=stops)
    return [
        (result, stops.text(i) if stops is not None else tokenizer.decode([t for t in result.tokens if t not in eos]))
        for i, result in enumerate(results)
    ]


def _chat_template(spec: str) -> Any:
    from megacann.data.sft_templates import TEMPLATES, get_template

    if spec not in TEMPLATES and "{instruction}" not in spec:
        raise ValueError(
            f"--template {spec!r} is neither a template name ({', '.join(TEMPLATES)}) nor a custom template "
            "string containing '{instruction}'"
        )
    return get_template(spec)


def _chat(args: argparse.Namespace, generator: Generator, tokenizer: Any, defaults: SamplingParams) -> int:
    from megacann.generation.chat import ChatSession, chat

    template = _chat_template(args.template)
    cache_len = None if args.no_chat_cache else args.max_len or generator.model.config.max_position_embeddings
    session = ChatSession(
        generator,
        tokenizer,
        template,
        defaults,
        lambda text: _encode(tokenizer, text, args.bos),
        args.system,
        cache_len=cache_len,
        notice=lambda line: print(f"megacann-generate: {line}", file=sys.stderr),
    )
    chat(session, sys.stdin, sys.stdout, "> " if sys.stdin.isatty() else "")
    return 0


def _write_completions(args: argparse.Namespace, generator: Generator, tokenizer: Any, defaults: SamplingParams) -> int:
    from megacann.data.progress import ProgressBar

    requests = list(read_requests(args.input, defaults))  # every line checked before anything is written
    progress = ProgressBar("megacann-generate", total=len(requests), unit="prompts")
    with open(args.output, "w", encoding="utf-8") as out:
        for batch in _batches(iter(requests), args.batch_size):
            ids = [_encode(tokenizer, prompt, args.bos) for prompt, _ in batch]
            done = _complete(generator, tokenizer, ids, [params for _, params in batch])
            for (prompt, _), (result, completion) in zip(batch, done):
                out.write(json.dumps(_record(prompt, result, completion), ensure_ascii=False) + "\n")
            out.flush()
            progress.advance(len(batch))
    progress.close()
    return 0


def run(args: argparse.Namespace) -> int:
    from megacann.models import get_model_spec

    defaults = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop_token_ids=tuple(args.stop_token_ids),
        stop=tuple(args.stop),
    )
    if args.chat:
        _chat_template(args.template)  # a bad --template is refused before the model loads
    model = load_model(args.model, args.precision, args.device, args.lora)
    tokenizer = load_model_tokenizer(args.model, args.tokenizer, model.config.vocab_size)
    eos = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    spec = get_model_spec(model.config.type)
    generator = Generator(model, spec, eos_token_ids=eos, pad_token_id=pad, max_len=args.max_len)
    if args.chat:
        return _chat(args, generator, tokenizer, defaults)
    if args.prompt is not None:
        ((_, completion),) = _complete(generator, tokenizer, [_encode(tokenizer, args.prompt, args.bos)], [defaults])
        print(completion)
        return 0
    return _write_completions(args, generator, tokenizer, defaults)


def main(argv: Optional[list[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.input is not None and args.output is None:
        parser.error("--input needs --output (the JSONL file of completions)")
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.max_len is not None and args.max_len < 1:
        parser.error(f"--max_len must be >= 1, got {args.max_len}")
    try:
        return run(args)
    except (MegacannError, ValueError, OSError) as err:  # bad input: one line naming it
        raise SystemExit(f"megacann-generate: {err}") from None


if __name__ == "__main__":
    sys.exit(main())
