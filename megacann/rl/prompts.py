"""The prompts of an RL run: a JSONL file read once, and which prompts each step samples.

Each line is ``{"prompt": text}`` (used as it is) or ``{"messages": [...]}`` (a conversation ending with a
user turn, rendered by the SFT template ``data.prompt_template`` up to the opening of the answer), plus
any fields the reward reads (``answer`` ...), kept as the line's record. Every record knows its
``file:line``, so a reward that cannot score it names the line.

The order depends only on the seed and the step: step ``t`` takes positions ``[t*n, (t+1)*n)`` of an endless
sequence of epochs, each a permutation of the file seeded by (seed, epoch); the extra rounds of dynamic
sampling draw from a permutation seeded by (seed, step, round). A resumed run therefore samples the prompts
the uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

from megacann.data.sft_templates import PromptTemplate
from megacann.errors import MegacannError

ROLES = ("system", "user", "assistant")


class PromptDataError(MegacannError, ValueError):
    """A prompts file or line that an RL run cannot use."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text (what the reward sees), token ids, the whole record and its ``file:line``."""

    text: str
    ids: tuple[int, ...]
    record: dict = field(hash=False)
    where: str = ""


def _prompt_text(record, template: PromptTemplate) -> str:
    """The text to generate after; raises ValueError saying what is wrong with the record."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise ValueError("'prompt' must be a non-empty string")
        return record["prompt"]
    if "messages" not in record:
        raise ValueError(f"expected a 'prompt' string or a 'messages' list; got keys {sorted(record)}")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with a role ({', '.join(ROLES)}) and a string content")
    if messages[-1]["role"] != "user":
        raise ValueError("'messages' must end with a user turn: the response is generated after it")
    return "".join(text for text, _ in template.render(messages))


def read_prompts(path: str, tokenizer, template: PromptTemplate, max_prompt_tokens: int) -> list[Prompt]:
    """Every prompt of ``path`` in line order, tokenized (the tokenizer's BOS first, when it has one); a line
    that is not usable, or whose prompt leaves no room for the response, raises naming the file and line."""
    if not os.path.isfile(path):
        raise PromptDataError(f"rl.prompts: {path} is not a file (a JSONL of prompt or messages records)")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
                text = _prompt_text(record, template)
            except ValueError as err:
                raise PromptDataError(f"{where}: malformed prompt record: {err}") from None
            bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
            ids = tuple(bos + list(tokenizer.encode(text)))
            if len(ids) > max_prompt_tokens:
                raise PromptDataError(
                    f"{where}: the prompt has {len(ids)} tokens, more than the {max_prompt_tokens} that "
                    "data.seq_length leaves beside rl.max_new_tokens"
                )
            prompts.append(Prompt(text, ids, record, where))
    if not prompts:
        raise PromptDataError(f"rl.prompts: {path} holds no prompt")
    return prompts


class PromptOrder:
    """Which prompts (indices into the file's list) a step samples, from the seed, the step and the round."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epochs: dict[int, list[int]] = {}

    def _permutation(self, *key: int) -> list[int]:
        generator = torch.Generator().manual_seed(hash_seed(self.seed, *key))
        return torch.randperm(self.count, generator=generator).tolist()

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            self._epochs = {epoch: self._permutation(0, epoch)}  # steps walk epochs forwards: keep one
        return self._epochs[epoch]

    def step_prompts(self, step: int, round_index: int, n: int) -> list[int]:
        """``n`` prompt indices of ``step`` (from 0); round 0 walks the epochs, later rounds draw afresh."""
        if round_index == 0:
            positions = range(step * n, (step + 1) * n)
            return [self._epoch(p // self.count)[p % self.count] for p in positions]
        order = self._permutation(1, step, round_index)
        return [order[k % self.count] for k in range(n)]


def hash_seed(*parts: int) -> int:
    """A 62-bit seed mixing ``parts`` (distinct tuples give unrelated seeds)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
