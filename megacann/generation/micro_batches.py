"""A generation's requests split into micro-batches, each with its own rows of the cache.

On pipeline stages one batch leaves every stage idle while another works; split into micro-batches, the
requests of each forward round (the prefill, then each decode step) flow through the stages one group after
another, so a stage runs group ``m + 1`` while the next stage runs group ``m``. Each group keeps its own left
padding, positions and cache (:class:`~megacann.generation.kv_cache.KVCache`), and drops its own finished
rows; a request's tokens do not depend on the group it is in (sampling draws from its own seed).

Requests of a group with the same prompt (a GRPO group's samples) may share its prefill: the prompt runs in
one row, and after that forward its cache rows, logits and next positions are copied to every request that
has it (:meth:`MicroBatch.spread`), so each request then decodes in its own row as if prefilled alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megacann.generation.kv_cache import KVCache


def split_requests(count: int, groups: int) -> list[list[int]]:
    """``count`` request indices in ``groups`` contiguous groups whose sizes differ by at most one (the
    first ones larger; empty ones where there are fewer requests than groups)."""
    base, extra = divmod(count, groups)
    bounds = [0]
    for group in range(groups):
        bounds.append(bounds[-1] + base + (group < extra))
    return [list(range(bounds[g], bounds[g + 1])) for g in range(groups)]


@dataclass
class MicroBatch:
    """One group of requests while it generates: ``requests``, the request of each live row; ``inputs``
    and ``positions``, its next forward's ``[rows, s]`` tokens and positions (the left-padded prompts, then
    one token a row); ``cache``, its rows of every cached layer (None for an empty group); ``logits``, its
    last forward's ``[rows, vocab]`` on the last stage."""

    requests: list[int]
    inputs: torch.Tensor
    positions: torch.Tensor
    cache: Optional[KVCache] = None
    logits: Optional[torch.Tensor] = None
    spread_rows: Optional[torch.Tensor] = None  # shared prefill: each request's prompt row, until spread

    @classmethod
    def of_prompts(
        cls,
        requests: list[int],
        prompts: Sequence[Sequence[int]],
        pad_token_id: int,
        device: torch.device,
        share: bool = False,
    ) -> tuple[MicroBatch, torch.Tensor]:
        """The group of ``requests`` (indices into ``prompts``), its prompts left-padded to its longest,
        each row's positions from 0 at its first real token; and each row's padding ``[rows]``. ``share``:
        one row for each distinct prompt (the first request's), ``spread_rows`` set when some repeat."""
        firsts, spread = (requests, []) if not share else ([], [])
        rows_of: dict[tuple[int, ...], int] = {}  # a distinct prompt's row
        for request in requests if share else ():
            key = tuple(prompts[request])
            if key not in rows_of:
                rows_of[key] = len(firsts)
                firsts.append(request)
            spread.append(rows_of[key])
        lengths = [len(prompts[request]) for request in firsts]
        longest = max(lengths, default=0)
        ids = torch.full((len(firsts), longest), pad_token_id, dtype=torch.long)
        for row, request in enumerate(firsts):
            ids[row, longest - lengths[row] :] = torch.tensor(list(prompts[request]), dtype=torch.long)
        pad = longest - torch.tensor(lengths, dtype=torch.long)
        positions = (torch.arange(longest).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
        batch = cls(requests, ids.to(device), positions.to(device))
        if share and len(firsts) < len(requests):
            batch.spread_rows = torch.tensor(spread, dtype=torch.long, device=device)
        return batch, pad.to(device)

    def spread(self) -> None:
        """After a shared prefill: each request gets its own copy of its prompt's row (cache, logits, next
        inputs and positions)."""
        rows, self.spread_rows = self.spread_rows, None
        self.cache.keep_rows(rows)
        self.inputs, self.positions = self.inputs.index_select(0, rows), self.positions.index_select(0, rows)
        if self.logits is not None:
            self.logits = self.logits.index_select(0, rows)

    def advance(self, tokens: torch.Tensor, finished: list[bool]) -> None:
        """After a forward: ``tokens`` ``[rows]`` (the chosen ones) are the next inputs; rows whose request
        ``finished`` leave the group and its cache."""
        self.cache.advance(self.inputs.shape[1])
        following = self.positions[:, -1] + 1
        keep = [row for row, done in enumerate(finished) if not done]
        if keep and len(keep) < len(finished):
            rows = torch.tensor(keep, device=tokens.device)
            self.cache.keep_rows(rows)
            tokens, following = tokens.index_select(0, rows), following.index_select(0, rows)
        self.requests = [self.requests[row] for row in keep]
        self.inputs, self.positions = tokens.unsqueeze(1), following.unsqueeze(1)
