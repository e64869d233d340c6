"""Gated DeltaNet under tensor + sequence parallelism and context parallelism equals one process (gloo).

One spawn of 4 gloo ranks builds the one-process layer (before any model-parallel group exists), runs it
on whole sequences, then runs each layout with the same weights (sharded by each parameter's own
sharding) and compares output, input gradient and every weight gradient (rel 1e-5, fp32): tp 2 with
sequence parallelism, cp 2, cp 4 (chunks of 2 tokens, shorter than the convolution's left context of
3), and tp 2 x cp 2 with sequence parallelism; causal and packed documents (boundaries inside chunks and
on a chunk edge), and at cp 2 a longer sequence whose chunks cross the op's 64-token chunks.

Probes that each mode was on: the parameters' shard shapes under tp, the tokens each rank held
(sequence parallel: s / tp; context parallel: s / cp), and the context-parallel hand-over: the
convolution's left context and the chunk summaries gathered in sequence order, ``[2·cp, ...]``, once each
per forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import full_grads, rel_err

from megacann import parallel_state as ps
from megacann.layers import GatedDeltaNet
from megacann.layers.context_parallel import context_parallel_gather, context_parallel_split, recurrent_state
from megacann.layers.sharding import get_sharding, shard_tensor

HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV = 16, 2, 4, 8, 6
B, S, LONG = 2, 16, 272
SEGMENTS = [[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
LAYOUTS = {
    "tp2_sp": (dict(tensor_model_parallel_size=2), True),
    "cp2": (dict(context_parallel_size=2), False),
    "cp4": (dict(context_parallel_size=4), False),
    "tp2_cp2_sp": (dict(tensor_model_parallel_size=2, context_parallel_size=2), True),
}
# name: (length, packed, dtype); the long case in fp64, where its decay gradients (sums over 272 tokens that
# nearly cancel: d.A_log's relative error is 1e-14 where the projections' is 1e-16) are held to 1e-12
CASES = {"causal": (S, False, torch.float32), "packed": (S, True, torch.float32), "long": (LONG, False, torch.float64)}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _one_process(weights, seq_len, packed, dtype):
    """The one-process layer's output, input gradient and weight gradients on the whole sequences."""
    layer = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV).to(dtype)
    layer.load_state_dict(weights)
    x = _randn(B, seq_len, HIDDEN, seed=seq_len).to(dtype).requires_grad_()
    out = layer(x, segment_ids=torch.tensor(SEGMENTS) if packed else None)
    out.backward(_randn(*out.shape, seed=seq_len + 1).to(dtype))
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


class _GatherCounter:
    """Counts the context-parallel hand-overs (gathers in sequence order) and keeps their shapes."""

    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []

    def __enter__(self):
        self.real = recurrent_state.gather_chunks

        def counted(pieces, group):
            out = self.real(pieces, group)
            self.shapes.append(tuple(out.shape))
            return out

        recurrent_state.gather_chunks = counted
        return self

    def __exit__(self, *exc):
        recurrent_state.gather_chunks = self.real


def _tp_split_seq(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(ps.get_tensor_model_parallel_world_size(), 1)[ps.get_tensor_model_parallel_rank()]


def _tp_gather_seq(t: torch.Tensor) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, 1)


def _run_layout(name, sp, weights, expected, errs, info):
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    layer = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV, sequence_parallel=sp)
    with torch.no_grad():
        for key, param in layer.named_parameters():
            param.copy_(shard_tensor(weights[key], get_sharding(param), ps.get_tensor_model_parallel_rank(), tp))
    info[f"{name}/shapes"] = {k: tuple(p.shape) for k, p in layer.named_parameters()}
    for case, (seq_len, packed, dtype) in CASES.items():
        if case == "long" and name != "cp2":
            continue
        out_ref, dx_ref, grads_ref = expected[case]
        layer.to(dtype)
        x_full = _randn(B, seq_len, HIDDEN, seed=seq_len).to(dtype)
        x = context_parallel_split(x_full)
        x = (_tp_split_seq(x) if sp else x).clone().requires_grad_()
        segments = context_parallel_split(torch.tensor(SEGMENTS)) if packed else None
        layer.zero_grad()
        with _GatherCounter() as handed:
            out = layer(x, segment_ids=segments)
        gout = context_parallel_split(_randn(*out_ref.shape, seed=seq_len + 1).to(dtype))
        out.backward(_tp_split_seq(gout) if sp else gout)
        info[f"{name}/{case}/tokens"] = x.shape[1]
        info[f"{name}/{case}/handed"] = handed.shapes
        out, dx = (_tp_gather_seq(t.detach()) if sp else t.detach() for t in (out, x.grad))
        errs[f"{name}/{case}/out"] = rel_err(context_parallel_gather(out), out_ref)
        errs[f"{name}/{case}/dx"] = rel_err(dx, context_parallel_split(dx_ref))
        if cp > 1:  # each cp rank's tokens give part of every weight's gradient
            for p in layer.parameters():
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
        for key, grad in full_grads(layer).items():
            errs[f"{name}/{case}/d.{key}"] = rel_err(grad, grads_ref[key])


def _checks():
    torch.manual_seed(5)
    reference = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV)  # no model-parallel groups yet: whole
    with torch.no_grad():  # slow decay (rates 0.001 to 0.02): the state handed on still matters a chunk later
        reference.A_log.uniform_(0.001, 0.02).log_()
    weights = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    expected = {case: _one_process(weights, *spec) for case, spec in CASES.items()}
    errs, info = {}, {}
    for name, (sizes, sp) in LAYOUTS.items():
        ps.initialize_model_parallel(**sizes)
        try:
            _run_layout(name, sp, weights, expected, errs, info)
        finally:
            ps.destroy_model_parallel()
    return errs, info


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_checks, world_size=4, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(results, layout):
    for rank, (errs, _) in enumerate(results):
        mine = {k: v for k, v in errs.items() if k.startswith(f"{layout}/")}
        cases = 3 if layout == "cp2" else 2
        assert len(mine) == cases * (2 + 9), sorted(mine)  # out, dx and nine weight gradients per case
        bad = {k: v for k, v in mine.items() if not v <= TOL[CASES[k.split("/")[1]][2]]}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_mode_was_on(results, layout):
    sizes, sp = LAYOUTS[layout]
    tp, cp = sizes.get("tensor_model_parallel_size", 1), sizes.get("context_parallel_size", 1)
    conv_channels = 2 * KEY_HEADS * DK + VALUE_HEADS * DV
    for _, info in results:
        shapes = info[f"{layout}/shapes"]
        assert shapes["in_proj_qkv.weight"] == (conv_channels // tp, HIDDEN)
        assert shapes["conv1d.weight"] == (conv_channels // tp, 1, 4)
        assert shapes["A_log"] == (VALUE_HEADS // tp,) and shapes["out_proj.weight"] == (HIDDEN, VALUE_HEADS * DV // tp)
        assert shapes["norm.weight"] == (DV,)
        for case in ("causal", "packed"):
            assert info[f"{layout}/{case}/tokens"] == S // cp // (tp if sp else 1)
            handed = info[f"{layout}/{case}/handed"]
            if cp == 1:
                assert handed == []
            else:  # left context (inputs, their ids), then the chunk summaries [P | local] per value head
                assert handed == [
                    (2 * cp, B, min(3, S // (2 * cp)), conv_channels // tp),
                    (2 * cp, B, min(3, S // (2 * cp))),
                    (2 * cp, B, VALUE_HEADS // tp, DK, DK + DV),
                    (2 * cp, B),
                ]
