"""precision.compile under tensor + sequence, context and expert parallelism: compiled blocks train like
eager blocks of the same layout (gloo, 2 ranks, fp32, reference ops so the compiler sees their math).

How each layout compiles: the tensor-parallel all-gathers / reduce-scatters are traced into the block's
graph (one graph, no break); the ring's point-to-point transfers of context parallelism graph-break (the
attention between them is compiled per block step); the MoE dispatch, experts and capacity run eagerly
(``torch.compiler.disable``: host-read counts, data-dependent shapes) between compiled router / shared
expert regions. Loss and grad-norm traces to 1e-5 relative, first-step gradients to 1e-5 and weights
after the steps to 1e-4 norm-wise (as test_compile_blocks). The default tier runs tp 2 + SP with
``aot_eager`` (fast to compile); the inductor runs, cp 2 and ep 2 (with full recompute) are extended.
"""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from test_compile_blocks import assert_close, record_training

STEPS = 2
TINY = ["model.num_layers=2", "precision.fused_ops=false", "optim.grad_accum_steps=1", "optim.clip_grad=0.5"]
TP_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
CP = ["distributed.context_parallel_size=2"]
EP = [
    "distributed.expert_parallel_size=2",
    "model.type=moe",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_shared_experts=1",
    "model.moe_aux_loss_coeff=1e-2",
    "data.seq_length=16",
]
FULL = ["model.activation_checkpointing=full"]


def _facts(trainer) -> dict:
    """What proves the layout was on: group sizes, this rank's shard of a weight, its experts."""
    from megacann import parallel_state as ps
    from megacann.layers.moe import moe_layers

    chunk = trainer.model_chunks[0]
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "shapes": {n: tuple(p.shape) for n, p in chunk.named_parameters() if "layers.0." in n},
        "experts": sorted(int(e) for layer in moe_layers(chunk)[:1] for e in layer.experts),
    }


def _train(layouts: dict[str, tuple[list[str], str]]) -> dict:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    results = {}
    for name, (overrides, backend) in layouts.items():
        for mode in ("eager", "compiled"):
            counters.clear()
            ps.destroy_model_parallel()
            extra = [f"precision.compile={backend}"] if mode == "compiled" else []
            cfg = tiny_config([*TINY, *overrides, *extra], world_size=dist.get_world_size())
            trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
            results[f"{name}/{mode}"] = {**record_training(trainer, STEPS), "facts": _facts(trainer)}
            ps.destroy_model_parallel()
            torch._dynamo.reset()
    return results


def _check(results: dict, name: str) -> dict:
    eager, compiled = results[f"{name}/eager"], results[f"{name}/compiled"]
    assert eager["compiled"] == [False] * 2 and compiled["compiled"] == [True] * 2, name
    assert eager["facts"] == compiled["facts"], name
    assert_close(compiled, eager)
    return compiled


@pytest.mark.extended
def test_compiled_blocks_at_tp2_sp_train_like_eager():
    results = run_on_ranks(_train, 2, args=({"tp2_sp": (TP_SP, "aot_eager")},), timeout=600)
    for result in results:
        compiled = _check(result, "tp2_sp")
        assert compiled["facts"]["tp"] == 2 and compiled["facts"]["cp"] == 1
        assert compiled["facts"]["shapes"]["layers.0.mlp.down_proj.weight"] == (64, 64)  # ffn 128 over 2
        assert compiled["graphs"] == 1 and compiled["graph_breaks"] == 0  # the collectives are in the graph
    assert results[0]["tp2_sp/eager"]["losses"] == results[1]["tp2_sp/eager"]["losses"]


@pytest.mark.extended
def test_compiled_blocks_at_every_layout_with_inductor_and_recompute():
    layouts = {
        "tp2_sp_full": (TP_SP + FULL, "inductor"),
        "cp2": (CP, "inductor"),
        "ep2_full": (EP + FULL, "inductor"),
    }
    results = run_on_ranks(_train, 2, args=(layouts,), timeout=1800)
    for rank, result in enumerate(results):
        tp = _check(result, "tp2_sp_full")
        assert tp["facts"]["tp"] == 2 and tp["graphs"] == 1 and tp["graph_breaks"] == 0
        cp = _check(result, "cp2")
        assert cp["facts"]["cp"] == 2 and cp["facts"]["tp"] == 1
        assert cp["graph_breaks"] > 0  # the ring's isend / irecv run between compiled regions
        ep = _check(result, "ep2_full")
        assert ep["facts"]["ep"] == 2 and ep["facts"]["experts"] == [2 * rank, 2 * rank + 1]
        assert ep["graphs"] >= 2  # compiled regions before and after the eager dispatch
