"""The training loop: data -> forward/backward schedule -> gradient reduction -> optimizer -> metrics.

One :class:`Trainer` runs one rank. It knows the model only through its family's
:class:`~megacann.models.ModelSpec`; the schedule (no pipelining, 1F1B, interleaved) comes from
``megacann.pipeline``, the optimizer (plain or ZeRO) from ``megacann.optimizer``, checkpoints from
``megacann.checkpoint`` (given the trainer's parts, not the trainer).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.config.offload_keys import offloaded_layer_ids
from megacann.layers.activation_offload import offload_layer_activations
from megacann.layers.compile import compile_blocks
from megacann.layers.fp8 import roll_amax_histories
from megacann.models import ModelSpec
from megacann.optimizer import LRSchedule, build_optimizer
from megacann.pipeline import Timeline, get_forward_backward_func
from megacann.training import finetune
from megacann.training.failure import guarded
from megacann.training.generation_eval import GenerationEval
from megacann.training.guards import StepGuard
from megacann.training.hf_save import HFSaves
from megacann.training.host_values import step_values_on_host
from megacann.training.metrics import MetricsLogger
from megacann.training.objective import build_objective
from megacann.training.preflight import (
    check_checkpoint_model,
    check_output_dir,
    check_tokenizer_fits,
    finished_run_message,
    resume_path,
)
from megacann.training.profiling import StepProfiling
from megacann.training.rank_model import build_rank_chunks
from megacann.training.recipe import compile_backend, prepare_recipe
from megacann.training.runtime import Runtime, setup_runtime
from megacann.training.signals import make_stop_signals, stop_after_signal
from megacann.training.step_log import stage_timers, start_lines, step_record
from megacann.training.watchdog import start_watchdog


@dataclass
class TrainState:
    """Progress that a checkpoint must carry besides weights and optimizer state."""

    step: int = 0  # optimizer updates done
    consumed_samples: int = 0  # samples of the global order already used
    skipped_steps: int = 0  # steps without an update: fp16 overflow, or skipped by the step guard


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Trainer:
    """Trains one rank of a recipe: builds this rank's model chunks through the model family's spec,
    the optimizer and the schedule, then :meth:`fit` runs steps, evaluation, metrics and checkpoints.

    Works for any registered family (``model.type``) or a ``model_spec`` passed in; the parallel layout,
    precision and everything else come from the recipe.
    """

    def __init__(
        self,
        cfg: MegacannConfig,
        runtime: Optional[Runtime] = None,
        tokenizer=None,
        data=None,
        data_factory: Optional[Callable[[int], Any]] = None,
        model_spec: Optional[ModelSpec] = None,
        checkpoint_follows: bool = False,
    ):
        """``tokenizer`` and ``data`` default to what the recipe's data section builds; tests and custom
        loops may pass their own (``data`` needs ``.train``, an iterator of micro-batches, and ``.valid()``),
        or a ``data_factory(consumed_samples)`` that is called again after a checkpoint is loaded.
        ``model_spec`` defaults to the registered family named by ``model.type``. ``checkpoint_follows``:
        the caller resumes a checkpoint before training, so weights it holds are not drawn."""
        self.cfg = cfg
        self.runtime = runtime or setup_runtime(cfg)
        self.device = self.runtime.device
        self.is_logging_rank = self.runtime.is_main
        self.metrics = MetricsLogger(cfg, enabled=self.is_logging_rank)
        self.model_spec, _ = prepare_recipe(cfg, self.runtime.world_size, spec=model_spec)  # advice printed once
        # checkpoints keep the tokenizer the data is known to be tokenized with: the caller's, or the recipe's
        # when the trainer builds the data itself
        keep_tokenizer = tokenizer is not None or (data is None and data_factory is None)
        if tokenizer is None and (data is None or cfg.model.vocab_size is None):
            from megacann.data import build_tokenizer

            tokenizer = build_tokenizer(cfg)
        self.tokenizer = tokenizer
        self.run_tokenizer = tokenizer if keep_tokenizer else None
        # ids past the embedding would fail deep in the first step: checked for the recipe's data and tokenizer,
        # and for any tokenizer when the weights come from model.init_from
        if tokenizer is not None and (cfg.model.init_from or (data is None and data_factory is None)):
            check_tokenizer_fits(cfg, tokenizer)
        if cfg.model.vocab_size is None:
            cfg.model.vocab_size = tokenizer.vocab_size
        self.model_chunks = build_rank_chunks(cfg, self.model_spec, self.device, checkpoint_follows)
        # model.init_from's weights; LoRA adapters (base frozen): before the optimizer sees the parameters
        self.lora_base = finetune.prepare_model_chunks(cfg, self.model_chunks)
        if compile_backend(cfg) is not None:  # precision.compile: torch.compile per transformer block
            compile_blocks(self.model_chunks, backend=compile_backend(cfg))
        # training.activation_offload_layers: those layers' saved activations go to host memory
        self.activation_offload = offload_layer_activations(self.model_chunks, offloaded_layer_ids(cfg))
        self.named_params = [(n, p) for chunk in self.model_chunks for n, p in chunk.named_parameters()]
        self.params = [p for _, p in self.named_params]
        self.optimizer = build_optimizer(
            cfg, self.named_params, modules=self.model_chunks, sharding_units=self.model_spec.sharding_units
        )
        self.schedule = LRSchedule.from_config(cfg.optim)
        # what a step optimises: the per-token loss, or (train_mode dpo) per-pair losses and a reference policy
        self.objective = build_objective(cfg, self.model_spec, self.model_chunks, self.device, self.tokenizer)
        self.forward_backward = get_forward_backward_func(cfg, self.objective.forward_step)
        # logging.timers: per-stage forward/backward/transfer-wait seconds of each step, in the metrics
        timed = cfg.logging.timers or cfg.logging.profile_breakdown
        self.timeline = Timeline(self.runtime.accelerator.synchronize) if timed else None
        # logging.profile_breakdown / logging.profiler: each step's time split, a torch.profiler trace
        self.profiling = StepProfiling(
            cfg, self.runtime, self.timeline, self.metrics.print, self.optimizer.grad_buffers
        )
        self.state = TrainState()
        self.flops_per_token = self.model_spec.flops_per_token(cfg.model, cfg.data.seq_length)
        self.peak_flops = self.runtime.accelerator.peak_bf16_flops()
        self._data = data
        # grpo: the objective samples its own data (rollouts); the trainer's data only counts the steps
        self._data_factory = data_factory or (self.objective.data_factory if data is None else None)
        self._own_data = data is None
        self._checkpointer = None
        self.guard = StepGuard(cfg.training, log=self.metrics.print)  # non-finite / spiking steps are skipped
        self.hf_saves = HFSaves(cfg, self.metrics.print)  # logging.hf_save_interval: hf_<step>/ beside checkpoints
        self.generation_eval = GenerationEval(cfg, self.tokenizer, self.model_spec)  # the recipe's generation_eval

    # -- data ---------------------------------------------------------------------------------------
    @property
    def data(self):
        if self._data is None and self._data_factory is not None:
            self._data = self._data_factory(self.state.consumed_samples)
        elif self._data is None:
            from megacann.data import build_data_iterators

            self._data = build_data_iterators(
                self.cfg,
                self.tokenizer,
                consumed_samples=self.state.consumed_samples,
                remaining_steps=self.cfg.optim.max_steps - self.state.step,
                dp_rank=ps.get_data_parallel_rank(),
                dp_size=ps.get_data_parallel_world_size(),
            )
        return self._data

    def _next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        return [_to_device(next(self.data.train), self.device) for _ in range(self.cfg.optim.grad_accum_steps)]

    # -- one step -----------------------------------------------------------------------------------
    @guarded
    def train_step(self) -> dict[str, Any]:
        """One optimizer update over grad_accum_steps micro-batches per data-parallel rank.

        The step waits for the device once: its figures (loss, token count, auxiliary losses, stats) stay
        device tensors until the global gradient norm is known, then all are read together so the guard can
        decide whether to apply the update (no ``.item()`` anywhere else). fp16's overflow check and
        pipeline stages' metric merge are the exceptions: they decide or exchange on the host.

        An error on any rank ends every rank promptly, naming the failing one (see training.failure)."""
        for chunk in self.model_chunks:
            chunk.train()
        micro_batches = self._next_micro_batches()
        self.objective.prepare(micro_batches, self.data)  # DPO: the reference policy's log-probabilities
        self.profiling.lap("data_wait")
        num_tokens = self.objective.count(micro_batches)  # the loss's normaliser: target tokens (DPO: pairs)
        lr = self.schedule.lr_at(self.state.step)
        self.optimizer.zero_grad()
        self.optimizer.set_lr(lr)
        timing = {"timeline": self.timeline} if self.timeline is not None else {}
        if self.timeline is not None:
            self.timeline.reset()
        totals = self.forward_backward(
            self.model_chunks,
            micro_batches,
            loss_normalizer=num_tokens,  # a device tensor: the step does not wait for the count
            loss_scale=self.optimizer.loss_scale,
            grad_sync_context=self.optimizer.last_micro_batch_backward,  # overlapped reductions start there
            **timing,
        )
        self.profiling.lap("schedule")
        self.optimizer.finalize_grads()
        self.profiling.lap("grad_comm")
        figures = self.objective.figures({**totals.reduce(num_tokens), "num_tokens": num_tokens})  # on the device
        host: dict[str, Any] = {}

        def veto(grad_norm: torch.Tensor) -> bool:
            """The step's one read of the device (its figures and the global gradient norm together), then
            the guard's verdict: skip a non-finite or spiking loss, or a non-finite norm (alike on all ranks)."""
            host.update(step_values_on_host({**figures, "grad_norm": grad_norm}))
            return self.guard.check_loss(host["loss"]) is not None or self.guard.check_grad_norm(host["grad_norm"])

        updated, grad_norm = self.optimizer.step(veto=veto)
        if not host:  # fp16: an overflow skipped the update before the norm was taken
            host.update(step_values_on_host(figures), grad_norm=None)
            self.guard.check_loss(host["loss"])
        if updated and self.model_spec.after_optimizer_step is not None:
            self.model_spec.after_optimizer_step(self.model_chunks)
        roll_amax_histories(
            self.model_chunks,
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group(with_context_parallel=True),
        )
        self.profiling.lap("optimizer")
        self.state.step += 1
        first_sample = self.state.consumed_samples
        self.state.consumed_samples += self.cfg.global_batch_size
        if not updated:
            self.state.skipped_steps += 1
        samples = (first_sample, self.state.consumed_samples)
        skipped = self.guard.end_step(self.state.step, host["loss"], updated, samples)  # raises after too many
        result = {**host, "lr": lr, "updated": updated, "skipped": skipped}
        if self.cfg.logging.timers:
            result["stage_timers"] = stage_timers(self.timeline, self.device)
        return result

    @guarded
    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """The objective's held-out figures over eval_iters global batches (loss and perplexity; DPO: pair
        loss, reward accuracy and margin), or None without a held-out split."""
        make_iter = self.data.valid
        iterator = make_iter() if make_iter is not None else None
        if iterator is None:
            return None
        for chunk in self.model_chunks:
            chunk.eval()
        batches = (_to_device(b, self.device) for b in iterator)
        return self.objective.evaluate(batches, self.forward_backward, self.data)

    # -- the loop -----------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Train to max_steps; returns the logged records (on the logging rank)."""
        cfg = self.cfg
        log = cfg.logging
        history: list[dict[str, Any]] = []
        self.metrics.start(self.state.step)  # fresh: an earlier metrics.jsonl moves aside; resumed: later records go
        for line in start_lines(self):  # what runs where: layout, operators, a fine-tuning run's base
            self.metrics.print(line)
        self.runtime.accelerator.reset_peak_memory_stats()
        window: list[float] = []  # losses since the last logged step: the logged loss is their mean
        times: list[float] = []  # and their step times
        signals = make_stop_signals(cfg.distributed.timeout_minutes)  # SIGTERM / SIGINT: stop after a step
        watchdog = start_watchdog(cfg, self.runtime.rank, self.runtime.world_size)  # hangs: report, exit
        signals.install()
        try:
            while self.state.step < cfg.optim.max_steps:
                self.profiling.before_step(self.state.step + 1)
                start = time.perf_counter()
                with watchdog.watch(f"step {self.state.step + 1}", is_step=True):
                    step_metrics = self.train_step()
                    self.runtime.accelerator.synchronize()
                step_time = time.perf_counter() - start
                step = self.state.step
                self.profiling.after_step(step, step_time)
                times.append(step_time)
                if step_metrics["skipped"] is None:
                    window.append(step_metrics["loss"])
                if step % log.log_interval == 0 or step == 1 or step == cfg.optim.max_steps:
                    mean = sum(window) / len(window) if window else step_metrics["loss"]
                    record = step_record(self, {**step_metrics, "loss": mean}, sum(times) / len(times))
                    self.profiling.log_window(record, self.metrics.print)  # logging.profile_breakdown
                    self.metrics.log(record)
                    if self.model_spec.metric_warnings is not None:  # e.g. an MoE expert far from its fair share
                        for line in self.model_spec.metric_warnings(record):
                            self.metrics.warn(f"step {step}: {line}")
                    history.append(record)
                    window.clear()
                    times.clear()
                if log.eval_interval and (step % log.eval_interval == 0 or step == cfg.optim.max_steps):
                    with watchdog.watch(f"evaluation after step {step}"):
                        result = self.evaluate()
                    if result is not None:
                        self.metrics.log({"step": step, **result})
                        history.append({"step": step, **result})
                if result := self.generation_eval.after_step(step, self.model_chunks, watchdog, self.metrics.log):
                    history.append(result)
                due = (log.ckpt_interval and step % log.ckpt_interval == 0) or step == cfg.optim.max_steps
                if due and step_metrics["skipped"] is None:  # a skipped step saves nothing new
                    with watchdog.watch(f"checkpoint save at step {step}"):
                        self.save_checkpoint()
                if self.hf_saves.due(step):  # the whole model as a Hugging Face directory, with the tokenizer
                    with watchdog.watch(f"Hugging Face save at step {step}"):
                        self.hf_saves.save(self.model_chunks, self.optimizer, self.run_tokenizer, step)
                signum = signals.agreed()
                if signum is not None:  # saves a checkpoint at this step, raises RunInterrupted
                    stop_after_signal(self, signum, saved=due and step_metrics["skipped"] is None)
            if self._checkpointer is not None:
                self._checkpointer.wait()  # an asynchronous save is published before training returns
        finally:
            self.profiling.close()
            signals.restore()
            watchdog.stop()
            self.metrics.close()
        return history

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpointer(self):
        """The checkpoint reader/writer of this trainer (made on first use; collective)."""
        if self._checkpointer is None:
            from megacann.checkpoint import Checkpointer

            self._checkpointer = Checkpointer(async_save=self.cfg.logging.async_save)
        return self._checkpointer

    def checkpoint_parts(self):
        """The trainer's state as checkpoint parts: model chunks, optimizer, step, data position, counters."""
        from megacann.checkpoint import CheckpointParts
        from megacann.interop.tokenizer import TokenizerFiles

        s = self.state
        kept = [TokenizerFiles(self.run_tokenizer)] if self.run_tokenizer is not None else []
        return CheckpointParts(
            self.model_chunks,
            self.optimizer,
            s.step,
            s.consumed_samples,
            {"skipped_steps": s.skipped_steps},
            files=kept,  # the run's tokenizer, saved beside the weights, so exports carry it
            base=self.lora_base,  # a LoRA run saves its adapters and names its base
            objective_state=self.objective.checkpoint_state(),  # e.g. the rollouts of a GRPO phase it falls inside
        )

    def save_checkpoint(self) -> str:
        """Save ``<output_dir>/checkpoint_<step>`` (in the background with logging.async_save)."""
        return self.checkpointer.save(self.checkpoint_parts(), self.cfg, log=self.metrics.print)

    def load_checkpoint(self, path: str) -> None:
        """Restore the full training state from a checkpoint written under any parallel layout."""
        parts = self.checkpoint_parts()
        self.checkpointer.load(parts, self.cfg, path, log=self.metrics.print)
        self.state = TrainState(parts.step, parts.consumed_samples, **parts.progress)
        self.objective.restore_state(parts.objective_state)
        if self._own_data or self._data_factory is not None:
            self._data = None  # rebuilt at the restored consumed_samples

    def resume(self, resume_from: Optional[str] = None) -> Optional[str]:
        """Load ``resume_from`` (a checkpoint directory, or 'latest'), or with None the newest complete
        checkpoint in output_dir if there is one. Returns the path loaded."""
        out = self.cfg.experiment.output_dir
        path = resume_path(self.cfg, resume_from)  # errors say why a checkpoint asked for cannot be used
        if path is None:
            self.metrics.print(f"no checkpoint in {out}: starting from step 0")
            return None
        why = f"--resume_from {resume_from}" if resume_from else "automatically: output_dir holds a complete checkpoint"
        self.metrics.print(f"resuming from {path} ({why})")
        check_checkpoint_model(self.cfg, path)
        self.load_checkpoint(path)
        return path


def train(cfg: MegacannConfig, resume_from: Optional[str] = None) -> list[dict[str, Any]]:
    """Entry point of ``megacann-train``: set up, resume if asked (or if a checkpoint exists), train."""
    from megacann.training.plot import plot_metrics

    check_output_dir(cfg)
    finished = finished_run_message(cfg, resume_from)
    if finished is not None:  # a finished run: say so rather than start nothing
        if os.environ.get("RANK", "0") == "0":
            print(finished, flush=True)
        return []
    trainer = Trainer(cfg, checkpoint_follows=resume_path(cfg, resume_from) is not None)
    trainer.resume(resume_from)
    trainer.data  # noqa: B018 -- built now: a data error is reported before the first step
    if trainer.is_logging_rank:
        from megacann.checkpoint.metadata import RECIPE_FILE

        os.makedirs(cfg.experiment.output_dir, exist_ok=True)
        with open(os.path.join(cfg.experiment.output_dir, RECIPE_FILE), "w") as f:
            f.write(cfg.to_yaml())
    history = trainer.fit()
    losses = [r["loss"] for r in history if "loss" in r]
    if trainer.is_logging_rank and losses:
        trainer.metrics.print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} ({len(losses)} logged steps)")
        png = plot_metrics(os.path.join(cfg.experiment.output_dir, "metrics.jsonl"))
        if png:
            trainer.metrics.print(f"loss curve: {png}")
    if dist.is_initialized():
        dist.barrier()
    return history
