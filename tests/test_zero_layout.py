"""ZeRO's layout and bucket machinery in one process: who owns what, padding, overlap order, freeing."""

import pytest
import torch

from megacann.layers.sharding import SHARED_EMBEDDING_ATTR
from megacann.optimizer.grad_buffer import GradBuffer, GradBuffers
from megacann.optimizer.zero.grad_buffer import ShardedGradBuffer
from megacann.optimizer.zero.layout import owned_range, shard_ranges

SHAPES = [(7, 3), (5,), (11, 4), (1,), (6, 6), (13,)]


def _params(shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s)) for s in shapes]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [1, 20, 1000])
def test_ranks_partition_every_parameter_once(dp, bucket_size):
    params = _params()
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    buffer = GradBuffer(params, None, bucket_size, pad_to=dp)
    covered = {names[id(p)]: torch.zeros(p.numel(), dtype=torch.int32) for p in params}
    for rank in range(dp):
        ranges = shard_ranges(buffer, rank, dp, names)
        shard_pos = 0
        for r in ranges:  # the shard holds the ranges back to back, skipping only padding
            assert r.shard_start >= shard_pos
            shard_pos = r.shard_start + r.numel
            covered[r.name][r.param_start : r.param_end] += 1
        assert shard_pos <= buffer.numel // dp
    assert all(bool((c == 1).all()) for c in covered.values())
    real = sum(p.numel() for p in params)
    assert buffer.numel % dp == 0 and 0 <= buffer.numel - real < dp * len(buffer.buckets)
    for bucket in buffer.buckets:
        assert bucket.start % dp == 0 and bucket.numel % dp == 0


def test_unpadded_bucket_is_an_error():
    buffer = GradBuffer(_params(), None, 1000, pad_to=1)
    with pytest.raises(ValueError, match="pad_for_zero"):
        owned_range(buffer.buckets[0], 0, 7)  # 120 elements


def test_shared_embedding_gets_a_bucket_of_its_own():
    params = _params()
    setattr(params[2], SHARED_EMBEDDING_ATTR, True)
    buffer = GradBuffer(params, None, 10_000, pad_to=4, own_bucket=lambda p: getattr(p, SHARED_EMBEDDING_ATTR, False))
    (bucket,) = [b for b in buffer.buckets if any(p is params[2] for p in b.params)]
    assert bucket.params == [params[2]] and bucket.numel == 44
    # its owned ranges do not depend on its neighbours (the same on any pipeline stage): rank r owns [11r, 11r + 11)
    names = {id(p): str(i) for i, p in enumerate(params)}
    for rank in range(4):
        (r,) = [x for x in shard_ranges(buffer, rank, 4, names) if x.name == "2"]
        assert (r.param_start, r.param_end) == (11 * rank, 11 * rank + 11)


def test_last_micro_batch_flag_nests_and_resets():
    buffers = GradBuffers(_params(), overlap=True)
    assert not buffers.in_last_backward
    with buffers.last_micro_batch_backward(False):
        assert not buffers.in_last_backward
    with buffers.last_micro_batch_backward():
        assert buffers.in_last_backward
        with buffers.last_micro_batch_backward(False):
            assert buffers.in_last_backward
    assert not buffers.in_last_backward
    buffers.remove_hooks()


def _toy_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).to(dtype)


def _backward(model, buffers: GradBuffers, last: bool, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).dtype)
    with buffers.last_micro_batch_backward(last):
        model(x).float().square().sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero2_overlap_reduces_from_hooks_and_frees_buckets(dtype):
    """One rank: buckets start in order inside the last backward, storage is freed as they finish, the
    shard equals the accumulated gradient; a gradient after the reduction is an error."""
    model = _toy_model(dtype)
    params = list(model.parameters())
    plain = GradBuffers(params, bucket_size=100)
    for seed in (1, 2):
        _backward(model, plain, last=False, seed=seed)
    plain.finish_grad_sync()
    reference = [p.main_grad.clone() for p in params]
    plain.remove_hooks()
    for p in params:
        del p.main_grad
        p.grad = None

    zero = GradBuffers(params, 100, pad_for_zero=True, overlap=True, buffer_cls=ShardedGradBuffer, keep_full=False)
    (buffer,) = zero.buffers
    _backward(model, zero, last=False, seed=1)
    assert buffer.allocated_numel == buffer.numel  # accumulation keeps the full gradient between micro-batches
    _backward(model, zero, last=True, seed=2)
    assert buffer.overlapped_buckets == len(buffer.buckets) > 2
    zero.finish_grad_sync()
    assert buffer.allocated_numel == 0 and not any(hasattr(p, "main_grad") for p in params)
    for p, ref in zip(params, reference):
        assert torch.equal(zero.reduced_grad(p).view(p.shape), ref)
    with pytest.raises(RuntimeError, match="after its bucket"):
        _backward(model, zero, last=False, seed=3)
    zero.remove_hooks()


def test_zero2_single_micro_batch_peak_is_a_few_buckets():
    model = _toy_model()
    zero = GradBuffers(
        list(model.parameters()), 100, pad_for_zero=True, overlap=True, buffer_cls=ShardedGradBuffer, keep_full=False
    )
    (buffer,) = zero.buffers
    _backward(model, zero, last=True, seed=1)
    zero.finish_grad_sync()
    largest = max(b.numel for b in buffer.buckets)
    assert buffer.peak_allocated_numel <= (buffer.MAX_IN_FLIGHT + 1) * largest < buffer.numel
    zero.remove_hooks()
