"""Delayed scaling for FP8 MoE experts: each expert projection keeps its own amax history, rolled after each
step over the expert-data-parallel ranks only, and kept in checkpoints.

* ep 2 equals one process over three steps (fp32, 1e-5: outputs, input and expert-weight gradients; the
  histories to 1e-6): the one-process reference is the same layer run on both ranks' batches at once, as in
  tests/test_fp8_experts.py. A probe rolls the experts' histories over the data-parallel group instead (the
  ranks of the expert-parallel group, which hold *other* experts): the histories and the later steps'
  outputs then differ.
* A MoE trainer at ep 2 stopped after a checkpoint resumes bit for bit with the experts' histories restored;
  a resume that lost them would differ (the probe).
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


def _train_layer(batches, expert_group) -> dict:
    """The delayed-scaling MoE layer for STEPS steps on ``batches(step)``, its histories rolled over
    ``expert_group``; each step's output, input gradient and expert gradients, and the final histories."""
    torch.manual_seed(SEED)
    cfg = MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=FFN, top_k=2)
    with LayerContext(fp8=DELAYED_SETTINGS):
        layer = MoELayer(cfg).train()
    steps = []
    for step in range(STEPS):
        x, g = batches(step)
        x = x.clone().requires_grad_()
        out = layer(x)
        (out * g).sum().backward()
        grads = {n: full_grad(p).clone() for n, p in layer.named_parameters() if n.startswith("experts.")}
        steps.append({"out": out.detach(), "dx": x.grad, "grads": grads})
        layer.zero_grad()
        roll_amax_histories([layer], None, expert_group)
    histories = {n: b.clone() for n, b in layer.named_buffers() if n.endswith(EXPERT_HISTORY)}
    return {"steps": steps, "histories": histories}


def _ep2_against_one_process() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _train_layer(lambda step: [torch.cat(t) for t in zip(*(_batch(step, d) for d in range(world)))], None)
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        runs = {
            "ep2": _train_layer(lambda step: _batch(step, rank), ps.get_expert_data_parallel_group()),
            # the bug: the experts' histories rolled over the data-parallel group, whose ranks hold other experts
            "ep2_dp_group": _train_layer(lambda step: _batch(step, rank), ps.get_data_parallel_group()),
        }
        out = {"expert_data_parallel_size": ps.get_expert_data_parallel_world_size()}
        for name, got in runs.items():
            errs = []
            for mine, want in zip(got["steps"], ref["steps"]):
                step = {"out": rel_err(mine["out"], want["out"][rows]), "dx": rel_err(mine["dx"], want["dx"][rows])}
                step.update({n: rel_err(grad, want["grads"][n]) for n, grad in mine["grads"].items()})
                errs.append(step)
            history_errs = {n: rel_err(h, ref["histories"][n], floor=0.0) for n, h in got["histories"].items()}
            out[name] = {"errs": errs, "history_errs": history_errs, "histories": got["histories"]}
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def ep2():
    return run_on_ranks(_ep2_against_one_process, 2, timeout=300)


def test_delayed_expert_scaling_under_expert_parallelism_equals_one_process(ep2):
    for rank, got in enumerate(ep2):
        run = got["ep2"]
        assert got["expert_data_parallel_size"] == 1
        # this rank's 2 experts x 2 projections, each with its own history: [1 + 2, 3], rolled 3 times
        experts = sorted({n.split(".")[1] for n in run["histories"]})
        assert experts == [str(e) for e in range(2 * rank, 2 * rank + 2)] and len(run["histories"]) == 4
        for name, history in run["histories"].items():
            assert history.shape == (3, 3) and torch.all(history[0] == 0) and torch.all(history[1:] > 0), name
        assert max(run["history_errs"].values()) <= 1e-6, run["history_errs"]
        for step, errs in enumerate(run["errs"]):
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad and len(errs) == 2 + 4, (rank, step, bad)


def test_expert_histories_rolled_over_the_data_parallel_group_break_parity(ep2):
    broken = [got["ep2_dp_group"] for got in ep2]
    assert max(max(run["history_errs"].values()) for run in broken) > 0.05
    # the first step scales by its own amax (no history yet) and still matches; later steps do not
    assert all(max(run["errs"][0].values()) <= 1e-5 for run in broken)
    assert max(run["errs"][-1]["out"] for run in broken) > 1e-5


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
