"""LoRA on MoE experts across two ranks (fp32, CPU, one spawn: ``_world2``).

The MoE layer with expert adapters at ep 2, tp 2 with experts split over TP (sequence parallel) and tp 2
with whole experts equals one process (outputs, input and adapter gradients), with the adapters sharded like
their experts; a PEFT export at ep 2 gathers every rank's experts (equal to one process's) and a one-process
export loads into ep 2; the trainer (``model.type: moe``, ``lora: true``) at ep 2 and at tp 2 (sequence
parallel) trains the one-process loss trace, adapter gradients and adapters, counts the whole model's
parameters, holds no gradient or optimizer state for the frozen base; the ep 2 run resumes its adapter-only
checkpoint bit for bit, and ``megacann-convert merge-lora`` of that checkpoint gives its logits.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from dist_harness import run_on_ranks
from layers_reference import full_grad, rel_err
from lora_expert_helpers import FFN, IDS, TOL, E, H, model_logits, randomise_adapters, tiny_moe_model

from megacann.layers import MoEConfig, MoELayer
from megacann.layers.lora import LoRAConfig, attach_lora, lora_parameters
from megacann.layers.sharding import get_sharding

# -- two ranks ---------------------------------------------------------------------------------------------

LAYOUTS = {  # name: (tp, ep, MoE layer changes, LoRA targets)
    "ep2": (1, 2, dict(num_shared_experts=1), ("gate_up_proj", "down_proj")),
    "tp2_sp_split_experts": (2, 1, dict(sequence_parallel=True), ("gate_proj", "up_proj", "down_proj")),
    "tp2_whole_experts": (2, 1, dict(expert_tensor_parallel=False, num_shared_experts=1), ("up_proj", "down_proj")),
}
LORA_TRAINER = ["lora=true", "lora_rank=4", "lora_alpha=8.0", "lora_target_modules=all-linear"]
MOE_TRAINER = [
    "model.type=moe", "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64",
    "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.moe_shared_experts=1",
    "model.moe_aux_loss_coeff=1e-2", "data.seq_length=16", "data.batch_size=1", "optim.clip_grad=0.5",
    "optim.lr=1e-2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
]  # fmt: skip
STEPS, SAVE_AT = 3, 2


def _batch(d: int):
    gen = torch.Generator().manual_seed(100 + d)
    return torch.randn(2, 8, H, generator=gen), torch.randn(2, 8, H, generator=gen)


def _lora_layer(moe: MoEConfig, targets) -> MoELayer:
    torch.manual_seed(11)  # the layer's expert seed comes from torch's RNG
    layer = MoELayer(moe).train()
    attach_lora(layer, LoRAConfig(rank=4, alpha=8.0, target_modules=targets))
    randomise_adapters(layer)
    return layer


def _layer_reference(moe: MoEConfig, targets, dp: int) -> dict:
    layer = _lora_layer(replace(moe, sequence_parallel=False), targets)
    runs = []
    for d in range(dp):
        x, g = _batch(d)
        x.requires_grad_()
        out = layer(x)
        (out * g).sum().backward()
        runs.append((out.detach(), x.grad))
    return {"runs": runs, "grads": {n: p.grad.clone() for n, p in lora_parameters(layer)}}


def _layer_layout(tp: int, ep: int, changes: dict, targets) -> dict:
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.collectives import all_reduce_if_parallel

    moe = MoEConfig(hidden_size=H, num_experts=E, ffn_hidden_size=FFN, **changes)
    ref = _layer_reference(moe, targets, dist.get_world_size() // tp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    layer = _lora_layer(moe, targets)
    d, tp_rank = ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank()
    x, g = _batch(d)
    ref_out, ref_dx = ref["runs"][d]
    if moe.sequence_parallel:
        x, g, ref_out, ref_dx = (t.chunk(tp, dim=1)[tp_rank] for t in (x, g, ref_out, ref_dx))
    x.requires_grad_()
    out = layer(x)
    (out * g).sum().backward()
    errs = {"out": rel_err(out, ref_out), "dx": rel_err(x.grad, ref_dx)}
    for name, p in lora_parameters(layer):
        grad = full_grad(p)
        expert = get_sharding(p).expert
        all_reduce_if_parallel(grad, ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group())
        errs[f"grad.{name}"] = rel_err(grad, ref["grads"][name])
    frozen = all(p.grad is None for n, p in layer.named_parameters() if ".adapter." not in n)
    shapes = {n: tuple(p.shape) for n, p in lora_parameters(layer)}
    ps.destroy_model_parallel()
    return {"errs": errs, "frozen": frozen, "shapes": shapes, "experts": sorted(int(e) for e in layer.experts)}


def _trainer(overrides: list[str], out: str):
    import torch.distributed as dist
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    cfg = tiny_config(MOE_TRAINER + LORA_TRAINER + overrides + [f"experiment.output_dir={out}"], dist.get_world_size())
    return Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))


def _adapters(trainer) -> dict:
    """Whole adapter tensors of every rank's experts, on all ranks."""
    import torch.distributed as dist

    from megacann.interop.full_state import full_state_dict

    local = {n: t for n, t in full_state_dict(trainer.model_chunks).items() if ".adapter." in n}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {n: t for part in parts for n, t in part.items()}


def _train(overrides: list[str], out: str, resume: bool) -> dict:
    from megacann.interop.full_state import gather_full_tensor
    from megacann.layers.sharding import set_sharding
    from megacann.training.finetune import parameter_counts

    trainer = _trainer(overrides, out)
    named = [(n, p) for chunk in trainer.model_chunks for n, p in chunk.named_parameters()]
    losses, grads, path = [], None, None
    for step in range(STEPS):
        losses.append(trainer.train_step()["loss"])
        if grads is None:
            grads = {
                n: gather_full_tensor(set_sharding(p.main_grad, get_sharding(p))) for n, p in named if p.requires_grad
            }
        if step + 1 == SAVE_AT:
            path = trainer.save_checkpoint()
            saved = _adapters(trainer)
    chunk = trainer.model_chunks[0].eval()
    with torch.no_grad():
        logits = chunk(input_ids=IDS)
    trainer.save_checkpoint()
    shards = trainer.optimizer.state_shards()
    record = {
        "losses": losses,
        "grads": grads,
        "adapters": _adapters(trainer),
        "logits": logits,
        "frozen_without_grads": not any(hasattr(p, "main_grad") for _, p in named if not p.requires_grad),
        "state_all_adapters": all(".adapter.lora_" in s.name for s in shards),
        "expert_adapter_groups": sorted(
            {b.group_size for b in trainer.optimizer.grad_buffers.buffers if get_sharding(b.params[0]).expert}
        ),
        "experts_here": sorted({n.split(".experts.")[1].split(".")[0] for n, _ in named if ".experts." in n}),
        "checkpoint": os.path.join(out, f"checkpoint_{STEPS}"),
        "counts": parameter_counts(trainer.model_chunks),
    }
    if resume:
        again = _trainer(overrides, out + "_resumed")
        again.load_checkpoint(path)
        record["loaded_equal"] = all(torch.equal(saved[n], t) for n, t in _adapters(again).items())
        record["resumed_losses"] = [again.train_step()["loss"] for _ in range(STEPS - SAVE_AT)]
        record["resumed_adapters"] = _adapters(again)
    return record


def _ep2_peft(root: str, reference: str) -> dict:
    """At ep 2: the PEFT export gathers every rank's experts; the one-process export loads into ep 2."""
    from megacann import parallel_state as ps
    from megacann.interop.peft import load_peft_adapter, save_peft_adapter

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model = tiny_moe_model()
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear")
    attach_lora(model, lora)
    randomise_adapters(model)
    save_peft_adapter([model], f"{root}/peft_ep2", lora)
    back = tiny_moe_model()
    load_peft_adapter(back, reference)
    result = {"logits": model_logits(model.eval()), "loaded_logits": model_logits(back.eval())}
    result["experts_here"] = sorted(int(e) for e in back.layers["0"].mlp.experts)
    result["path"] = f"{root}/peft_ep2"
    ps.destroy_model_parallel()
    return result


def _world2(root: str, peft_reference: str) -> dict:
    results = {name: _layer_layout(*layout) for name, layout in LAYOUTS.items()}
    results["peft"] = _ep2_peft(root, peft_reference)
    results["ep2_trainer"] = _train(["distributed.expert_parallel_size=2", "optim.grad_accum_steps=2"], root, True)
    tp2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", "optim.grad_accum_steps=4"]
    results["tp2_trainer"] = _train(tp2, root + "/tp2", False)
    return results


def _world1(root: str) -> dict:
    return _train(["optim.grad_accum_steps=4"], root, False)


@pytest.fixture(scope="module")
def peft_one_process(tmp_path_factory) -> tuple[str, torch.Tensor]:
    """A one-process PEFT export of the model ``_ep2_peft`` builds, and that model's logits."""
    from megacann.interop.peft import save_peft_adapter

    path = str(tmp_path_factory.mktemp("peft1"))
    model = tiny_moe_model()
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear")
    attach_lora(model, lora)
    randomise_adapters(model)
    save_peft_adapter([model], path, lora)
    return path, model_logits(model.eval())


@pytest.fixture(scope="module")
def world2(tmp_path_factory, peft_one_process):
    root = str(tmp_path_factory.mktemp("ep2"))
    return run_on_ranks(_world2, 2, args=(root, peft_one_process[0]), timeout=400)


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_world1, 1, args=(str(tmp_path_factory.mktemp("ep1")),), timeout=300)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_lora_layer_layouts_equal_one_process(world2, layout):
    for rank, results in enumerate(world2):
        got = results[layout]
        assert got["frozen"] and any(k.startswith("grad.experts.") for k in got["errs"])
        bad = {k: v for k, v in got["errs"].items() if not v <= TOL}
        assert not bad, f"{layout} rank {rank}: {bad}"
    shapes = [r[layout]["shapes"] for r in world2]
    if layout == "ep2":  # each rank holds its experts' adapters only
        assert [r[layout]["experts"] for r in world2] == [[0, 1], [2, 3]]
        assert "experts.2.gate_up_proj.adapter.lora_A" in shapes[1] and not any(".experts.2." in n for n in shapes[0])
        assert shapes[0]["experts.0.gate_up_proj.adapter.lora_A"] == (4, H)  # one A shared by gate and up
    elif layout == "tp2_sp_split_experts":  # gate_up: B split by rows per part; down: A split by columns
        assert shapes[0]["experts.1.gate_up_proj.adapter.lora_B"] == (FFN, 4)
        assert shapes[0]["experts.1.gate_up_proj.adapter.lora_A"] == (8, H)
        assert shapes[0]["experts.1.down_proj.adapter.lora_A"] == (4, FFN // 2)
    else:  # whole experts on every TP rank, whole adapters
        assert shapes[0]["experts.1.gate_up_proj.adapter.lora_B"] == (FFN, 4)
        assert shapes[0]["experts.1.down_proj.adapter.lora_A"] == (4, FFN)


def test_expert_parallel_peft_export_and_load_equal_one_process(world2, peft_one_process):
    from megacann.interop.peft import read_peft_tensors

    path, logits = peft_one_process
    expected = read_peft_tensors(path)
    got = read_peft_tensors(world2[0]["peft"]["path"])
    assert got.keys() == expected.keys() and all(torch.equal(got[k], t) for k, t in expected.items())
    for rank, results in enumerate(world2):
        run = results["peft"]
        assert run["experts_here"] == [2 * rank, 2 * rank + 1]
        assert rel_err(run["logits"], logits) < TOL and rel_err(run["loaded_logits"], logits) < TOL


@pytest.mark.extended
@pytest.mark.parametrize("run", ["ep2_trainer", "tp2_trainer"])
def test_expert_parallel_lora_trains_like_one_process(world1, world2, run):
    from test_training_parity import assert_close_trace, assert_params_close

    got, ref = world2[0][run], world1
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    expert_b = [t for n, t in ref["adapters"].items() if ".experts." in n and n.endswith("lora_B")]
    assert len(expert_b) == 2 * 4 * 2 and all(t.abs().sum() > 0 for t in expert_b)  # B left 0: they trained
    grads = {**world2[1][run]["grads"], **got["grads"]}
    assert grads.keys() == ref["grads"].keys() and any(".experts.3." in n for n in grads)
    assert_params_close(grads, ref["grads"], 1e-5)
    assert_params_close(got["adapters"], ref["adapters"], 1e-4)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    for rank, results in enumerate(world2):
        record = results[run]
        assert record["frozen_without_grads"] and record["state_all_adapters"]
        assert record["expert_adapter_groups"] == [1]  # ep 2 of 2 ranks / tp 2: experts reduce over one rank
        here = range(2 * rank, 2 * rank + 2) if run == "ep2_trainer" else range(E)
        assert record["experts_here"] == [str(e) for e in here]
        assert record["counts"] == world1["counts"]  # the whole model's, every rank's experts counted
    assert world1["expert_adapter_groups"] == [1] and world1["experts_here"] == ["0", "1", "2", "3"]


def test_expert_parallel_lora_checkpoint_resumes_bit_for_bit(world2):
    run = world2[0]["ep2_trainer"]
    assert run["loaded_equal"]
    assert run["resumed_losses"] == run["losses"][SAVE_AT:]
    assert run["resumed_adapters"].keys() == run["adapters"].keys()
    assert all(torch.equal(run["resumed_adapters"][n], t) for n, t in run["adapters"].items())


def test_merge_lora_of_an_expert_parallel_checkpoint_gives_its_logits(world2, tmp_path):
    from megacann.convert import main as convert
    from megacann.interop.lora_export import build_full_model
    from megacann.interop.reading import read_checkpoint_weights

    run = world2[0]["ep2_trainer"]
    stored, _ = read_checkpoint_weights(run["checkpoint"])
    assert stored.keys() == run["adapters"].keys()  # the adapters only (no routing bias in this recipe)
    assert convert(["merge-lora", run["checkpoint"], str(tmp_path / "merged")]) == 0
    merged = build_full_model(str(tmp_path / "merged")).eval()
    torch.testing.assert_close(model_logits(merged), run["logits"], rtol=0, atol=1e-5)
