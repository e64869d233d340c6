"""Prefill plus incremental decoding of a batch of requests on a model at its training layout.

Prompts of different lengths are left-padded into one batch; each row's positions start at 0 at its first
real token and its padding is never attended to (:mod:`megacann.generation.kv_cache`). The prompt runs
in one forward (the prefill), then one token a row per forward. A request ends at EOS, at one of its stop
tokens or after its ``max_new_tokens``; its row then leaves the batch and its cache, so finished
requests cost nothing more. The generator knows the model only through the contract: the family's
``ModelSpec.decode`` and the attention layers (:class:`~megacann.layers.SelfAttention`) it caches for.

Under tensor parallelism each rank holds its heads' share of the cache and computes the whole
logits (the head gathers the vocabulary), so every rank draws the same token; the first rank's is sent
to the others all the same. Sequence parallelism is switched off while generating: one new token a row
cannot be split over ranks, and without the split the layers compute the same values (all-reduce in
place of reduce-scatter plus all-gather); an MoE layer then takes its whole, replicated input as its
rank's share, which gives the same values too. On pipeline stages each forward runs stage after stage
and the last stage's choices reach every stage (:mod:`.pipeline_stages`); under expert parallelism the
ranks of a group stay in step until all of them are done (:mod:`.lockstep`); under ZeRO-3 the weights
are gathered once for a call and freed after (:mod:`megacann.layers.gathered_weights`). Context
parallelism is refused unless the caller asks for ``context_parallel_replicas``: then every cp rank
generates the whole sequences by itself (attention reads its own cache, never the cp group), the caller
giving the cp ranks of a data-parallel rank the same requests (the GRPO loop's rollouts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.generation.kv_cache import KVCache
from megacann.generation.lockstep import Lockstep
from megacann.generation.pipeline_stages import PipelineStages, check_pipeline_generation
from megacann.generation.sampling import SamplingParams, choose_rows, processed_logprob
from megacann.layers import MoELayer
from megacann.layers.gathered_weights import weights_gathered
from megacann.models.spec import ModelSpec

TokenCallback = Callable[[int, int], None]  # (request index, token) as each token is chosen
StopCheck = Callable[[int, int], bool]  # (request index, token) -> the request's text now holds a stop string


@dataclass
class GenerationResult:
    """One request's new tokens, each one's log-probability under the model's distribution, the
    processed distribution's (when its params asked), and why it ended: ``eos``, ``stop`` or ``length``."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    processed_logprobs: Optional[list[float]] = None
    finish_reason: Optional[str] = None


@contextlib.contextmanager
def sequence_parallel_off(model: torch.nn.Module) -> Iterator[None]:
    """The model's layers compute without splitting the sequence over TP ranks inside the block."""
    changed = [m for m in model.modules() if getattr(m, "sequence_parallel", False) is True]
    overlapped = [m for m in model.modules() if getattr(m, "comm_overlap", False) is True]
    # an MoE layer under TP takes its (now whole, replicated) input as this rank's sequence shard: it
    # gathers the ranks' copies (each token TP times), its TP-split experts compute their shares, and its
    # reduce-scatter hands each rank one copy's summed shares, the whole output (a one-token step cannot
    # be split over the ranks instead)
    moe_split = [m for m in model.modules() if isinstance(m, MoELayer) and m.tp_size > 1]
    moe_was = [m.config.sequence_parallel for m in moe_split]
    for module in changed:
        module.sequence_parallel = False
    for module in overlapped:
        module.comm_overlap = False
    for module in moe_split:
        module.config.sequence_parallel = True
    try:
        yield
    finally:
        for module in changed:
            module.sequence_parallel = True
        for module in overlapped:
            module.comm_overlap = True
        for module, was in zip(moe_split, moe_was):
            module.config.sequence_parallel = was


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) inside the block, in the mode it had after it (a trainer's
    model generating between steps goes back to training)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class Generator:
    """Generate from ``model`` (this rank's chunk of a model of family ``spec`` at its layout: the whole
    model, or its pipeline stage; every rank of the model's groups calls :meth:`generate` together).

    ``eos_token_ids`` end every request; ``pad_token_id`` fills the padding (never attended to);
    ``max_len`` (None: as long as the batch needs) is the cache's tokens a row, prompt padding included.
    ``context_parallel_replicas``: under context parallelism each cp rank generates whole sequences alone
    (the module's docstring); refused without it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: ModelSpec,
        *,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        max_len: Optional[int] = None,
        context_parallel_replicas: bool = False,
    ):
        if spec.decode is None:
            raise ValueError(
                f"model family {spec.name!r} declares no decode path (ModelSpec.decode): it cannot generate"
            )
        if ps.get_context_parallel_world_size() > 1 and not context_parallel_replicas:
            raise ValueError(
                f"generation under context parallelism (distributed.context_parallel_size "
                f"{ps.get_context_parallel_world_size()}) is refused: decode one token a row with "
                "context_parallel_size 1"
            )
        check_pipeline_generation(model, spec)
        self.model, self.spec = model, spec
        self.stages, self.lockstep = PipelineStages(model, spec), Lockstep()
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.pad_token_id, self.max_len = pad_token_id, max_len
        self.last_cache: Optional[KVCache] = None  # the cache of the last generate call (its bytes, shapes)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _cache_length(self, lengths: list[int], params: list[SamplingParams]) -> int:
        """Slots a row needs: the longest prompt, then one per new token but the last (never fed back)."""
        longest = max(lengths)
        need = longest + max(p.max_new_tokens for p in params) - 1
        if self.max_len is None:
            return need
        if longest > self.max_len:
            raise ValueError(f"a prompt of {longest} tokens is longer than the cache's max_len {self.max_len}")
        if need > self.max_len:
            raise ValueError(
                f"the longest prompt ({longest} tokens) plus max_new_tokens needs {need} cache slots a row, "
                f"more than max_len {self.max_len}"
            )
        return self.max_len

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        on_token: Optional[TokenCallback] = None,
        stop_check: Optional[StopCheck] = None,
    ) -> list[GenerationResult]:
        """One result per prompt (token ids); ``params`` for all of them or one per prompt (None: greedy,
        64 new tokens). ``stop_check`` is called with each chosen token before ``on_token`` and ends its
        request (``stop``) when it answers True: params with ``stop`` strings need one, e.g.
        :class:`~megacann.generation.stops.StopStrings`."""
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if stop_check is None and any(p.stop for p in params):
            raise ValueError("sampling option stop needs the tokenizer: pass stop_check=StopStrings(tokenizer, ...)")
        if not prompts and self.lockstep.needed:  # none here, but the expert-parallel group needs this rank
            return self._idle_until_done()
        lengths = [len(p) for p in prompts]
        if not prompts or min(lengths) == 0:
            raise ValueError(
                "generation needs at least one prompt (none only under expert parallelism), and no empty prompt"
            )
        device, longest = self._device(), max(lengths)
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        pad = longest - torch.tensor(lengths)
        positions = (torch.arange(longest).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
        cache = self.last_cache = KVCache(self.model, len(prompts), self._cache_length(lengths, params), pad.to(device))
        results = [GenerationResult(processed_logprobs=[] if p.processed_logprobs else None) for p in params]
        active = list(range(len(prompts)))  # the request of each batch row
        next_positions = torch.tensor(lengths, device=device)
        with (
            torch.no_grad(),
            evaluating(self.model),
            cache.attached(),
            sequence_parallel_off(self.model),
            weights_gathered(self.model),  # ZeRO-3: gathered once for the whole call, not once a forward
        ):
            logits = self.stages.forward(ids.to(device), positions.to(device), prefill=True)
            cache.advance(longest)
            while True:
                if active:
                    tokens = self._choose(logits, active, params, results, on_token, stop_check)
                    keep = [row for row, request in enumerate(active) if results[request].finish_reason is None]
                    if keep and len(keep) < len(active):
                        rows = torch.tensor(keep, device=device)
                        cache.keep_rows(rows)
                        tokens, next_positions = tokens.index_select(0, rows), next_positions.index_select(0, rows)
                    active = [active[row] for row in keep]
                if not self.lockstep.anyone_active(bool(active), device):
                    return results
                if not active:  # finished here, not everywhere: join the group's all-to-alls
                    with self.lockstep.without_cache(cache):
                        self._idle_step(device)
                    continue
                logits = self.stages.forward(tokens.unsqueeze(1), next_positions.unsqueeze(1), prefill=False)
                cache.advance(1)
                next_positions = next_positions + 1

    def _idle_step(self, device: torch.device, prefill: bool = False) -> None:
        """One forward of a pad token at position 0, its output unused, with no cache attached
        (:mod:`.lockstep`); ``prefill``: the first forward of this rank's call."""
        pad = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=device)
        self.stages.forward(pad, torch.zeros_like(pad), prefill=prefill)
        self.lockstep.idle_steps += 1

    def _idle_until_done(self) -> list[GenerationResult]:
        """No request on this rank: an idle step beside the group's prefill and each of its decode steps."""
        device = self._device()
        with torch.no_grad(), evaluating(self.model), sequence_parallel_off(self.model), weights_gathered(self.model):
            self._idle_step(device, prefill=True)
            while self.lockstep.anyone_active(False, device):
                self._idle_step(device)
        return []

    def _choose(
        self,
        logits: Optional[torch.Tensor],
        active: list[int],
        params: list[SamplingParams],
        results: list[GenerationResult],
        on_token: Optional[TokenCallback],
        stop_check: Optional[StopCheck] = None,
    ) -> torch.Tensor:
        """Each row's next token, recorded in its request's result (ended where it must). ``logits``: the
        last pipeline stage's (None on the others, which receive its choices)."""
        choices = torch.empty(3, len(active), dtype=torch.float64, device=self._device())
        if logits is not None:
            choices = self._pick(logits.float(), active, params, results)
        tokens_row, logprobs, processed = self.stages.share(choices).tolist()
        tokens = torch.tensor([int(t) for t in tokens_row], device=choices.device)
        for row, request in enumerate(active):
            result, p, token = results[request], params[request], int(tokens_row[row])
            result.tokens.append(token)
            result.logprobs.append(logprobs[row])
            if result.processed_logprobs is not None:
                result.processed_logprobs.append(processed[row])
            stopped = stop_check is not None and stop_check(request, token)
            if on_token is not None:
                on_token(request, token)
            if token in self.eos_token_ids:
                result.finish_reason = "eos"
            elif token in p.stop_token_ids or stopped:
                result.finish_reason = "stop"
            elif len(result.tokens) >= p.max_new_tokens:
                result.finish_reason = "length"
        return tokens

    def _pick(
        self, logits: torch.Tensor, active: list[int], params: list[SamplingParams], results: list[GenerationResult]
    ) -> torch.Tensor:
        """``[3, rows]`` float64: each row's token (the TP group's first rank's), its log-probability under
        the model's distribution and under the processed one (NaN where its request did not ask)."""
        chosen = choose_rows(logits, [params[r] for r in active], [len(results[r].tokens) for r in active])
        tokens = torch.tensor(chosen, device=logits.device)
        if ps.get_tensor_model_parallel_world_size() > 1:  # every rank feeds the same tokens back
            group = ps.get_tensor_model_parallel_group()
            dist.broadcast(tokens, ps.get_tensor_model_parallel_src_rank(), group=group)
        logprobs = logits.log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        processed = [
            processed_logprob(logits[row], params[request], int(tokens[row]))
            if params[request].processed_logprobs
            else float("nan")
            for row, request in enumerate(active)
        ]
        return torch.stack([tokens.double(), logprobs.double(), torch.tensor(processed, dtype=torch.float64)])
