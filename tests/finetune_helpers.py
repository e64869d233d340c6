"""Shared pieces of the fine-tuning tests: recipes (with or without inline sizes), a tiny byte-level SFT
task, a tiny Hugging Face base, and the LoRA settings used throughout."""

from __future__ import annotations

import json
import os
import random
import string

import torch
from training_helpers import TINY_MODEL, prepared_recipe

from megacann.config import MegacannConfig, ModelConfig

VOCAB = 260  # the byte tokenizer's 259 ids fit
LORA = ["lora=true", "lora_rank=4", "lora_alpha=8.0", "lora_target_modules=all-linear"]
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-2", f"model.vocab_size={VOCAB}", "data.tokenizer=byte"]
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def recipe(overrides=(), model: dict | None = None, world_size: int = 1, **sections) -> MegacannConfig:
    """The tiny test recipe; ``model`` replaces the whole model section (e.g. only a type, sizes from
    ``model.init_from``)."""
    raw = {
        "experiment": {"name": "finetune-test", "output_dir": "/tmp/megacann-finetune-unused"},
        "model": dict(model) if model is not None else dict(TINY_MODEL),
        "data": {"seq_length": 32, "batch_size": 2, "num_workers": 0},
        "optim": {"max_steps": 4, "warmup_steps": 1, "grad_accum_steps": 2, "weight_decay": 0.1},
        "logging": {"log_interval": 1, "ckpt_interval": 0},
        "seed": 7,
    }
    return prepared_recipe(raw, overrides, world_size, **sections)


def random_words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct lower-case words of 3-5 letters drawn from ``rng``, sorted."""
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5))))
    return sorted(words)


def write_jsonl(path: str, records: list[dict]) -> str:
    """``records`` as JSON lines at ``path`` (its directory made); returns ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def write_reverse_task(path: str, count: int = 64, seed: int = 0) -> str:
    """``{"instruction": "Reverse: abc", "output": "cba"}`` lines (distinct words of 3-5 letters)."""
    words = random_words(random.Random(seed), count)
    return write_jsonl(path, [{"instruction": f"Reverse: {word}", "output": word[::-1]} for word in words])


def sft_overrides(jsonl: str, cache_dir: str) -> list[str]:
    return [
        "train_mode=sft",
        f"data.path={jsonl}",
        "data.tokenizer=byte",
        "data.prompt_template=plain",
        f"data.cache_dir={cache_dir}",
        "data.split=90,10,0",
    ]


def tiny_hf_base(path: str, seed: int = 3) -> str:
    """A tiny LLaMA written as a Hugging Face directory (what model.init_from reads)."""
    from megacann.interop.hf import save_pretrained_hf
    from megacann.layers import initialize_weights
    from megacann.models import LlamaModel

    fields = {k: v for k, v in TINY_MODEL.items() if k not in ("type", "make_vocab_size_divisible_by")}
    model = LlamaModel(ModelConfig(**{**fields, "vocab_size": VOCAB}))
    initialize_weights(model, seed)
    save_pretrained_hf([model], path, model.config)
    return path


def chunk_logits(trainer, ids: torch.Tensor = IDS) -> torch.Tensor:
    """Logits of a one-stage trainer's model on ``ids`` (eval mode: no dropout)."""
    chunk = trainer.model_chunks[0]
    chunk.eval()
    with torch.no_grad():
        logits = chunk(input_ids=ids)
    chunk.train()
    return logits
