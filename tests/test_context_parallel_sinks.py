"""Attention sinks (gpt-oss) under context parallelism: at cp 2 every algorithm (ring, all-gather, Ulysses)
gives each rank's output and dq, dk, dv equal to the sink-column formula over the whole sequence, and the
sinks' gradients of the two ranks add up to the formula's (fp64, 1e-10), causal, packed, with GQA and with
sliding windows (of 5 and 3 keys). Probes: each rank held s/2 tokens, ring and
all-gather ran their block steps (Ulysses none, its two all-to-alls instead), and the sinks move the result.
One spawn of 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from gpt_oss_helpers import attention_with_sink_column, visible_keys
from layers_reference import rel_err

B, S, HQ, HKV, D = 2, 16, 4, 2, 8
PACKED = [[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3], [5] * 7 + [7] * 9]  # documents cross the chunk edges
CASES = {"causal": (False, None), "packed": (True, None), "window5": (False, 5), "packed_window3": (True, 3)}
ALGOS = ("ring", "allgather", "ulysses")


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=g, dtype=torch.float64) * 2
    return q, k, v, sinks, torch.randn(B, S, HQ, D, generator=g, dtype=torch.float64)


def _checks() -> dict:
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.layers.context_parallel import blockwise, context_parallel_attention, context_parallel_split

    ps.initialize_model_parallel(context_parallel_size=2)
    results = {}
    real_step, real_all_to_all, counts = blockwise._block_forward, dist.all_to_all_single, {}
    blockwise._block_forward = lambda *a, **kw: (counts.update(steps=counts["steps"] + 1), real_step(*a, **kw))[1]
    dist.all_to_all_single = lambda *a, **kw: (counts.update(a2a=counts["a2a"] + 1), real_all_to_all(*a, **kw))[1]
    try:
        for seed, (case, (packed, window)) in enumerate(CASES.items()):
            q, k, v, sinks, grad = _inputs(seed)
            segments = torch.tensor(PACKED) if packed else torch.zeros(B, S, dtype=torch.long)
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            expected = attention_with_sink_column(*leaves, visible_keys(segments, window))
            want = torch.autograd.grad(expected, leaves, grad)
            for algo in ALGOS:
                counts.update(steps=0, a2a=0)
                local = [context_parallel_split(t).requires_grad_() for t in (q, k, v)]
                mine = sinks.clone().requires_grad_()
                out = context_parallel_attention(
                    *local,
                    context_parallel_split(segments) if packed else None,
                    algo=algo,
                    sliding_window=window,
                    sinks=mine,
                )
                got = torch.autograd.grad(out, [*local, mine], context_parallel_split(grad))
                dsinks = got[3].clone()
                dist.all_reduce(dsinks, group=ps.get_context_parallel_group())  # as the replicated weight's grad
                errors = {"out": rel_err(out, context_parallel_split(expected))}
                errors |= {name: rel_err(a, context_parallel_split(b)) for name, a, b in zip("qkv", got, want)}
                errors["sinks"] = rel_err(dsinks, want[3])
                results[f"{case}/{algo}"] = {
                    "errors": errors,
                    "local_tokens": out.shape[1],
                    "block_steps": counts["steps"],
                    "all_to_alls": counts["a2a"],
                    "sinks_matter": float(
                        (out - context_parallel_split(_without_sinks(q, k, v, segments, window))).abs().max()
                    ),
                }
    finally:
        blockwise._block_forward, dist.all_to_all_single = real_step, real_all_to_all
        ps.destroy_model_parallel()
    return results


def _without_sinks(q, k, v, segments, window):
    """The same attention with sinks of -inf (no sink column): what the sinks must move the result from."""
    return attention_with_sink_column(
        q, k, v, torch.full((HQ,), float("-inf"), dtype=q.dtype), visible_keys(segments, window)
    )


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_checks, 2, timeout=300)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("case", list(CASES))
def test_sinks_under_context_parallelism_equal_the_whole_sequence_formula(ranks, case, algo):
    for rank, results in enumerate(ranks):
        got = results[f"{case}/{algo}"]
        assert set(got["errors"]) == {"out", "q", "k", "v", "sinks"}
        bad = {name: err for name, err in got["errors"].items() if not err < 1e-10}
        assert not bad, (rank, bad)
        assert got["local_tokens"] == S // 2 and got["sinks_matter"] > 0.05
        if algo == "ulysses":  # q, k and v together, then the output back, in forward and again in backward
            assert got["block_steps"] == 0 and got["all_to_alls"] == 4
        else:  # the rank's own block and the other rank's (at cp 2 a window of 2 or more reaches it)
            assert got["block_steps"] == 2 and got["all_to_alls"] == 0
