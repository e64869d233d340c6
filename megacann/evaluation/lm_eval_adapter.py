"""megacann models in lm-evaluation-harness: the ``LM`` interface (``loglikelihood``,
``loglikelihood_rolling``, ``generate_until``) on a megacann model, registered as ``megacann``.

    python -m megacann.evaluation --model megacann --model_args model=DIR --tasks TASK [lm-eval options]

``model`` is what ``megacann-generate --model`` loads (a megacann checkpoint, output, consolidated or
Hugging Face directory); from Python, :class:`MegacannLM` also takes a model module and a tokenizer.
Scores follow lm-eval's Hugging Face backend: a continuation's log-likelihood is the sum of its tokens'
log-probabilities after its context (right-padded batches, one forward), a rolling log-likelihood sums
disjoint windows of ``max_length`` tokens, and ``generate_until`` decodes with the KV-cache generator
(left-padded batches) with ``until`` as its stop strings: a row stops generating once its text holds one,
and its text is cut before it (the tokenizer's EOS ends a row).
Needs the ``eval`` extra (``pip install megacann[eval]``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while empty)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megacann.evaluation.layout import PREFIX, DataParallel, parallel_sizes, start_parallel
from megacann.generation import Generator, SamplingParams, StopStrings

# generate_until's gen_kwargs the adapter honours (lm-eval's names), and what each becomes
SAMPLING_ARGS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed"}
LENGTH_ARGS = ("max_gen_toks", "max_new_tokens", "max_tokens")
IGNORED_ARGS = ("do_sample",)  # temperature decides: 0 is greedy

Request = tuple[Any, list[int], list[int]]  # (its cache key, context tokens, continuation tokens)


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@register_model("megacann")
class MegacannLM(TemplateLM):
    """lm-eval's ``LM`` on a megacann model, in one process or on ``dp x tp`` processes.

    ``model``: a directory (as ``megacann-generate --model``) or a whole-model module; ``tokenizer``:
    ``byte``, a tokenizer.json or directory, or a megacann tokenizer object (default: the directory's);
    ``batch_size`` requests per forward; ``max_length`` tokens a forward sees (default the model's
    ``max_position_embeddings``); ``max_gen_toks`` the default new tokens of ``generate_until``;
    ``add_bos_token`` starts every encoding with the tokenizer's BOS; ``tensor_parallel_size`` loads this
    rank's shards of the model, every rank of a TP group running every request of its data-parallel rank;
    ``data_parallel_size`` ranks (or TP groups) each score their share of the documents, lm-eval gathering
    the results (:mod:`megacann.evaluation.layout`). A size not given fills the launcher's ``WORLD_SIZE``
    (1 outside a launcher) that the other leaves; neither given: all processes are one TP group.
    ``pipeline_parallel_size`` and ``expert_parallel_size`` above 1 are refused.
    """

    def __init__(
        self,
        model: Union[str, torch.nn.Module],
        tokenizer: Any = None,
        batch_size: Union[int, str] = 1,
        max_length: Optional[int] = None,
        max_gen_toks: int = 256,
        add_bos_token: bool = False,
        precision: str = "fp32",
        device: Optional[str] = None,
        max_batch_size: Optional[int] = None,  # lm-eval passes it; only "auto" batch sizes use it
        tensor_parallel_size: Optional[int] = None,
        data_parallel_size: Optional[int] = None,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
    ):
        super().__init__()
        if str(batch_size).startswith("auto"):
            raise ValueError(f"{PREFIX}: batch_size {batch_size!r} is not supported, give a number")
        self.batch_size_per_forward = int(batch_size)
        if self.batch_size_per_forward < 1:
            raise ValueError(f"megacann lm-eval model: batch_size must be >= 1, got {batch_size}")
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            print(f"megacann lm-eval model: device {device!r} is not available here, using the CPU", file=sys.stderr)
            device = "cpu"  # lm-eval's command asks for cuda unless told otherwise; its hf model does the same
        for name, size in (
            ("pipeline_parallel_size", pipeline_parallel_size),
            ("expert_parallel_size", expert_parallel_size),
        ):
            if int(size) != 1:
                raise ValueError(
                    f"{PREFIX}: {name} {size} is not supported (evaluation runs at tensor and data parallel sizes)"
                )
        self.tensor_parallel_size, self.data_parallel_size = parallel_sizes(tensor_parallel_size, data_parallel_size)
        self.data_parallel = DataParallel()  # one process: lm-eval's no-op collectives
        if self.tensor_parallel_size * self.data_parallel_size > 1:
            if isinstance(model, torch.nn.Module):
                raise ValueError(f"{PREFIX}: tensor_parallel_size or data_parallel_size > 1 needs a model directory")
            device = start_parallel(self.tensor_parallel_size, self.data_parallel_size, device)
            self.data_parallel = DataParallel.current()
        self.model, self.tokenizer = _model_and_tokenizer(model, tokenizer, precision, device)
        self._rank, self._world_size = self.data_parallel.rank, self.data_parallel.size
        self._device = next(self.model.parameters()).device  # lm-eval makes its count tensors there
        from megacann.models import get_model_spec

        self._max_length = int(max_length or self.model.config.max_position_embeddings)
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = str(add_bos_token).lower() in ("true", "1")
        eos = self.tokenizer.eos_id
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        self.generator = Generator(
            self.model,
            get_model_spec(self.model.config.type),
            eos_token_ids=[] if eos is None else [eos],
            pad_token_id=pad,
        )

    # -- what TemplateLM asks of a backend ----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS, else EOS (as lm-eval's Hugging Face backend)."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        ids = list(self.tokenizer.encode(string))
        bos = self.tokenizer.bos_id
        if self.add_bos_token and add_special_tokens is not False and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        left_truncate_len = kwargs.get("left_truncate_len")
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` without the special tokens (BOS, EOS, padding)."""
        special = self._special_ids()
        return self.tokenizer.decode([t for t in tokens if t not in special])

    def _special_ids(self) -> set[int]:
        """The ids that add no text to a generation: EOS, BOS and padding."""
        ids = (self.tokenizer.eos_id, self.tokenizer.bos_id, self.tokenizer.pad_id)
        return {t for t in ids if t is not None}

    # -- lm-eval's collectives across data-parallel ranks (its evaluator splits and gathers with them) ------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.data_parallel.all_gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        return self.data_parallel.gather_object(obj, dst)

    def barrier(self) -> None:
        self.data_parallel.barrier()

    # -- scoring -------------------------------------------------------------------------------------------

    def _log_probs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Per input, the fp32 log-softmax of the model's logits at each of its positions ``[len, vocab]``
        (one forward of the batch, right-padded: causal attention keeps padding out of real positions)."""
        longest = max(map(len, inputs))
        ids = torch.zeros(len(inputs), longest, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(device))
        finally:
            self.model.train(was_training)
        log_probs = logits[..., : self.model.config.vocab_size].float().log_softmax(-1).cpu()
        return [log_probs[row, : len(tokens)] for row, tokens in enumerate(inputs)]

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request; the
        longest first, so a batch's padding is small, then back in the requests' order."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        answers: list[Optional[tuple[float, bool]]] = [None] * len(requests)
        for batch in _batches(order, self.batch_size_per_forward):
            inputs = []
            for index in batch:
                _, context, continuation = requests[index]
                inputs.append((context + continuation)[-(self._max_length + 1) :][:-1])
            for index, tokens, log_probs in zip(batch, inputs, self._log_probs(inputs)):
                key, _, continuation = requests[index]
                target = torch.tensor(continuation, dtype=torch.long)
                scored = log_probs[len(tokens) - len(continuation) :]
                answer = (float(scored.gather(1, target.unsqueeze(1)).sum()), bool((scored.argmax(-1) == target).all()))
                answers[index] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood: the sum over disjoint windows of at most ``max_length``
        tokens, the first conditioned on ``prefix_token_id``."""
        windows: list[Request] = []
        owners: list[int] = []
        for number, (text,) in enumerate(request.args for request in requests):
            pieces = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self._max_length, 1)
            for context, continuation in map(make_disjoint_window, pieces):
                windows.append((None, context, continuation))
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------------------------

    def _sampling(self, gen_kwargs: dict[str, Any]) -> SamplingParams:
        """The generator's params of one request's ``gen_kwargs``, ``until`` (and the EOS text) as its stop
        strings; a key the adapter does not know is refused by name."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos_text = self.tokenizer.decode([self.tokenizer.eos_id]) if self.tokenizer.eos_id is not None else ""
        if eos_text and eos_text not in until:
            until.append(eos_text)
        lengths = [kwargs.pop(name) for name in LENGTH_ARGS if name in kwargs]
        params: dict[str, Any] = {
            "max_new_tokens": int(lengths[0]) if lengths else self._max_gen_toks,
            "stop": tuple(stop for stop in until if stop),  # lm-eval lets an empty string through: it stops nothing
        }
        for name in IGNORED_ARGS:
            kwargs.pop(name, None)
        for name in list(kwargs):
            if name not in SAMPLING_ARGS:
                raise ValueError(
                    f"megacann lm-eval model: gen_kwargs key {name!r} is not supported (expected until, "
                    f"{', '.join(LENGTH_ARGS)}, do_sample, {', '.join(SAMPLING_ARGS)})"
                )
            params[SAMPLING_ARGS[name]] = kwargs.pop(name)
        params["temperature"] = float(params.get("temperature") or 0.0)
        return SamplingParams(**params)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's generated text, ended and cut at its first stop string; requests of the same
        ``gen_kwargs`` run in left-padded batches, the longest contexts first."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        texts: list[Optional[str]] = [None] * len(requests)
        for members in groups.values():
            params = self._sampling(requests[members[0]].args[1])
            room = self._max_length - params.max_new_tokens
            if room < 1:
                raise ValueError(
                    f"megacann lm-eval model: max_gen_toks {params.max_new_tokens} leaves no room for a "
                    f"context in max_length {self._max_length}"
                )
            contexts = {i: self.tok_encode(requests[i].args[0], left_truncate_len=room) for i in members}
            order = sorted(members, key=lambda i: -len(contexts[i]))
            for batch in _batches(order, self.batch_size_per_forward):
                stops = StopStrings(self.tokenizer, [params.stop] * len(batch), skip=self._special_ids())
                self.generator.generate([contexts[i] for i in batch], params, stop_check=stops)
                for row, index in enumerate(batch):
                    texts[index] = stops.text(row)
                    self.cache_hook.add_partial("generate_until", requests[index].args, texts[index])
        return texts  # type: ignore[return-value]


def _model_and_tokenizer(
    model: Union[str, torch.nn.Module], tokenizer: Any, precision: str, device: Optional[str]
) -> tuple[torch.nn.Module, Any]:
    """The model (loaded as ``megacann-generate --model`` loads it, when a path) and its tokenizer."""
    if isinstance(model, torch.nn.Module):
        if tokenizer is None or isinstance(tokenizer, str):
            from megacann.data.tokenizer import load_tokenizer

            if tokenizer is None:
                raise ValueError("megacann lm-eval model: a model module needs its tokenizer (tokenizer=...)")
            tokenizer = load_tokenizer(tokenizer)
        return model, tokenizer
    from megacann.generate import load_model, load_model_tokenizer

    loaded = load_model(str(model), precision, device)
    if tokenizer is not None and not isinstance(tokenizer, str):
        return loaded, tokenizer
    return loaded, load_model_tokenizer(str(model), tokenizer, loaded.config.vocab_size)
