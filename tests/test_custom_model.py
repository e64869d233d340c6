"""The model contract: examples/custom_model.py, a family megacann does not ship, trains under every layout
exactly like one process, resumes bit for bit, and runs from its command line; each switch is checked to be
really on (sequence-parallel shapes, virtual chunks, ZeRO shards, recompute)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace, assert_params_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "custom_model.py")
STEPS = 4
CUSTOM = ["model.type=parallel_lm", "model.tie_word_embeddings=true", "optim.clip_grad=0.5", "optim.lr=1e-3"]
REFERENCE_RUNS = {"base": [], "accum4": ["optim.grad_accum_steps=4"]}
LAYOUTS = {
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "pp2": ["distributed.pipeline_parallel_size=2"],
    "pp2_vpp2": ["distributed.pipeline_parallel_size=2", "distributed.virtual_pipeline_size=2"],
    "zero1_dp2": ["distributed.zero_optimization=1"],
}
MATCHING = {"tp2_sp": "base", "pp2": "base", "pp2_vpp2": "base", "zero1_dp2": "accum4"}


def load_example():
    """Import examples/custom_model.py once per process (importing it registers the family)."""
    if "custom_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("custom_model", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["custom_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["custom_model"]


def _train(runs: dict[str, list[str]]) -> dict:
    import torch.distributed as dist
    from checkpoint_helpers import weights
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    example = load_example()
    results = {}
    for name, overrides in runs.items():
        ps.destroy_model_parallel()
        cfg = tiny_config(CUSTOM + overrides, world_size=dist.get_world_size())
        runtime = setup_runtime(cfg)
        trainer = Trainer(cfg, runtime, data=SyntheticData(cfg, *_dp()))
        shapes = []
        block = next(iter(trainer.model_chunks[0].layers.values()))
        block.register_forward_hook(lambda module, args, out, shapes=shapes: shapes.append(tuple(out.shape)))
        trace = [trainer.train_step() for _ in range(STEPS)]
        shards = trainer.optimizer.state_shards()
        results[name] = {
            "losses": [m["loss"] for m in trace],
            "norms": [m["grad_norm"] for m in trace],
            "params": _untied(weights(trainer)),
            "block_output_shape": shapes[0],
            "chunks": [sorted(int(i) for i in c.layers) for c in trainer.model_chunks],
            "types": {type(c).__name__ for c in trainer.model_chunks},
            "state_elements": sum(s.end - s.start for s in shards),
            "param_elements": sum(p.numel() for p in trainer.params),
        }
        assert isinstance(trainer.model_chunks[0], example.ParallelLM)
    return results


def _untied(params):
    """Whole weights without the last stage's copy of the tied embedding (checked equal to it first)."""
    if params is None or "lm_head.weight" not in params:
        return params
    copy = params.pop("lm_head.weight")
    assert (copy == params["embed_tokens.weight"]).all()
    return params


def _dp():
    from megacann import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, args=(REFERENCE_RUNS,), timeout=300)[0]


@pytest.fixture(scope="module")
def world2():
    return run_on_ranks(_train, 2, args=(LAYOUTS,), timeout=600)[0]


@pytest.mark.extended
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_custom_model_layouts_train_like_one_process(reference, world2, layout):
    ref, got = reference[MATCHING[layout]], world2[layout]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert_params_close(got["params"], ref["params"], 1e-4)  # Adam amplifies rounding over the steps
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.extended
def test_each_mode_was_really_on(reference, world2):
    b, s, h = 2, 32, 64  # tiny_config's micro-batch, sequence and width
    assert reference["base"]["block_output_shape"] == (b, s, h)
    assert world2["tp2_sp"]["block_output_shape"] == (b, s // 2, h)  # sequence shards between blocks
    assert world2["pp2"]["chunks"] == [[0, 1]]  # rank 0 holds the first stage's layers only
    assert world2["pp2_vpp2"]["chunks"] == [[0], [2]]  # two virtual chunks: segments 0 and 2 of four
    assert world2["pp2_vpp2"]["types"] == {"ParallelLM"}
    zero, plain = world2["zero1_dp2"], world2["tp2_sp"]
    assert zero["state_elements"] <= zero["param_elements"] // 2 + 64  # 1/dp of the state, plus padding
    assert zero["state_elements"] >= zero["param_elements"] // 2 - 64
    assert plain["state_elements"] == plain["param_elements"]  # without ZeRO: the whole local shard


def _recompute_counts() -> dict:
    """Forward calls of the MLP and of core attention per micro-batch, for each recompute mode."""
    from training_helpers import SyntheticData, tiny_config

    import megacann.ops as ops
    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    load_example()
    counts, losses = {}, {}
    attention = ops.scaled_dot_product_attention
    for mode in ("none", "selective", "full"):
        ps.destroy_model_parallel()
        cfg = tiny_config(CUSTOM + [f"model.activation_checkpointing={mode}", "optim.grad_accum_steps=1"])
        trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
        calls = {"mlp": 0, "attention": 0}
        block = trainer.model_chunks[0].layers["0"]
        # a pre-hook: torch stops a recompute as soon as the saved tensors are back, before the MLP returns
        block.mlp.register_forward_pre_hook(lambda *a, calls=calls: calls.__setitem__("mlp", calls["mlp"] + 1))

        def counted(*args, calls=calls, **kwargs):
            calls["attention"] += 1
            return attention(*args, **kwargs)

        ops.scaled_dot_product_attention = counted
        try:
            losses[mode] = [trainer.train_step()["loss"] for _ in range(2)]
        finally:
            ops.scaled_dot_product_attention = attention
        layers = len(trainer.model_chunks[0].layers)
        counts[mode] = {"mlp": calls["mlp"] / 2, "attention": calls["attention"] / (2 * layers)}
    return {"counts": counts, "losses": losses}


def test_recompute_really_recomputes_and_changes_nothing():
    out = run_on_ranks(_recompute_counts, 1, timeout=300)[0]
    counts, losses = out["counts"], out["losses"]
    assert counts["none"] == {"mlp": 1, "attention": 1}
    assert counts["selective"] == {"mlp": 1, "attention": 2}  # core attention again in backward
    assert counts["full"] == {"mlp": 2, "attention": 2}  # the whole block again in backward
    assert losses["selective"] == losses["none"] and losses["full"] == losses["none"]


def _zero3_units(reference_runs: dict[str, list[str]]) -> dict:
    """ZeRO-3 at dp 2 with the family's sharding units (one per ParallelBlock) and, for contrast, with the
    spec naming none (one unit per chunk): losses, the units' sizes, and the most weight elements whole on
    this rank while a block runs."""
    import dataclasses

    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config
    from zero3_checks import GatherProbe, memory_facts

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    example = load_example()
    results = {}
    for name, units in (("per_block", example.PARALLEL_LM.sharding_units), ("per_chunk", ())):
        ps.destroy_model_parallel()
        cfg = tiny_config(CUSTOM + ["distributed.zero_optimization=3"], world_size=dist.get_world_size())
        spec = dataclasses.replace(example.PARALLEL_LM, sharding_units=units)
        trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, *_dp()), model_spec=spec)
        probe = GatherProbe(trainer, (example.ParallelBlock,))
        trace = [trainer.train_step() for _ in range(STEPS)]
        results[name] = {
            "losses": [m["loss"] for m in trace],
            "norms": [m["grad_norm"] for m in trace],
            "peak_gathered": probe.peak,
            **memory_facts(trainer),
        }
    return results


def test_custom_family_shards_per_block_under_zero3():
    """The family's ``sharding_units`` reach ZeRO-3: at dp 2 each rank holds half the weights between steps
    and, while a block runs, only the chunk's own weights and that block whole (naming no units: the whole
    chunk); it trains as one process does."""
    reference = run_on_ranks(_train, 1, args=({"accum4": REFERENCE_RUNS["accum4"]},), timeout=300)[0]["accum4"]
    for rank in run_on_ranks(_zero3_units, 2, args=(REFERENCE_RUNS,), timeout=400):
        per_block, per_chunk = rank["per_block"], rank["per_chunk"]
        root, *blocks = per_block["unit_numels"]
        assert len(blocks) == 4 and len(set(blocks)) == 1  # tiny_config's 4 layers, one unit each
        assert per_block["peak_gathered"] == root + blocks[0] < per_block["whole_numel"]  # bytes: 4 x these
        assert len(per_chunk["unit_numels"]) == 1
        assert per_chunk["peak_gathered"] == per_chunk["unit_numels"][0] >= per_block["whole_numel"]
        for run in (per_block, per_chunk):
            padded = sum(numel for numel, _, _ in run["buffers"])
            assert run["memory"]["params"] == 4 * padded // 2  # fp32: half of the (padded) weights per rank
            assert run["gathered"] == 0 and run["stored_bytes"] == 0  # between steps no weight is whole
            assert_close_trace(run["losses"], reference["losses"], 1e-5)
            assert_close_trace(run["norms"], reference["norms"], 1e-5)


def _resume_bitwise(root: str) -> dict:
    """tp2 + SP with dropout: 4 steps straight vs 2 steps, checkpoint, a fresh trainer loads and runs 2."""
    from checkpoint_helpers import make_trainer, run_steps

    load_example()
    layout = CUSTOM + LAYOUTS["tp2_sp"] + ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    straight = run_steps(make_trainer(layout, f"{root}/straight"), 4)
    first = make_trainer(layout, f"{root}/stopped")
    run_steps(first, 2)
    path = first.save_checkpoint()
    resumed = make_trainer(layout, f"{root}/stopped")
    resumed.load_checkpoint(path)
    return {"straight": straight[2:], "resumed": run_steps(resumed, 2)}


def test_custom_model_resumes_bit_for_bit(tmp_path):
    out = run_on_ranks(_resume_bitwise, 2, args=(str(tmp_path),), timeout=400)[0]
    assert out["resumed"] == out["straight"]  # losses and grad norms, exactly


@pytest.mark.extended
def test_custom_model_script_trains_and_writes_a_run(tmp_path):
    out = tmp_path / "run"
    overrides = [
        f"experiment.output_dir={out}",
        "model.hidden_size=64",
        "model.num_layers=2",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "model.ffn_hidden_size=128",
        "data.seq_length=32",
        "data.batch_size=4",
        "optim.max_steps=6",
        "logging.log_interval=1",
        "logging.eval_interval=0",
    ]
    config = os.path.join(ROOT, "examples", "configs", "custom", "tiny.yaml")
    env = {**os.environ, "MEGACANN_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--config", config, *overrides], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoint_6" / "megacann.json").is_file()
    assert json.loads((out / "checkpoint_6" / "megacann.json").read_text())["model"]["type"] == "parallel_lm"
