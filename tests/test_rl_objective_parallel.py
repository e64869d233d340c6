"""The reinforcement-learning objective across ranks (gloo, CPU, fp32), with fixed rollouts built here: a
trainer whose objective is the policy loss on SFT micro-batches completed with advantages and old / reference
/ rollout log-probabilities that depend only on each sequence's tokens (so any layout sees the same ones).
At tp 2 + SP, pp 2, ep 2 (an MoE model), dp 2 + ZeRO-1, dp 2 + ZeRO-3, LoRA at tp 2 and (GSPO) cp 2, the
loss, the global gradient norm and every figure of 3 steps equal one process's, and so does each tensor's
first-step gradient where a rank holds whole gradients (no ZeRO, no expert parallelism); probes show that
each layout was in force (weight shards, tokens per block, layers per stage, experts per rank, shards)."""

from __future__ import annotations

import os

import pytest
from dist_harness import run_on_ranks
from finetune_helpers import LORA

pytestmark = pytest.mark.extended

STEPS = 3
TP2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
ONE_MICRO_BATCH = ["optim.grad_accum_steps=1"]  # dp 2: the global batch of one process (4 x 2)
MOE = [
    "model.type=moe", "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64",
    "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=1e-2",
]  # fmt: skip
# name: (overrides, loss, the one-process run it equals)
RUNS_WORLD1 = {"dense": ([], "clip"), "gspo": ([], "gspo"), "lora": (LORA, "clip"), "moe": (MOE, "clip")}
RUNS_WORLD2 = {
    "tp2_sp": (TP2, "clip", "dense"),
    "pp2": (["distributed.pipeline_parallel_size=2"], "clip", "dense"),
    "ep2": ([*MOE, "distributed.expert_parallel_size=2", *ONE_MICRO_BATCH], "clip", "moe"),
    "zero1_dp2": (["distributed.zero_optimization=1", *ONE_MICRO_BATCH], "clip", "dense"),
    "zero3_dp2": (["distributed.zero_optimization=3", *ONE_MICRO_BATCH], "clip", "dense"),
    "tp2_lora": ([*TP2, *LORA], "clip", "lora"),
    "cp2_gspo": (["distributed.context_parallel_size=2"], "gspo", "gspo"),
}
FIGURES = ("loss", "grad_norm", "pg_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high")
FIGURES += ("logp_diff_mean", "logp_diff_max", "tis_weight_mean", "response_tokens", "sequences")


def _losses():
    from megacann.models.policy_loss import PolicyLoss

    return {
        "clip": PolicyLoss(0.2, 0.28, loss_aggregation="seq_mean_token_mean", kl_coef=0.1, tis_cap=1.05),
        "gspo": PolicyLoss(0.01, 0.015, ratio_level="sequence", kl_coef=0.1, kl_estimator="k1", tis_cap=1.05),
    }


def write_long_answers(path: str) -> None:
    """Short prompts with answers of 16-24 bytes: under cp 2 each response straddles both ranks' shares
    (of 32 tokens, rank 0 holds 0-7 and 24-31), so per-sequence sums need the cp reduction."""
    import random

    from finetune_helpers import random_words, write_jsonl

    words = random_words(random.Random(0), 64)
    write_jsonl(path, [{"instruction": w, "output": " ".join([w[::-1]] * 4)} for w in words])


def _moved(logp, batch: dict, amplitude: float, phase: float):
    """``logp`` plus a fixed pattern of each token's id and position, 0 off the response."""
    import torch

    from megacann.constants import IGNORE_INDEX

    position = torch.arange(logp.shape[1], dtype=torch.float32)
    pattern = torch.sin(batch["tokens"].float() * 1.3 + position * 0.7 + phase)
    return torch.where(batch["labels"] != IGNORE_INDEX, logp + amplitude * pattern, 0.0)


class FixedRollouts:
    """The trainer's objective for the test: the policy loss, with each step's micro-batches completed by
    values that depend on each sequence's tokens alone: the advantage, and the current policy's per-token
    log-probabilities (one forward-only pass) moved by fixed patterns as old, reference and rollout values."""

    def __init__(self, trainer, loss):
        from megacann.models.policy_loss import policy_forward_step
        from megacann.pipeline import get_forward_backward_func

        self.trainer, self.loss, self.max_sink = trainer, loss, []
        self.base = trainer.model_spec.forward_step
        self.forward_step = policy_forward_step(self.base, loss, self.max_sink)
        self.logps_schedule = get_forward_backward_func(trainer.cfg, self.base)

    def prepare(self, micro_batches, data) -> None:
        import torch

        from megacann.models.policy_loss import token_logps_forward_step

        sink: list = []
        with torch.no_grad():
            self.logps_schedule(
                self.trainer.model_chunks,
                micro_batches,
                loss_normalizer=1.0,
                forward_only=True,
                forward_step=token_logps_forward_step(self.base, sink),
            )
        if not sink:  # a stage without the head: the values are not read there
            sink = [torch.zeros(mb["labels"].shape, dtype=torch.float32) for mb in micro_batches]
        for mb, logp in zip(micro_batches, sink):
            mb["advantages"] = (mb["tokens"].sum(-1) % 7).float() / 3.0 - 1.0
            mb["old_logps"] = _moved(logp, mb, 0.3, 0.0)
            mb["ref_logps"] = _moved(logp, mb, 0.5, 1.0)
            mb["rollout_logps"] = _moved(logp, mb, 0.05, 2.0)

    def count(self, micro_batches):
        from megacann import parallel_state as ps
        from megacann.models.policy_loss import count_policy_normalizer

        return count_policy_normalizer(micro_batches, self.loss.loss_aggregation, ps.get_data_parallel_group())

    def figures(self, figures):
        from megacann.models.policy_loss import policy_figures

        return policy_figures(figures, self.loss, self.max_sink)


def _runs(runs: dict, tmp: str) -> dict:
    import torch.distributed as dist
    from finetune_helpers import COMMON, recipe, sft_overrides
    from test_training_parity import ModeProbes
    from zero3_checks import storages

    from megacann import parallel_state as ps
    from megacann.interop.full_state import gather_full_tensor
    from megacann.layers.moe.layer import MoELayer
    from megacann.layers.sharding import get_sharding, set_sharding
    from megacann.layers.transformer import TransformerBlock
    from megacann.pipeline import get_forward_backward_func
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    path = os.path.join(tmp, "task.jsonl")
    if dist.get_rank() == 0:
        write_long_answers(path)
    dist.barrier()
    losses = _losses()
    results = {}
    for name, (overrides, loss_name, *_) in runs.items():
        extra = [f"experiment.output_dir={tmp}/{name}", "optim.lr=1e-3", "data.batch_size=4", *overrides]
        cfg = recipe([*COMMON, *sft_overrides(path, f"{tmp}/cache"), *extra], world_size=dist.get_world_size())
        trainer = Trainer(cfg, setup_runtime(cfg))
        trainer.objective = FixedRollouts(trainer, losses[loss_name])
        trainer.forward_backward = get_forward_backward_func(cfg, trainer.objective.forward_step)
        modes = ModeProbes(trainer)
        steps, grads = [trainer.train_step()], None
        if not cfg.distributed.zero_stage and ps.get_expert_model_parallel_world_size() == 1:
            # the first step's (clipped) gradients, whole (ZeRO leaves each rank a reduced shard only; expert
            # parallelism holds each rank's experts under local names)
            grads = {
                n: gather_full_tensor(set_sharding(p.main_grad, get_sharding(p)))
                for chunk in trainer.model_chunks
                for n, p in chunk.named_parameters()
                if p.requires_grad
            }
        steps += [trainer.train_step() for _ in range(STEPS - 1)]
        params = [p for chunk in trainer.model_chunks for p in chunk.parameters()]
        results[name] = {
            "trace": {k: [float(s[k]) for s in steps] for k in FIGURES},
            "grads": grads,
            "layout": (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_data_parallel_world_size(),
                ps.get_context_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
            ),
            "q_proj_rows": sorted(
                {
                    tuple(p.shape)[0]
                    for chunk in trainer.model_chunks
                    for n, p in chunk.named_parameters()
                    if n.endswith("q_proj.weight")
                }
            ),
            "blocks": sum(isinstance(m, TransformerBlock) for c in trainer.model_chunks for m in c.modules()),
            "seq": modes.summary()["seq_lengths"]["train"],
            "experts": sorted(
                {
                    m.dispatcher.num_local_experts
                    for c in trainer.model_chunks
                    for m in c.modules()
                    if isinstance(m, MoELayer)
                }
            ),
            # ZeRO-3: the share of the weights this rank keeps (its shards; none without ZeRO-3)
            "shard_share": sum(s.shard.numel() for s in storages(trainer.optimizer)) / sum(p.numel() for p in params),
            "adapters": sum(".adapter." in n for chunk in trainer.model_chunks for n, _ in chunk.named_parameters()),
        }
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_runs, 1, args=(RUNS_WORLD1, str(tmp_path_factory.mktemp("w1"))), timeout=600)[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_on_ranks(_runs, 2, args=(RUNS_WORLD2, str(tmp_path_factory.mktemp("w2"))), timeout=900)


PER_TENSOR_GRADIENTS = {"tp2_sp", "pp2", "tp2_lora", "cp2_gspo"}  # the others: the global gradient norm

# what each run's probes must show: (tp, pp, dp, cp, ep), q_proj rows, blocks per rank, tokens per block
# divisor, local experts, weights sharded by ZeRO-3
EXPECTED = {
    "tp2_sp": ((2, 1, 1, 1, 1), [32], 4, 2, [], False),
    "pp2": ((1, 2, 1, 1, 1), [64], 2, 1, [], False),
    "ep2": ((1, 1, 2, 1, 2), [32], 2, 1, [2], False),
    "zero1_dp2": ((1, 1, 2, 1, 1), [64], 4, 1, [], False),
    "zero3_dp2": ((1, 1, 2, 1, 1), [64], 4, 1, [], True),
    "tp2_lora": ((2, 1, 1, 1, 1), [32], 4, 2, [], False),
    "cp2_gspo": ((1, 1, 1, 2, 1), [64], 4, 2, [], False),
}


@pytest.mark.parametrize("run", sorted(RUNS_WORLD2))
def test_policy_loss_trains_like_one_process(world1, world2, run):
    ref = world1[RUNS_WORLD2[run][2]]
    layout, rows, blocks, token_split, experts, sharded = EXPECTED[run]
    for rank in world2:
        got = rank[run]
        assert got["layout"] == layout
        assert got["q_proj_rows"] == rows and ref["q_proj_rows"] == [r * layout[0] for r in rows]
        assert got["blocks"] == blocks and ref["blocks"] == blocks * layout[1]
        assert got["seq"] == [s // token_split for s in ref["seq"]] and ref["seq"]
        assert got["experts"] == experts and ref["experts"] == [e * layout[4] for e in experts]
        assert 0.5 <= got["shard_share"] < 0.6 if sharded else got["shard_share"] == 0, got["shard_share"]
        assert got["adapters"] == ref["adapters"] and (got["adapters"] > 0) == run.endswith("lora")
        for key in FIGURES:
            for a, e in zip(got["trace"][key], ref["trace"][key], strict=True):
                assert abs(a - e) <= 1e-5 * max(abs(e), 1e-2), (run, key, got["trace"][key], ref["trace"][key])
        if got["grads"] is not None:  # each tensor of this rank's stage, norm-wise
            assert got["grads"] and set(got["grads"]) <= set(ref["grads"]), run
            for name, grad in got["grads"].items():
                want = ref["grads"][name]
                assert (grad - want).norm() <= 1e-5 * want.norm(), (run, name)
    compared = [set(rank[run]["grads"] or ()) for rank in world2]
    assert set().union(*compared) == (set(ref["grads"]) if run in PER_TENSOR_GRADIENTS else set()), run


def test_the_one_process_runs_exercise_every_term(world1):
    """The fixed rollouts clip on both sides, weigh tokens by truncated importance sampling (weights below
    1 on average), and differ from the reference; the loss moves from step to step."""
    for name, run in world1.items():
        trace = run["trace"]
        assert max(trace["clip_frac_low"]) > 0 and max(trace["clip_frac_high"]) > 0, name
        assert min(trace["tis_weight_mean"]) > 0.85 and max(trace["tis_weight_mean"]) < 1.0, name
        assert min(trace["kl"]) > 1e-3 and min(trace["entropy"]) > 1.0 and min(trace["logp_diff_max"]) > 0, name
        assert len(set(trace["loss"])) == STEPS and min(trace["grad_norm"]) > 0, name
