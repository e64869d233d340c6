"""DeepSeek-V4's grouped output projection against transformers' ``DeepseekV4GroupedLinear`` followed by
``o_b_proj`` (the tail of ``DeepseekV4Attention``) with the same weights, and under tensor parallelism 2
(with and without sequence parallelism) equal to one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import parameter_errors, rel_err

from megacann import parallel_state as ps
from megacann.layers.grouped_output_projection import GroupedOutputProjection

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

HEADS, HEAD_DIM, GROUPS, RANK, HIDDEN, SEED, TOL = 4, 6, 4, 5, 12, 17, 1e-5
WIDTH = HEADS * HEAD_DIM


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, WIDTH, generator=gen), torch.randn(2, 4, HIDDEN, generator=gen)


class _TransformersTail(torch.nn.Module):
    """``DeepseekV4Attention``'s last lines: heads reshaped into groups, ``o_a_proj``, ``o_b_proj``."""

    def __init__(self):
        super().__init__()
        self.o_a_proj = hf.DeepseekV4GroupedLinear(WIDTH // GROUPS, GROUPS * RANK, GROUPS)
        self.o_b_proj = torch.nn.Linear(GROUPS * RANK, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_b_proj(self.o_a_proj(x.unflatten(-1, (GROUPS, -1))).flatten(2))


def test_matches_transformers_outputs_and_gradients():
    torch.manual_seed(SEED)
    reference, ours = _TransformersTail(), GroupedOutputProjection(WIDTH, HIDDEN, GROUPS, RANK)
    ours.load_state_dict(reference.state_dict())  # copied by name
    x, grad = _inputs()
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, out = reference(x_ref), ours(x_ours)
    torch.testing.assert_close(out, out_ref, rtol=TOL, atol=1e-6)
    (out_ref * grad).sum().backward()
    (out * grad).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=TOL, atol=1e-6)
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=TOL, atol=1e-6, msg=name)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_groups 5 must divide the attention width 24"):
        GroupedOutputProjection(WIDTH, HIDDEN, 5, RANK)
    with pytest.raises(ValueError, match="input of width 20, expected 24"):
        GroupedOutputProjection(WIDTH, HIDDEN, GROUPS, RANK)(torch.zeros(1, 2, 20))


def _tp2_checks() -> dict[str, dict[str, float]]:
    x, grad = _inputs()
    torch.manual_seed(SEED)
    one = GroupedOutputProjection(WIDTH, HIDDEN, GROUPS, RANK)  # one process
    x_one = x.clone().requires_grad_(True)
    out_one = one(x_one)
    (out_one * grad).sum().backward()
    results = {}
    for sequence_parallel in (False, True):
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        tp_rank = ps.get_tensor_model_parallel_rank()
        torch.manual_seed(SEED)
        layer = GroupedOutputProjection(WIDTH, HIDDEN, GROUPS, RANK, sequence_parallel=sequence_parallel)
        x_mine = x.chunk(2, dim=-1)[tp_rank].clone().requires_grad_(True)  # this rank's heads
        out = layer(x_mine)
        out_expected, grad_mine = out_one.detach(), grad
        if sequence_parallel:  # the output is this rank's part of the sequence
            out_expected, grad_mine = out_expected.chunk(2, dim=1)[tp_rank], grad.chunk(2, dim=1)[tp_rank]
        (out * grad_mine).sum().backward()
        errs = {"out": rel_err(out, out_expected), "dx": rel_err(x_mine.grad, x_one.grad.chunk(2, dim=-1)[tp_rank])}
        errs.update(parameter_errors(layer, one))
        # the split was in force: half the groups' rows and columns here
        errs["sharded"] = float(
            layer.o_a_proj.weight.shape != (GROUPS // 2 * RANK, WIDTH // GROUPS)
            or layer.o_b_proj.weight.shape != (HIDDEN, GROUPS // 2 * RANK)
        )
        results[f"sp={sequence_parallel}"] = errs
        ps.destroy_model_parallel()
        dist.barrier()
    return results


def test_tp2_equals_one_process():
    for rank, per_rank in enumerate(run_on_ranks(_tp2_checks, world_size=2, timeout=180)):
        for layout, errs in per_rank.items():
            assert "grad.o_a_proj.weight" in errs and "grad.o_b_proj.weight" in errs
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"{layout}, rank {rank}: {bad}"
