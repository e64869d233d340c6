"""Delayed scaling for FP8 MoE experts: each expert projection keeps its own amax history, rolled after each
step over the expert-data-parallel ranks only, and kept in checkpoints.

* ep 2 equals one process over three steps (fp32, 1e-5: outputs, input and expert-weight gradients; the
  histories to 1e-6): the one-process reference is the same layer run on both ranks' batches at once, as in
  tests/test_fp8_experts.py; extended: ep 2 x expert data parallelism 2 against one process that runs the
  two expert-parallel groups' tokens as two micro-batches of each step. A probe rolls the experts'
  histories over the data-parallel group instead (which spans the expert-parallel ranks, holding *other*
  experts): the histories and the later steps' outputs then differ.
* A MoE trainer at ep 2 stopped after a checkpoint resumes bit for bit with the experts' histories restored;
  a resume that lost them would differ (the probe).

The multi-rank checks are in the extended tier, with the other FP8 expert layouts (docs/testing.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import full_grad, rel_err
from test_fp8_training import DELAYED
from tiny_recipes import TINY_MOE

from megacann import parallel_state as ps
from megacann.layers import LayerContext, MoEConfig, MoELayer
from megacann.layers.fp8 import EXPERT_HISTORY, roll_amax_histories
from megacann.ops.fp8 import Fp8Settings

SEED, BATCH, SEQ, HIDDEN, FFN, EXPERTS, STEPS = 5, 2, 16, 64, 64, 4, 3
DELAYED_SETTINGS = Fp8Settings("tensorwise", scaling="delayed", amax_history_len=2)


def _batch(step: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``d``'s input and output gradient in ``step`` (larger each step, so the scales
    from the history differ from each step's own amax)."""
    gen = torch.Generator().manual_seed(300 + 10 * step + d)
    grow = 1.0 + step
    return grow * torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen)


def _train_layer(micro_batches, expert_group) -> dict:
    """The delayed-scaling MoE layer for STEPS steps on ``micro_batches(step)`` (a list of inputs and output
    gradients, the weight gradients accumulated over them), its histories rolled over ``expert_group``
    after each step; each step's outputs, input gradients and expert gradients, and the final histories."""
    torch.manual_seed(SEED)
    cfg = MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=FFN, top_k=2)
    with LayerContext(fp8=DELAYED_SETTINGS):
        layer = MoELayer(cfg).train()
    steps = []
    for step in range(STEPS):
        outs, dxs = [], []
        for x, g in micro_batches(step):
            x = x.clone().requires_grad_()
            out = layer(x)
            (out * g).sum().backward()
            outs.append(out.detach())
            dxs.append(x.grad)
        grads = {n: full_grad(p).clone() for n, p in layer.named_parameters() if n.startswith("experts.")}
        steps.append({"out": outs, "dx": dxs, "grads": grads})
        layer.zero_grad()
        roll_amax_histories([layer], None, expert_group)
    histories = {n: b.clone() for n, b in layer.named_buffers() if n.endswith(EXPERT_HISTORY)}
    return {"steps": steps, "histories": histories}


def _against_one_process() -> dict:
    """ep 2 (x expert data parallelism 2 at world 4) against one process whose micro-batch ``k`` of a step
    is every batch of the ranks with expert-data-parallel rank ``k`` (one expert-parallel group's tokens)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_rank, edp_rank = rank % 2, rank // 2  # the rank grid's tp-cp-ep-dp-pp order (checked below)

    def one_process(step):
        return [[torch.cat(t) for t in zip(*(_batch(step, 2 * k + e) for e in range(2)))] for k in range(world // 2)]

    ref = _train_layer(one_process, None)
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        assert (ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()) == (ep_rank, edp_rank)
        edp_group = ps.get_expert_data_parallel_group()
        rows = slice(ep_rank * BATCH, (ep_rank + 1) * BATCH)
        runs = {
            "ep2": _train_layer(lambda step: [_batch(step, rank)], edp_group),
            # the bug: the experts' histories rolled over the data-parallel group, whose ranks hold other experts
            "ep2_dp_group": _train_layer(lambda step: [_batch(step, rank)], ps.get_data_parallel_group()),
        }
        out = {"expert_data_parallel_size": ps.get_expert_data_parallel_world_size()}
        for name, got in runs.items():
            errs = []
            for mine, want in zip(got["steps"], ref["steps"]):
                step = {
                    "out": rel_err(mine["out"][0], want["out"][edp_rank][rows]),
                    "dx": rel_err(mine["dx"][0], want["dx"][edp_rank][rows]),
                }
                for n, grad in mine["grads"].items():  # summed over the ranks holding the same experts
                    if dist.get_world_size(edp_group) > 1:
                        dist.all_reduce(grad, group=edp_group)
                    step[n] = rel_err(grad, want["grads"][n])
                errs.append(step)
            history_errs = {n: rel_err(h, ref["histories"][n], floor=0.0) for n, h in got["histories"].items()}
            out[name] = {"errs": errs, "history_errs": history_errs, "histories": got["histories"]}
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def ep2():
    return run_on_ranks(_against_one_process, 2, timeout=300)


def _check_parity(results: list, edp: int) -> None:
    for rank, got in enumerate(results):
        run = got["ep2"]
        assert got["expert_data_parallel_size"] == edp
        # this rank's 2 experts x 2 projections, each with its own history: [1 + 2, 3], rolled 3 times
        experts = sorted({n.split(".")[1] for n in run["histories"]})
        first = 2 * (rank % 2)
        assert experts == [str(e) for e in range(first, first + 2)] and len(run["histories"]) == 4
        for name, history in run["histories"].items():
            assert history.shape == (3, 3) and torch.all(history[0] == 0) and torch.all(history[1:] > 0), name
        assert max(run["history_errs"].values()) <= 1e-6, run["history_errs"]
        for step, errs in enumerate(run["errs"]):
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad and len(errs) == 2 + 4, (rank, step, bad)


def _check_wrong_group_differs(results: list) -> None:
    broken = [got["ep2_dp_group"] for got in results]
    assert max(max(run["history_errs"].values()) for run in broken) > 0.05
    # the first step scales by its own amax (no history yet) and still matches; later steps do not
    assert all(max(run["errs"][0].values()) <= 1e-5 for run in broken)
    assert max(run["errs"][-1]["out"] for run in broken) > 1e-5


@pytest.mark.extended  # FP8 experts' multi-rank checks are in the extended tier (docs/testing.md)
def test_delayed_expert_scaling_under_expert_parallelism_equals_one_process(ep2):
    _check_parity(ep2, 1)


@pytest.mark.extended  # FP8 experts' multi-rank checks are in the extended tier (docs/testing.md)
def test_expert_histories_rolled_over_the_data_parallel_group_break_parity(ep2):
    _check_wrong_group_differs(ep2)


@pytest.mark.extended
def test_delayed_expert_histories_are_reduced_over_the_expert_data_parallel_ranks():
    # world 4: ep 2 x expert-data-parallel 2, each expert's histories rolled over its 2 holders, equal to one
    # process that ran both expert-parallel groups' tokens as two micro-batches of a step
    results = run_on_ranks(_against_one_process, 4, timeout=400)
    _check_parity(results, 2)
    _check_wrong_group_differs(results)


def test_delayed_scaling_is_accepted_for_experts():
    from megacann.layers.moe.fp8 import check_fp8_experts

    check_fp8_experts(DELAYED_SETTINGS, "GroupedExperts(E)", FFN, True, 1)
    with LayerContext(fp8=DELAYED_SETTINGS):
        layer = MoELayer(MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=FFN, top_k=2))
    names = sorted(n for n, _ in layer.named_buffers() if n.endswith(EXPERT_HISTORY))
    assert names == [f"experts.{e}.{p}.{EXPERT_HISTORY}" for e in range(4) for p in ("down_proj", "gate_up_proj")]
    assert f"experts.0.down_proj.{EXPERT_HISTORY}" in layer.state_dict()  # persistent: checkpoints keep it


MOE_DELAYED = [*TINY_MOE, *DELAYED, "distributed.expert_parallel_size=2", "logging.ckpt_interval=2"]


def _expert_histories(trainer) -> dict:
    return {n: b.clone() for chunk in trainer.model_chunks for n, b in chunk.named_buffers() if EXPERT_HISTORY in n}


def _resume(root: str) -> dict:
    from checkpoint_helpers import make_trainer, run_steps

    straight = run_steps(make_trainer(MOE_DELAYED, f"{root}/straight", 4), 4)
    first = make_trainer(MOE_DELAYED, f"{root}/stopped", 4)
    head = run_steps(first, 2)
    saved = _expert_histories(first)
    first.save_checkpoint()
    first.checkpointer.wait()
    results = {"straight": straight, "saved": saved}
    for name in ("resumed", "resumed_without_histories"):
        second = make_trainer(MOE_DELAYED, f"{root}/stopped", 4)
        second.resume()
        results[f"{name}_histories"] = _expert_histories(second)
        if name == "resumed_without_histories":  # what a checkpoint without the experts' histories would give
            for chunk in second.model_chunks:
                for n, b in chunk.named_buffers():
                    if EXPERT_HISTORY in n:
                        b.zero_()
        results[name] = head + run_steps(second, 2)
    return results


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_on_ranks(_resume, 2, args=(str(tmp_path_factory.mktemp("moe_delayed")),), timeout=400)


@pytest.mark.extended  # FP8 experts' multi-rank checks are in the extended tier (docs/testing.md)
def test_moe_trainer_with_delayed_expert_scaling_resumes_bit_for_bit(resumed):
    for rank, got in enumerate(resumed):
        # 2 MoE blocks x this rank's 2 of the 4 experts x 2 projections, each history restored as saved
        assert len(got["saved"]) == 8 and all(torch.any(h[1:] > 0) for h in got["saved"].values())
        experts = {n.split(".experts.")[1].split(".")[0] for n in got["saved"]}
        assert experts == {str(e) for e in range(2 * rank, 2 * rank + 2)}, experts
        restored = got["resumed_histories"]
        assert restored.keys() == got["saved"].keys()
        assert all(torch.equal(restored[n], h) for n, h in got["saved"].items())
        assert got["resumed"] == got["straight"], (got["resumed"], got["straight"])
        assert got["resumed_without_histories"] != got["straight"]
    # the trainer rolled each rank's experts on their own: rolled over the data-parallel group (here the
    # expert-parallel ranks), expert e's history would equal expert e + 2's on the other rank
    mine, other = (got["saved"] for got in resumed)
    for name, history in mine.items():
        twin = name.replace(".experts.0.", ".experts.2.").replace(".experts.1.", ".experts.3.")
        assert not torch.equal(history[1:], other[twin][1:]), name
