"""Process-group layout (tp-cp-ep-dp-pp), getters on real gloo ranks, and size errors."""

import pytest
from dist_harness import run_on_ranks

from megacann import parallel_state as ps

WORLD8 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


def test_world8_layout_matches_reference():
    layout = ps.rank_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for kind, expected in WORLD8.items():
        assert layout.groups[kind] == expected
    assert layout.groups["embedding"] == WORLD8["pp"]
    assert layout.data_parallel_size == 2


def test_expert_parallel_is_carved_out_of_data_parallel():
    layout = ps.rank_layout(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    # dp=4 over ranks with the same tp rank; ep pairs adjacent dp ranks; expert-dp strides over ep
    assert layout.groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_context_parallel_sits_between_tp_and_dp():
    layout = ps.rank_layout(8, tensor_model_parallel_size=2, context_parallel_size=2)
    assert layout.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize(
    "sizes,numbers",
    [
        (dict(tensor_model_parallel_size=3), ["world_size 8", "tensor_model_parallel_size 3", "= 3"]),
        (
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3),
            ["world_size 8", "tensor_model_parallel_size 2", "pipeline_model_parallel_size 3", "= 6"],
        ),
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=3), ["expert_model_parallel_size 3", "4"]),
    ],
)
def test_sizes_that_do_not_divide_raise_with_numbers(sizes, numbers):
    with pytest.raises(ValueError) as err:
        ps.rank_layout(8, **sizes)
    for text in numbers:
        assert text in str(err.value)


def test_single_process_defaults_without_initialisation():
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_data_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_tensor_model_parallel_group() is None


def _world8_getters():
    import torch
    import torch.distributed as dist

    layout = ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    rank = dist.get_rank()
    out = {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "embedding": ps.get_embedding_group_ranks(),
        "pp_ranks": ps.get_pipeline_model_parallel_ranks(),
    }
    # the groups really connect the ranks the layout names: sum of global ranks over each group
    sums = {}
    for kind, getter in (
        ("tp", ps.get_tensor_model_parallel_group),
        ("dp", ps.get_data_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
        ("embedding", ps.get_embedding_group),
    ):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getter())
        sums[kind] = int(t.item())
    out["sums"] = sums
    out["expected_sums"] = {k: sum(layout.group_of(k, rank)) for k in sums}
    ps.destroy_model_parallel()
    return out


@pytest.mark.extended
def test_world8_getters_on_gloo_ranks():
    results = run_on_ranks(_world8_getters, world_size=8, timeout=240)
    for rank, r in enumerate(results):
        assert r["sums"] == r["expected_sums"]
        assert r["tp"] == (rank % 2, 2)
        assert r["pp"] == (rank // 4, 2)
        assert r["dp"] == ((rank // 2) % 2, 2)
        assert r["first"] == (rank < 4) and r["last"] == (rank >= 4)
        assert r["pp_ranks"] == [rank % 4, rank % 4 + 4]
        assert r["embedding"] == [rank % 4, rank % 4 + 4]


def test_virtual_pipeline_stage_flags():
    # pure state manipulation, no collectives: pretend we are stage 0 of 2 with 2 virtual chunks
    layout = ps.rank_layout(2, pipeline_model_parallel_size=2)
    ps._STATE = ps._State(layout, rank=0, groups={}, virtual_pipeline_size=2, virtual_pipeline_rank=0)
    try:
        assert ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
        ps.set_virtual_pipeline_model_parallel_rank(1)
        assert not ps.is_pipeline_first_stage() and ps.is_pipeline_first_stage(ignore_virtual=True)
    finally:
        ps.destroy_model_parallel()
