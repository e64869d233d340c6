"""Pieces the benchmarks share: random-token data for the Trainer and the model section of their recipes."""

from __future__ import annotations

from typing import Any

import torch


class RandomTokens:
    """Micro-batches of random tokens (the Trainer's data interface: ``.train`` and ``.valid()``)."""

    def __init__(self, vocab: int, seq: int, batch: int, seed: int):
        generator = torch.Generator().manual_seed(seed)

        def batches():
            while True:
                rows = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
                yield {"tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

        self.train = batches()

    def valid(self):
        return None


def add_llama_size_args(parser, hidden: int, layers: int, ffn: int, vocab: int, seq: int) -> None:
    """``--hidden --layers --ffn --vocab --seq``: the size of a benchmark's LLaMA (:func:`llama_model`)."""
    for name, default in (("hidden", hidden), ("layers", layers), ("ffn", ffn), ("vocab", vocab), ("seq", seq)):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"model {name} (default {default})")


def llama_model(precision: str, hidden: int, layers: int, ffn: int, vocab: int, seq: int) -> dict[str, Any]:
    """The ``model`` section of a benchmark's LLaMA recipe (8 attention heads, no GQA)."""
    return {
        "type": "llama",
        "precision": precision,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "ffn_hidden_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": seq,
    }
