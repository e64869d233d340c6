"""The GRPO loop (``train_mode: grpo``) at the layouts whose rollouts need the generator's layout support,
on 2 gloo ranks (CPU, fp32, seeded sampling): 3 steps of loss, policy-gradient loss, KL, rewards, advantage
std, entropy and gradient norm equal one process (1e-5) at

- pipeline parallel 2 (probes: the stages hold layers 0-1 and 2-3; both stages train on the same
  micro-batches, the last stage's rewards), with 2 interleaved chunks a stage (probe: stage 0's chunks
  hold layers 0 and 2, stage 1's layers 1 and 3; the generator runs both chunks of each rank), and with the
  V-shaped schedules zbv (with and without router replay) and dualpipev (probe: stage 0 holds layers 0 and
  3 and the head, stage 1 layers 1 and 2; the generator runs both chunks of each rank);
- expert parallel 2 over data parallel 2, a MoE model (probe: 2 of the 4 experts of a layer a rank; the
  ranks generate for different prompts, kept in step by the generator's lockstep);
- ZeRO-3 over data parallel 2 (probe: each rank stores half of the weights, none whole between steps);
- ZeRO-1 over data parallel 2 (probe: the optimizer's state is sharded);
- context parallel 2 for the training pass, dense, MoE and deepseek_v3 (latent attention) (probes: the training
  forward sees 16 of the 32 tokens a rank; both cp ranks generate the same rollouts, said at start-up; the
  deepseek_v3 chunk's 4 attentions are latent);
- router replay (``rl.router_replay``) at ep 2, pp 2, pp 2 x 2 interleaved chunks, tp 2 with and without SP and
  cp 2 with a MoE model, against one process with replay (probe: the micro-batches carry the recorded choices
  of this rank's routers: 4 at ep 2, tp 2 and cp 2, 2 a stage at pp 2, one a chunk with interleaved chunks;
  where whole sequences are routed, every training forward of every router routes each recorded token as the
  rollout did); at ep 2 and at one process also with full activation recomputation (probe: every block
  recomputed), selective recomputation at one process;
- a resume inside a rollout phase at ep 2 with replay, tp 2 + SP, pp 2 and ZeRO-3 repeats the uninterrupted
  run bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch
from dist_harness import run_on_ranks
from test_rl_loop import STEPS, _resume_runs, _trace, _trainer, assert_same_trace, rl_overrides, write_prompts

pytestmark = pytest.mark.extended  # a slow multi-rank check: `make test-extended` runs it

MOE = ["model.type=moe", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]
DEEPSEEK = [  # deepseek_v3: latent attention, MoE with a shared expert
    "model.type=deepseek_v3",
    "model.num_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=8",
    "model.num_key_value_heads=4",
]
DP2 = ["optim.grad_accum_steps=1"]  # global batch 8 on 2 ranks, as one process's 2 x 4
TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
SELECTIVE = "model.activation_checkpointing=selective"
FULL = "model.activation_checkpointing=full"
PP2 = "distributed.pipeline_parallel_size=2"
ZBV = [PP2, "distributed.pipeline_schedule=zbv"]
DUALPIPEV = [PP2, "distributed.pipeline_schedule=dualpipev", "data.batch_size=2", "optim.grad_accum_steps=4"]  # m >= 2p
LAYOUTS = {  # name: (overrides at 2 ranks, the one-process run it must equal)
    "pp2": (["distributed.pipeline_parallel_size=2"], "dense"),
    "pp2_zbv": (ZBV, "dense"),  # the V placement: stage 0 holds layers 0 and 3 and the head
    "pp2_dualpipev": (DUALPIPEV, "dense"),
    "pp2_zbv_replay": ([*MOE, *ZBV, "rl.router_replay=true"], "moe_replay"),
    "pp2_vpp2": (["distributed.pipeline_parallel_size=2", "distributed.virtual_pipeline_size=2"], "dense"),
    "ep2": ([*MOE, *DP2, "distributed.expert_parallel_size=2"], "moe"),
    "zero3": ([*DP2, "distributed.zero_optimization=3"], "dense"),
    "zero1": ([*DP2, "distributed.zero_optimization=1"], "dense"),
    "cp2": (["distributed.context_parallel_size=2"], "dense"),
    "cp2_moe": ([*MOE, "distributed.context_parallel_size=2"], "moe"),
    "cp2_deepseek": ([*DEEPSEEK, "distributed.context_parallel_size=2"], "deepseek"),
    "ep2_replay": ([*MOE, *DP2, "distributed.expert_parallel_size=2", "rl.router_replay=true"], "moe_replay"),
    "ep2_replay_full": (
        [*MOE, *DP2, "distributed.expert_parallel_size=2", "rl.router_replay=true", FULL],
        "moe_replay",
    ),
    "pp2_replay": ([*MOE, "distributed.pipeline_parallel_size=2", "rl.router_replay=true"], "moe_replay"),
    "pp2_vpp2_replay": (
        [*MOE, "distributed.pipeline_parallel_size=2", "distributed.virtual_pipeline_size=2", "rl.router_replay=true"],
        "moe_replay",
    ),
    "tp2_sp_replay": ([*MOE, *TP2_SP, "rl.router_replay=true"], "moe_replay"),
    "tp2_replay": ([*MOE, TP2_SP[0], "rl.router_replay=true"], "moe_replay"),  # the MoE layer scatters
    "cp2_replay": ([*MOE, "distributed.context_parallel_size=2", "rl.router_replay=true"], "moe_replay"),
}
REPLAY = [*MOE, "rl.router_replay=true"]
ONE_PROCESS = {
    "dense": [],
    "moe": MOE,
    "deepseek": DEEPSEEK,
    "moe_replay": REPLAY,
    "replay_selective": [*REPLAY, SELECTIVE],
    "replay_full": [*REPLAY, FULL],
}


def _micro_batch_digest(objective) -> str:
    """A digest of the tokens, labels and advantages of every micro-batch of the phase on this rank."""
    digest = hashlib.sha256()
    for mini_batch in objective.mini_batches:
        for mb in mini_batch:
            for key in ("tokens", "labels", "advantages"):
                digest.update(mb[key].cpu().numpy().tobytes())
    return digest.hexdigest()


def _layout_probe(trainer) -> dict:
    """What shows the layout was in force: this rank's layers, experts, weight and optimizer shards."""
    from megacann.layers import MoELayer, TransformerBlock
    from megacann.layers.latent_attention import LatentAttention

    chunk = trainer.model_chunks[0]
    moe = [m for m in chunk.modules() if isinstance(m, MoELayer)]
    blocks = [m for m in chunk.modules() if isinstance(m, TransformerBlock)]
    probe = {
        "layers": sorted(int(i) for i in chunk.layers),
        "chunk_layers": [sorted(int(i) for i in c.layers) for c in trainer.model_chunks],
        "generator_chunks": len(trainer.objective.generator.chunks),
        "head_stage": trainer.objective.generator.stages.head_stage,
        "experts": sorted(int(e) for e in moe[0].experts) if moe else None,
        "digest": _micro_batch_digest(trainer.objective),
        "optimizer": type(trainer.optimizer).__name__,
        "recomputed_attention": sum(getattr(m, "recompute_core_attention", False) is True for m in chunk.modules()),
        "recomputed_blocks": sum(m.config.recompute == "full" for m in blocks),
        "latent_attention": sum(isinstance(m, LatentAttention) for m in chunk.modules()),
    }
    first = trainer.objective.mini_batches[0][0]
    if "replay_ids" in first:  # router replay: this stage's routers, and the recorded tokens of a micro-batch
        probe["replay"] = (first["replay_ids"].shape[2], int(first["replay_mask"].sum()))
    if trainer.cfg.distributed.zero_optimization == 3:
        from zero3_checks import storages

        stores = storages(trainer.optimizer)
        probe["whole_between_steps"] = sum(s.gathered_numel() for s in stores)
        probe["stored"] = sum(s.shard.numel() for s in stores)
        probe["total"] = sum(s.layout.numel for s in stores)
    return probe


@contextlib.contextmanager
def _training_routes(trainer):
    """Collects ``(router index on this rank, chosen ids [b * s, k])`` of every training forward of a router
    with router replay and whole sequences routed (no tensor or context parallelism); nothing otherwise."""
    from megacann import parallel_state as ps
    from megacann.layers.moe.routing_replay import routers

    routes: list[tuple[int, torch.Tensor]] = []
    whole = ps.get_tensor_model_parallel_world_size() == ps.get_context_parallel_world_size() == 1
    found = [router for chunk in trainer.model_chunks for router in routers(chunk)]
    keep = lambda j: lambda m, args, out: routes.append((j, out.expert_ids)) if m.training else None  # noqa: E731
    wanted = trainer.cfg.rl.router_replay and whole
    hooks = [router.register_forward_hook(keep(j)) for j, router in enumerate(found)] if wanted else []
    try:
        yield routes
    finally:
        for hook in hooks:
            hook.remove()


def _replayed_as_recorded(routes: list[tuple[int, torch.Tensor]], micro_batches: list[dict]) -> list[bool]:
    """For each collected training forward of a router, whether it routed every recorded token of one of the
    step's micro-batches to that router's recorded experts (``replay_ids[:, :, router]``); clears ``routes``."""
    out = []
    for index, ids in routes:
        matched = False
        for mb in micro_batches:
            recorded, mask = mb["replay_ids"][:, :, index], mb["replay_mask"]
            if ids.numel() == recorded.numel() and mask.any():
                matched |= bool((ids.view_as(recorded) == recorded)[mask].all())
        out.append(matched)
    routes.clear()
    return out


def _run(prompts: str, overrides: list[str], world_size: int) -> dict:
    from megacann import parallel_state as ps
    from megacann.layers import TransformerBlock

    trainer = _trainer(rl_overrides(prompts, *overrides), world_size)
    seen = []  # the sequence length the first block saw in training (seq / cp under context parallelism)
    block = next(m for m in trainer.model_chunks[0].modules() if isinstance(m, TransformerBlock))
    block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]) if m.training else None)
    steps, replayed = [], []
    with _training_routes(trainer) as routes:
        for _ in range(STEPS):
            steps.append(trainer.train_step())
            replayed += _replayed_as_recorded(routes, trainer.objective.mini_batches[0])
    out = {"trace": _trace(steps), "seq": sorted(set(seen)), "describe": trainer.objective.describe()}
    out["replayed_as_recorded"] = replayed
    out.update(_layout_probe(trainer))
    ps.destroy_model_parallel()
    return out


def _runs(prompts: str, runs: dict[str, list[str]]) -> dict:
    import torch.distributed as dist

    return {name: _run(prompts, overrides, dist.get_world_size()) for name, overrides in runs.items()}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    return write_prompts(str(tmp_path_factory.mktemp("rl_layouts") / "prompts.jsonl"))


@pytest.fixture(scope="module")
def one_process(prompts) -> dict:
    return run_on_ranks(_runs, 1, args=(prompts, ONE_PROCESS), timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(prompts) -> list[dict]:
    runs = {name: overrides for name, (overrides, _) in LAYOUTS.items()}
    return run_on_ranks(_runs, 2, args=(prompts, runs), timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loop_at_layout_equals_one_process(layout, one_process, two_ranks):
    reference = one_process[LAYOUTS[layout][1]]["trace"]
    for rank in two_ranks:
        assert_same_trace(rank[layout]["trace"], reference)


def test_pipeline_stages_hold_their_layers_and_train_the_same_rollouts(two_ranks, one_process):
    first, last = (rank["pp2"] for rank in two_ranks)
    assert first["layers"] == [0, 1] and last["layers"] == [2, 3]
    assert one_process["dense"]["layers"] == [0, 1, 2, 3]
    assert first["digest"] == last["digest"]  # the same micro-batches, advantages included, on both stages


def test_expert_parallel_ranks_hold_half_the_experts_and_their_own_prompts(two_ranks, one_process):
    assert [rank["ep2"]["experts"] for rank in two_ranks] == [[0, 1], [2, 3]]
    assert one_process["moe"]["experts"] == [0, 1, 2, 3]
    assert two_ranks[0]["ep2"]["digest"] != two_ranks[1]["ep2"]["digest"]  # data parallel: different rollouts


def test_router_replay_was_on_at_ep2_and_on_each_pipeline_stage(two_ranks):
    for rank in two_ranks:
        routers, tokens = rank["ep2_replay"]["replay"]
        assert routers == 4 and tokens > 4 * 6  # every layer's router; a row's prompt and response but one
    assert [rank["pp2_replay"]["replay"][0] for rank in two_ranks] == [2, 2]  # each stage its own 2 routers
    for layout in ("tp2_sp_replay", "tp2_replay", "cp2_replay"):  # each rank replays its slice of the whole recording
        assert [rank[layout]["replay"][0] for rank in two_ranks] == [4, 4]
        assert two_ranks[0][layout]["digest"] == two_ranks[1][layout]["digest"]
    assert "replay" not in two_ranks[0]["ep2"]


@pytest.mark.parametrize("layout", ["cp2", "cp2_moe", "cp2_deepseek"])
def test_context_parallel_ranks_generate_the_same_rollouts_and_train_halves(layout, two_ranks, one_process):
    first, second = (rank[layout] for rank in two_ranks)
    assert first["seq"] == second["seq"] == [16] and one_process[LAYOUTS[layout][1]]["seq"] == [32]
    assert first["digest"] == second["digest"]  # the same rollouts on both cp ranks
    assert "each of the 2 cp ranks of a data-parallel rank generates the same rollouts" in first["describe"]


def test_deepseek_v3_runs_latent_attention(two_ranks, one_process):
    assert one_process["deepseek"]["latent_attention"] == 4 and one_process["moe"]["latent_attention"] == 0
    assert [rank["cp2_deepseek"]["latent_attention"] for rank in two_ranks] == [4, 4]


def test_router_replay_with_recomputation_trains_the_same_trace(one_process):
    for run in ("replay_selective", "replay_full"):
        assert_same_trace(one_process[run]["trace"], one_process["moe_replay"]["trace"])
    assert one_process["replay_selective"]["recomputed_attention"] == 4  # every layer's, and none without it
    assert one_process["moe_replay"]["recomputed_attention"] == 0
    assert one_process["replay_full"]["recomputed_blocks"] == 4  # every block recomputed in backward
    assert one_process["moe_replay"]["recomputed_blocks"] == one_process["replay_selective"]["recomputed_blocks"] == 0


def test_router_replay_with_full_recomputation_at_ep2_recomputes_every_block(two_ranks):
    for rank in two_ranks:
        assert rank["ep2_replay_full"]["recomputed_blocks"] == 4
        assert rank["ep2_replay_full"]["replay"][0] == 4  # the micro-batches carry every router's record


def test_zero3_shards_the_weights_and_zero1_the_optimizer(two_ranks):
    for rank in two_ranks:
        zero3 = rank["zero3"]
        assert zero3["whole_between_steps"] == 0
        assert zero3["stored"] * 2 == zero3["total"]
    assert {rank["zero1"]["optimizer"] for rank in two_ranks} == {"DistributedOptimizer"}
    assert two_ranks[0]["zero1"]["digest"] != two_ranks[1]["zero1"]["digest"]


def test_interleaved_chunks_hold_their_layers_and_the_generator_runs_both(two_ranks):
    first, second = (rank["pp2_vpp2"] for rank in two_ranks)
    assert (first["chunk_layers"], second["chunk_layers"]) == ([[0], [2]], [[1], [3]])
    assert first["generator_chunks"] == second["generator_chunks"] == 2
    assert first["digest"] == second["digest"]  # both stages train on the same rollouts


@pytest.mark.parametrize("layout", ["pp2_zbv", "pp2_dualpipev", "pp2_zbv_replay"])
def test_v_shaped_schedules_generate_and_train_on_both_chunks_of_a_stage(layout, two_ranks):
    """zbv, dualpipev: stage 0 holds layers 0 and 3 (the embedding and the head: it scores the rollouts),
    stage 1 layers 1 and 2; the generator runs both chunks of a rank; both stages train the same rollouts."""
    first, second = (rank[layout] for rank in two_ranks)
    assert (first["chunk_layers"], second["chunk_layers"]) == ([[0], [3]], [[1], [2]])
    assert first["generator_chunks"] == second["generator_chunks"] == 2
    assert first["head_stage"] == second["head_stage"] == 0
    assert first["digest"] == second["digest"]
    if layout.endswith("replay"):  # one router a chunk, both in the rank's record, each routed as recorded
        assert first["replay"][0] == second["replay"][0] == 2
        for run in (first, second):
            assert run["replayed_as_recorded"] == [True] * (2 * 2 * STEPS), run["replayed_as_recorded"]


def test_router_replay_over_interleaved_chunks_routes_each_chunk_as_its_rollout(two_ranks, one_process):
    """pp 2 x 2 chunks: a rank's record holds its 2 chunks' routers (layers 0 and 2, or 1 and 3), and every
    training forward of every router routed each recorded token of its micro-batch as the rollout did."""
    for rank in two_ranks:
        run = rank["pp2_vpp2_replay"]
        assert len(run["chunk_layers"]) == 2 and run["replay"][0] == 2  # 1 router a chunk, both in the record
        # each router of the rank, each training micro-batch (2 a step), 3 steps
        assert run["replayed_as_recorded"] == [True] * (2 * 2 * STEPS), run["replayed_as_recorded"]
    assert [rank["pp2_vpp2_replay"]["chunk_layers"] for rank in two_ranks] == [[[0], [2]], [[1], [3]]]
    assert one_process["moe_replay"]["replayed_as_recorded"] == [True] * (4 * 2 * STEPS)
    assert [len(rank["pp2_replay"]["replayed_as_recorded"]) for rank in two_ranks] == [2 * 2 * STEPS] * 2
    assert all(all(rank["pp2_replay"]["replayed_as_recorded"]) for rank in two_ranks)
    assert one_process["moe"]["replayed_as_recorded"] == []  # no replay: nothing collected


RESUME_LAYOUTS = {  # name: (overrides at 2 ranks, the layout the checkpoint's rollouts were cut for)
    "ep2_replay": (LAYOUTS["ep2_replay"][0], "tp1 pp1 dp2 ep2"),
    "tp2_sp": (TP2_SP, "tp2 pp1 dp1"),
    "pp2": (LAYOUTS["pp2"][0], "tp1 pp2 dp1"),
    "zero3": (LAYOUTS["zero3"][0], "tp1 pp1 dp2 zero3"),
}


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_resume_inside_a_rollout_phase_at_layout_is_bitwise(layout, prompts, tmp_path):
    """Each rank saves and takes back its own share of the phase (its prompts; with router replay its
    routers' choices; at pp 2 the same micro-batches on both stages)."""
    overrides, cut = RESUME_LAYOUTS[layout]
    data_parallel = "dp2" in cut
    ranks = run_on_ranks(_resume_runs, 2, args=(prompts, str(tmp_path), tuple(overrides)), timeout=600)
    for index, got in enumerate(ranks):
        whole = got["uninterrupted"]
        assert got["inside"] == whole[2:] and got["boundary"] == whole[4:]
        phase, counts, keys = got["saved"]
        # a data-parallel rank holds 1 micro-batch of each mini-batch, a tp / pp rank the phase's 2
        assert (phase, counts) == (0, [1, 1] if data_parallel else [2, 2]), (phase, counts)
        assert got["cut"] == cut  # the layout was in force
        assert {"advantages", "rollout_logps"} <= set(keys)
        # the old and reference log-probabilities on the stages whose loss reads them (pp 2: the last only)
        loss_stage = layout != "pp2" or index == 1
        assert ({"old_logps", "ref_logps"} <= set(keys)) == loss_stage and ("old_logps" in keys) == loss_stage, keys
        assert ("replay_ids" in keys) == (layout == "ep2_replay")
        assert "data.batch_size 4; this run has" in got["refused"]
    # data-parallel ranks save their own prompts; tp ranks and pipeline stages the same rows
    assert (ranks[0]["saved_tokens"] != ranks[1]["saved_tokens"]) == data_parallel
