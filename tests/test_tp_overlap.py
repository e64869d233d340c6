"""distributed.tp_comm_overlap: the overlapped sequence-parallel column projection equals the plain one
(all-gather, F.linear; reduce-scatter of the input gradient), values and gradients, at tp 2 (gloo); a
trainer with the key trains like one without; the key is refused where there is nothing to overlap."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks


def _compare() -> dict:
    import torch
    import torch.nn.functional as F

    from megacann import parallel_state as ps
    from megacann.layers import ColumnParallelLinear, LayerContext, mappings
    from megacann.layers.tp_overlap import overlapped_gather_linear

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group = ps.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(2, 8, 6, generator=g)  # [b, s, h], b = 2: the rank-major reorder is not a view
    weight = torch.randn(10, 6, generator=g)
    bias = torch.randn(10, generator=g)
    grad = torch.randn(2, 8, 10, generator=g)
    rank = ps.get_tensor_model_parallel_rank()
    shard = x_all[:, 4 * rank : 4 * rank + 4]
    results = []
    for overlapped in (False, True):
        x, w, b = (t.clone().requires_grad_() for t in (shard, weight, bias))
        if overlapped:
            y = overlapped_gather_linear(x, w, b, group)
        else:
            y = F.linear(mappings.gather_from_sequence_parallel_region(x, group), w, b)
        y.backward(grad)
        results.append((y.detach(), x.grad, w.grad, b.grad))
    with LayerContext(sequence_parallel=True, tp_comm_overlap=True):
        layer = ColumnParallelLinear(6, 10)
    ps.destroy_model_parallel()
    return {"results": results, "layer_overlaps": layer.comm_overlap}


def test_overlapped_gather_linear_equals_the_plain_path():
    import torch

    for rank, out in enumerate(run_on_ranks(_compare, 2, timeout=300)):
        plain, overlapped = out["results"]
        assert len(plain) == len(overlapped) == 4
        for want, got in zip(plain, overlapped):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert plain[1].shape == (2, 4, 6), rank  # this rank's shard of the input gradient
        assert out["layer_overlaps"]


def test_tp_comm_overlap_is_refused_without_sequence_parallelism():
    from training_helpers import tiny_config

    from megacann.config import ConfigError

    with pytest.raises(ConfigError, match="distributed.tp_comm_overlap needs distributed.sequence_parallel: true"):
        tiny_config(["distributed.tp_comm_overlap=true", "distributed.tensor_parallel_size=2"], world_size=2)
