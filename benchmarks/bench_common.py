"""Pieces the benchmarks share: random-token data for the Trainer (and the Trainer on it), steps timed on
the slowest rank, the model section of their recipes, their integer options and the first line of a
two-rank table. Importing it puts the checkout and tests/ (the tests' gloo launcher, dist_harness) on
``sys.path``, so a benchmark runs from a checkout without an install."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "tests"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


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


def add_int_args(parser, **defaults: int) -> None:
    """One integer option per keyword, ``kv_heads=2`` giving ``--kv-heads`` (default 2)."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"(default {default})")


def add_llama_size_args(parser, hidden: int, layers: int, ffn: int, vocab: int, seq: int) -> None:
    """``--hidden --layers --ffn --vocab --seq``: the size of a benchmark's LLaMA (:func:`llama_model`)."""
    add_int_args(parser, hidden=hidden, layers=layers, ffn=ffn, vocab=vocab, seq=seq)


def two_rank_header(args, what: str) -> str:
    """The first line of a table measured on two gloo ranks: the LLaMA's size (``args``) and ``what``."""
    return (
        f"2 gloo ranks x 1 thread: llama d{args.hidden} x {args.layers} layers, ffn {args.ffn}, seq {args.seq}, "
        f"micro-batch {args.batch}, {what}"
    )


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


@contextlib.contextmanager
def random_token_trainer(recipe: dict[str, Any], seed: int = 0) -> Iterator[Any]:
    """The real Trainer for ``recipe`` on random tokens (:class:`RandomTokens`, the recipe's vocabulary,
    sequence length and micro-batch size), validated for this rank's world (``WORLD_SIZE``, 1 without one);
    on leaving, its loggers closed and the model-parallel groups forgotten, so the next one can start."""
    from megacann import parallel_state as ps
    from megacann.config import config_from_dict, validate
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cfg = config_from_dict(recipe)
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    data = RandomTokens(cfg.model.vocab_size, cfg.data.seq_length, cfg.data.batch_size, seed)
    trainer = Trainer(cfg, setup_runtime(cfg), data=data)
    try:
        yield trainer
    finally:
        trainer.metrics.close()
        ps.destroy_model_parallel()


def timed_steps(trainer: Any, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps, each started together (a barrier) and timed on its
    slowest rank: a step ends when its slowest rank does."""
    import torch.distributed as dist

    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        slowest = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest.item()))
    return times
