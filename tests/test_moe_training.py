"""The MoE family trains alike under every layout (gloo, CPU, fp32, dropless routing), resumes bit for bit,
and its checkpoints reshard across expert-parallel sizes.

Two spawns. World 4: expert parallelism 2 and 4 (data parallelism 4), ep 2 with tensor + sequence
parallelism, with pipeline stages, with ZeRO-1, and with full activation recompute; the ep 2 run saves a checkpoint after step 2 and goes on,
then a fresh ep 2 trainer resumes from it (bitwise equal) and an ep 4 trainer reshards it. World 1: the
one-process references and a one-process (ep 1) load of the ep 2 checkpoint. Every run has the
load-balancing loss, the z-loss, bias balancing and shared experts on, so the router's buffers, the
auxiliary losses and the expert all-to-all are all in play. Losses and gradient norms agree to 1e-5
relative, first-step gradients to 1e-5 norm-wise per tensor, weights after all steps to 1e-4 (Adam
amplifies rounding).
"""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace, assert_params_close
from tiny_recipes import TINY_MOE

pytestmark = pytest.mark.extended  # a slow check: `make test-extended` runs it

STEPS, SAVE_AT = 4, 2
MOE = [
    *TINY_MOE,
    "model.moe_shared_experts=1",
    "model.moe_z_loss_coeff=1e-3",
    "model.moe_bias_update_rate=1e-2",
    "data.seq_length=16",
    "data.batch_size=1",
    "optim.clip_grad=0.5",
    "optim.lr=1e-3",
    # seed 8: under the block-wise draw, seed 7's router biases move by +-1e-2 in step 1 and back to exactly 0
    # in step 2, so the saved state would not show that balancing moved them
    "seed=8",
]
EP2, EP4 = "distributed.expert_parallel_size=2", "distributed.expert_parallel_size=4"
ACCUM = {n: f"optim.grad_accum_steps={n}" for n in (1, 2, 4)}
# global batch 4 samples of 16 tokens everywhere; world 4
WORLD4 = {
    "ep2": [EP2, ACCUM[1]],
    "ep4": [EP4, ACCUM[1]],
    "tp2_sp_ep2": [EP2, ACCUM[2], "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "pp2_ep2": [EP2, ACCUM[2], "distributed.pipeline_parallel_size=2"],
    "zero1_ep2": [EP2, ACCUM[1], "distributed.zero_optimization=1"],
    # whole blocks recomputed in backward: the all-to-alls run again there, the auxiliary losses backpropagate
    "ep2_full_recompute": [EP2, ACCUM[1], "model.activation_checkpointing=full"],
}
REFERENCE = {"ep1": [ACCUM[4]]}


def _trainer(overrides: list[str], output_dir: str = "/tmp/megacann-test-unused"):
    import torch.distributed as dist
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    cfg = tiny_config(MOE + overrides + [f"experiment.output_dir={output_dir}"], world_size=dist.get_world_size())
    return Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))


def _whole_state(trainer) -> dict:
    """Whole weights and persistent buffers of the whole model (every rank's experts and stages), on all ranks."""
    import torch.distributed as dist

    from megacann.checkpoint.state import persistent_buffers
    from megacann.interop.full_state import full_state_dict

    trainer.optimizer.finish_param_sync()
    local = full_state_dict(trainer.model_chunks)
    for chunk in trainer.model_chunks:
        local.update({name: b.detach().clone() for name, b in persistent_buffers(chunk)})
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {name: tensor for part in parts for name, tensor in part.items()}


def _first_grads(trainer) -> dict:
    """This rank's whole (TP-gathered) gradients by name."""
    from megacann.interop.full_state import gather_full_tensor
    from megacann.layers.sharding import get_sharding, set_sharding

    return {
        name: gather_full_tensor(set_sharding(p.main_grad, get_sharding(p)))
        for chunk in trainer.model_chunks
        for name, p in chunk.named_parameters()
    }


def _layout_facts(trainer) -> dict:
    """What shows the mode was on: experts held here, all-to-all width, groups gradients reduce over."""
    from megacann.layers.moe import moe_layers
    from megacann.layers.sharding import get_sharding

    layers = [layer for chunk in trainer.model_chunks for layer in moe_layers(chunk)]
    buffers = trainer.optimizer.grad_buffers.buffers
    return {
        "experts": sorted({int(e) for layer in layers for e in layer.experts}),
        "dispatch_ep": {layer.dispatcher.ep_size for layer in layers},
        "reduce_groups": sorted({(get_sharding(b.params[0]).expert, b.group_size) for b in buffers}),
    }


def _run(trainer, steps: int, grads: bool = False) -> dict:
    losses, norms, aux, first = [], [], [], None
    for _ in range(steps):
        metrics = trainer.train_step()
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        aux.append((metrics["moe_load_balancing"], metrics["moe_z_loss"]))
        if grads and first is None:
            first = _first_grads(trainer)
    return {"losses": losses, "norms": norms, "aux": aux, "grads": first}


def _world4(root: str) -> dict:
    import torch.distributed as dist

    results = {}
    for name, overrides in WORLD4.items():
        trainer = _trainer(overrides, f"{root}/{name}")
        facts = _layout_facts(trainer)
        if name == "ep2":  # save mid-way, then carry on: the reference for resume and resharding
            head = _run(trainer, SAVE_AT, grads=True)
            saved_state = _whole_state(trainer)
            path = trainer.save_checkpoint()
            tail = _run(trainer, STEPS - SAVE_AT)
            run = {key: head[key] + tail[key] for key in ("losses", "norms", "aux")}
            run.update(grads=head["grads"], saved_state=saved_state, path=path)
        else:
            run = _run(trainer, STEPS, grads="zero" not in name)
        run.update(state=_whole_state(trainer), facts=facts)
        results[name] = run
    for name, overrides in (("resume_ep2", WORLD4["ep2"]), ("reshard_ep4", WORLD4["ep4"])):
        trainer = _trainer(overrides, f"{root}/{name}")
        trainer.load_checkpoint(results["ep2"]["path"])
        loaded = _whole_state(trainer)
        run = _run(trainer, STEPS - SAVE_AT)
        run.update(loaded=loaded, state=_whole_state(trainer), facts=_layout_facts(trainer))
        results[name] = run
    return {"rank": dist.get_rank(), **{k: v for k, v in results.items()}}


def _world1(path: str, root: str) -> dict:
    results = {}
    for name, overrides in REFERENCE.items():
        trainer = _trainer(overrides, f"{root}/{name}")
        run = _run(trainer, STEPS, grads=True)
        run.update(state=_whole_state(trainer))
        results[name] = run
    trainer = _trainer(REFERENCE["ep1"], f"{root}/reshard_ep1")
    trainer.load_checkpoint(path)
    loaded = _whole_state(trainer)
    run = _run(trainer, STEPS - SAVE_AT)
    run.update(loaded=loaded, state=_whole_state(trainer))
    results["reshard_ep1"] = run
    results["fit"] = _fit_with_collapsed_router(f"{root}/fit")
    return results


def _fit_with_collapsed_router(out: str) -> dict:
    """Trainer.fit for 2 steps with every router weight zeroed: all scores tie, every token picks the same
    two experts, so step 1's figures are known by hand (capacity 1.0: each expert keeps 8 of a
    micro-batch's 16 tokens)."""
    import io
    import json

    import torch

    from megacann.layers.moe import moe_layers

    overrides = [ACCUM[4], "optim.max_steps=2", "logging.log_interval=1", "model.moe_capacity_factor=1.0"]
    trainer = _trainer(overrides, out)
    with torch.no_grad():
        for layer in moe_layers(trainer.model_chunks[0]):
            layer.router.weight.zero_()
    trainer.metrics.stream = console = io.StringIO()
    trainer.fit()
    with open(f"{out}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {"console": console.getvalue(), "records": records}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe4"))
    return run_on_ranks(_world4, 4, args=(root,), timeout=900)


@pytest.fixture(scope="module")
def world1(world4, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe1"))
    return run_on_ranks(_world1, 1, args=(world4[0]["ep2"]["path"], root), timeout=600)[0]


def _merged_grads(ranks: list[dict], name: str) -> dict:
    """First-step gradients of every parameter, from whichever rank holds it."""
    merged = {}
    for rank in ranks:
        merged.update(rank[name]["grads"])
    return merged


@pytest.mark.parametrize("layout", sorted(WORLD4))
def test_expert_parallel_layouts_match_one_process(world4, world1, layout):
    ref, got = world1["ep1"], world4[0][layout]
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert len(got["aux"]) == len(ref["aux"]) > 0
    for (lb, z), (ref_lb, ref_z) in zip(got["aux"], ref["aux"]):
        assert abs(lb - ref_lb) <= 1e-5 * ref_lb and abs(z - ref_z) <= 1e-5 * ref_z
    if got["grads"] is not None:
        assert_params_close(_merged_grads(world4, layout), ref["grads"], 1e-5)
    assert_params_close(got["state"], ref["state"], 1e-4)
    biases = [n for n in ref["state"] if n.endswith("router.expert_bias")]
    assert len(biases) == 2 and all(got["state"][n].equal(ref["state"][n]) for n in biases)  # the same counts


def test_the_layouts_really_split_the_experts(world4):
    facts = {name: [rank[name]["facts"] for rank in world4] for name in WORLD4}
    # ep 4: one expert per rank, all-to-all across 4; ep 2: experts 0-1 or 2-3
    assert [f["experts"] for f in facts["ep4"]] == [[0], [1], [2], [3]]
    assert [f["experts"] for f in facts["ep2"]] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert all(f["dispatch_ep"] == {4} for f in facts["ep4"]) and all(f["dispatch_ep"] == {2} for f in facts["ep2"])
    # tp2 x dp2 with ep 2: ranks 0, 1 (one TP group) hold experts 0-1, ranks 2, 3 experts 2-3
    assert [f["experts"] for f in facts["tp2_sp_ep2"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # gradients: dense ones over the 4 (or 2) data-parallel ranks, expert ones over the expert-data-parallel ranks
    assert facts["ep2"][0]["reduce_groups"] == [(False, 4), (True, 2)]
    assert facts["ep4"][0]["reduce_groups"] == [(False, 4), (True, 1)]
    assert facts["pp2_ep2"][0]["reduce_groups"] == [(False, 2), (True, 1)]
    assert facts["zero1_ep2"][0]["reduce_groups"] == [(False, 4), (True, 2)]


def test_resume_is_bitwise_equal(world4):
    kept, resumed = world4[0]["ep2"], world4[0]["resume_ep2"]
    assert resumed["losses"] == kept["losses"][SAVE_AT:]
    assert resumed["norms"] == kept["norms"][SAVE_AT:]
    biases = [n for n in kept["saved_state"] if n.endswith("router.expert_bias")]
    assert any(kept["saved_state"][n].abs().sum() > 0 for n in biases)  # balancing had moved them by step 2
    for name, tensor in kept["saved_state"].items():
        assert resumed["loaded"][name].equal(tensor), name  # weights and router biases restored
    for name, tensor in kept["state"].items():
        assert resumed["state"][name].equal(tensor), name


@pytest.mark.parametrize("target", ["reshard_ep4", "reshard_ep1"])
def test_checkpoints_reshard_across_expert_parallel_sizes(world4, world1, target):
    kept = world4[0]["ep2"]
    got = world4[0][target] if target in world4[0] else world1[target]
    assert got["loaded"].keys() == kept["saved_state"].keys()
    for name, tensor in kept["saved_state"].items():
        assert got["loaded"][name].equal(tensor), name  # the ep 2 checkpoint, whole, under another ep size
    assert_close_trace(got["losses"], kept["losses"][SAVE_AT:], 1e-5)
    assert_close_trace(got["norms"], kept["norms"][SAVE_AT:], 1e-5)
    assert_params_close(got["state"], kept["state"], 1e-4)
    if target == "reshard_ep4":
        assert [rank[target]["facts"]["experts"] for rank in world4] == [[0], [1], [2], [3]]


def test_metrics_hold_auxiliary_losses_and_expert_counts_and_the_console_warns(world1):
    import math

    fit = world1["fit"]
    first = fit["records"][0]
    assert first["step"] == 1
    # uniform softmax scores: the balancing loss is its coefficient, the z-loss coeff * ln(4)^2, per layer
    assert first["moe_load_balancing"] == pytest.approx(2 * 1e-2, rel=1e-6)
    assert first["moe_z_loss"] == pytest.approx(2 * 1e-3 * math.log(4) ** 2, rel=1e-6)
    for layer in (0, 1):  # 4 micro-batches x 16 tokens, each choosing the same 2 of the 4 experts
        assert sorted(first[f"moe_tokens_per_expert/layer_{layer}"]) == [0, 0, 64, 64]
    assert first["moe_dropped_tokens"] == 2 * 2 * 4 * 8  # layers x experts x micro-batches x (16 - capacity 8)
    assert all("moe_tokens_per_expert/layer_1" in r and "moe_load_balancing" in r for r in fit["records"])
    warnings = [line for line in fit["console"].splitlines() if line.startswith("WARNING: step 1: MoE layer")]
    assert len(warnings) == 2 and all("got under 1/10 of it ([0, 0])" in line for line in warnings), fit["console"]
    assert "fair share 32 token choices per expert" in warnings[0]
