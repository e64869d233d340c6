"""The recipe's ``generation_eval``: every ``interval`` steps (and at the last) the training model, at its
layout, generates from a JSONL file of prompts and its completions are scored; the trainer logs the mean
score and the mean response length (console, metrics.jsonl, TensorBoard, wandb) like the eval loss.

Each data-parallel rank generates its share of the prompts (lines ``r, r + D, ...``); sums over the
data-parallel group give the means, so the figures do not depend on the layout. Sampled requests draw with
``seed`` plus their line number, so they too are the same at any layout.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.config.generation_eval import GenerationEvalConfig, Scorer, find_scorer, generation_cache_slots
from megacann.data.jsonl_records import prompt_records
from megacann.generation import Generator, SamplingParams
from megacann.models.spec import ModelSpec


def read_prompts(path: str, key: str = "generation_eval.prompts") -> list[dict[str, Any]]:
    """The JSON object of each non-empty line of ``path``; each needs a ``prompt`` string."""
    records = [record for _, record in prompt_records(path, key)]
    if not records:
        raise ValueError(f"{key} {path}: holds no prompt")
    return records


def score_completions(
    generator: Generator,
    tokenizer: Any,
    records: list[dict[str, Any]],
    prompts: list[list[int]],
    lines: list[int],
    section: GenerationEvalConfig,
    scorer: Scorer,
) -> tuple[float, float, int]:
    """(sum of scores, sum of response lengths in tokens, number of prompts) of ``records`` (their
    ``prompts`` encoded, at the 0-based ``lines`` of the file, which seed their draws), generated in
    batches of ``section.batch_size``."""
    eos = set(generator.eos_token_ids)
    score = length = 0.0
    for start in range(0, len(records), section.batch_size):
        batch = records[start : start + section.batch_size]
        params = [sampling_params(section, line) for line in lines[start : start + section.batch_size]]
        results = generator.generate(prompts[start : start + section.batch_size], params)
        for record, result in zip(batch, results):
            completion = tokenizer.decode([t for t in result.tokens if t not in eos])
            score += float(scorer(completion, record))
            length += len(result.tokens)
    return score, length, len(records)


def sampling_params(section: GenerationEvalConfig, line: int) -> SamplingParams:
    """The generator's params of the prompt at (0-based) ``line``."""
    return SamplingParams(
        max_new_tokens=section.max_new_tokens,
        temperature=section.temperature,
        top_k=section.top_k,
        top_p=section.top_p,
        min_p=section.min_p,
        seed=section.seed + line,
    )


class GenerationEval:
    """What the trainer runs for ``generation_eval``: :meth:`due` at a step, then :meth:`run`."""

    def __init__(self, cfg: MegacannConfig, tokenizer: Any, spec: ModelSpec):
        self.section, self.max_steps, self.spec = cfg.generation_eval, cfg.optim.max_steps, spec
        if not self.section.interval:
            return
        if tokenizer is None:
            raise ValueError("generation_eval needs the run's tokenizer (data.tokenizer), to encode its prompts")
        self.tokenizer = tokenizer
        self.records = read_prompts(self.section.prompts)
        self.prompts = [tokenizer.encode(record["prompt"]) for record in self.records]
        for number, prompt in enumerate(self.prompts, 1):
            if not 0 < len(prompt) <= cfg.data.seq_length:
                raise ValueError(
                    f"generation_eval.prompts {self.section.prompts}: prompt {number} has {len(prompt)} tokens; "
                    f"expected 1 to data.seq_length ({cfg.data.seq_length})"
                )
        self.max_len = generation_cache_slots(cfg)  # the cache --dry_run and megacann-plan report
        self.scorer = find_scorer(self.section.scorer, cfg.experiment.imports)

    def due(self, step: int) -> bool:
        interval = self.section.interval
        return bool(interval) and (step % interval == 0 or step == self.max_steps)

    def after_step(self, step: int, model_chunks: list[torch.nn.Module], watchdog: Any, log: Any) -> Optional[dict]:
        """At a step it is due: run under the trainer's ``watchdog`` and ``log`` the record (returned)."""
        if not self.due(step):
            return None
        with watchdog.watch(f"generation evaluation after step {step}"):
            record = self.run(model_chunks[0], step)
        log(record)
        return record

    def run(self, model: torch.nn.Module, step: int) -> dict[str, Any]:
        """Generate and score this data-parallel rank's prompts; the record to log (the group's means)."""
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        eos = self.tokenizer.eos_id
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        generator = Generator(
            model, self.spec, eos_token_ids=[] if eos is None else [eos], pad_token_id=pad, max_len=self.max_len
        )
        lines = list(range(dp_rank, len(self.records), dp_size))
        records, prompts = [self.records[i] for i in lines], [self.prompts[i] for i in lines]
        totals = score_completions(generator, self.tokenizer, records, prompts, lines, self.section, self.scorer)
        self.last_cache_bytes = generator.last_cache.nbytes if generator.last_cache is not None else 0
        sums = torch.tensor(totals, dtype=torch.float64)
        if dp_size > 1:
            device = next(model.parameters()).device
            sums = sums.to(device)
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
            sums = sums.cpu()
        score, length, count = sums.tolist()
        return {"step": step, "generation_score": score / count, "generation_length": length / count}
