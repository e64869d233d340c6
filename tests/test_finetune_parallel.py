"""LoRA through the trainer across ranks (gloo, CPU, fp32): tensor parallel 2 (with sequence parallelism)
and pipeline parallel 2 train the one-process loss trace, adapter gradients and adapters; ZeRO-1 over dp 2 too, holding optimizer
state for adapter shards only (the frozen base has none, nor gradient buffers). The checkpoint written at
tp 2 (adapters + the seed its base was drawn from) merges on one process into a model with the tp-2
logits. SFT tokenisation runs once when two ranks start together.

One spawn per world size; the tests compare what the runs recorded.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_on_ranks
from finetune_helpers import COMMON, IDS, LORA
from test_training_parity import assert_close_trace, assert_params_close

pytestmark = pytest.mark.extended  # a slow check: `make test-extended` runs it

STEPS = 3
TP2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
Z1_DP2 = ["distributed.zero_optimization=1", "optim.grad_accum_steps=1"]  # global batch 4, as one process
RUNS_WORLD1 = {"reference": []}
PP2 = ["distributed.pipeline_parallel_size=2"]
RUNS_WORLD2 = {"tp2": TP2, "zero1_dp2": Z1_DP2, "pp2": PP2}


def _runs(runs: dict[str, list[str]], tmp: str) -> dict:
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import SyntheticData

    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict, gather_full_tensor
    from megacann.layers.sharding import get_sharding, set_sharding
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    results = {"cache_builds": _cache_builds(tmp)}
    for name, overrides in runs.items():
        out = os.path.join(tmp, name)
        cfg = recipe([*COMMON, *LORA, f"experiment.output_dir={out}", *overrides], world_size=dist.get_world_size())
        runtime = setup_runtime(cfg)
        data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        trainer = Trainer(cfg, runtime, data=data)
        named = [(n, p) for chunk in trainer.model_chunks for n, p in chunk.named_parameters()]
        losses, grads = [], None
        for _ in range(STEPS):
            losses.append(trainer.train_step()["loss"])
            if grads is None and not cfg.distributed.zero_stage:  # ZeRO leaves each rank a reduced shard only
                grads = {
                    n: gather_full_tensor(set_sharding(p.main_grad, get_sharding(p)))
                    for n, p in named
                    if p.requires_grad
                }
        trainer.save_checkpoint()
        logits = None
        if ps.get_pipeline_model_parallel_world_size() == 1:
            chunk = trainer.model_chunks[0].eval()
            with torch.no_grad():
                logits = chunk(input_ids=IDS)
        shards = trainer.optimizer.state_shards()
        record = {
            "losses": losses,
            "grads": grads,
            "adapters": {n: t for n, t in full_state_dict(trainer.model_chunks).items() if ".adapter." in n},
            "logits": logits,
            "local_shapes": {n: tuple(p.shape) for n, p in named if p.requires_grad},
            "state_elements": sum(s.end - s.start for s in shards),
            "state_all_adapters": all(".adapter.lora_" in s.name for s in shards),
            "frozen_without_grads": not any(hasattr(p, "main_grad") for _, p in named if not p.requires_grad),
            "buffer_elements": sum(b.numel for b in trainer.optimizer.grad_buffers.buffers),
            "trainable_local": sum(p.numel() for _, p in named if p.requires_grad),
            "checkpoint": os.path.join(out, f"checkpoint_{STEPS}"),
        }
        results[name] = record
        ps.destroy_model_parallel()
    return results


def _cache_builds(tmp: str) -> int:
    """Ranks that tokenized the SFT file when every rank asked for it at once (the rest read the cache)."""
    import torch.distributed as dist
    from finetune_helpers import write_reverse_task

    from megacann.data.sft import cached_sft_samples
    from megacann.data.sft_templates import get_template
    from megacann.data.tokenizer import load_tokenizer

    path = os.path.join(tmp, "data", "reverse.jsonl")
    if dist.get_rank() == 0:
        write_reverse_task(path, count=2000)
    dist.barrier()
    _, _, built = cached_sft_samples(path, load_tokenizer("byte"), get_template("plain"), 32, cache_dir=tmp + "/c")
    count = torch.tensor([int(built)])
    dist.all_reduce(count)
    return int(count.item())


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_runs, 1, args=(RUNS_WORLD1, str(tmp_path_factory.mktemp("w1"))), timeout=300)[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_on_ranks(_runs, 2, args=(RUNS_WORLD2, str(tmp_path_factory.mktemp("w2"))), timeout=400)


@pytest.mark.parametrize("run", sorted(RUNS_WORLD2))
def test_lora_trains_like_one_process(world1, world2, run):
    ref, got = world1["reference"], dict(world2[0][run])
    got["adapters"] = {**world2[1][run]["adapters"], **got["adapters"]}  # pipeline stages hold their own
    if run == "pp2":
        got["grads"] = {**world2[1][run]["grads"], **got["grads"]}
        assert set(world2[0][run]["adapters"]).isdisjoint(world2[1][run]["adapters"])
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert ref["losses"][-1] < ref["losses"][0]  # the adapters learn
    if got["grads"] is not None:
        assert got["grads"].keys() == ref["grads"].keys()
        assert_params_close(got["grads"], ref["grads"], 1e-5)
    assert_params_close(got["adapters"], ref["adapters"], 1e-4)
    if got["logits"] is not None:
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-4)


def test_tensor_parallel_adapters_are_sharded_with_their_layers(world1, world2):
    ref, ranks = world1["reference"]["local_shapes"], [r["tp2"]["local_shapes"] for r in world2]
    q_b, o_a = "layers.0.self_attn.q_proj.adapter.lora_B", "layers.0.self_attn.o_proj.adapter.lora_A"
    assert ranks[0][q_b] == (ref[q_b][0] // 2, ref[q_b][1])  # column-parallel: B split by output rows
    assert ranks[0][o_a] == (ref[o_a][0], ref[o_a][1] // 2)  # row-parallel: A split by input columns


def test_frozen_base_has_no_gradients_and_no_zero_state(world1, world2):
    adapters = world1["reference"]["trainable_local"]
    for rank in world2:
        run = rank["zero1_dp2"]
        assert run["state_all_adapters"] and run["frozen_without_grads"]
        assert run["buffer_elements"] >= adapters and run["buffer_elements"] < adapters + 64  # ZeRO padding only
    assert sum(r["zero1_dp2"]["state_elements"] for r in world2) == adapters  # adapters sharded over dp, once
    assert 0 < world2[0]["zero1_dp2"]["state_elements"] < adapters


def test_sft_tokenisation_runs_once_when_ranks_start_together(world2):
    assert world2[0]["cache_builds"] == 1


def test_a_tensor_parallel_lora_checkpoint_merges_into_its_seed_base(world2):
    from megacann.interop.lora_export import build_full_model

    run = world2[0]["tp2"]
    merged = build_full_model(run["checkpoint"]).eval()  # base drawn again from the recorded seed
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS), run["logits"], rtol=0, atol=1e-5)
