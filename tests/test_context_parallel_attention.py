"""Context-parallel attention equals one process: output and dq, dk, dv of every algorithm (ring,
allgather, ulysses) at cp 4 and cp 2, for causal, packed, GQA and MQA inputs; and a SelfAttention layer
(output, input grad, weight grads) at cp 4, cp 2 and tp 2 x cp 2 (+ sequence parallelism).

It also checks that the mode was really on: each rank held s/cp tokens, the ring received cp-1 key/value
blocks forward and cp-1 blocks plus cp gradient blocks backward, posting each receive before computing on
the current block, all-gather gathered once per pass and reduce-scattered the gradients once, and Ulysses
made its all-to-alls.

One spawn of 4 gloo ranks runs every layout in turn (``_cp_checks``); the tests assert on its results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import dense_attention, dense_block, full_grads, full_weights, rel_err

from megacann import parallel_state as ps
from megacann.layers import (
    RotaryEmbedding,
    SelfAttention,
    TransformerBlock,
    TransformerBlockConfig,
    model_parallel_manual_seed,
)
from megacann.layers import attention as attention_module
from megacann.layers.context_parallel import (
    CONTEXT_PARALLEL_ALGORITHMS,
    context_parallel_attention,
    context_parallel_gather,
    context_parallel_position_ids,
    context_parallel_split,
)
from megacann.layers.context_parallel import blockwise as ring_module
from megacann.ops import attention_blocks

TOL = 1e-5
B, S, D = 2, 16, 8
# documents cross the chunk edges of cp 2 (every 4 tokens) and cp 4 (every 2): boundaries at 3, 9, 12 and 7
SEGMENTS = [[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
CASES = {  # name: (query heads, kv heads, packed)
    "causal": (4, 4, False),
    "packed": (4, 4, True),
    "gqa_packed": (4, 2, True),
    "mqa": (4, 1, False),
}
LAYOUTS = {"cp4": dict(context_parallel_size=4), "cp2": dict(context_parallel_size=2)}
LAYER_LAYOUTS = {**LAYOUTS, "tp2_cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2)}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _positions(segments: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at each packed document."""
    starts = torch.cat([torch.ones(segments.shape[0], 1, dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], 1)
    index = torch.arange(segments.shape[1]).expand_as(segments)
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def _dense_sdpa(q, k, v, segments):
    """Plain causal softmax attention on [b, s, heads, d], kv heads repeated: the one-process reference."""
    g = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    allowed = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    probs = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)


class _Recorder:
    """Wraps isend/irecv/all_to_all_single, the ring's block computations and SelfAttention's call of
    context-parallel attention, logging (what, shape of the first argument) in order."""

    def __init__(self):
        self.events: list[tuple[str, tuple]] = []
        self._saved = []

    def __enter__(self):
        def wrap(owner, name, label):
            real = getattr(owner, name)
            self._saved.append((owner, name, real))

            def logged(*args, **kwargs):
                self.events.append((label, tuple(args[0].shape)))
                return real(*args, **kwargs)

            setattr(owner, name, logged)

        wrap(dist, "isend", "send")
        wrap(dist, "irecv", "recv")
        wrap(dist, "all_to_all_single", "all_to_all")
        wrap(ring_module, "_block_forward", "compute")
        wrap(ring_module, "_block_backward", "compute")
        wrap(attention_module, "context_parallel_attention", "cp_attention")
        wrap(ring_module, "all_gather_flat", "all_gather")
        wrap(ring_module, "reduce_scatter_flat", "reduce_scatter")
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]


def _ring_pattern(cp: int, backward: bool) -> list[str]:
    """Expected event order of one ring pass: the next block's send/recv posted before each computation
    (even ranks send first, odd ranks receive first; the order of the pair is checked separately)."""
    if not backward:
        return ["xfer", "compute"] * (cp - 1) + ["compute"]
    return ["xfer", "compute", "xfer"] * (cp - 1) + ["compute", "xfer"]


def _pairs(kinds: list[str]) -> list[str]:
    """Collapse each consecutive (send, recv) / (recv, send) pair into 'xfer'."""
    out, i = [], 0
    while i < len(kinds):
        if kinds[i] in ("send", "recv"):
            assert kinds[i + 1] in ("send", "recv") and kinds[i + 1] != kinds[i], kinds
            out.append("xfer")
            i += 2
        else:
            out.append(kinds[i])
            i += 1
    return out


def _check_functional(errs, info, layout):
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    seg_full = torch.tensor(SEGMENTS)
    for case, (heads, kv_heads, packed) in CASES.items():
        q_full = _randn(B, S, heads, D, seed=1).requires_grad_()
        k_full = _randn(B, S, kv_heads, D, seed=2).requires_grad_()
        v_full = _randn(B, S, kv_heads, D, seed=3).requires_grad_()
        gout = _randn(B, S, heads, D, seed=4)
        segs = seg_full if packed else None
        _dense_sdpa(q_full, k_full, v_full, segs).backward(gout)
        for algo in CONTEXT_PARALLEL_ALGORITHMS:
            name = f"{layout}/fn/{case}/{algo}"
            q, k, v = (context_parallel_split(t.detach()).requires_grad_() for t in (q_full, k_full, v_full))
            seg = context_parallel_split(segs) if packed else None
            info[f"{name}/local_tokens"] = q.shape[1]
            with _Recorder() as forward:
                out = context_parallel_attention(q, k, v, seg, algo=algo)
            with _Recorder() as backward:
                out.backward(context_parallel_split(gout))
            errs[f"{name}/out"] = rel_err(
                context_parallel_gather(out.detach()), _dense_sdpa(q_full, k_full, v_full, segs)
            )
            for label, local, full in (("dq", q, q_full), ("dk", k, k_full), ("dv", v, v_full)):
                errs[f"{name}/{label}"] = rel_err(local.grad, context_parallel_split(full.grad))
            if algo == "ring":
                kv_shape = (2, B, S // cp, kv_heads, D)
                info[f"{name}/forward_events"] = _pairs(forward.kinds()) == _ring_pattern(cp, False)
                info[f"{name}/backward_events"] = _pairs(backward.kinds()) == _ring_pattern(cp, True)
                info[f"{name}/forward_blocks_received"] = forward.events.count(("recv", kv_shape))
                info[f"{name}/backward_blocks_received"] = backward.kinds().count("recv")
                first = forward.kinds()[0]
                info[f"{name}/even_sends_first"] = first == ("send" if rank % 2 == 0 else "recv")
            if algo == "allgather":  # the blocks gathered once per pass, gradients reduce-scattered once
                info[f"{name}/collectives"] = (
                    [k for k in forward.kinds() if k != "compute"],
                    [k for k in backward.kinds() if k != "compute"],
                    forward.kinds().count("compute"),
                )
            if algo == "ulysses":
                info[f"{name}/all_to_alls"] = (
                    forward.kinds().count("all_to_all"),
                    backward.kinds().count("all_to_all"),
                )


def _check_layer(errs, info, layout):
    tp = ps.get_tensor_model_parallel_world_size()
    seg_full = torch.tensor(SEGMENTS)
    hidden, heads, kv_heads = 32, 4, 2
    head_dim = hidden // heads
    for algo in CONTEXT_PARALLEL_ALGORITHMS:
        for packed in (False, True):
            sp = tp > 1 and packed  # sequence parallelism under tp, on one of the two cases
            name = f"{layout}/layer/{'packed' if packed else 'causal'}/{algo}"
            model_parallel_manual_seed(21)
            layer = SelfAttention(
                hidden, heads, kv_heads, qkv_bias=True, sequence_parallel=sp, context_parallel_algo=algo
            )
            w = {key: t.requires_grad_() for key, t in full_weights(layer).items()}
            segs = seg_full if packed else None
            positions = _positions(seg_full) if packed else torch.arange(S).expand(B, S)
            rotary = RotaryEmbedding(head_dim, theta=500.0)
            x_full = _randn(B, S, hidden, seed=5).requires_grad_()
            ref = dense_attention(x_full, w, heads, kv_heads, head_dim, *rotary(positions), segs)
            gout = _randn(*ref.shape, seed=6)
            ref.backward(gout)

            x_cp = context_parallel_split(x_full.detach())
            x = (x_cp.chunk(tp, 1)[ps.get_tensor_model_parallel_rank()] if sp else x_cp).clone().requires_grad_()
            with _Recorder() as record:
                out = layer(
                    x, rotary(context_parallel_split(positions)), context_parallel_split(segs) if packed else None
                )
            gout_local = context_parallel_split(gout)
            out.backward(gout_local.chunk(tp, 1)[ps.get_tensor_model_parallel_rank()] if sp else gout_local)
            info[f"{name}/attention_tokens"] = [shape[1] for kind, shape in record.events if kind == "cp_attention"]
            if sp:  # reassemble this cp rank's share from the tp ranks' pieces first
                out, dx = (_gather_tp_seq(t.detach()) for t in (out, x.grad))
            else:
                dx = x.grad
            errs[f"{name}/out"] = rel_err(context_parallel_gather(out.detach()), ref)
            errs[f"{name}/dx"] = rel_err(dx, context_parallel_split(x_full.grad))
            for p in layer.parameters():  # each cp rank's tokens give part of every weight's gradient
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
            for key, grad in full_grads(layer).items():
                errs[f"{name}/d.{key}"] = rel_err(grad, w[key].grad)


def _check_block(errs, layout):
    """A TransformerBlock given no positions rotates by its share's global positions."""
    cfg = TransformerBlockConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=48,
        context_parallel_algo="ulysses",
    )
    model_parallel_manual_seed(23)
    block = TransformerBlock(cfg)
    w = {key: t.requires_grad_() for key, t in full_weights(block).items()}
    x_full = _randn(B, S, 32, seed=8).requires_grad_()
    ref = dense_block(x_full, w, cfg, *block.rotary(torch.arange(S).expand(B, S)))
    ref.backward(_randn(*ref.shape, seed=9))
    x = context_parallel_split(x_full.detach()).requires_grad_()
    out = block(x)
    out.backward(context_parallel_split(_randn(*ref.shape, seed=9)))
    errs[f"{layout}/block/out"] = rel_err(context_parallel_gather(out.detach()), ref)
    errs[f"{layout}/block/dx"] = rel_err(x.grad, context_parallel_split(x_full.grad))
    for p in block.parameters():
        dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    for key, grad in full_grads(block).items():
        errs[f"{layout}/block/d.{key}"] = rel_err(grad, w[key].grad)


def _errors(layout) -> dict[str, str]:
    """The messages of inputs context parallelism refuses."""
    messages = {}
    q = torch.zeros(B, 4, 3, D)
    for name, call in {
        "ulysses_heads": lambda: context_parallel_attention(q, q, q, algo="ulysses"),
        "dropout": lambda: SelfAttention(24, 3, attention_dropout=0.1)(torch.zeros(B, 4, 24)),
        "odd_ring": lambda: context_parallel_attention(q[:, :3], q[:, :3], q[:, :3], algo="ring"),
    }.items():
        try:
            call()
            messages[f"{layout}/{name}"] = "no error"
        except ValueError as err:
            messages[f"{layout}/{name}"] = str(err)
    return messages


def _gather_tp_seq(t: torch.Tensor) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, 1)


def _check_layout_helpers(errs, layout):
    cp = ps.get_context_parallel_world_size()
    x = _randn(B, S, 3, seed=7).requires_grad_()
    local = context_parallel_split(x.detach()).requires_grad_()
    gathered = context_parallel_gather(local)
    gathered.backward(x.detach() * 2)
    errs[f"{layout}/helpers/gather_of_split"] = rel_err(gathered, x)
    errs[f"{layout}/helpers/gather_grad"] = rel_err(local.grad, context_parallel_split(x.detach() * 2))
    positions = context_parallel_position_ids(S)
    errs[f"{layout}/helpers/positions"] = rel_err(local.detach()[0, :, 0], x.detach()[0, positions, 0])
    errs[f"{layout}/helpers/local_len"] = float(positions.numel() != S // cp)


def _cp_checks() -> tuple[dict[str, float], dict[str, object]]:
    errs: dict[str, float] = {}
    info: dict[str, object] = {}
    attention_blocks.SCORE_TILE_ELEMENTS = 200  # several (uneven) row tiles per reference block
    for layout, sizes in LAYER_LAYOUTS.items():
        ps.initialize_model_parallel(**sizes)
        try:
            if layout in LAYOUTS:
                _check_layout_helpers(errs, layout)
                _check_functional(errs, info, layout)
                _check_block(errs, layout)
                info.update(_errors(layout))
            _check_layer(errs, info, layout)
        finally:
            ps.destroy_model_parallel()
    return errs, info


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_cp_checks, world_size=4, timeout=300)


def _cp_of(layout: str) -> int:
    return LAYER_LAYOUTS[layout]["context_parallel_size"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algo", CONTEXT_PARALLEL_ALGORITHMS)
def test_attention_matches_one_process(results, layout, algo):
    for rank, (errs, info) in enumerate(results):
        checked = {k: v for k, v in errs.items() if k.startswith(f"{layout}/fn/") and k.endswith(f"/{algo}/out")}
        assert len(checked) == len(CASES), checked
        bad = {k: v for k, v in errs.items() if k.startswith(f"{layout}/fn/") and f"/{algo}/" in k and not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        for case in CASES:
            assert info[f"{layout}/fn/{case}/{algo}/local_tokens"] == S // _cp_of(layout)


@pytest.mark.parametrize("layout", list(LAYER_LAYOUTS))
@pytest.mark.parametrize("algo", CONTEXT_PARALLEL_ALGORITHMS)
def test_self_attention_matches_one_process(results, layout, algo):
    cp = _cp_of(layout)
    for rank, (errs, info) in enumerate(results):
        mine = {k: v for k, v in errs.items() if k.startswith(f"{layout}/layer/") and f"/{algo}/" in k}
        assert len(mine) == 2 * (2 + 7), sorted(mine)  # out, dx, 7 weights (q/k/v weight+bias, o weight)
        bad = {k: v for k, v in mine.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        for case in ("causal", "packed"):  # the layer took the context-parallel path with s/cp tokens
            assert info[f"{layout}/layer/{case}/{algo}/attention_tokens"] == [S // cp]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_passes_blocks_around_and_overlaps(results, layout):
    cp = _cp_of(layout)
    for rank, (_, info) in enumerate(results):
        for case in CASES:
            key = f"{layout}/fn/{case}/ring"
            assert info[f"{key}/forward_blocks_received"] == cp - 1, (rank, key)
            assert info[f"{key}/backward_blocks_received"] == (cp - 1) + cp, (rank, key)  # kv again, then dk/dv
            assert info[f"{key}/forward_events"] and info[f"{key}/backward_events"], (rank, key)
            assert info[f"{key}/even_sends_first"], (rank, key)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_allgather_and_ulysses_collectives_and_layout_helpers(results, layout):
    cp = _cp_of(layout)
    for rank, (errs, info) in enumerate(results):
        for case in CASES:
            assert info[f"{layout}/fn/{case}/ulysses/all_to_alls"] == (2, 2), (rank, case)
            assert info[f"{layout}/fn/{case}/allgather/collectives"] == (
                ["all_gather"],
                ["all_gather", "reduce_scatter"],
                cp,
            ), (rank, case)
        helpers = {k: v for k, v in errs.items() if k.startswith(f"{layout}/helpers/")}
        assert len(helpers) == 4 and all(v <= TOL for v in helpers.values()), (rank, helpers)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_transformer_block_matches_one_process(results, layout):
    for rank, (errs, _) in enumerate(results):
        mine = {k: v for k, v in errs.items() if k.startswith(f"{layout}/block/")}
        assert len(mine) == 2 + 8, sorted(mine)  # out, dx, 2 norms + q/k/v/o + gate_up/down
        assert all(v <= TOL for v in mine.values()), (rank, mine)


def test_refusals_name_the_problem(results):
    info = results[0][1]
    for layout in LAYOUTS:
        cp = _cp_of(layout)
        assert info[f"{layout}/ulysses_heads"] == (
            f"context_parallel_algo 'ulysses' splits this rank's 3 attention heads across context_parallel_size "
            f"{cp}: they must divide; use 'ring' or 'allgather' instead"
        )
        assert info[f"{layout}/dropout"] == (
            "attention_dropout 0.1 is not supported under context parallelism (context_parallel_size > 1): set it to 0"
        )
        assert info[f"{layout}/odd_ring"] == (
            f"context parallelism cuts the sequence (length {3 * cp}) into 2 x context_parallel_size {cp} = {2 * cp} "
            f"equal chunks: the length must be divisible by {2 * cp}"
        )
