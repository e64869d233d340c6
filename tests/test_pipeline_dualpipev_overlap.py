"""DualPipeV's overlapped pairs (megacann.pipeline.overlap): a pair's forward and backward really run at
once (on two threads, their recorded intervals overlapping), each chunk on its own communication lane,
and the run still equals one process (loss and gradient-norm traces 1e-5, equal lengths), the same run
with ``distributed.dualpipev_overlap: false``, and its plan (the executed F/B/W/transfer order).

The default tier checks the key, the pair runner and when a run may overlap, without processes; the pairs
of its pp 2 dualpipev training run are checked by test_pipeline_v_training (``check_pairs_ran_at_once``).
``extended``: pp 2, pp 2 x ep 2 MoE and pp 2 x tp 2 + SP, each overlapped against one process and the
back-to-back run, with the lanes."""

from typing import Optional

import pytest
import test_pipeline_zero_bubble_training as zb
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace

STEPS = 3
PP2, DUALPIPEV = zb.PP2, "distributed.pipeline_schedule=dualpipev"
OFF = "distributed.dualpipev_overlap=false"
SMALL = ["model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64", "data.seq_length=16"]
MOE4 = [*zb.MOE, "model.num_layers=4"]
TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
REFERENCES = {"small_m4": [zb.M4, *SMALL], "moe4_m8": ["optim.grad_accum_steps=8", *MOE4], "m4": [zb.M4]}
WORLD2 = {"pp2": [PP2, DUALPIPEV, zb.M4, *SMALL]}
WORLD4 = {
    "pp2_ep2_moe": [PP2, DUALPIPEV, zb.M4, *MOE4, "distributed.expert_parallel_size=2"],
    "pp2_tp2_sp": [PP2, DUALPIPEV, zb.M4, *TP2_SP],
}
REFERENCE_OF = {"pp2": "small_m4", "pp2_ep2_moe": "moe4_m8", "pp2_tp2_sp": "m4"}


def _train(runs: dict, root: str) -> dict:
    """Each run trains STEPS steps (and again with the overlap off), recording in the first step what the
    executor ran, the pairs' threads and intervals, and the lanes its groups came from."""
    import functools
    import threading
    import warnings

    import torch.distributed as dist
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann import parallel_state as ps
    from megacann.pipeline.plan import build_plan
    from megacann.pipeline.v_schedules import dualpipev_pairs
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    warnings.simplefilter("ignore")
    results = {}
    for name, overrides in runs.items():
        for variant, extra in (("on", []), ("off", [OFF])):
            if variant == "off" and DUALPIPEV not in overrides:  # a one-process reference runs once
                continue
            ps.destroy_model_parallel()
            out = f"experiment.output_dir={root}/{name}_{variant}"
            cfg = tiny_config(zb.COMMON + overrides + extra + [out], world_size=dist.get_world_size())
            trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
            lanes = _lane_facts() if variant == "on" else None
            trace, probe = [], []
            schedule = trainer.forward_backward
            pipelined = cfg.distributed.pipeline_parallel_size > 1
            trainer.forward_backward = functools.partial(
                schedule, trace=trace, **({"probe": probe} if pipelined else {})
            )
            losses, norms = [], []
            for _ in range(STEPS):
                metrics = trainer.train_step()
                losses.append(metrics["loss"])
                norms.append(metrics["grad_norm"])
                trainer.forward_backward = schedule
            d, stage = cfg.distributed, ps.get_pipeline_model_parallel_rank()
            m = cfg.optim.grad_accum_steps
            plan = build_plan(d.pipeline_parallel_size, stage, m, schedule=d.pipeline_schedule)
            chunk_groups = [_groups_kept(chunk, dist.ProcessGroup) for chunk in trainer.model_chunks]
            results[f"{name}_{variant}"] = {
                "losses": losses,
                "norms": norms,
                "trace": trace,
                "expected": zb.expected_trace(plan, stage),
                "probe": [(a, t == threading.get_ident(), s, e) for a, t, s, e in probe],
                "pairs": len(dualpipev_pairs(d.pipeline_parallel_size, stage, m)),
                "lanes": ps.communication_lanes(),
                "lane_facts": lanes,
                "chunks_share_a_group": len(chunk_groups) == 2 and bool(chunk_groups[0] & chunk_groups[1]),
                "chunk_groups": [len(g) for g in chunk_groups],
            }
    ps.destroy_model_parallel()
    return results


def check_pairs_ran_at_once(probe: list, pairs: int) -> None:
    """``pairs`` pairs ran at once: each pair's forward on the calling thread and its backward (of the other
    chunk) on another, both past the probe's barrier, which two works run one after the other cannot pass
    (so no assertion on measured times, which a loaded machine's scheduling could reorder). ``probe``:
    (action, on the calling thread, start, end), a pair's two records in the order they finished."""
    assert pairs > 0 and len(probe) == 2 * pairs, (pairs, len(probe))
    for first, second in zip(probe[::2], probe[1::2]):
        (f, f_here, f_start, f_end), (b, b_here, b_start, b_end) = sorted(
            (first, second), key=lambda r: type(r[0]).__name__ != "Forward"
        )
        assert type(f).__name__ == "Forward" and type(b).__name__ == "Backward" and f.chunk != b.chunk, (f, b)
        assert f_here and not b_here, (f, b)
        assert f_start <= f_end and b_start <= b_end, (f, b)


def _lane_facts() -> tuple:
    """Lane 1's getters answer with other groups of the same ranks, only in the thread that entered it; the
    pipeline group has no lanes."""
    import threading

    import torch.distributed as dist

    from megacann import parallel_state as ps

    base = [ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group(), ps.get_data_parallel_group()]
    pp = ps.get_pipeline_model_parallel_group()
    with ps.communication_lane(1):
        lane = [
            ps.get_tensor_model_parallel_group(),
            ps.get_expert_model_parallel_group(),
            ps.get_data_parallel_group(),
        ]
        seen = []
        other = threading.Thread(target=lambda: seen.append(ps.get_tensor_model_parallel_group()))
        other.start()
        other.join()
        same_pp = ps.get_pipeline_model_parallel_group() is pp
    return (
        all(a is not b for a, b in zip(base, lane)),
        all(dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b) for a, b in zip(base, lane)),
        seen[0] is base[0],
        same_pp,
        ps.get_tensor_model_parallel_group() is base[0],
    )


def _groups_kept(chunk, group_type) -> set:
    """ids of the process groups the chunk's modules (and their helpers, such as a token dispatcher) keep."""
    found = set()
    for module in chunk.modules():
        for value in vars(module).values():
            inner = vars(value).values() if hasattr(value, "__dict__") and not hasattr(value, "parameters") else ()
            found |= {id(g) for g in (value, *inner) if isinstance(g, group_type)}
    return found


def _reference(names: list, root: str) -> dict:
    runs = {name: REFERENCES[name] for name in names}
    result = run_on_ranks(_train, 1, args=(runs, root), timeout=300)[0]
    return {name: result[f"{name}_on"] for name in names}


def _check(per_rank: list, ref: Optional[dict], name: str, groups_captured: bool) -> None:
    """The overlapped run against one process (``ref``) and the back-to-back run (when it ran); on every
    rank the executed order, the lanes, and each pair's threads and intervals."""
    on, off = per_rank[0][f"{name}_on"], per_rank[0].get(f"{name}_off")
    assert len(on["losses"]) == len(on["norms"]) == STEPS
    for other in (ref, off):
        if other is not None:
            assert len(other["losses"]) == len(other["norms"]) == STEPS
            assert_close_trace(on["losses"], other["losses"], 1e-5)
            assert_close_trace(on["norms"], other["norms"], 1e-5)
    for rank, result in enumerate(per_rank):
        run, plain = result[f"{name}_on"], result.get(f"{name}_off")
        assert run["losses"] == on["losses"], rank  # every rank logs the step's loss
        assert run["trace"] == run["expected"], rank
        assert run["lanes"] == 2 and run["lane_facts"] == (True,) * 5, rank
        if plain is not None:
            assert plain["trace"] == plain["expected"] and plain["lanes"] == 1 and not plain["probe"], rank
        check_pairs_ran_at_once(run["probe"], run["pairs"])  # recorded in the first step
        if groups_captured:  # layers that keep a group hold their chunk's lane: no group shared by the chunks
            assert min(run["chunk_groups"]) > 0 and not run["chunks_share_a_group"], rank
            assert plain["chunks_share_a_group"], rank  # (without lanes they share)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(sorted(set(REFERENCE_OF.values())), str(tmp_path_factory.mktemp("ovref")))


@pytest.mark.extended
def test_extended_pp2_dualpipev_overlap_matches_one_process_and_the_back_to_back_run(tmp_path):
    per_rank = run_on_ranks(_train, 2, args=(WORLD2, str(tmp_path)), timeout=300)
    _check(per_rank, _reference(["small_m4"], str(tmp_path / "ref"))["small_m4"], "pp2", groups_captured=False)


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(WORLD4))
def test_extended_dualpipev_overlap_with_ep_and_tp(world4, reference, name):
    _check(world4, reference[REFERENCE_OF[name]], name, groups_captured=name == "pp2_ep2_moe")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_on_ranks(_train, 4, args=(WORLD4, str(tmp_path_factory.mktemp("ov4"))), timeout=600)


def _cfg(overrides):
    from training_helpers import tiny_config

    return tiny_config([PP2, DUALPIPEV, zb.M4, *SMALL, *overrides], world_size=2)


def test_dualpipev_overlap_key_does_what_it_says():
    from megacann.config import ConfigError
    from megacann.pipeline.overlap import check_overlap_config, overlap_hazards, overlap_wanted

    assert overlap_wanted(_cfg([])) and not overlap_wanted(_cfg([OFF]))
    assert overlap_wanted(_cfg(["distributed.dualpipev_overlap=true"]))
    with pytest.raises(ConfigError, match="dualpipev_overlap must be auto, true or false, got 'sometimes'"):
        _cfg(["distributed.dualpipev_overlap=sometimes"])
    with pytest.raises(ConfigError, match="dualpipev_overlap true overlaps the pairs of pipeline_schedule dualpipev"):
        _cfg(["distributed.pipeline_schedule=zbv", "distributed.dualpipev_overlap=true"])
    unsafe = ["model.hidden_dropout=0.1", "model.activation_checkpointing=full"]
    with pytest.raises(ConfigError, match="dropout .*model.hidden_dropout 0.1.* recompute resets"):
        _cfg([*unsafe, "distributed.dualpipev_overlap=true"])
    auto = _cfg(unsafe)  # auto: back to back, with the reason
    assert not overlap_wanted(auto) and len(overlap_hazards(auto)) == 1
    (note,) = check_overlap_config(auto, "r.yaml")
    assert note.startswith("r.yaml: dualpipev runs each pair's forward and backward back to back")
    assert overlap_wanted(_cfg(["model.hidden_dropout=0.1"]))  # dropout without recompute draws on one thread
    from megacann.dry_run import describe

    assert "micro-batches paired, run at once on two threads)" in describe(_cfg([]))
    assert "micro-batches paired, run back to back)" in describe(_cfg([OFF]))


def test_run_pair_runs_the_second_on_another_thread_and_raises_its_error():
    import threading

    from megacann.pipeline.overlap import run_pair

    both = threading.Barrier(2, timeout=10)  # each half waits for the other: only concurrency passes
    probe = []
    run_pair(both.wait, both.wait, ("f", "b"), probe)
    threads = {action: thread for action, thread, _, _ in probe}  # recorded in the order they finished
    assert len(probe) == 2 and threads["f"] == threading.get_ident() != threads["b"]

    def fail():
        raise ValueError("backward failed")

    with pytest.raises(ValueError, match="backward failed"):
        run_pair(lambda: None, fail, ("f", "b"))


def test_resolve_overlap_needs_lanes_chunks_built_in_them_and_a_cpu_model():
    import torch

    from megacann.pipeline.overlap import LANE_ATTR, resolve_overlap

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    assert not resolve_overlap("auto", 2, chunks)  # not built by build_model_chunks
    with pytest.raises(RuntimeError, match="dualpipev_overlap true: the model chunks were not built in their lanes"):
        resolve_overlap(True, 2, chunks)
    for lane, chunk in enumerate(chunks):
        setattr(chunk, LANE_ATTR, lane)
    assert resolve_overlap("auto", 2, chunks) and resolve_overlap(True, 2, chunks)
    assert not resolve_overlap("auto", 1, chunks) and not resolve_overlap(False, 2, chunks)
    with pytest.raises(RuntimeError, match="no second communication lane"):
        resolve_overlap(True, 1, chunks)
    chunks[0].to("meta")
    assert not resolve_overlap("auto", 2, chunks)
    with pytest.raises(RuntimeError, match="the model is on meta"):
        resolve_overlap(True, 2, chunks)
