"""How the next token is chosen from the logits: greedy, or drawn after temperature, top-k, top-p and
min-p, with one seed per request; and the log-probabilities a trainer needs.

A draw takes one uniform number determined by the request's seed and the token's index, so
a request samples the same tokens whatever the batch, the layout or the step a run resumed at. The
log-probability of a token is taken under the model's own distribution (temperature 1, nothing cut:
what the trainer computes) and, on request, under the processed one it was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megacann.generation.stops import check_stop

_SEED_STRIDE = 1_000_003  # token i of seed s draws at counter s * stride + i


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings. ``temperature`` 0 is greedy (the rest then unused); ``top_k`` 0,
    ``top_p`` 1 and ``min_p`` 0 cut nothing. ``stop_token_ids`` end a request like EOS (the stop token is
    kept in its output); ``stop`` (a string or a list of them) ends it once its text holds one, the text
    cut before it (:mod:`megacann.generation.stops`; needs the tokenizer). ``processed_logprobs``: also
    return each token's log-probability under the distribution it was drawn from."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    processed_logprobs: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = {
            "max_new_tokens": (self.max_new_tokens < 1, "must be >= 1"),
            "temperature": (self.temperature < 0, "must be >= 0 (0: greedy)"),
            "top_k": (self.top_k < 0, "must be >= 0 (0: off)"),
            "top_p": (not 0 < self.top_p <= 1, "must be in (0, 1] (1: off)"),
            "min_p": (not 0 <= self.min_p <= 1, "must be in [0, 1] (0: off)"),
        }
        for option, (bad, expected) in problems.items():
            if bad:
                raise ValueError(f"sampling option {option} {expected}, got {getattr(self, option)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", check_stop(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 ``logits`` ``[vocab]`` divided by the temperature, with the tokens top-k, top-p and min-p cut
    set to -inf (each keeps at least the most likely token)."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the more likely tokens
        cut = torch.zeros_like(scores, dtype=torch.bool).scatter(0, order, before >= params.top_p)
        scores = scores.masked_fill(cut, float("-inf"))
    if params.min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores


_MASK64 = (1 << 64) - 1


def _uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) that token ``index`` of a request seeded ``seed`` is drawn at: the top
    53 bits of SplitMix64's output for the counter ``seed * stride + index``, a counter-based draw that
    needs no generator state (computed in Python: a fifth of a seeded generator's cost a draw)."""
    z = (seed * _SEED_STRIDE + index + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def draw(scores: torch.Tensor, seed: int, index: int) -> int:
    """A token from ``softmax(scores)`` by inverting its distribution at one uniform number of the
    generator seeded by ``seed`` and the token's ``index``."""
    u = _uniform(seed, index)
    cumulative = scores.double().softmax(-1).cumsum(-1).cpu()
    target = torch.tensor([u * cumulative[-1].item()], dtype=torch.float64)
    token = int(torch.searchsorted(cumulative, target, right=True))  # never a token of probability 0
    return min(token, scores.numel() - 1)


def choose(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """The next token of one request from its fp32 ``logits`` ``[vocab]`` (``index``: how many tokens it
    has generated before)."""
    if params.greedy:
        return int(logits.argmax())
    return draw(processed_logits(logits, params), params.seed, index)


def choose_rows(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """:func:`choose` for each row of fp32 ``logits`` ``[rows, vocab]`` (row ``i``: ``params[i]``, its
    ``indices[i]``-th token), the same tokens: :func:`draw_rows` as a list."""
    return draw_rows(logits, params, indices).tolist()


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    """:func:`choose` for each row of fp32 ``logits`` ``[rows, vocab]`` (row ``i``: ``params[i]``, its
    ``indices[i]``-th token), the same tokens, as a ``[rows]`` int64 tensor on ``logits``' device. Rows that
    only scale by a temperature (no top-k, top-p or min-p: a rollout's usual settings) are drawn together,
    one softmax and one search for all of them, since one small op per row and token is what a decode step
    of many short rows spends its time on."""
    plain = [i for i, p in enumerate(params) if not p.greedy and not p.top_k and p.top_p == 1 and p.min_p == 0]
    if len(plain) < 2:
        plain = []
    if plain and len(plain) == len(params):  # every row (a rollout's decode step): nothing to pick out
        return _draw_plain(logits, params, indices).to(logits.device)
    tokens = [0] * len(params)
    if plain:
        rows = torch.tensor(plain, device=logits.device)
        chosen = _draw_plain(logits.index_select(0, rows), [params[i] for i in plain], [indices[i] for i in plain])
        for i, token in zip(plain, chosen.tolist()):
            tokens[i] = token
    batched = set(plain)
    for i in range(len(params)):
        if i not in batched:
            tokens[i] = choose(logits[i], params[i], indices[i])
    return torch.tensor(tokens, dtype=torch.long, device=logits.device)


def _draw_plain(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    """One token a row of ``logits`` ``[rows, vocab]`` from ``softmax(logits / temperature)`` at each row's
    uniform number (:func:`draw`'s inversion, for all rows at once); ``[rows]`` int64 on the CPU."""
    temperatures = [p.temperature for p in params]
    scores = logits.float()
    if any(t != 1.0 for t in temperatures):  # dividing by 1 changes nothing: skipped
        scores = scores / torch.tensor(temperatures, device=logits.device).unsqueeze(1)
    cumulative = scores.double().softmax(-1).cumsum(-1).cpu()
    uniforms = torch.tensor([_uniform(p.seed, i) for p, i in zip(params, indices)], dtype=torch.float64)
    targets = (uniforms * cumulative[:, -1]).unsqueeze(1)
    return torch.searchsorted(cumulative, targets, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def processed_logprob(logits: torch.Tensor, params: SamplingParams, token: int) -> float:
    """``token``'s log-probability under the distribution ``params`` draw from (greedy: all mass on the
    most likely token)."""
    if params.greedy:
        return 0.0 if token == int(logits.argmax()) else float("-inf")
    return float(processed_logits(logits, params).log_softmax(-1)[token])
