"""DeepSeek-V4's attention block (:class:`CompressedSparseAttention`) under all-gather context parallelism 2
equals the same layer over the whole sequence on one rank, for its three layer types (gloo, CPU, fp32):
each rank's output, its input's gradient and every weight's gradient (summed over the cp ranks) to 1e-5
relative. 24 tokens cut into chunks of 6 (rank 0 holds tokens 0-5 and 18-23): windows of 5 keys, eight
compressed sparse windows (rate 3, top 2) and six heavily compressed ones (rate 4) cross the chunk edges.
The sliding type also over packed documents that cross them. Probes: the all-gather path ran on every layer
and each rank attended for its 12 queries only. Under tp 2 x cp 2 (with and without sequence parallelism,
four ranks) the three types equal one process too (output, input and weight gradients)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import parameter_errors, rel_err
from test_compressed_attention import HIDDEN, LAYER_TYPES, _config, _ours

SEQ, TOL = 24, 1e-5
SEGMENTS = torch.tensor([[0] * 4 + [1] * 11 + [2] * 9, [3] * 24])  # documents crossing the chunk edges


def _positions(segments: torch.Tensor) -> torch.Tensor:
    """Positions restarting at each document of ``segments`` ``[b, s]``."""
    index = torch.arange(segments.shape[1]).expand_as(segments)
    starts = torch.cat([torch.ones_like(segments[:, :1], dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], 1)
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def _count_queries() -> list[int]:
    """The number of queries of each all-gather call from now on (appended to the returned list)."""
    from megacann.layers import compressed_attention

    ran, queries = compressed_attention.context_parallel_compressed_attention, []
    compressed_attention.context_parallel_compressed_attention = lambda *a: queries.append(a[1].shape[1]) or ran(*a)
    return queries


def _cp2_errors() -> dict:
    from megacann import parallel_state as ps
    from megacann.layers.context_parallel import context_parallel_gather, context_parallel_split

    ps.initialize_model_parallel(context_parallel_size=2)
    alone = [dist.new_group([r]) for r in range(2)][dist.get_rank()]
    cp = ps.get_context_parallel_group()
    queries = _count_queries()
    config = _config()
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    probe = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))
    cases = [(layer_type, None) for layer_type in LAYER_TYPES] + [("sliding_attention", SEGMENTS)]
    errors = {}
    for layer_type, segments in cases:
        torch.manual_seed(11)
        layer = _ours(config, layer_type, context_parallel_algo="allgather").train()
        with torch.no_grad():  # wide weights: choices far from ties
            for param in layer.parameters():
                param.normal_(0.0, 0.5)
        positions = torch.arange(SEQ).expand(2, SEQ) if segments is None else _positions(segments)
        results = []
        for group, split in ((alone, lambda t: t), (None, context_parallel_split)):
            layer.context_parallel_group = group
            layer.zero_grad()
            local = split(x).clone().requires_grad_()
            seg = None if segments is None else split(segments)
            out = layer(local, split(positions), seg)
            (out * split(probe)).sum().backward()
            grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
            out = out.detach()
            if group is None:  # back to the whole sequence, the weights' gradients summed over the cp ranks
                out = context_parallel_gather(out)
                for g in grads.values():
                    dist.all_reduce(g, group=cp)
            results.append((out, local.grad, grads))
        (out_1, dx_1, grads_1), (out_2, dx_2, grads_2) = results
        name = layer_type + ("/packed" if segments is not None else "")
        errors[f"{name}/out"] = rel_err(out_2, out_1)
        errors[f"{name}/dx"] = rel_err(dx_2, context_parallel_split(dx_1))
        errors[f"{name}/grads"] = float(sorted(grads_1) != sorted(grads_2))  # the same weights got gradients
        errors |= {f"{name}/d.{n}": rel_err(grads_2[n], grads_1[n]) for n in grads_1}
    ps.destroy_model_parallel()
    return {"errors": errors, "queries": queries}


def test_all_gather_context_parallel_equals_one_process():
    for rank, result in enumerate(run_on_ranks(_cp2_errors, world_size=2, timeout=300)):
        assert result["queries"] == [SEQ // 2] * 4  # the all-gather path ran for every case, 12 queries a rank
        errors = result["errors"]
        for layer_type in LAYER_TYPES:  # the compressor's weights got gradients through the gathered inputs
            assert f"{layer_type}/d.kv_proj.weight" in errors
            if layer_type != "sliding_attention":
                assert f"{layer_type}/d.compressor.kv_proj.weight" in errors
        bad = {name: err for name, err in errors.items() if not err <= TOL}
        assert not bad, (rank, bad)


def _tp2_cp2_errors() -> dict:
    from megacann import parallel_state as ps
    from megacann.layers.context_parallel import context_parallel_split

    queries, config = _count_queries(), _config()
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    probe = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))
    errors = {}
    for layer_type in LAYER_TYPES:
        torch.manual_seed(11)
        one = _ours(config, layer_type)  # one process, the whole sequence
        x_one = x.clone().requires_grad_()
        out_one = one(x_one)
        (out_one * probe).sum().backward()
        for sequence_parallel in (False, True):
            ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
            torch.manual_seed(11)
            layer = _ours(config, layer_type, sequence_parallel=sequence_parallel, context_parallel_algo="allgather")
            mine = [context_parallel_split(t) for t in (x, probe, out_one.detach(), x_one.grad)]
            if sequence_parallel:  # this TP rank's half of the cp share
                mine = [t.chunk(2, dim=1)[ps.get_tensor_model_parallel_rank()] for t in mine]
            x_mine, probe_mine, out_expected, dx_expected = mine
            x_mine = x_mine.clone().requires_grad_()
            out = layer(x_mine)
            (out * probe_mine).sum().backward()
            for param in layer.parameters():  # each cp rank's part of the weights' gradients, summed
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=ps.get_context_parallel_group())
            name = f"{layer_type} sp={sequence_parallel}"
            errors[f"{name}/out"] = rel_err(out, out_expected)
            errors[f"{name}/dx"] = rel_err(x_mine.grad, dx_expected)
            errors |= {f"{name}/{k}": v for k, v in parameter_errors(layer, one).items()}
            ps.destroy_model_parallel()
            dist.barrier()
    return {"errors": errors, "queries": queries}


def test_tp2_cp2_equals_one_process():
    for rank, result in enumerate(run_on_ranks(_tp2_cp2_errors, world_size=4, timeout=300)):
        assert result["queries"] == [SEQ // 2] * 6  # the all-gather path, 12 queries (the whole TP share)
        errors = result["errors"]
        assert len([name for name in errors if name.endswith("/grad.sinks")]) == 6
        bad = {name: err for name, err in errors.items() if not err <= TOL}
        assert not bad, (rank, bad)
