"""DPO across ranks (gloo, CPU, fp32): tensor parallel 2 with sequence parallelism, pipeline parallel 2
(a pair's chosen and rejected sequences in one micro-batch), data parallel 2 with ZeRO-1, context
parallel 2 and (an MoE model) expert parallel 2 train the one-process loss and reward trace, with the reference a frozen copy sharded like the
policy, or (LoRA) the base with adapters disabled. One spawn per world size; and the precomputed reference
table of data parallel 2 equals one process's where the last rank's micro-batches run past the data."""

from __future__ import annotations

import os

import pytest
from dist_harness import run_on_ranks
from finetune_helpers import LORA
from test_training_parity import ModeProbes, assert_close_trace

pytestmark = pytest.mark.extended

STEPS = 3
TP2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
PP2 = ["distributed.pipeline_parallel_size=2"]
Z1_DP2 = ["distributed.zero_optimization=1", "optim.grad_accum_steps=1"]  # global batch 8, as one process
CP2 = ["distributed.context_parallel_size=2"]
MOE = [
    "model.type=moe", "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64",
    "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=1e-2",
]  # fmt: skip
EP2 = [*MOE, "distributed.expert_parallel_size=2", "optim.grad_accum_steps=1"]  # dp 2, experts split over it
RUNS_WORLD1 = {"copy": [], "lora": LORA, "moe": MOE}
RUNS_WORLD2 = {
    "tp2": TP2,
    "pp2": PP2,
    "zero1_dp2": Z1_DP2,
    "cp2": CP2,
    "tp2_lora": [*TP2, *LORA],
    "pp2_lora": [*PP2, *LORA],
    "ep2": EP2,
}
FIGURES = ("loss", "chosen_reward", "rejected_reward", "reward_margin")


def _runs(runs: dict[str, list[str]], tmp: str, evaluate: bool = False) -> dict:
    """Each run's trace of STEPS steps (and with ``evaluate`` its held-out figures after them)."""
    import functools
    import threading

    import torch.distributed as dist
    from finetune_helpers import recipe
    from test_dpo import dpo_overrides, write_pairs

    from megacann import parallel_state as ps
    from megacann.layers.moe.layer import MoELayer
    from megacann.pipeline.plan import BackwardWeight
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    path = os.path.join(tmp, "p.jsonl")
    if dist.get_rank() == 0:
        write_pairs(path)
    dist.barrier()
    results = {}
    for name, overrides in runs.items():
        out = os.path.join(tmp, name)
        cfg = recipe(
            [*dpo_overrides(path, tmp, f"experiment.output_dir={out}", "optim.lr=1e-3"), *overrides],
            world_size=dist.get_world_size(),
        )
        trainer = Trainer(cfg, setup_runtime(cfg))
        modes = ModeProbes(trainer)  # the sequence length every block of the policy saw
        actions, probe = [], []  # what the policy's schedule ran; dualpipev's pairs that ran at once
        pipelined = {"probe": probe} if cfg.distributed.pipeline_parallel_size > 1 else {}
        trainer.forward_backward = functools.partial(trainer.forward_backward, trace=actions, **pipelined)
        steps = [trainer.train_step() for _ in range(STEPS)]
        results[name] = {
            "trace": {k: [s[k] for s in steps] for k in (*FIGURES, "reward_accuracy", "grad_norm")},
            "weights_run": sum(isinstance(a, BackwardWeight) for a in actions),  # W of a split backward
            "probe": [(a, t == threading.get_ident(), start, end) for a, t, start, end in probe],
            "copy_sharded": trainer.objective.reference is not None
            and all(
                tuple(p.shape) == tuple(q.shape)
                for chunk, ref in zip(trainer.model_chunks, trainer.objective.reference)
                for (_, p), q in zip(
                    [(n, p) for n, p in chunk.named_parameters() if ".adapter." not in n], ref.parameters()
                )
            ),
            "kind": trainer.objective.kind,
            "seq": modes.summary()["seq_lengths"]["train"],
            "shapes": {n: tuple(p.shape) for chunk in trainer.model_chunks for n, p in chunk.named_parameters()},
            "experts": sorted(
                {
                    m.dispatcher.num_local_experts
                    for c in trainer.model_chunks
                    for m in c.modules()
                    if isinstance(m, MoELayer)
                }
            ),
            "stage": ps.get_pipeline_model_parallel_rank(),
            "eval": trainer.evaluate() if evaluate else None,
            "layout": (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_data_parallel_world_size(),
                ps.get_context_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
            ),
        }
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_runs, 1, args=(RUNS_WORLD1, str(tmp_path_factory.mktemp("w1"))), timeout=300)[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_on_ranks(_runs, 2, args=(RUNS_WORLD2, str(tmp_path_factory.mktemp("w2"))), timeout=600)


LAYOUTS = {
    "tp2": (2, 1, 1, 1, 1),
    "pp2": (1, 2, 1, 1, 1),
    "zero1_dp2": (1, 1, 2, 1, 1),
    "cp2": (1, 1, 1, 2, 1),
    "ep2": (1, 1, 2, 1, 2),
}


# Tensor parallelism splits these weights along this dimension (column-parallel: outputs; row-parallel: inputs).
TP_SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_up_proj": 0, "o_proj": 1, "down_proj": 1}


def assert_split_as_the_layout_says(got: dict, ref: dict, run: str) -> None:
    """Probes that the layout really split the work, against the one-process run ``ref``: under tp each
    projection weight holds half its rows (column-parallel) or columns (row-parallel) and the norms are
    whole; blocks see half the tokens under tp with sequence parallelism and under cp; under ep each rank
    holds half the experts. A layout that ran unsplit while its groups were made fails here."""
    tp, _, _, cp, ep = LAYOUTS[run.removesuffix("_lora")]
    split = 0
    for name, shape in got["shapes"].items():
        if ".adapter." in name:  # LoRA's A and B: split like their base on one side only; the traces prove them
            continue
        if name in ("embed_tokens.weight", "lm_head.weight"):  # vocabulary-parallel, padded per tp size
            rows, whole = shape[0], ref["shapes"][name][0]
            assert shape[1:] == ref["shapes"][name][1:], (run, name, shape)
            assert rows == whole if tp == 1 else rows < whole <= rows * tp, (run, name, shape, ref["shapes"][name])
            continue
        dim = next((d for proj, d in TP_SPLIT.items() if f".{proj}." in name), None)
        expected = list(ref["shapes"][name])
        if dim is not None and name.endswith("weight"):
            expected[dim] //= tp
            split += tp > 1
        assert list(shape) == expected, (run, name, shape, ref["shapes"][name])
    assert split == (6 * 4 if tp > 1 else 0), (run, split)  # six projections in each of the 4 layers
    tokens_split = cp * (tp if "distributed.sequence_parallel=true" in RUNS_WORLD2[run] else 1)
    assert got["seq"] == [s // tokens_split for s in ref["seq"]] and ref["seq"], (run, got["seq"], ref["seq"])
    assert got["experts"] == [e // ep for e in ref["experts"]], (run, got["experts"], ref["experts"])
    assert bool(got["experts"]) == (run == "ep2")


@pytest.mark.parametrize("run", sorted(RUNS_WORLD2))
def test_dpo_trains_like_one_process(world1, world2, run):
    lora = run.endswith("_lora")
    ref = world1["lora" if lora else "moe" if run == "ep2" else "copy"]
    for rank in world2:  # every rank logs the same figures
        got = rank[run]
        assert got["layout"] == LAYOUTS[run.removesuffix("_lora")]  # the groups the layout asks for
        assert_split_as_the_layout_says(got, ref, run)
    if any(LAYOUTS[run.removesuffix("_lora")][i] > 1 for i in (0, 3, 4)):  # tp, cp or ep: a run left unsplit
        with pytest.raises(AssertionError):  # (the one-process run's own probes) fails the probes
            assert_split_as_the_layout_says(ref, ref, run)
        assert got["kind"] == ("adapters_off" if lora else "copy")
        assert got["copy_sharded"] != lora
        assert_close_trace(got["trace"]["loss"], ref["trace"]["loss"], 1e-5)
        for key in FIGURES[1:]:  # beta x differences of log-probability sums (~10 each): compared absolutely
            assert len(got["trace"][key]) == STEPS
            for a, e in zip(got["trace"][key], ref["trace"][key]):
                assert abs(a - e) <= 1e-5, (key, got["trace"][key], ref["trace"][key])
        assert got["trace"]["reward_accuracy"] == ref["trace"]["reward_accuracy"]
    assert ref["trace"]["reward_margin"][0] == 0.0  # step 1: the policy is its reference
    assert all(abs(m) > 1e-4 for m in ref["trace"]["reward_margin"][1:])  # then it moves away


def _table(tmp: str, overrides: list[str]) -> list[float]:
    """``dpo.reference: precomputed``'s table over 49 pairs (98 sequences), computed at the first step."""
    import torch.distributed as dist
    from finetune_helpers import recipe
    from test_dpo import dpo_overrides, write_pairs

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    path = os.path.join(tmp, "p.jsonl")
    if dist.get_rank() == 0:
        write_pairs(path, count=49)
    dist.barrier()
    extra = [f"experiment.output_dir={tmp}/out", "dpo.reference=precomputed", *overrides]
    cfg = recipe(dpo_overrides(path, tmp, *extra), world_size=dist.get_world_size())
    trainer = Trainer(cfg, setup_runtime(cfg))
    trainer.train_step()
    ps.destroy_model_parallel()
    return trainer.objective.table.tolist()


def test_precomputed_reference_under_data_parallel_writes_each_sequence_once(tmp_path):
    """98 sequences in micro-batches of 4 dealt to 2 ranks: rank 1's last one lies past the end and reads the
    last sequence again; the ranks' tables are summed, so that value must come from one rank only."""
    one = run_on_ranks(_table, 1, args=(str(tmp_path / "w1"), []), timeout=300)[0]
    two = run_on_ranks(_table, 2, args=(str(tmp_path / "w2"), Z1_DP2), timeout=300)
    assert len(one) == 98 and all(v < 0 for v in one)
    for rank in two:
        assert_close_trace(rank, one, 1e-5)
