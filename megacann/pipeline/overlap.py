"""DualPipeV's overlap: a pair's forward and backward at once, on two threads and two communication lanes.

In DualPipeV's main phase a stage runs the forward of one micro-batch through one of its chunks beside the
backward of another through its other chunk (``dualpipev_pairs``); running them at once hides one's
communication (the MoE dispatch/combine all-to-all under expert parallelism, tensor- and
context-parallel collectives) behind the other's compute. In eager PyTorch on CPU this works with
threads: ATen ops and gloo's waits release the GIL, and CPU autograd runs a backward in the thread
that calls it. :func:`run_pair` runs the backward on a worker thread while the calling thread runs the
forward, then joins.

Two threads must never issue collectives on one process group, and every rank of a group must issue
its collectives in one order. So each chunk talks over its own *lane*
(:func:`megacann.parallel_state.communication_lane`): chunk c's modules are built, and its forwards and
backwards run, with the tensor-, context-, expert- and data-parallel getters answering lane c's
duplicates of those groups (``initialize_model_parallel(communication_lanes=2)``; the trainer asks for
them when :func:`overlap_wanted`). Groups captured when a module is built or when an autograd function's
forward runs, and groups read in a backward, all end up on the chunk's lane; a pair always holds two
different chunks, and every rank of a group runs the same plan, so each lane's order is the same on all.

What cannot run from two threads at once is listed by :func:`overlap_hazards`: with
``distributed.dualpipev_overlap: auto`` (the default) such a recipe runs its pairs back to back (a note
says why), with ``true`` it is refused naming the key; ``false`` always runs them back to back.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Union

from megacann.config import ConfigError, MegacannConfig
from megacann.pipeline.schedule_spec import find_schedule

OVERLAP_VALUES = ("auto", True, False)
KEY = "distributed.dualpipev_overlap"
LANE_ATTR = "_megacann_communication_lane"  # set by build_model_chunks on each chunk: the lane it was built in
Probe = list  # receives (action, thread id, start, end) for each action of a pair that ran at once
MEET_TIMEOUT_S = 300.0  # how long a probed pair's sides wait for each other (a loaded machine is slow)


def overlap_hazards(cfg: MegacannConfig) -> list[str]:
    """Why this recipe's pairs may not run from two threads at once (empty: they may)."""
    m, d = cfg.model, cfg.distributed
    hazards = []
    dropouts = [f"model.{k} {getattr(m, k)}" for k in ("hidden_dropout", "attention_dropout") if getattr(m, k)]
    if getattr(cfg, "lora", False) and cfg.lora_dropout:
        dropouts.append(f"lora_dropout {cfg.lora_dropout}")
    if dropouts and m.activation_checkpointing != "none":
        hazards.append(
            f"dropout ({', '.join(dropouts)}) with model.activation_checkpointing {m.activation_checkpointing}: "
            "a backward's recompute resets the random generators the other thread's forward draws from"
        )
    if d.zero_stage == 3:
        hazards.append("distributed.zero_optimization 3: both threads would gather weights over one group")
    if cfg.precision.compile not in (False, None):
        hazards.append("precision.compile: torch.compile'd blocks would compile and run from two threads")
    if cfg.training.activation_offload_layers:
        hazards.append("training.activation_offload_layers: the offload's hooks and counters are not thread-safe")
    if d.device not in (None, "cpu"):
        hazards.append(
            f"distributed.device {d.device}: on an accelerator the backward needs its own stream (not built)"
        )
    return hazards


def pairs_actions(cfg: MegacannConfig) -> bool:
    """The recipe's schedule pairs a forward with a backward (DualPipeV: its spec has ``pairs``) on a
    pipeline of more than one stage."""
    spec = find_schedule(cfg.distributed.pipeline_schedule)
    return spec is not None and spec.pairs is not None and cfg.distributed.pipeline_parallel_size > 1


def check_overlap_config(cfg: MegacannConfig, source: str) -> list[str]:
    """Raise ConfigError for a value of ``distributed.dualpipev_overlap`` that cannot do what it says;
    return a note when ``auto`` falls back to running the pairs back to back."""
    value = cfg.distributed.dualpipev_overlap
    if value not in OVERLAP_VALUES or isinstance(value, int) and not isinstance(value, bool):
        raise ConfigError(f"{source}: {KEY} must be auto, true or false, got {value!r}")
    schedule = cfg.distributed.pipeline_schedule
    if value is True and not pairs_actions(cfg):
        raise ConfigError(
            f"{source}: {KEY} true overlaps the pairs of pipeline_schedule dualpipev (with pipeline_parallel_size "
            f"> 1), got pipeline_schedule {schedule!r}: set it to dualpipev or leave {KEY} auto"
        )
    spec = find_schedule(schedule)
    if spec is None or spec.pairs is None or value is False:
        return []
    hazards = overlap_hazards(cfg)
    if hazards and value is True:
        raise ConfigError(
            f"{source}: {KEY} true cannot run a pair's forward and backward at once: {'; '.join(hazards)}"
        )
    if hazards:
        return [
            f"{source}: dualpipev runs each pair's forward and backward back to back ({KEY} auto): {'; '.join(hazards)}"
        ]
    return []


def overlap_wanted(cfg: MegacannConfig) -> bool:
    """The recipe runs dualpipev's pairs at once (so each rank needs two communication lanes)."""
    return pairs_actions(cfg) and cfg.distributed.dualpipev_overlap is not False and not overlap_hazards(cfg)


def run_pair(
    first: Callable[[], None],
    second: Callable[[], None],
    actions: tuple,
    probe: Optional[Probe] = None,
) -> None:
    """Run ``second`` on a worker thread while this thread runs ``first``; return when both are done
    (the worker's exception, if any, is raised here). ``probe`` receives (action, thread id, start, end);
    with a probe the two sides first meet at a barrier, which only two works in flight at once can pass
    (run one after the other, they would time out there): the proof, independent of timing, that a pair
    really runs concurrently."""
    error: list[BaseException] = []
    meet = threading.Barrier(2) if probe is not None else None

    def timed(work: Callable[[], None], action: object) -> None:
        if meet is not None:
            meet.wait(timeout=MEET_TIMEOUT_S)
        start = time.perf_counter()
        work()
        if probe is not None:
            probe.append((action, threading.get_ident(), start, time.perf_counter()))

    def worker() -> None:
        try:
            timed(second, actions[1])
        except BaseException as exc:  # handed to the calling thread
            error.append(exc)

    thread = threading.Thread(target=worker, name="megacann-dualpipev-backward", daemon=True)
    thread.start()
    timed(first, actions[0])  # on failure the worker is left to its collectives (the run is ending)
    thread.join()
    if error:
        raise error[0]


def resolve_overlap(mode: Union[bool, str], lanes: int, model_chunks: list) -> bool:
    """Whether a schedule asked to overlap (``mode``: the key's value) really can: it needs two
    communication lanes, chunk c built in lane c and a CPU model; ``True`` raises where ``auto`` quietly
    runs back to back."""
    if mode is False:
        return False
    param = next(model_chunks[0].parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    problem = None
    if lanes < 2:
        problem = (
            "the process groups have no second communication lane "
            "(megacann.parallel_state.initialize_model_parallel(communication_lanes=2))"
        )
    elif [getattr(chunk, LANE_ATTR, None) for chunk in model_chunks] != list(range(len(model_chunks))):
        problem = (
            "the model chunks were not built in their lanes (build them with megacann.pipeline.build_model_chunks)"
        )
    elif device_type != "cpu":
        problem = f"the model is on {device_type}, and the overlap is built for CPU only"
    if problem and mode is True:
        raise RuntimeError(f"{KEY} true: {problem}")
    return problem is None
