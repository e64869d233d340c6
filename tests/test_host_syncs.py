"""A training step reads the device once: its figures and the global gradient norm in one copy, which the
step guard needs before the update (a non-finite loss or norm skips it on every rank); nothing else in the
step waits for the device.

Every way Python reads a tensor's value (``item``, ``float``, ``int``, ``bool``, ``tolist``, ``cpu``,
``numpy``) is counted: exactly one read per ``train_step()``, and in ``fit`` one per step, logging steps
included (their figures are already on the host), with the logged figures (the mean loss of the window,
the grad norm) what the steps computed.
"""

import pytest
from dist_harness import run_on_ranks

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy")


def _count_reads(body, counts: list[int]):
    """Run ``body()`` with every tensor read counted into ``counts[0]``."""
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            counts[0] += 1
            return original(self, *args, **kwargs)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        return body()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class _Prepared:
    """Micro-batches drawn before the steps run (a data loader's host work is not the step's)."""

    def __init__(self, cfg, steps: int):
        from training_helpers import SyntheticData

        source = SyntheticData(cfg, 0, 1).train
        self.train = iter([next(source) for _ in range(steps * cfg.optim.grad_accum_steps)])

    @staticmethod
    def valid():
        return None


def _steps(overrides: list[str]) -> dict:
    import json
    import os
    import tempfile

    from training_helpers import tiny_config

    from megacann import parallel_state as ps
    from megacann.training.host_values import to_host
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    out = {}
    cfg = tiny_config(["optim.clip_grad=0.5", *overrides])
    trainer = Trainer(cfg, setup_runtime(cfg), data=_Prepared(cfg, 3))
    trainer.train_step()  # first step: lazy set-up (op resolution, optimizer state) is not the step's business
    counts = [0]
    out["sync_values"] = _count_reads(trainer.train_step, counts)
    out["reads_sync"] = counts[0]
    ps.destroy_model_parallel()

    # fit: log every 3 steps over 7 steps -> records at steps 1, 3, 6, 7; reads counted per step
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(
            ["optim.clip_grad=0.5", "optim.max_steps=7", "logging.log_interval=3", *overrides],
            experiment={"output_dir": tmp},
        )
        trainer = Trainer(cfg, setup_runtime(cfg), data=_Prepared(cfg, 8))
        trainer.train_step()  # warm-up as above, then train steps 2..7 under fit
        trainer.state.step = 0  # fit trains max_steps steps from here (the data simply continues)
        per_step, step_results = [], []
        counts[0] = 0
        original_step = trainer.train_step

        def counted_step(**kwargs):
            per_step.append(counts[0])
            counts[0] = 0
            result = original_step(**kwargs)
            step_results.append(result)  # read after fit, outside the counting
            return result

        trainer.train_step = counted_step
        trainer.save_checkpoint = lambda: None  # saving reads tensors by design; not a step's cost
        _count_reads(trainer.fit, counts)
        per_step.append(counts[0])
        with open(os.path.join(tmp, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    out["fit_reads"] = per_step[1:]  # reads after each step (logging included), steps 1..7
    step_results = [to_host(r) for r in step_results]
    out["fit_losses"] = [r["loss"] for r in step_results]
    out["fit_norms"] = [r["grad_norm"] for r in step_results]
    out["records"] = [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module", params=["fp32", pytest.param("bf16", marks=pytest.mark.extended)])
def result(request):
    return run_on_ranks(_steps, 1, args=([f"model.precision={request.param}"],), timeout=300)[0]


def test_host_numbers_cost_one_read(result):
    assert result["reads_sync"] == 1
    values = result["sync_values"]
    assert isinstance(values["loss"], float) and isinstance(values["grad_norm"], float)
    assert isinstance(values["num_tokens"], int) and values["num_tokens"] == 2 * 2 * 32  # batch 2, accum 2, seq 32
    assert values["grad_norm"] > 0.5  # clipping was active: the device-side factor really applied
    assert values["loss"] > 0


def test_fit_reads_once_per_step(result):
    assert result["fit_reads"] == [1] * 7, result["fit_reads"]  # logging (steps 1, 3, 6, 7) adds no read
    losses, norms = result["fit_losses"], result["fit_norms"]
    windows = {1: [0], 3: [1, 2], 6: [3, 4, 5], 7: [6]}  # each record's loss is its window's mean
    assert [step for step, _, _ in result["records"]] == [1, 3, 6, 7]
    for step, loss, norm in result["records"]:
        mean = sum(losses[i] for i in windows[step]) / len(windows[step])
        assert loss == pytest.approx(mean, rel=1e-12)
        assert norm == norms[step - 1]
