"""Rollouts: a group of sampled responses per prompt, drawn by the training model itself, and the
micro-batches a policy step trains on.

Each response is drawn with its own seed, mixed from (run seed, phase, round, the prompt's slot in the
phase, the sample's index in its group), so the same rollout comes out of any layout, batch or resumed run.
The generator returns each token's log-probability under the model's own distribution (what the trainer
recomputes); they travel with the micro-batch as ``rollout_logps`` for the mismatch figures and TIS.

With router replay (``rl.router_replay``, a MoE policy) each rollout also carries the experts every router
of this rank chose for each of its tokens while generating (:mod:`megacann.layers.moe.routing_replay`):
the prefill's for the prompt, each decode step's for the token it fed back (the last new token is never
fed back, so ``prompt + response - 1`` tokens); the micro-batch carries them as ``replay_ids``
``[b, s, routers, k]`` with ``replay_mask`` ``[b, s]`` (the tokens with a recorded choice), both cut along
``s`` like the tokens under context parallelism. With interleaved pipeline chunks the record holds every
chunk's routers of the rank, chunk after chunk, and each chunk's forward replays its own span.

A training row is ``prompt + response``, right-padded to ``data.seq_length``; its labels are the
response's tokens (the EOS that ended it included), shifted like any language-model label, and the ignore
index elsewhere, so only response tokens carry the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megacann.constants import IGNORE_INDEX
from megacann.generation import GenerationResult, Generator, SamplingParams
from megacann.layers.moe.routing_replay import routers, routing_recorded, routing_replayed
from megacann.rl.prompts import Prompt, hash_seed


@dataclass
class Rollout:
    """One sampled response: which prompt (index into the file's list) and which member of its group, the
    new tokens with their log-probabilities, why it ended (``eos``, ``stop``, ``length``) and its rewards."""

    prompt: int
    sample: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    raw_reward: float = 0.0  # the reward function's
    reward: float = 0.0  # with the overlong penalty: what the advantages are computed from
    routing: Optional[list[torch.Tensor]] = None  # router replay: each router's chosen ids [tokens - 1, k]


def sampling_params(rl, seed: int) -> SamplingParams:
    """The recipe's rollout sampling (``rl.max_new_tokens``, temperature, top-p, top-k) with ``seed``."""
    return SamplingParams(
        max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p, seed=seed
    )


def generate_groups(
    generator: Generator,
    prompts: Sequence[Prompt],
    slots: Sequence[tuple[int, int]],
    rl,
    seed_key: tuple[int, ...],
    rows_per_call: int,
    record_routing: bool = False,
) -> list[Rollout]:
    """``rl.group_size`` responses for each ``(slot, prompt index)``, in slot then sample order; each
    response's seed is ``hash_seed(*seed_key, slot, sample)``. At most ``rows_per_call`` rows a generation.
    ``record_routing``: each rollout keeps its tokens' expert choices (router replay)."""
    requests = [(slot, index, k) for slot, index in slots for k in range(rl.group_size)]
    rollouts: list[Rollout] = []
    for first in range(0, len(requests), rows_per_call):
        chunk = requests[first : first + rows_per_call]
        params = [sampling_params(rl, hash_seed(*seed_key, slot, k)) for slot, _, k in chunk]
        ids = [prompts[index].ids for _, index, _ in chunk]
        recording = routing_recorded(generator.model) if record_routing else contextlib.nullcontext()
        with recording as recorded:
            results = generator.generate(ids, params)
        routing = request_routing(recorded, [len(p) for p in ids], results) if record_routing else None
        for row, ((_, index, k), result) in enumerate(zip(chunk, results)):
            rollout = Rollout(index, k, result.tokens, result.logprobs, result.finish_reason or "length")
            rollout.routing = routing[row] if routing is not None else None
            rollouts.append(rollout)
    return rollouts


def request_routing(
    recorded: list[list[torch.Tensor]], prompt_lengths: list[int], results: list[GenerationResult]
) -> list[list[torch.Tensor]]:
    """Each request's expert choices ``[prompt + new tokens - 1, k]`` per router, from what each router
    recorded in one generate call: the prefill ``[rows x longest, k]`` (prompts left-padded), then decode
    step ``t`` (from 1) one row for each request with more than ``t`` new tokens, in request order, feeding
    its new token ``t - 1``; a step with no request of this rank is an idle step of the expert-parallel
    lockstep (skipped)."""
    rows, longest = len(prompt_lengths), max(prompt_lengths)
    out: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for forwards in recorded:
        prefill = forwards[0].view(rows, longest, -1)
        pieces = [[prefill[r, longest - length :]] for r, length in enumerate(prompt_lengths)]
        for step, ids in enumerate(forwards[1:], start=1):
            live = [r for r, result in enumerate(results) if len(result.tokens) > step]
            if not live:
                continue
            if ids.shape[0] != len(live):
                raise RuntimeError(
                    f"routing record: decode step {step} routed {ids.shape[0]} tokens for {len(live)} rows"
                )
            for position, r in enumerate(live):
                pieces[r].append(ids[position : position + 1])
        for r in range(rows):
            out[r].append(torch.cat(pieces[r]).cpu())
    return out


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong penalty: 0 up to ``max_new_tokens - buffer`` tokens, then falling linearly to
    ``-penalty`` at ``max_new_tokens`` (0 when ``buffer`` is 0)."""
    start = max_new_tokens - buffer
    if buffer == 0 or length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer


def gather_rollouts(rollouts: list[Rollout], group) -> list[Rollout]:
    """Every rank's rollouts of ``group`` (data parallel), in rank order (each rank's own list when alone)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return rollouts
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, rollouts, group=group)
    return [r for part in everyone for r in part]


def rollout_micro_batches(
    prompts: Sequence[Prompt],
    rollouts: Sequence[Rollout],
    advantages: Sequence[float],
    seq_length: int,
    batch_size: int,
    pad_id: int,
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of ``batch_size`` rows: ``tokens``, ``labels`` (the response's tokens), ``position_ids``,
    ``advantages`` [b] and the generator's ``rollout_logps`` [b, s] (aligned with the labels, 0 elsewhere)."""
    batches = []
    positions = torch.arange(seq_length)
    for first in range(0, len(rollouts), batch_size):
        rows = rollouts[first : first + batch_size]
        token_rows, label_rows, logp_rows = [], [], []
        for rollout in rows:  # each row as lists, then one tensor a field (not a few small copies a row)
            prompt, response = list(prompts[rollout.prompt].ids), list(rollout.tokens)
            length = len(prompt) + len(response)
            if length > seq_length:
                raise ValueError(f"a rollout of {length} tokens is longer than data.seq_length {seq_length}")
            start, tail = len(prompt) - 1, seq_length - length + 1  # label j predicts token j + 1
            token_rows.append(prompt + response + [pad_id] * (seq_length - length))
            label_rows.append([IGNORE_INDEX] * start + response + [IGNORE_INDEX] * tail)
            logp_rows.append([0.0] * start + list(rollout.logprobs) + [0.0] * tail)
        replay = _replay_tensors(rows, seq_length)
        for row, rollout in enumerate(rows):
            if replay and rollout.routing:
                routed = len(prompts[rollout.prompt].ids) + len(rollout.tokens) - 1
                replay["replay_ids"][row, :routed] = torch.stack(rollout.routing, dim=1)
                replay["replay_mask"][row, :routed] = True
        batches.append(
            {
                "tokens": torch.tensor(token_rows, dtype=torch.long),
                "labels": torch.tensor(label_rows, dtype=torch.long),
                "position_ids": positions.expand(len(rows), seq_length).clone(),
                "advantages": torch.tensor(advantages[first : first + batch_size], dtype=torch.float32),
                "rollout_logps": torch.tensor(logp_rows, dtype=torch.float32),
                **replay,
            }
        )
    return batches


def _replay_tensors(rows: Sequence[Rollout], seq_length: int) -> dict[str, torch.Tensor]:
    """Empty ``replay_ids`` ``[b, s, routers, k]`` and ``replay_mask`` ``[b, s]`` for rollouts that carry
    their routing ({} for those that do not)."""
    if not rows or rows[0].routing is None:
        return {}
    routers, k = len(rows[0].routing), (rows[0].routing[0].shape[-1] if rows[0].routing else 1)
    return {
        "replay_ids": torch.zeros((len(rows), seq_length, routers, k), dtype=torch.long),
        "replay_mask": torch.zeros((len(rows), seq_length), dtype=torch.bool),
    }


def replaying_forward_step(forward_step: Callable, chunks: Sequence[torch.nn.Module] = ()) -> Callable:
    """``forward_step`` whose chunk's routers reuse the micro-batch's recorded choices (``replay_ids``,
    ``replay_mask``) where it has them (router replay). ``chunks``: this rank's model chunks, in the order the
    generator recorded their routers (interleaved pipeline chunks: chunk 0's routers, then chunk 1's ...);
    each chunk replays its own span of the record's routers (all of them when ``chunks`` holds one or none)."""
    spans = _router_spans(chunks)

    def step(chunk: torch.nn.Module, batch: dict, hidden_states: Optional[torch.Tensor]):
        ids = batch["replay_ids"].unbind(2)  # per router [b, s, k]
        if spans:
            found = routers(chunk)
            first = spans[id(found[0])] if found else 0
            ids = ids[first : first + len(found)]
        with routing_replayed(chunk, ids, batch["replay_mask"]):
            return forward_step(chunk, batch, hidden_states)

    return step


def _router_spans(chunks: Sequence[torch.nn.Module]) -> dict[int, int]:
    """For several chunks, each router's index in the rank's whole record (by the router's id); {} for one."""
    if len(chunks) < 2:
        return {}
    found = [router for chunk in chunks for router in routers(chunk)]
    return {id(router): index for index, router in enumerate(found)}


def response_figures(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Response length mean and max (tokens) and the share cut at ``max_new_tokens`` (``truncation_rate``)."""
    lengths = [len(r.tokens) for r in rollouts]
    return {
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": float(max(lengths)),
        "truncation_rate": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
    }
