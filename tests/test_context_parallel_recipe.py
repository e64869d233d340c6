"""Context parallelism in the recipe, without spawning ranks: the keys and their checks, each cp rank's share
of a micro-batch (context_parallel_batch), the pipeline's activation shape, the dry run and the planner."""

from __future__ import annotations

import pytest
import torch
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.config.schema import CHOICES
from megacann.dry_run import describe
from megacann.layers.context_parallel import CONTEXT_PARALLEL_ALGORITHMS, context_parallel_batch, context_parallel_split
from megacann.pipeline import activation_shape
from megacann.planning.activations import layer_activation_bytes
from megacann.planning.estimate import estimate_stages
from megacann.planning.formulas import layout_of
from megacann.planning.search import candidate_layouts, rank_layouts

CP2 = "distributed.context_parallel_size=2"


def test_algorithm_key_offers_the_layer_algorithms_and_is_checked():
    assert CHOICES["distributed.context_parallel_algo"] == CONTEXT_PARALLEL_ALGORITHMS
    cfg = tiny_config([CP2, "distributed.context_parallel_algo=allgather"], world_size=2)
    assert cfg.distributed.context_parallel_algo == "allgather" and cfg.distributed.data_parallel_size == 1
    with pytest.raises(ConfigError, match="distributed.context_parallel_algo: 'rings' is not one of ring, allgather"):
        tiny_config([CP2, "distributed.context_parallel_algo=rings"], world_size=2)


def test_the_algorithm_reaches_every_attention_layer_of_the_built_model():
    from megacann.models import get_model_spec
    from megacann.pipeline import build_model_chunks

    cfg = tiny_config(["distributed.context_parallel_algo=ulysses"])  # chosen ahead of cp: harmless at cp 1
    (chunk,) = build_model_chunks(cfg, get_model_spec("llama"), torch.device("cpu"))
    algos = {layer.self_attn.context_parallel_algo for layer in chunk.layers.values()}
    assert algos == {"ulysses"}


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["data.seq_length=34"],
            2,
            r"data.seq_length 34 must be divisible by 2 x distributed.context_parallel_size 2 = 4",
        ),
        (
            ["data.seq_length=32", "distributed.context_parallel_size=3"],
            3,
            r"data.seq_length 32 must be divisible by 2 x distributed.context_parallel_size 3 = 6",
        ),
        (
            ["data.seq_length=20", "distributed.tensor_parallel_size=4", "distributed.sequence_parallel=true"],
            8,
            r"sequence parallelism splits each cp rank's 10 tokens \(data.seq_length 20 / context_parallel_size 2\) "
            r"over tensor_parallel_size 4",
        ),
        (["model.attention_dropout=0.1"], 2, r"model.attention_dropout 0.1 is not supported with .*: set it to 0"),
        (
            ["distributed.context_parallel_algo=ulysses", "distributed.tensor_parallel_size=4"],
            8,
            r"'ulysses' splits each tensor-parallel rank's 1 attention heads .* use 'ring' or 'allgather'",
        ),
    ],
)
def test_recipes_context_parallelism_cannot_run_are_refused(overrides, world, message):
    if not any(o.startswith("distributed.context_parallel_size") for o in overrides):
        overrides = [CP2, *overrides]
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides, world_size=world)


def test_batch_share_splits_every_sequence_tensor_and_adds_global_positions():
    b, s = 2, 16
    tokens = torch.arange(b * s).view(b, s)
    segments = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    batch = {"tokens": tokens, "labels": tokens + 1, "segment_ids": segments, "weights": torch.ones(b)}
    shares = [context_parallel_batch(batch, cp_size=2, cp_rank=r) for r in range(2)]
    for rank, share in enumerate(shares):
        for key in ("tokens", "labels", "segment_ids"):
            assert torch.equal(share[key], context_parallel_split(batch[key], 1, 2, rank))
        assert share["weights"] is batch["weights"]  # not a sequence: passed unchanged
    # positions of the whole sequence, split: rank 0 holds 0-3 and 12-15, rank 1 holds 4-11
    assert shares[0]["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] * b
    assert shares[1]["position_ids"].tolist() == [list(range(4, 12))] * b
    assert "position_ids" not in batch  # the caller's batch is left alone
    # packed documents: the batch's own positions (restarting per document) are split, not recomputed
    restarting = torch.tensor([list(range(5)) + list(range(11)), list(range(9)) + list(range(7))])
    packed = context_parallel_batch({**batch, "position_ids": restarting}, cp_size=2, cp_rank=1)
    assert packed["position_ids"].tolist() == [[4, 0, 1, 2, 3, 4, 5, 6], [4, 5, 6, 7, 8, 0, 1, 2]]
    assert context_parallel_batch(batch, cp_size=1, cp_rank=0) is batch
    with pytest.raises(ValueError, match=r"length 18\) into 2 x context_parallel_size 2 = 4 equal chunks"):
        context_parallel_batch({"tokens": torch.zeros(1, 18, dtype=torch.long)}, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="needs 'tokens' or 'labels'"):
        context_parallel_batch({"segment_ids": segments}, cp_size=2, cp_rank=0)


def test_pipeline_activations_are_the_rank_share():
    assert activation_shape(2, 32, 64, cp_size=2) == (2, 16, 64)
    assert activation_shape(2, 32, 64, sequence_parallel=True, tp_size=2, cp_size=2) == (2, 8, 64)
    with pytest.raises(ValueError, match="seq_length 32 / context_parallel_size 2 over tensor_parallel_size 3"):
        activation_shape(2, 32, 64, sequence_parallel=True, tp_size=3, cp_size=2)


def test_dry_run_shows_cp_groups_and_the_rank_share():
    cfg = tiny_config(
        [CP2, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", "data.seq_length=64"],
        world_size=8,
    )
    text = describe(cfg)
    assert "world 8 = tp 2 x pp 1 x dp 2 x cp 2" in text
    assert "context-parallel groups (4): [0,2] [1,3] [4,6] [5,7]" in text
    assert "data x context-parallel (gradient reduction) groups (2): [0,2,4,6] [1,3,5,7]" in text
    assert (
        "cp 2, attention by ring; each sequence of 64 tokens is cut into 4 chunks of 16, cp rank i holds chunks "
        "i and 3-i: 32 tokens per rank (0.5 of the activations), 16 per rank between tensor-parallel layers"
    ) in text
    plain = describe(tiny_config([], world_size=2))
    assert "context-parallel" not in plain and "context parallel" not in plain


def test_planner_divides_activations_by_cp_and_zero_shards_by_dp_x_cp():
    one = tiny_config(["distributed.zero_optimization=1"], world_size=2)
    two = tiny_config([CP2, "distributed.zero_optimization=1"], world_size=4)
    lay1, lay2 = layout_of(one), layout_of(two)
    assert (lay2.cp, lay2.dp, lay2.world_size, lay2.zero_shards) == (2, 2, 4, 4)
    assert layer_activation_bytes(two, lay2) == layer_activation_bytes(one, lay1) / 2
    s1, s2 = estimate_stages(one, lay1)[0], estimate_stages(two, lay2)[0]
    assert s2.weights == s1.weights and s2.optimizer == s1.optimizer / 2  # ZeRO over 4 ranks instead of 2
    assert sum(s2.chunk_saved) == pytest.approx(sum(s1.chunk_saved) / 2)
    assert "dp 2 x cp 2" in lay2.describe()
    # the search keeps the recipe's cp and fills the rest of the world
    layouts = list(candidate_layouts(two, 8))
    assert layouts and all(lay.cp == 2 and lay.world_size == 8 for lay in layouts)
    ranked = rank_layouts(two, 8, 1e9)
    assert ranked and all(r.layout.cp == 2 for r in ranked)
