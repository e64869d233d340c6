"""Zero-bubble pipelines train exactly as one process, resume bit for bit, and the executor runs every
rank's plan exactly: the forwards, B, W, backwards and point-to-point transfers each rank really executed
(recorded by ``run_plan(trace=...)``) equal its plan, for 1F1B and interleaved 1F1B too.

The pp 2 cases are the default tier; pp 4 and the combinations with TP + SP, dp + ZeRO-1, context
parallelism, recompute, MoE with expert parallelism and LoRA are ``extended``."""

import functools

import pytest
import torch
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace, assert_params_close
from tiny_recipes import TINY_MOE

STEPS = 4
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3"]
PP2, PP4 = "distributed.pipeline_parallel_size=2", "distributed.pipeline_parallel_size=4"
ZB = "distributed.pipeline_schedule=zb1p"
M2, M4 = "optim.grad_accum_steps=2", "optim.grad_accum_steps=4"
TIED = "model.tie_word_embeddings=true"
MOE = [
    *TINY_MOE,
    "data.seq_length=16",
]
LORA = ["lora=true", "lora_rank=4", "lora_alpha=8.0", "lora_target_modules=all-linear"]
# one-process references: global batch = micro-batch 2 x dp x grad_accum_steps
REFERENCES = {
    "m4": [M4],
    "l6_m4": [M4, "model.num_layers=6"],
    "moe_m4": [M4, *MOE],
    "lora_m4": [M4, *LORA],
    "tied_m4": [M4, TIED],
}
WORLD2 = {  # (overrides, reference)
    "pp2_zb1p_uneven": ([PP2, ZB, M4, "distributed.pipeline_layers=[1,3]"], "m4"),
    "pp2_1f1b": ([PP2, "distributed.pipeline_schedule=1f1b", M4], None),
}
WORLD4 = {
    "pp4_zb1p": ([PP4, ZB, M4], "m4"),
    "pp4_zb1p_uneven_fewer_micro_batches": (
        [PP4, ZB, "optim.grad_accum_steps=4", "model.num_layers=6", "distributed.pipeline_layers=[2,1,2,1]"],
        "l6_m4",
    ),
    "pp2_zb1p_tp2_sp": (
        [PP2, ZB, M4, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
        "m4",
    ),
    "pp2_zb1p_dp2_zero1": ([PP2, ZB, M2, "distributed.zero_optimization=1"], "m4"),
    "pp2_zb1p_cp2_recompute": (
        [PP2, ZB, M4, "distributed.context_parallel_size=2", "model.activation_checkpointing=full"],
        "m4",
    ),
    "pp2_zb1p_moe_ep2": ([PP2, ZB, M2, *MOE, "distributed.expert_parallel_size=2"], "moe_m4"),
    "pp2_zb1p_lora_tp2": ([PP2, ZB, M4, *LORA, "distributed.tensor_parallel_size=2"], "lora_m4"),
    "pp2_zb1p_dp2_tied": ([PP2, ZB, M2, TIED], "tied_m4"),
    "pp4_interleaved": ([PP4, M4, "distributed.virtual_pipeline_size=2", "model.num_layers=8"], None),
}
TRACE_ONLY = {"pp2_1f1b": 1}  # runs whose trace alone is checked: one step (1F1B parity: test_pipeline_parity)
RESUMED = ("pp2_zb1p_uneven",)  # saved after SAVE_AT steps, resumed by a new trainer, compared bit for bit
SAVE_AT = 2
# with dropout (every RNG stream must be restored), through test_checkpoint_resume's matrix
RESUME_WORLD4 = {"pp4_zb1p": [PP4, ZB, M4], "pp2_zb1p_dp2_zero1": [PP2, ZB, M2, "distributed.zero_optimization=1"]}


def expected_trace(plan: list, stage: int) -> list:
    """What an executor that follows ``plan`` runs: each compute action, and each Exchange's transfers in
    the order p2p posts them (even stages: send next, receive previous, send previous, receive next; odd
    stages: receive previous, send next, receive next, send previous); a V exchange's transfers as listed."""
    from megacann.pipeline.plan import Exchange
    from megacann.pipeline.v_schedules import VExchange

    order = (
        ("send_next", "recv_prev", "send_prev", "recv_next")
        if stage % 2 == 0
        else ("recv_prev", "send_next", "recv_next", "send_prev")
    )
    out = []
    for action in plan:
        if isinstance(action, VExchange):
            out += list(action.transfers)
            continue
        if not isinstance(action, Exchange):
            out.append(action)
            continue
        present = {
            "send_next": action.send_forward,
            "recv_prev": action.recv_forward is not None,
            "send_prev": action.send_backward,
            "recv_next": action.recv_backward is not None,
        }
        out += [name for name in order if present[name]]
    return out


def _train(runs: dict, resume: dict, root: str) -> dict:
    """Every rank trains each run, recording what its executor ran in the first step; the RESUMED runs
    also save after SAVE_AT steps and a new trainer resumes there; then the ``resume`` matrix."""
    import threading
    import warnings

    import torch
    import torch.distributed as dist
    from test_checkpoint_resume import _resume_matrix
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict
    from megacann.pipeline.plan import BackwardWeight, build_plan
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    warnings.simplefilter("ignore")  # bubble advice of the small recipes

    def trainer_for(name: str, overrides: list) -> Trainer:
        ps.destroy_model_parallel()
        out = f"experiment.output_dir={root}/{name}"
        cfg = tiny_config(COMMON + overrides + [out], world_size=dist.get_world_size())
        return Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))

    def weights(trainer: Trainer) -> dict:
        trainer.optimizer.finish_param_sync()
        return full_state_dict(trainer.model_chunks)

    results = {}
    for name, overrides in runs.items():
        trainer = trainer_for(name, overrides)
        trace, probe = [], []  # probe: dualpipev's pairs that ran at once (megacann.pipeline.overlap)
        schedule = trainer.forward_backward
        pipelined = trainer.cfg.distributed.pipeline_parallel_size > 1
        trainer.forward_backward = functools.partial(schedule, trace=trace, **({"probe": probe} if pipelined else {}))
        losses, norms = [], []
        for step in range(TRACE_ONLY.get(name, STEPS)):
            metrics = trainer.train_step()
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
            trainer.forward_backward = schedule
            if name in RESUMED and step + 1 == SAVE_AT:
                trainer.save_checkpoint()
                trainer.checkpointer.wait()
        cfg = trainer.cfg
        d, stage = cfg.distributed, ps.get_pipeline_model_parallel_rank()
        plan = build_plan(
            d.pipeline_parallel_size,
            stage,
            cfg.optim.grad_accum_steps,
            d.virtual_pipeline_size,
            schedule=d.pipeline_schedule,
        )
        params = weights(trainer)
        # data-parallel ranks hold equal weights, expert-parallel ones their own experts: all are merged
        owner = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        results[name] = {
            "losses": losses,
            "norms": norms,
            "trace": trace,
            "expected": expected_trace(plan, stage),
            "weights_run": sum(isinstance(a, BackwardWeight) for a in trace),
            "probe": [(a, t == threading.get_ident(), start, end) for a, t, start, end in probe],
            "params": params if owner else None,
            "sizes": {
                "pipeline_parallel_size": ps.get_pipeline_model_parallel_world_size(),
                "tensor_parallel_size": ps.get_tensor_model_parallel_world_size(),
                "context_parallel_size": ps.get_context_parallel_world_size(),
                "expert_parallel_size": ps.get_expert_model_parallel_world_size(),
                "data_parallel_size": ps.get_data_parallel_world_size(),
            },
            "zero_stage": cfg.distributed.zero_stage,
            "recompute": cfg.model.activation_checkpointing,
            "lora": bool(getattr(cfg, "lora", False)),
        }
        if name in RESUMED:
            second = trainer_for(name, overrides)
            path = second.resume()
            tail = [second.train_step()["loss"] for _ in range(STEPS - SAVE_AT)]
            again = weights(second)
            results[name]["resumed"] = {
                "path": path,
                "losses": losses[:SAVE_AT] + tail,
                "same_weights": again.keys() == params.keys() and all(torch.equal(again[k], params[k]) for k in params),
            }
    ps.destroy_model_parallel()
    results["resume"] = _resume_matrix(resume, root) if resume else {}
    return results


def _merge(per_rank: list[dict], name: str) -> dict:
    runs = [r[name] for r in per_rank]
    params = {}
    for run in runs:
        params.update(run["params"] or {})
    return {"runs": runs, "losses": runs[0]["losses"], "norms": runs[0]["norms"], "params": params}


def _reference(names, root: str) -> dict:
    runs = {name: REFERENCES[name] for name in names}
    return run_on_ranks(_train, 1, args=(runs, {}, root), timeout=300)[0]


def _references(names, root: str) -> dict:
    """The named one-process references, run in one process and merged."""
    result = _reference(sorted(names), root)
    return {name: _merge([result], name) for name in names}


def _layouts(world: int, layouts: dict, resume: dict, root: str) -> tuple[dict, dict]:
    per_rank = run_on_ranks(_train, world, args=({n: o for n, (o, _) in layouts.items()}, resume, root), timeout=600)
    return {name: _merge(per_rank, name) for name in layouts}, per_rank[0]["resume"]


def _check_parity(got: dict, ref: dict) -> None:
    for run in got["runs"]:  # every rank reports the same loss
        assert run["losses"] == got["losses"]
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    ref_params = {}
    for run in ref["runs"]:
        ref_params.update(run["params"] or {})
    params = dict(got["params"])
    if "lm_head.weight" in params and "lm_head.weight" not in ref_params:  # the last stage's tied copy
        assert torch.equal(params.pop("lm_head.weight"), params["embed_tokens.weight"])
    assert_params_close(params, ref_params, 1e-4)  # a few Adam steps amplify rounding differences


def _check_layout_on(got: dict, overrides: list) -> None:
    """The parallel sizes the run's overrides ask for were really in effect on every rank."""
    asked = dict(o.split("=", 1) for o in overrides)
    for run in got["runs"]:
        for key, size in run["sizes"].items():
            assert size == int(asked.get(f"distributed.{key}", run["sizes"][key])), (key, run["sizes"])
        assert str(run["zero_stage"]) == asked.get("distributed.zero_optimization", str(run["zero_stage"]))
        assert run["recompute"] == asked.get("model.activation_checkpointing", run["recompute"])
        assert run["lora"] == ("lora" in asked)


def _check_trace(got: dict, split: bool) -> None:
    """Every rank executed exactly its plan; W ran apart exactly when the schedule splits backwards."""
    for rank, run in enumerate(got["runs"]):
        assert run["trace"] == run["expected"], f"rank {rank} ran another order than its plan"
        assert len(run["trace"]) > 0
        assert (run["weights_run"] > 0) == split, rank  # zb1p really ran W apart


def _check_run(got: dict, entry: tuple, references: dict, split: bool) -> None:
    """A layout's run (``entry``: its overrides and its reference's name, or None for a trace-only run): the
    asked sizes were in effect, it trained as its one-process reference, every rank followed its plan."""
    overrides, ref = entry
    _check_layout_on(got, overrides)
    if ref is not None:
        _check_parity(got, references[ref])
    _check_trace(got, split=split)


def _check_resume(resumed: dict, name: str) -> None:
    result = resumed[name]
    assert len(result["got"]) == len(result["expected"]) > 0
    assert result["got"] == result["expected"], f"{name}: resumed trace differs"
    assert result["same_weights"], f"{name}: final weights differ"


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _layouts(2, WORLD2, {}, str(tmp_path_factory.mktemp("zb2")))[0]


@pytest.fixture(scope="module")
def reference2(tmp_path_factory):
    return _references(["m4"], str(tmp_path_factory.mktemp("ref2")))


def test_pp2_zb1p_uneven_matches_one_process_and_resumes_bit_for_bit(world2, reference2):
    got = world2["pp2_zb1p_uneven"]
    _check_run(got, WORLD2["pp2_zb1p_uneven"], reference2, split=True)
    for rank, run in enumerate(got["runs"]):
        resumed = run["resumed"]
        assert resumed["path"].endswith(f"checkpoint_{SAVE_AT}"), rank
        assert len(resumed["losses"]) == STEPS and resumed["losses"] == run["losses"], rank
        assert resumed["same_weights"], rank


def test_pp2_1f1b_follows_its_plan(world2):
    _check_trace(world2["pp2_1f1b"], split=False)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _layouts(4, WORLD4, RESUME_WORLD4, str(tmp_path_factory.mktemp("zb4")))


@pytest.fixture(scope="module")
def reference4(tmp_path_factory):
    return _references({ref for _, ref in WORLD4.values() if ref}, str(tmp_path_factory.mktemp("ref4")))


@pytest.mark.extended
@pytest.mark.parametrize("layout", sorted(WORLD4))
def test_extended_layouts_match_one_process_and_follow_their_plans(world4, reference4, layout):
    _check_run(world4[0][layout], WORLD4[layout], reference4, split="zb1p" in layout)


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(RESUME_WORLD4))
def test_extended_zb1p_resumes_bit_for_bit(world4, name):
    _check_resume(world4[1], name)
