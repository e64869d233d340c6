"""TP-aware RNG: dropout masks agree across TP ranks on replicated activations and differ on sharded ones;
activation checkpointing (full and selective) recomputes with the same masks, so gradients are identical."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_on_ranks
from layers_reference import gather_dim, rel_err, split_dim

from megacann import parallel_state as ps
from megacann.layers import (
    TransformerBlock,
    TransformerBlockConfig,
    checkpoint,
    dropout,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from megacann.layers.random import RNGStatesTracker


def _same_on_all_tp_ranks(t: torch.Tensor) -> bool:
    pieces = gather_dim(t.unsqueeze(0), 0)
    return all(torch.equal(pieces[0], p) for p in pieces[1:])


def _block(sp: bool, recompute: str) -> TransformerBlock:
    cfg = TransformerBlockConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=32,
        hidden_dropout=0.3,
        attention_dropout=0.3,
        sequence_parallel=sp,
        recompute=recompute,
    )
    model_parallel_manual_seed(5)
    return TransformerBlock(cfg)


def _train_step(sp: bool, recompute: str, input_grad: bool = True):
    block = _block(sp, recompute)
    model_parallel_manual_seed(21)  # same streams for every variant
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    x = (split_dim(x, 1) if sp else x).clone().requires_grad_(input_grad)
    out = block(x)
    out2 = block(out)  # a second call: the streams have moved on, recompute must not care
    out2.backward(torch.ones_like(out2))
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    after = (torch.get_rng_state(), get_rng_tracker().get_states())
    return out2.detach(), (x.grad if input_grad else None), grads, after


def _rng_checks():
    tp = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    res = {}
    model_parallel_manual_seed(7)
    ones = torch.ones(256)
    res["default_mask_same"] = _same_on_all_tp_ranks(F.dropout(ones, 0.5).ne(0))
    with get_rng_tracker().fork():
        fork_mask = F.dropout(ones, 0.5).ne(0)
    res["fork_mask_differs"] = tp == 1 or not _same_on_all_tp_ranks(fork_mask)
    res["dropout_helper_replicated_same"] = _same_on_all_tp_ranks(dropout(ones, 0.5, True, tensor_parallel=False))
    sharded = dropout(ones, 0.5, True, tensor_parallel=True)
    res["dropout_helper_sharded_differs"] = tp == 1 or not _same_on_all_tp_ranks(sharded)
    res["dropout_eval_identity"] = dropout(ones, 0.5, False, tensor_parallel=True) is ones

    states = get_rng_tracker().get_states()
    with get_rng_tracker().fork():
        first = torch.rand(8)
    get_rng_tracker().set_states(states)
    with get_rng_tracker().fork():
        again = torch.rand(8)
    res["tracker_states_restore"] = torch.equal(first, again)

    # a block without sequence parallelism, dropout on: its output is replicated on every TP rank
    block = _block(sp=False, recompute="none")
    model_parallel_manual_seed(9)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    out = block(x)
    res["block_output_replicated_with_dropout"] = _same_on_all_tp_ranks(out.detach())
    block.eval()
    res["block_dropout_active"] = not torch.equal(out.detach(), block(x).detach())

    for sp in (False, True):
        base = _train_step(sp, "none")
        for recompute in ("selective", "full"):
            got = _train_step(sp, recompute)
            key = f"sp={sp}/{recompute}"
            res[f"{key}/out"] = rel_err(got[0], base[0])
            res[f"{key}/dx"] = rel_err(got[1], base[1])
            res[f"{key}/grads"] = max(rel_err(got[2][n], g) for n, g in base[2].items())
            res[f"{key}/rng_after_same"] = torch.equal(got[3][0], base[3][0]) and all(
                torch.equal(got[3][1][k], v) for k, v in base[3][1].items()
            )
    # no input requires grad (e.g. a frozen embedding): parameters still get their gradients
    base = _train_step(False, "none", input_grad=False)
    got = _train_step(False, "full", input_grad=False)
    res["no_input_grad/grads"] = max(rel_err(got[2][n], g) for n, g in base[2].items())
    if dist.is_initialized():
        ps.destroy_model_parallel()
    return res


def _assert_rng_results(res):
    flags = {k: v for k, v in res.items() if isinstance(v, bool)}
    assert all(flags.values()), {k: v for k, v in flags.items() if not v}
    errors = {k: v for k, v in res.items() if not isinstance(v, bool)}
    assert errors and all(v <= 1e-6 for v in errors.values()), errors


def test_rng_and_checkpoint_one_process():
    _assert_rng_results(_rng_checks())


def test_rng_and_checkpoint_two_tp_ranks():
    for res in run_on_ranks(_rng_checks, world_size=2, timeout=180):
        _assert_rng_results(res)


def test_fork_before_seeding_names_the_fix():
    tracker = RNGStatesTracker()
    with pytest.raises(RuntimeError, match="model_parallel_manual_seed"), tracker.fork():
        pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)


def test_checkpoint_passes_through_without_grad():
    with torch.no_grad():
        assert checkpoint(lambda t: t * 2, torch.ones(2)).tolist() == [2.0, 2.0]
