"""Saving and loading checkpoints of explicit parts (:class:`CheckpointParts`) with torch.distributed.checkpoint.

Every rank writes the pieces it holds into its own file, all at once (pieces several ranks hold alike
are written by one of them, spread over the ranks); rank 0 then writes ``megacann.json`` and the recipe
and publishes the directory atomically (see :mod:`megacann.checkpoint.files`). With
``logging.async_save`` the pieces are first copied to CPU memory and the writing and publishing run in a
background thread, so training goes on; the next save, a load, or the end of training waits for it.
Checkpoint traffic uses its own gloo process group, so a background save never interleaves with the
training's collectives.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from megacann import parallel_state as ps
from megacann.accelerator import get_accelerator
from megacann.checkpoint.files import (
    TMP_SUFFIX,
    checkpoint_dir,
    fsync_path,
    latest_checkpoint,
    publish,
    remove_stale_temporaries,
    rotate,
    write_file_synced,
    write_latest,
)
from megacann.checkpoint.metadata import (
    INFO_FILE,
    RECIPE_FILE,
    CheckpointError,
    base_problems,
    check_entries,
    check_files,
    checkpoint_info,
    describe_layout,
    layout_of,
    raise_if_problems,
    read_dcp_metadata,
    read_info,
)
from megacann.checkpoint.pieces import Piece
from megacann.checkpoint.planner import PieceLoadPlanner, PieceSavePlanner, TensorPieces
from megacann.checkpoint.rng import capture_rng, restore_rng
from megacann.checkpoint.state import (
    MODEL_PREFIX,
    PROGRESS_KEY,
    CheckpointFiles,
    CheckpointParts,
    finish_load,
    load_request,
    objective_key,
    progress,
    rng_key,
    save_entries,
)
from megacann.config import MegacannConfig

Log = Callable[[str], None]

_LAYOUT_KEYS_FOR_RNG = (
    "world_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "context_parallel_size",
)


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """CPU copies of every piece, so training may change the live tensors while files are written."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, TensorPieces):
            copies = [Piece(p.offsets, p.sizes, p.tensor.detach().to("cpu", copy=True)) for p in value.pieces]
            value = TensorPieces(value.shape, value.dtype, copies)
        out[key] = value
    return out


def _root_cause(err: BaseException) -> str:
    """The first OSError (e.g. "No space left on device") inside a (DCP-wrapped) error, else the error."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return f"{type(current).__name__}: {current}"
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
        if isinstance(current, CheckpointException):  # rank -> (error, traceback)
            todo += [pair[0] for pair in current.failures.values()]
    return f"{type(err).__name__}: {err}"


@dataclass
class _SaveJob:
    """What publishing a save needs besides the tensors."""

    out: str
    final: str
    info: dict[str, Any]
    recipe: str
    keep_last: Optional[int]
    log: Callable[[str], None]
    start: float
    files: list[CheckpointFiles] = field(default_factory=list)  # those with a record in ``info``


class Checkpointer:
    """Checkpoint I/O of one training run: :meth:`save`, :meth:`load`, :meth:`wait` (an asynchronous save).
    Collective: every rank of the job makes one and calls each method together."""

    def __init__(self, async_save: bool = False):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.async_save = async_save
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="megacann-ckpt") if async_save else None
        self._pending: Optional[Future] = None

    # -- collectives on the checkpoint group --------------------------------------------------------
    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _dcp_kwargs(self) -> dict[str, Any]:
        return {"process_group": self.group, "no_dist": self.group is None}

    # -- saving -------------------------------------------------------------------------------------
    def save(self, parts: CheckpointParts, cfg: MegacannConfig, log: Log = print) -> str:
        """Write ``<output_dir>/checkpoint_<step>``; returns its path (still being written when async).
        ``log`` prints on one rank (pass a no-op elsewhere)."""
        self.wait()
        if parts.optimizer is not None:
            parts.optimizer.finish_param_sync()  # overlapped parameter gathers in flight land first
        out, step = cfg.experiment.output_dir, parts.step
        final = checkpoint_dir(out, step)
        start = time.perf_counter()
        state: dict[str, Any] = dict(save_entries(parts))
        state[PROGRESS_KEY] = progress(parts)
        state[rng_key(self.rank)] = capture_rng(get_accelerator())
        if parts.objective_state is not None:
            state[objective_key(self.rank)] = parts.objective_state
        info = checkpoint_info(cfg, step, parts.consumed_samples, parts.base)
        files = []
        for extra in parts.files:
            record = extra.record()
            if record is not None:
                info[extra.key] = record
                files.append(extra)
        job = _SaveJob(out, final, info, cfg.to_yaml(), cfg.logging.keep_last, log, start, files)
        if self._executor is None:
            self._write(state, job)
        else:
            state = _snapshot(state)
            log(f"checkpoint_{step}: state copied in {time.perf_counter() - start:.2f} s, writing in the background")
            self._pending = self._executor.submit(self._write, state, job)
        return final

    def _write(self, state: dict[str, Any], job: _SaveJob) -> None:
        """Every rank: write its pieces into ``<final>.tmp``; then rank 0 publishes."""
        tmp = job.final + TMP_SUFFIX
        if self.rank == 0:
            os.makedirs(job.out, exist_ok=True)
            remove_stale_temporaries(job.out)
            os.makedirs(tmp)
        self._barrier()
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                metadata = dcp.save(state, storage_writer=writer, planner=PieceSavePlanner(), **self._dcp_kwargs())
        except (Exception, CheckpointException) as err:  # DCP raises on every rank when any rank's write failed
            raise self._save_failed(tmp, job, _root_cause(err)) from err
        failure: Optional[str] = None
        published = False
        if self.rank == 0:
            try:
                self._publish(tmp, job, metadata)
            except Exception as err:  # every rank learns of it below, so none waits forever or trains on
                failure, published = _root_cause(err), not os.path.isdir(tmp)
        failure, published = self._all_gather((failure, published))[0]  # rank 0's outcome, on every rank
        if failure is not None and not published:
            raise self._save_failed(tmp, job, failure)
        if failure is not None:
            raise CheckpointError(f"{job.final} was saved, but updating 'latest' or rotating failed: {failure}")

    def _save_failed(self, tmp: str, job: _SaveJob, reason: str) -> CheckpointError:
        """The error of a save that did not complete: the previous checkpoint is untouched and still
        ``latest`` (rotation runs only after a complete save), the partial one is removed to free space."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(Exception):  # every rank raises alike once it is gone (a dead rank: at once)
            self._barrier()
        previous = latest_checkpoint(job.out)
        kept = (
            f"the previous checkpoint {previous} is intact and still 'latest'"
            if previous
            else "there is no earlier checkpoint"
        )
        space = ""
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(job.out).free / 2**30
            space = f" ({free:.2f} GiB free on that file system)"
        error = CheckpointError(
            f"saving {job.final} failed: {reason}{space}; {kept}; nothing was deleted (logging.keep_last rotates "
            "only after a complete save). Free space or point experiment.output_dir elsewhere, then continue "
            "with --resume_from latest"
        )
        error.exit_code = 1  # a failure during training, not bad input
        return error

    def _publish(self, tmp: str, job: _SaveJob, metadata: Metadata) -> None:
        """Rank 0, once every rank's files are written: describe, mark complete, rename, ``latest``, rotate."""
        for extra in job.files:  # e.g. the run's tokenizer, which travels with its weights (exports need it)
            for path in extra.write(tmp, job.info):
                fsync_path(path)
        write_file_synced(os.path.join(tmp, INFO_FILE), json.dumps(job.info, indent=1) + "\n")
        write_file_synced(os.path.join(tmp, RECIPE_FILE), job.recipe)
        publish(tmp, job.final, job.info["step"])
        write_latest(job.out, job.final)
        removed = rotate(job.out, job.keep_last)
        seconds = time.perf_counter() - job.start
        stored = metadata.storage_data.values()
        mb = sum(s.length for s in stored) / 2**20
        files = len({s.relative_path for s in stored})
        mode = "async" if self.async_save else "sync"
        note = f"; removed {', '.join(os.path.basename(p) for p in removed)}" if removed else ""
        job.log(
            f"saved {job.final} ({mode}): {mb:.2f} MB in {files} file(s) written in parallel, "
            f"{seconds:.2f} s, {mb / max(seconds, 1e-9):.1f} MB/s{note}"
        )

    def wait(self) -> None:
        """Block until an asynchronous save is written and published (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()

    # -- loading ------------------------------------------------------------------------------------
    def _rng_key(self, cfg: MegacannConfig, saved_layout: dict[str, Any]) -> str:
        """This rank's own RNG states when the layout is unchanged; otherwise those of the saved rank
        with the same tensor-parallel rank (rank t of the first TP group), else of rank 0."""
        now = layout_of(cfg)
        if all(saved_layout.get(k) == now[k] for k in _LAYOUT_KEYS_FOR_RNG):
            return rng_key(self.rank)
        tp_rank = ps.get_tensor_model_parallel_rank()
        return rng_key(tp_rank if tp_rank < saved_layout["tensor_parallel_size"] else 0)

    def load(self, parts: CheckpointParts, cfg: MegacannConfig, path: str, log: Log = print) -> dict[str, Any]:
        """Restore weights, optimizer state, progress and RNG from ``path`` (any layout) into ``parts``;
        returns the checkpoint's description. Every problem found in the files is reported, on every rank,
        before anything is read."""
        self.wait()
        if parts.optimizer is not None:
            parts.optimizer.finish_param_sync()  # no gather in flight may overwrite what is loaded
        start = time.perf_counter()
        info = read_info(path)
        raise_if_problems(base_problems(path, info.get("base"), parts.base), f"cannot load checkpoint {path}")
        metadata = read_dcp_metadata(path)
        stored = metadata.state_dict_metadata
        request = load_request(parts, set(stored))
        key = self._rng_key(cfg, info["layout"])
        objects: dict[str, Any] = {PROGRESS_KEY: None}
        if key in stored:
            objects[key] = None
        own = objective_key(self.rank)
        if own in stored:
            objects[own] = None
        problems = check_entries(metadata, request.entries)
        if PROGRESS_KEY not in stored:
            problems.append(f"'{PROGRESS_KEY}' (step and optimizer counters) is missing")
        problems += check_files(path, metadata, set(request.entries) | set(objects))
        model_keys = {k for k in request.entries if k.startswith(MODEL_PREFIX)} | request.weights_from_masters
        gathered = self._all_gather((problems, model_keys))
        problems = [p for rank_problems, _ in gathered for p in rank_problems]
        used = set().union(*(keys for _, keys in gathered))
        unused = sorted(k for k in stored if k.startswith(MODEL_PREFIX) and k not in used)
        if unused:
            problems.append(f"the model has no parameter for {len(unused)} stored tensor(s): {unused[:8]}")
        raise_if_problems(problems, f"cannot load checkpoint {path}")

        planner = PieceLoadPlanner()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(
                {**request.entries, **objects},
                storage_reader=dcp.FileSystemReader(path),
                planner=planner,
                **self._dcp_kwargs(),
            )
        finish_load(parts, request, planner.objects[PROGRESS_KEY])
        if key in planner.objects:
            restore_rng(get_accelerator(), planner.objects[key])
        parts.objective_state = planner.objects.get(own)
        self._barrier()
        seconds = time.perf_counter() - start
        mb = sum(e.nbytes() for e in request.entries.values()) / 2**20
        saved, now = describe_layout(info["layout"]), describe_layout(layout_of(cfg))
        change = "" if saved == now else f", resharded from {saved} to {now}"
        log(
            f"loaded {path} (step {parts.step}, {parts.consumed_samples} samples consumed{change}): "
            f"{mb:.2f} MB on rank 0 in {seconds:.2f} s, {mb / max(seconds, 1e-9):.1f} MB/s"
        )
        return info
