"""Pipeline recipes: validation of micro-batch counts, the bubble advice, the dry run's stage listing,
partitioning and the activation shape."""

import os
import re

import pytest
from training_helpers import tiny_config

from megacann.config import ConfigError, load_config
from megacann.config.advice import forget_advice
from megacann.dry_run import describe
from megacann.pipeline import activation_shape, check_pipeline_config, pipeline_bubble_fraction, stage_layer_ids

SEED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples/configs/llama/llama_7b.yaml")
PP4 = ["distributed.pipeline_parallel_size=4", "model.num_layers=8"]


def test_interleaved_needs_micro_batches_multiple_of_stages():
    for m in (2, 6):  # fewer than the stages, and not a multiple
        with pytest.raises(ConfigError, match=f"multiple of pipeline_parallel_size 4, got {m}: use"):
            tiny_config([*PP4, "distributed.virtual_pipeline_size=2", f"optim.grad_accum_steps={m}"], world_size=4)
    tiny_config([*PP4, "distributed.virtual_pipeline_size=2", "optim.grad_accum_steps=8"], world_size=4)


def test_fewer_micro_batches_than_stages_run_with_1f1b_and_advise():
    (advice,) = check_pipeline_config(tiny_config([*PP4, "optim.grad_accum_steps=2"], world_size=4))
    assert re.search(r"pipeline bubble 60% > 25%.*p 4 .*m 2 .*= 3/5.*grad_accum_steps 9 or more", advice)


def test_bubble_advice_is_printed_once_per_process(capsys):
    forget_advice()
    tiny_config([*PP4, "optim.grad_accum_steps=2"], world_size=4)
    err = capsys.readouterr().err
    assert re.fullmatch(r"megacann: note: .*pipeline bubble 60% > 25%.*grad_accum_steps 9 or more.*\n", err)
    tiny_config([*PP4, "optim.grad_accum_steps=2"], world_size=4)
    assert capsys.readouterr().err == ""


def test_bubble_advice_threshold():
    assert pipeline_bubble_fraction(4, 9) == pytest.approx(0.25)
    assert pipeline_bubble_fraction(4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert check_pipeline_config(tiny_config([*PP4, "optim.grad_accum_steps=9"], world_size=4)) == []  # exactly 25%
    assert check_pipeline_config(tiny_config(["optim.grad_accum_steps=1"])) == []  # no pipeline


def test_dry_run_lists_stages_chunks_and_tied_head():
    cfg = load_config(
        SEED, ["distributed.virtual_pipeline_size=2", "optim.grad_accum_steps=8", "model.tie_word_embeddings=true"]
    )
    text = describe(cfg)
    assert "-- pipeline: 4 stages, interleaved 1F1B, 2 chunks per stage, 8 micro-batches, bubble 15.8%" in text
    assert "stage 0 (ranks 0-7): chunk 0: embedding, layers 0-3 | chunk 1: layers 16-19" in text
    assert "stage 2 (ranks 16-23): chunk 0: layers 8-11 | chunk 1: layers 24-27" in text
    assert "stage 3 (ranks 24-31): chunk 0: layers 12-15 | chunk 1: layers 28-31, final norm, lm_head (copy of" in text


def test_dry_run_uneven_pipeline_layers():
    cfg = load_config(SEED, ["distributed.pipeline_layers=[7,9,9,7]"])
    text = describe(cfg)
    assert "-- pipeline: 4 stages, 1F1B, 4 micro-batches, bubble 42.9%" in text
    assert "stage 0 (ranks 0-7): embedding, layers 0-6" in text
    assert "stage 3 (ranks 24-31): layers 25-31, final norm, lm_head, loss" in text


def test_pipeline_layers_must_be_counts():
    with pytest.raises(ConfigError, match=r"pipeline_layers \[-1, 5\] must list non-negative"):
        tiny_config(["distributed.pipeline_parallel_size=2", "distributed.pipeline_layers=[-1,5]"], world_size=2)
    with pytest.raises(ConfigError, match="must list 2 stage sizes"):
        tiny_config(["distributed.pipeline_parallel_size=2", "distributed.pipeline_layers=[1,2]"], world_size=2)


def test_partition_and_activation_shape():
    assert stage_layer_ids(8, 2, 1, 2, 1) == [6, 7]  # chunk 1 of stage 1 is segment 3
    assert stage_layer_ids(6, 2, 0, pipeline_layers=[2, 4]) == [0, 1]
    with pytest.raises(ValueError, match="pipeline_layers"):
        stage_layer_ids(6, 2, 0, pipeline_layers=[2, 3])
    assert activation_shape(2, 32, 64) == (2, 32, 64)
    assert activation_shape(2, 32, 64, sequence_parallel=True, tp_size=4) == (2, 8, 64)
    with pytest.raises(ValueError, match="seq_length 30 over tensor_parallel_size 4"):
        activation_shape(2, 30, 64, sequence_parallel=True, tp_size=4)


def test_no_pipelining_refuses_the_pipeline_only_keywords():
    """run_plan takes tensor_shape, v_shape, ... of its own: the one-stage schedule must not pass them on."""
    import torch

    from megacann.pipeline.schedules import forward_backward_no_pipelining

    for keyword, value in (("tensor_shape", (1, 2, 3)), ("v_shape", True), ("overlap_pairs", {})):
        with pytest.raises(TypeError, match=rf"unexpected keyword arguments \['{keyword}'\]; besides its own"):
            forward_backward_no_pipelining([torch.nn.Linear(1, 1)], [], loss_normalizer=1.0, **{keyword: value})
