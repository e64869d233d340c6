"""Bad numbers and stop signals on 2 gloo ranks (pipeline stages, so the ranks hold different parts of the
model and only the last one computes the loss): a poisoned step is skipped on every rank alike with
parameters and optimizer state untouched; too many in a row stop the run naming the step, saving nothing
new; fp16 overflow stays the loss scaler's business; SIGTERM on one rank stops both after the same step
with a checkpoint there."""

import os
import signal

import pytest
from dist_harness import run_on_ranks

PP2 = ["distributed.pipeline_parallel_size=2", "optim.grad_accum_steps=2", "logging.log_interval=1"]


def _trainer(out: str, overrides: list[str]):
    import torch.distributed as dist
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    cfg = tiny_config([*PP2, f"experiment.output_dir={out}", *overrides], world_size=dist.get_world_size())
    return Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))


def _optimizer_state(trainer) -> list:
    return [t.detach().clone() for shard in trainer.optimizer.state_shards() for t in shard.tensors.values()]


def _poison(trainer, grad_steps: set, loss_steps: set) -> list:
    """NaN into one gradient (``grad_steps``) or into the local loss (``loss_steps``) of the last stage
    only; records, per step, what happened to parameters and optimizer state."""
    import torch
    import torch.distributed as dist

    from megacann.models.contract import LossTotals
    from megacann.optimizer.optimizer import optimizer_step_count

    last_stage = dist.get_rank() == 1
    finalize, add, step = trainer.optimizer.finalize_grads, LossTotals.add, trainer.train_step

    def poisoned_finalize():
        finalize()
        if last_stage and trainer.state.step + 1 in grad_steps:
            trainer.params[0].main_grad.view(-1)[0] = float("nan")

    def poisoned_add(self, output):
        add(self, output)
        if last_stage and trainer.state.step + 1 in loss_steps:
            self.token_loss = self.token_loss + float("inf")

    log = []

    def recorded_step():
        params = [p.detach().clone() for p in trainer.params]
        state, count = _optimizer_state(trainer), optimizer_step_count(trainer.optimizer.optimizer)
        try:
            out = step()
        finally:
            same_params = all(torch.equal(a, p) for a, p in zip(params, trainer.params))
            same_state = all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(trainer)))
            same_count = count == optimizer_step_count(trainer.optimizer.optimizer)
            log.append((trainer.state.step, same_params and same_state and same_count))
        log[-1] += (out["updated"], out["skipped"])
        return out

    trainer.optimizer.finalize_grads = poisoned_finalize
    LossTotals.add = poisoned_add
    trainer.train_step = recorded_step
    return log


def _steps_and_signals(root: str) -> dict:
    import torch.distributed as dist

    from megacann.errors import TrainingAborted
    from megacann.training.signals import RunInterrupted

    result = {}
    # 1. steps 3 (grad) and 4 (loss) skipped, 5 applied, 6-8 skipped: 3 in a row stop the run at step 8
    trainer = _trainer(f"{root}/nan", ["training.max_skipped_steps=3", "optim.max_steps=20", "logging.ckpt_interval=2"])
    log = _poison(trainer, grad_steps={3, 6, 7, 8}, loss_steps={4})
    with pytest.raises(TrainingAborted) as aborted:
        trainer.fit()
    result["log"], result["aborted"] = log, str(aborted.value)
    result["saved"] = sorted(os.listdir(f"{root}/nan"))
    result["skipped_steps"] = trainer.state.skipped_steps

    # 2. fp16: a huge initial scale overflows the first steps; the scaler halves it, the guard does not count
    trainer = _trainer(
        f"{root}/fp16",
        [
            "model.precision=fp16",
            "optim.initial_loss_scale=1048576",
            "training.max_skipped_steps=1",
            "optim.max_steps=8",
        ],
    )
    history = trainer.fit()
    result["fp16"] = [(r["step"], r["loss_scale"], r["skipped_steps"]) for r in history if "loss" in r]

    # 3. SIGTERM reaches rank 1 only, in the middle of step 3: both stop after step 3 and save it
    trainer = _trainer(f"{root}/term", ["optim.max_steps=50", "logging.ckpt_interval=0"])
    step = trainer.train_step

    def signalled_step():
        if dist.get_rank() == 1 and trainer.state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    trainer.train_step = signalled_step
    with pytest.raises(RunInterrupted) as stopped:
        trainer.fit()
    result["term"] = (str(stopped.value), stopped.value.exit_code, trainer.state.step)
    result["term_saved"] = sorted(os.listdir(f"{root}/term"))
    resumed = _trainer(f"{root}/term", ["optim.max_steps=50", "logging.ckpt_interval=0"])
    resumed.resume("latest")
    result["resumed"] = (resumed.state.step, resumed.state.consumed_samples)
    result["handler"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # fit put the old handler back
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(_steps_and_signals, 2, args=(str(tmp_path_factory.mktemp("steps")),), timeout=300)


def test_poisoned_steps_are_skipped_on_every_rank_with_state_untouched(ranks):
    expected = [
        (1, False, True, None),
        (2, False, True, None),
        (3, True, False, "the gradient norm is nan"),
        (4, True, False, "the loss is inf"),
        (5, False, True, None),
        (6, True, False, "the gradient norm is nan"),
        (7, True, False, "the gradient norm is nan"),
    ]
    for rank in ranks:
        assert rank["log"][:7] == expected, rank["log"]
        assert rank["log"][7][:2] == (8, True)  # the third skip in a row raised inside step 8
        assert rank["skipped_steps"] == 5  # steps 3, 4, 6, 7, 8


def test_too_many_skips_in_a_row_stop_the_run_naming_the_step_and_saving_nothing_new(ranks):
    for rank in ranks:
        message = rank["aborted"]
        assert message.startswith("step 8: 3 consecutive steps skipped (steps 6-8, training.max_skipped_steps 3)")
        assert "the last because the gradient norm is nan" in message and "stopping without saving" in message
        # step 2 saved; 4 was skipped (no save), 6 and 8 skipped: nothing after checkpoint_2
        assert [n for n in rank["saved"] if n.startswith("checkpoint")] == ["checkpoint_2"]


def test_fp16_overflow_is_the_loss_scalers_business(ranks):
    for rank in ranks:
        steps = rank["fp16"]
        assert [s for s, _, _ in steps] == list(range(1, 9))  # not stopped by max_skipped_steps 1
        assert steps[0][1:] == (2.0**19, 1)  # step 1 overflowed: the scale halved, the step skipped
        assert steps[-1][2] < 8  # later steps were applied
        for (_, scale, skipped), (_, next_scale, next_skipped) in zip(steps, steps[1:]):
            assert (next_scale < scale) == (next_skipped > skipped)  # each overflow halves the scale


def test_sigterm_on_one_rank_stops_all_after_the_same_step_with_a_checkpoint(ranks):
    for rank in ranks:
        message, code, step = rank["term"]
        assert (code, step) == (128 + signal.SIGTERM, 3)
        assert message.startswith("SIGTERM: stopped after step 3 of 50, checkpoint ")
        assert message.endswith("checkpoint_3 saved; continue with --resume_from latest")
        assert "checkpoint_3" in rank["term_saved"] and rank["resumed"] == (3, 3 * 4)
        assert rank["handler"]


def test_loss_spike_detector_warns_or_skips_against_the_running_mean():
    from megacann.config.schema import TrainingConfig
    from megacann.errors import TrainingAborted
    from megacann.training.guards import StepGuard

    lines = []
    guard = StepGuard(TrainingConfig(loss_spike_factor=2.0, loss_spike_window=3, max_skipped_steps=2), lines.append)
    for step, loss in enumerate([4.0, 3.0, 2.0], start=1):  # the window fills: mean 3.0
        assert guard.check_loss(loss) is None and guard.end_step(step, loss, True, (0, 1)) is None
    assert guard.running_mean() == 3.0
    assert guard.check_loss(6.5) is None  # 6.5 > 2 x 3.0: a warning only, the step is applied
    assert lines[-1].startswith(
        "warning: loss 6.5000 is 2.2 x its running mean 3.0000 (training.loss_spike_factor 2.0)"
    )
    guard.end_step(4, 6.5, True, (0, 1))  # the mean is now (3 + 2 + 6.5) / 3

    skipping = StepGuard(
        TrainingConfig(loss_spike_factor=2.0, loss_spike_window=2, skip_loss_spikes=True, max_skipped_steps=2),
        lines.append,
    )
    for step, loss in enumerate([2.0, 2.0], start=1):
        skipping.check_loss(loss)
        skipping.end_step(step, loss, True, (0, 1))
    assert skipping.check_loss(5.0) == "loss 5.0000 is 2.5 x its running mean 2.0000 (training.loss_spike_factor 2.0)"
    assert skipping.end_step(3, 5.0, False, (8, 12)) is not None and "update skipped because loss 5.0000" in lines[-1]
    assert skipping.running_mean() == 2.0  # a skipped loss does not enter the mean
    assert skipping.check_loss(4.1) is not None
    with pytest.raises(TrainingAborted, match=r"^step 4: 2 consecutive steps skipped \(steps 3-4"):
        skipping.end_step(4, 4.1, False, (12, 16))
