"""Offload (docs/zero.md#offload): optimizer state and masters on the host (``optim.offload_optimizer``) and
activations of chosen layers on the host (``training.activation_offload_layers``) train the loss trace of the
run without offload (fp32 and bf16, dp 1, dp 2 with ZeRO-1 and ZeRO-2, MoE at ep 2), move the bytes the formulas say
through the offload path, and resume bit for bit (also into a run without offload). On CPU the host is the
same memory: the counters of the offload path are what shows it ran.

One spawn per world size runs every case; the tests read the records.
"""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks

STEPS = 3
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", "model.num_layers=2", "data.seq_length=16"]
# the activation formulas describe the reference operators with the fused head loss (tests/test_planner.py)
# and count no dropout masks
REFERENCE_OPS = [
    "precision.fused_ops=[vocab_parallel_head_loss]",
    "precision.fp32_ops=[]",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
]
OFF = ["optim.offload_optimizer=true"]
RUNS_WORLD1 = {
    "plain": [],
    "offload": OFF,
    "reference": REFERENCE_OPS,
    "activations": REFERENCE_OPS + ["training.activation_offload_layers=[1]"],
    "activations_selective": REFERENCE_OPS
    + ["training.activation_offload_layers=2", "model.activation_checkpointing=selective"],
    "selective": REFERENCE_OPS + ["model.activation_checkpointing=selective"],
}
Z1 = ["distributed.zero_optimization=1"]
Z2 = ["distributed.zero_optimization=2", "distributed.bucket_size_mb=0.01"]
MOE_EP2 = [
    "model.type=moe",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_layer_freq=2",
    "distributed.expert_parallel_size=2",
]
RUNS_WORLD2 = {
    "zero1": Z1,
    "zero1_offload": Z1 + OFF,
    "moe_zero1": MOE_EP2 + Z1,
    "moe_zero1_offload": MOE_EP2 + Z1 + OFF,  # dense state over dp 2, the experts' over dp / ep = 1
    "zero2_bf16": Z2 + ["model.precision=bf16"],
    "zero2_bf16_offload": Z2 + OFF + ["model.precision=bf16"],
}


def _train(runs: dict[str, list[str]], ckpt_root: str) -> dict:
    import os
    import warnings

    import torch.distributed as dist
    from checkpoint_helpers import make_trainer, run_steps, weights

    from megacann.optimizer.memory import optimizer_memory
    from megacann.planning import estimate_stages, layout_of
    from megacann.planning.activations import layer_activation_bytes

    warnings.simplefilter("ignore")
    out = {}
    for name, overrides in runs.items():
        root = os.path.join(ckpt_root, name)
        trainer = make_trainer(COMMON + overrides, os.path.join(root, "straight"), max_steps=2 * STEPS)
        record = {"trace": run_steps(trainer, STEPS), "memory": optimizer_memory(trainer.optimizer)}
        offload = getattr(trainer.optimizer, "offload", None)
        if offload is not None:
            record["moved"] = (offload.moved_to_host, offload.moved_to_device)
            record["updated_numel"] = sum(
                p.numel() for g in trainer.optimizer.optimizer.param_groups for p in g["params"]
            )
        acts = trainer.activation_offload
        record["activations"] = (acts.layers, acts.moved_to_host, acts.moved_to_device, acts.host_peak)
        (stage,) = estimate_stages(trainer.cfg, layout_of(trainer.cfg))
        record["estimate"] = {"host_optimizer": stage.host_optimizer, "host_activations": stage.host_activations}
        record["layer_bytes"] = layer_activation_bytes(trainer.cfg, layout_of(trainer.cfg), "none")
        record["micro_batches"] = trainer.cfg.optim.grad_accum_steps
        if "offload" in name:  # the run that never stopped, against one stopped at a checkpoint and resumed
            record["after"] = run_steps(trainer, STEPS)
            record["weights"] = weights(trainer)
            first = make_trainer(COMMON + overrides, os.path.join(root, "stopped"), max_steps=2 * STEPS)
            run_steps(first, STEPS)
            path = first.save_checkpoint()
            for variant, extra in (("resumed", overrides), ("resumed_without", [o for o in overrides if o not in OFF])):
                again = make_trainer(COMMON + extra, os.path.join(root, variant), max_steps=2 * STEPS)
                again.load_checkpoint(path)
                record[variant] = run_steps(again, STEPS)
                record[variant + "_weights"] = weights(again)
        out[name] = record
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_train, 1, args=(RUNS_WORLD1, str(tmp_path_factory.mktemp("w1"))), timeout=600)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_on_ranks(_train, 2, args=(RUNS_WORLD2, str(tmp_path_factory.mktemp("w2"))), timeout=600)


def _same_trace(got, ref, rel=1e-5):
    assert len(got) == len(ref) == STEPS
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=rel) and norm == pytest.approx(ref_norm, rel=rel)


def _check_optimizer_offload(run: dict, psi: int) -> None:
    """Nothing of the optimizer's on the device; on the host a master, two moments and a gradient staging
    copy of every element this rank updates (16 B each); per step 4 B each way per element."""
    assert run["memory"]["optimizer_states"] == 0, run["memory"]
    assert run["updated_numel"] == psi
    assert run["memory"]["host"] == 16 * psi
    assert run["moved"] == (STEPS * 4 * psi, STEPS * 4 * psi)
    assert run["estimate"]["host_optimizer"] == pytest.approx(16 * psi, rel=0.01)  # planner: Ψ/N, no padding


def _checkpoint_resumes(run: dict) -> None:
    import torch

    assert run["resumed"] == run["after"]  # bit for bit
    assert run["resumed_without"] == run["after"]  # the checkpoint is a plain one: no offload resumes it too
    for name, tensor in (run["weights"] or {}).items():  # rank 0 holds the whole weights
        assert torch.equal(run["resumed_weights"][name], tensor), name
        assert torch.equal(run["resumed_without_weights"][name], tensor), name


def test_optimizer_offload_dp1_trains_the_same_trace_and_moves_its_bytes(world1):
    (rank,) = world1
    for run, ref in (("offload", "plain"),):
        _same_trace(rank[run]["trace"], rank[ref]["trace"])
        _check_optimizer_offload(rank[run], rank[ref]["memory"]["params"] // (4 if "bf16" not in run else 2))
        assert rank[ref]["memory"]["host"] == 0 and rank[ref]["memory"]["optimizer_states"] > 0
        _checkpoint_resumes(rank[run])


@pytest.mark.extended
def test_optimizer_offload_dp2_zero_trains_the_same_trace_and_moves_its_shard(world2):
    for rank in world2:
        for run, ref in (
            ("zero1_offload", "zero1"),
            ("zero2_bf16_offload", "zero2_bf16"),
            ("moe_zero1_offload", "moe_zero1"),
        ):
            _same_trace(rank[run]["trace"], rank[ref]["trace"])
            shard = rank[ref]["memory"]["optimizer_states"] // (8 if "bf16" not in run else 12)  # numel / N
            _check_optimizer_offload(rank[run], shard)
            _checkpoint_resumes(rank[run])


def test_activation_offload_trains_the_same_trace_and_moves_the_layers_activations(world1):
    (rank,) = world1
    for run, ref, layers in (("activations", "reference", 1), ("activations_selective", "selective", 2)):
        got = rank[run]
        _same_trace(got["trace"], rank[ref]["trace"])
        assert got["activations"][0] == layers
        selective = "selective" in run
        # what the planner counts for one layer and micro-batch, minus the attention core under selective
        per_layer = got["layer_bytes"]
        if selective:
            per_layer = got["estimate"]["host_activations"] / layers
        moved = STEPS * got["micro_batches"] * layers * per_layer
        assert got["activations"][1] == moved and got["activations"][2] == moved, (got["activations"], moved)
        assert got["activations"][3] == got["estimate"]["host_activations"] == layers * per_layer
    assert rank["reference"]["activations"] == (0, 0, 0, 0)
