"""Loading a checkpoint peaks at no more host memory than a training step plus a bounded buffer.

Measured in a fresh process (a spawned rank): the resident-set high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) of one training step and of one load of a checkpoint, each after a warm-up (so
imports and thread pools do not count). glibc is told (mallopt) to map every allocation of 64 KiB or more on its own,
so freed tensors leave the resident set at once and the high-water mark follows the live tensors.

The model has a large vocabulary (its embedding and output layer, and their Adam moments, are 16 MB tensors)
and small activations, so whatever a load materialises whole stands out. A checkpoint written in chunks of
``MAX_CHUNK_BYTES`` loads within the step's peak plus a few chunks; one written with whole tensors as single
chunks (what saves wrote before the limit) peaks higher, which shows the measurement sees the spike.
"""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks

CHUNK = 256 * 1024
BOUND = 4 * CHUNK + 2 * 2**20  # a few chunks in flight, and slack for the allocator and DCP's bookkeeping
BIG_VOCAB = [
    "model.vocab_size=32000",
    "model.hidden_size=128",
    "model.ffn_hidden_size=256",
    "model.num_layers=2",
    "data.seq_length=16",
    "optim.grad_accum_steps=1",
]


def _map_large_allocations() -> None:
    """glibc: allocations of 64 KiB or more get their own mapping, returned to the system when freed (and
    megacann's CPU runtime told not to set its own policy over this one)."""
    import ctypes
    import os

    os.environ["MEGACANN_HOST_MALLOC"] = "system"

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 64 * 1024)


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peaks(output_dir: str, overrides: list[str]) -> dict:
    import gc
    import os
    import warnings

    from checkpoint_helpers import make_trainer, run_steps

    import megacann.checkpoint.planner as planner

    warnings.simplefilter("ignore")
    _map_large_allocations()
    out = {}
    for label, limit in (("chunked", CHUNK), ("whole", 2**62)):
        planner.MAX_CHUNK_BYTES = limit
        trainer = make_trainer(BIG_VOCAB + overrides, os.path.join(output_dir, label), max_steps=4)
        run_steps(trainer, 1)
        path = trainer.save_checkpoint()
        trainer.load_checkpoint(path)  # warm-up: DCP's code paths, thread pools
        run_steps(trainer, 1)
        gc.collect()
        _reset_hwm()
        run_steps(trainer, 1)
        gc.collect()
        step = _hwm_kib()
        _reset_hwm()
        trainer.load_checkpoint(path)
        load = _hwm_kib()
        out[label] = {"step": step * 1024, "load": load * 1024}
        trainer.checkpointer.close()
        del trainer
        gc.collect()
    return out


def _can_reset_hwm() -> bool:
    try:
        _reset_hwm()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _can_reset_hwm(), reason="/proc/self/clear_refs cannot reset the high-water mark here")
@pytest.mark.parametrize(
    "world,overrides",
    [
        (1, []),
        pytest.param(2, ["distributed.zero_optimization=2", "model.precision=bf16"], marks=pytest.mark.extended),
    ],
)
def test_loading_peaks_within_the_step_plus_a_bounded_buffer(tmp_path, world, overrides):
    ranks = run_on_ranks(_peaks, world, args=(str(tmp_path), overrides), timeout=600)
    for peaks in ranks:
        chunked, whole = peaks["chunked"], peaks["whole"]
        assert chunked["load"] <= chunked["step"] + BOUND, peaks
        # the same load from whole-tensor chunks materialises 16 MB tensors: the measurement sees them (at
        # dp 1 above the step's peak; ZeRO-2's step holds whole gradient buckets, which hide them there)
        assert whole["load"] - whole["step"] >= chunked["load"] - chunked["step"] + 8 * 2**20, peaks
        if world == 1:
            assert whole["load"] > whole["step"] + BOUND, peaks


def test_split_piece_tiles_the_box_in_chunks_under_the_limit():
    import torch

    from megacann.checkpoint.pieces import Piece, split_piece

    whole = torch.arange(6 * 5 * 4, dtype=torch.float32).view(6, 5, 4)
    piece = Piece((10, 0, 0), (6, 5, 4), whole)
    for limit in (4 * 4, 4 * 7, 4 * 20, 4 * 45, 10**9):
        parts = split_piece(piece, limit)
        covered = torch.zeros(6, 5, 4, dtype=torch.int64)
        for p in parts:
            assert p.tensor.numel() * 4 <= max(limit, 16) and tuple(p.tensor.shape) == p.sizes
            index = tuple(slice(o - base, o - base + n) for o, base, n in zip(p.offsets, (10, 0, 0), p.sizes))
            assert torch.equal(p.tensor, whole[index])  # the view holds exactly its box
            covered[index] += 1
        assert torch.equal(covered, torch.ones_like(covered)), limit  # every element once
    assert len(split_piece(piece, 10**9)) == 1
