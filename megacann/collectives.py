"""Raw collectives (no autograd) that several parts of megacann share.

- :func:`all_reduce_if_parallel`: an in-place all-reduce that is a no-op on a one-rank or absent group;
- :func:`all_reduce_coalesced`: one all-reduce for many tensors (flattened together, copied back);
- :func:`reduce_scatter_flat` / :func:`all_gather_flat`: the flat-tensor collectives
  (``reduce_scatter_tensor`` / ``all_gather_into_tensor``, or their newer ``*_single`` names) that NCCL,
  HCCL and recent gloo provide; where a backend lacks one, an all-reduce and a slice, or a list
  all-gather, stand in (remembered per backend).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_MISSING: set[tuple[str, str]] = set()  # (collective, backend) pairs found unsupported


def all_reduce_if_parallel(tensor: torch.Tensor, group: Group, op=None) -> torch.Tensor:
    """In-place all-reduce that is a no-op for a one-rank (or absent) group."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum each tensor over ``group`` in place, with one all-reduce for all of them."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _backend(group: Group) -> str:
    return str(dist.get_backend(group))


def _try_flat(
    name: str, collective, out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False
) -> tuple[bool, Optional[dist.Work]]:
    """Run a flat-tensor collective: (True, its work handle when ``async_op``), or (False, None) when this
    backend lacks it (remembered), so the caller falls back. Older gloo raises e.g. "no support for
    _reduce_scatter_base in Gloo process group"."""
    key = (name, _backend(group))
    if collective is None or key in _MISSING:
        return False, None
    try:
        return True, collective(out, inp, group=group, async_op=async_op)
    except RuntimeError as err:
        if "support" not in str(err).lower():
            raise
        _MISSING.add(key)
        return False, None


def reduce_scatter_flat(
    out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False
) -> Optional[dist.Work]:
    """``out`` (n elements) = this rank's n-element slice of the sum of every rank's 1-D ``inp``
    (world * n elements). ``out`` may be that slice of ``inp`` itself (in place). ``inp`` is scratch: a
    backend without flat reduce-scatter sums it in place (synchronously) instead. Returns the work handle
    when ``async_op`` and the collective is still running, else None."""
    done, work = _try_flat("reduce_scatter", _reduce_scatter_base, out, inp, group, async_op)
    if done:
        return work
    dist.all_reduce(inp, group=group)
    n = out.numel()
    out.copy_(inp[dist.get_rank(group) * n : (dist.get_rank(group) + 1) * n])
    return None


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False) -> Optional[dist.Work]:
    """Every rank's 1-D ``inp`` (n elements) concatenated in rank order into ``out`` (world * n); ``inp``
    may be this rank's slice of ``out`` (in place). Returns the work handle when ``async_op`` and the
    collective is still running, else None (a backend without flat all-gather runs synchronously)."""
    done, work = _try_flat("all_gather", _all_gather_base, out, inp, group, async_op)
    if done:
        return work
    world = dist.get_world_size(group)
    dist.all_gather(list(out.chunk(world)), inp.clone(), group=group)
    return None
