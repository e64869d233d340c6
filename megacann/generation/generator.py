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
rank's share, which gives the same values too. On pipeline stages the requests are split into
micro-batches that flow through the stages one after another in each forward round, each with its own
cache rows (:mod:`.micro_batches`), and the last stage's choices reach every stage
(:mod:`.pipeline_stages`; with interleaved chunks a rank passes all its chunks, run in the pipeline's
order); under expert parallelism the ranks of a group stay in step until all of them are done
(:mod:`.lockstep`); under ZeRO-3 the weights
are gathered once for a call and freed after (:mod:`megacann.layers.gathered_weights`). Context
parallelism is refused unless the caller asks for ``context_parallel_replicas``: then every cp rank
generates the whole sequences by itself (attention reads its own cache, never the cp group), the caller
giving the cp ranks of a data-parallel rank the same requests (the GRPO loop's rollouts).

:meth:`Generator.extend` continues one request on a cache kept from an earlier call (a chat's
conversation): only the new tokens run, after the cached ones.
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
from megacann.generation.micro_batches import MicroBatch, split_requests
from megacann.generation.pipeline_stages import PipelineStages, check_pipeline_generation
from megacann.generation.sampling import SamplingParams, draw_rows, processed_logprob
from megacann.layers import MoELayer
from megacann.layers.gathered_weights import weights_gathered
from megacann.models.spec import ModelSpec
from megacann.ops.weight_copies import call_weight_copies

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


def _check_stops(params: list[SamplingParams], stop_check: Optional[StopCheck]) -> None:
    if stop_check is None and any(p.stop for p in params):
        raise ValueError("sampling option stop needs the tokenizer: pass stop_check=StopStrings(tokenizer, ...)")


@contextlib.contextmanager
def sequence_parallel_off(model: torch.nn.Module) -> Iterator[None]:
    """The model's layers compute without splitting the sequence over TP ranks inside the block."""
    modules = list(model.modules())  # one walk of the model for the three lists
    changed = [m for m in modules if getattr(m, "sequence_parallel", False) is True]
    overlapped = [m for m in modules if getattr(m, "comm_overlap", False) is True]
    # an MoE layer under TP takes its (now whole, replicated) input as this rank's sequence shard: it
    # gathers the ranks' copies (each token TP times), its TP-split experts compute their shares, and its
    # reduce-scatter hands each rank one copy's summed shares, the whole output (a one-token step cannot
    # be split over the ranks instead)
    moe_split = [m for m in modules if isinstance(m, MoELayer) and m.tp_size > 1]
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
    """The model in eval mode (no dropout) inside the block; after it each module is back in the mode it
    had (a trainer's model generating between steps goes back to training, a submodule it keeps in eval
    stays so). The flags are set directly (``Module.train`` walks and sets them through
    ``Module.__setattr__``, a tenth of a small model's generate call); a module whose class overrides
    ``train`` is asked through it."""
    modules = list(model.modules())
    was = [m.training for m in modules]
    for m in modules:
        if type(m).train is not torch.nn.Module.train:
            m.train(False)
        object.__setattr__(m, "training", False)
    try:
        yield
    finally:
        for m, mode in zip(modules, was):
            if type(m).train is not torch.nn.Module.train:
                m.train(mode)
            object.__setattr__(m, "training", mode)


class Generator:
    """Generate from ``model`` (this rank's part of a model of family ``spec`` at its layout: the whole
    model, its pipeline stage's chunk, or the list of its interleaved chunks in order; every rank of the
    model's groups calls :meth:`generate` together).

    ``eos_token_ids`` end every request; ``pad_token_id`` fills the padding (never attended to);
    ``max_len`` (None: as long as the batch needs) is the cache's tokens a row, prompt padding included.
    ``context_parallel_replicas``: under context parallelism each cp rank generates whole sequences alone
    (the module's docstring); refused without it. ``share_prompts``: requests of a micro-batch with the same
    prompt share one prefill row, copied to each before the first token is chosen (the same results; off
    for models with MoE layers). ``num_microbatches`` (None: the pipeline size): the
    groups the requests are split into, each forward round running them one after another (on pipeline
    stages, overlapped); the results are the same for any number. ``cpu_weight_copies``: on CPU a call's
    products read transposed fp32 copies of the weights, made once for the call (faster steps, one fp32
    copy of the weights for the call's length; :mod:`megacann.ops.weight_copies`); False keeps the memory.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
        spec: ModelSpec,
        *,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        max_len: Optional[int] = None,
        context_parallel_replicas: bool = False,
        num_microbatches: Optional[int] = None,
        share_prompts: bool = False,
        cpu_weight_copies: bool = True,
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
        chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        check_pipeline_generation(chunks, spec)
        if num_microbatches is not None and (
            isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1
        ):
            raise ValueError(f"generation option num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        self.num_microbatches = num_microbatches or ps.get_pipeline_model_parallel_world_size()
        # one module holding every chunk: the cache serves all their attention layers, each its own entries
        self.model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        self.chunks, self.spec = chunks, spec
        self.stages, self.lockstep = PipelineStages(chunks, spec), Lockstep()
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.pad_token_id, self.max_len = pad_token_id, max_len
        self.last_caches: list[KVCache] = []  # the last generate call's caches, one a micro-batch (bytes, shapes)
        # equal prompts of a micro-batch prefilled once (not for MoE layers: their routing record and token
        # capacity see the rows of a forward)
        self.share_prompts = share_prompts and not any(isinstance(m, MoELayer) for m in self.model.modules())
        self.cpu_weight_copies = cpu_weight_copies

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
        _check_stops(params, stop_check)
        # none here is allowed under expert parallelism: the group needs this rank's forwards
        if (not prompts and not self.lockstep.needed) or any(len(p) == 0 for p in prompts):
            raise ValueError(
                "generation needs at least one prompt (none only under expert parallelism), and no empty prompt"
            )
        device = self._device()
        batches = []
        for requests in split_requests(len(prompts), self.num_microbatches):
            batch, pad = MicroBatch.of_prompts(requests, prompts, self.pad_token_id, device, self.share_prompts)
            if requests:
                lengths = [len(prompts[r]) for r in requests]
                slots = self._cache_length(lengths, [params[r] for r in requests])
                batch.cache = KVCache(self.model, len(pad), slots, pad)  # a row a distinct prompt when shared
            batches.append(batch)
        self.last_caches = [batch.cache for batch in batches if batch.cache is not None]
        return self._decode(batches, params, on_token, stop_check)

    def new_cache(self, max_len: int) -> KVCache:
        """An empty one-row cache of ``max_len`` tokens for :meth:`extend` (a conversation kept across
        turns)."""
        return KVCache(self.model, 1, max_len, torch.zeros(1, dtype=torch.long, device=self._device()))

    def extend(
        self,
        cache: KVCache,
        tokens: Sequence[int],
        params: SamplingParams,
        on_token: Optional[TokenCallback] = None,
        stop_check: Optional[StopCheck] = None,
    ) -> GenerationResult:
        """One request continuing the tokens a one-row ``cache`` holds (empty from :meth:`new_cache`, or
        filled by an earlier call): ``tokens`` run after them in one forward, then one token a forward as
        :meth:`generate` does. After it the cache holds every token but the last one chosen, which the
        next call's ``tokens`` must start with; the tokens chosen equal :meth:`generate`'s on the whole
        sequence. On one process (or one micro-batch), for caches whose layers take several new tokens
        after cached ones (``cache.extendable``: every built-in kind)."""
        if self.num_microbatches != 1 or len(cache.pad) != 1 or not cache.extendable:
            raise ValueError("extend needs one micro-batch and a one-row cache whose layers take several tokens")
        need = cache.length + len(tokens) + params.max_new_tokens - 1
        if not tokens or need > cache.max_len:
            raise ValueError(
                f"extending a cache of {cache.length} tokens by {len(tokens)} (at least one) and "
                f"max_new_tokens {params.max_new_tokens} needs {need} slots, more than its {cache.max_len}"
            )
        _check_stops([params], stop_check)
        device = self._device()
        positions = torch.arange(cache.length, cache.length + len(tokens), device=device).unsqueeze(0)
        inputs = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        self.last_caches = [cache]
        return self._decode([MicroBatch([0], inputs, positions, cache)], [params], on_token, stop_check)[0]

    def _decode(
        self,
        batches: list[MicroBatch],
        params: list[SamplingParams],
        on_token: Optional[TokenCallback],
        stop_check: Optional[StopCheck],
    ) -> list[GenerationResult]:
        """Run ``batches`` (their first forward's inputs and caches set) until every request ended."""
        device = self._device()
        results = [GenerationResult(processed_logprobs=[] if p.processed_logprobs else None) for p in params]
        self.stages.begin()
        with (
            torch.no_grad(),
            evaluating(self.model),
            sequence_parallel_off(self.model),
            contextlib.ExitStack() as gathered,
        ):
            for chunk in self.chunks:  # ZeRO-3: gathered once for the whole call, not once a forward
                gathered.enter_context(weights_gathered(chunk))
            gathered.enter_context(call_weight_copies(self.cpu_weight_copies))
            while True:
                self._round(batches, device)
                live = [batch for batch in batches if batch.requests]
                for batch, tokens in zip(live, self._choose(live, params, results, on_token, stop_check)):
                    batch.advance(tokens, [results[request].finish_reason is not None for request in batch.requests])
                if not self.lockstep.anyone_active(any(batch.requests for batch in batches), device):
                    return results

    @property
    def last_cache(self) -> Optional[KVCache]:
        """The first micro-batch's cache of the last generate call (``last_caches``: every micro-batch's;
        one at one micro-batch)."""
        return self.last_caches[0] if self.last_caches else None

    def _round(self, batches: list[MicroBatch], device: torch.device) -> None:
        """One forward of each micro-batch with live rows, in order, each with its own cache; an empty one
        runs an idle step where the expert-parallel group needs this rank's forwards (:mod:`.lockstep`)."""
        for batch in batches:
            if batch.requests:
                with batch.cache.attached():
                    batch.logits = self.stages.forward(batch.inputs, batch.positions)
                if batch.spread_rows is not None:  # a shared prefill: a row of its own for each request now
                    batch.spread()
            elif self.lockstep.needed:
                pad = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=device)
                self.stages.forward(pad, torch.zeros_like(pad))
                self.lockstep.idle_steps += 1

    def _choose(
        self,
        batches: list[MicroBatch],
        params: list[SamplingParams],
        results: list[GenerationResult],
        on_token: Optional[TokenCallback],
        stop_check: Optional[StopCheck] = None,
    ) -> list[torch.Tensor]:
        """Each live row's next token (a ``[rows]`` tensor per micro-batch), recorded in its request's
        result (ended where it must). The last pipeline stage chooses from its logits; the others receive
        its choices, every micro-batch's in one broadcast."""
        requests = [request for batch in batches for request in batch.requests]
        if not requests:  # every stage of this rank's pipeline holds the same (no) rows
            return []
        choices = torch.empty(3, len(requests), dtype=torch.float64, device=batches[0].inputs.device)
        if self.stages.last:
            choices = torch.cat([self._pick(b.logits.float(), b.requests, params, results) for b in batches], 1)
        tokens_row, logprobs, processed = self.stages.share(choices).tolist()
        for row, request in enumerate(requests):
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
        tokens = torch.tensor(tokens_row, dtype=torch.long, device=choices.device)  # exact: ids < 2**53
        return list(tokens.split([len(batch.requests) for batch in batches]))

    def _pick(
        self, logits: torch.Tensor, active: list[int], params: list[SamplingParams], results: list[GenerationResult]
    ) -> torch.Tensor:
        """``[3, rows]`` float64: each row's token (the TP group's first rank's), its log-probability under
        the model's distribution and under the processed one (NaN where its request did not ask)."""
        sampled = [row for row, request in enumerate(active) if not params[request].greedy]
        requests = [active[row] for row in sampled]
        drawn = [params[r] for r in requests], [len(results[r].tokens) for r in requests]
        if len(sampled) == len(active):  # every row drawn (a rollout): no greedy choice to make
            tokens = draw_rows(logits, *drawn)
        else:  # the greedy rows' choices in one op; the sampled rows drawn together
            tokens = logits.argmax(-1)
            if sampled:
                tokens[sampled] = draw_rows(logits[sampled], *drawn)
        if ps.get_tensor_model_parallel_world_size() > 1:  # every rank feeds the same tokens back
            group = ps.get_tensor_model_parallel_group()
            dist.broadcast(tokens, ps.get_tensor_model_parallel_src_rank(), group=group)
        logprobs = logits.log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        processed = torch.full((len(active),), float("nan"), dtype=torch.float64, device=logits.device)
        for row, request in enumerate(active):
            if params[request].processed_logprobs:
                processed[row] = processed_logprob(logits[row], params[request], int(tokens[row]))
        return torch.stack([tokens.double(), logprobs.double(), processed])
