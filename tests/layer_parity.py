"""What the layer parity tests share (tests/test_layers_parallel.py: the tensor-parallel primitives;
tests/test_layers_parallel_blocks.py: attention and transformer blocks).

A file's checks run in one spawn per TP size (:func:`parity_runs`); each check builds a parallel layer, its dense
one-process equivalent on the full weights, and records the relative errors of forward, input grad and weight
grads, and the layer's initial full weights; the tests assert on those results.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from dist_harness import LazyRuns, run_on_ranks
from layers_reference import full_grads, full_weights, rel_err

from megacann import parallel_state as ps

TOL = 1e-5
SEGMENTS = [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]]  # packed documents of a micro-batch of two

Check = Callable[[dict, dict], None]  # check(errors, initial weights): fills both


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dense_leaves(module):
    """The module's full weights as leaves of a dense reference (their grads are compared)."""
    return {k: v.requires_grad_() for k, v in full_weights(module).items()}


def record(errs, name, out, ref, dx, ref_dx, module, dense_w):
    """Relative errors of output, input grad (when given) and every weight grad against the dense reference."""
    errs[f"{name}/out"] = rel_err(out, ref)
    if dx is not None:
        errs[f"{name}/dx"] = rel_err(dx, ref_dx)
    for key, grad in full_grads(module).items():
        errs[f"{name}/d.{key}"] = rel_err(grad, dense_w[key].grad)


def run_checks(checks: tuple[Check, ...]) -> dict:
    """On every rank: the checks at tp = world size; errors, and rank 0's initial weights."""
    torch.manual_seed(0)
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    errs, inits = {}, {}
    for check in checks:
        check(errs, inits)
    ps.destroy_model_parallel()
    # plain numpy arrays: torch tensors would travel as shared memory that dies with the rank process
    inits = {layer: {k: v.numpy() for k, v in ws.items()} for layer, ws in inits.items()}
    return {"errors": errs, "inits": inits if dist.get_rank() == 0 else None}


def parity_runs(checks: tuple[Check, ...]) -> LazyRuns:
    """Results per TP size, run when a selected test first asks for that size (tp 4 is extended)."""
    return LazyRuns(lambda tp: run_on_ranks(run_checks, world_size=tp, args=(checks,), timeout=240)[0])


def assert_small(errors: dict[str, float], prefix: str, tp: int) -> None:
    picked = {k: v for k, v in errors.items() if k.startswith(prefix)}
    assert picked, f"no results for {prefix}"
    bad = {k: v for k, v in picked.items() if not v <= TOL}
    assert not bad, f"tp={tp}: relative errors above {TOL}: {bad}"


def assert_same_initial_weights(results: LazyRuns, tp: int) -> None:
    """Every layer starts from the same full weights at tp 1 and at ``tp``."""
    one, many = results[1]["inits"], results[tp]["inits"]
    assert one and one.keys() == many.keys()
    for layer in one:
        for name, tensor in one[layer].items():
            assert (many[layer][name] == tensor).all(), f"{layer}.{name} differs between tp=1 and tp={tp}"
