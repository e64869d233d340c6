"""The layer context: one object carries sequence parallelism, dtype, device, the context-parallel
algorithm, initialisation and recompute into every layer; explicit arguments still win; outside any
context a layer gets the one-process defaults; a forgotten algorithm is an error under context
parallelism, never a silent choice."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from dist_harness import run_on_ranks
from training_helpers import tiny_config

from megacann.layers import (
    LayerContext,
    RMSNorm,
    SelfAttention,
    TransformerBlock,
    TransformerBlockConfig,
    current_layer_context,
)
from megacann.layers.sharding import INIT_ATTR
from megacann.models import layer_context_from_config

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "custom_model.py")
BLOCK = dict(hidden_size=16, num_attention_heads=4, ffn_hidden_size=32)


def _std(param: torch.nn.Parameter) -> float:
    return getattr(param, INIT_ATTR).keywords["std"]


def test_outside_any_context_a_layer_gets_the_one_process_defaults():
    assert current_layer_context() == LayerContext()
    attn = SelfAttention(16, 4)
    assert attn.context_parallel_algo is None and not attn.recompute_core_attention
    assert not attn.q_proj.sequence_parallel and attn.q_proj.weight.dtype == torch.get_default_dtype()
    assert _std(attn.q_proj.weight) == 0.02 and _std(attn.o_proj.weight) == 0.02
    block = TransformerBlock(TransformerBlockConfig(**BLOCK))
    c = block.config
    assert (c.sequence_parallel, c.recompute, c.context_parallel_algo, c.params_dtype) == (False, "none", None, None)
    assert (c.init_method_std, c.output_layer_init_std) == (0.02, 0.02)


def test_the_context_reaches_every_layer_of_a_block_and_explicit_arguments_win():
    ctx = LayerContext(
        params_dtype=torch.float64, context_parallel_algo="ulysses", init_method_std=0.1, num_layers=8, recompute="full"
    )
    with ctx:
        block = TransformerBlock(TransformerBlockConfig(**BLOCK))
        explicit = SelfAttention(
            16, 4, context_parallel_algo="ring", recompute_core_attention=True, dtype=torch.float32
        )
        norm = RMSNorm(16, dtype=torch.float32)
    assert {p.dtype for p in block.parameters()} == {torch.float64}
    assert block.self_attn.context_parallel_algo == "ulysses" and not block.self_attn.recompute_core_attention
    assert block.config.recompute == "full" and block.config.context_parallel_algo == "ulysses"
    scaled = 0.1 / math.sqrt(2.0 * 8)
    assert _std(block.self_attn.q_proj.weight) == 0.1 and _std(block.mlp.gate_up_proj.weight) == 0.1
    assert _std(block.self_attn.o_proj.weight) == scaled and _std(block.mlp.down_proj.weight) == scaled
    assert explicit.context_parallel_algo == "ring" and explicit.recompute_core_attention
    assert explicit.q_proj.weight.dtype == torch.float32 and norm.weight.dtype == torch.float32
    # the block's own settings win over the context too
    with ctx:
        own = TransformerBlock(TransformerBlockConfig(**BLOCK, init_method_std=0.5, recompute="selective"))
    assert own.config.output_layer_init_std == 0.5 and own.self_attn.recompute_core_attention


def test_contexts_nest_and_are_restored():
    outer, inner = LayerContext(recompute="full"), LayerContext(recompute="selective")
    with outer:
        with inner as entered:
            assert entered is inner and current_layer_context() is inner
        assert current_layer_context() is outer
    assert current_layer_context() == LayerContext()


def test_bad_settings_are_refused_with_a_suggestion():
    with pytest.raises(ValueError, match="context_parallel_algo='ulysess' .* did you mean 'ulysses'"):
        LayerContext(context_parallel_algo="ulysess")
    with pytest.raises(ValueError, match="recompute='selctive' .* did you mean 'selective'"):
        LayerContext(recompute="selctive")
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        LayerContext(num_layers=0)


def test_the_recipe_gives_the_context():
    cfg = tiny_config(
        [
            "model.precision=bf16",
            "model.init_method_std=0.01",
            "model.activation_checkpointing=selective",
            "distributed.context_parallel_algo=allgather",
            "distributed.sequence_parallel=true",
        ]
    )
    ctx = layer_context_from_config(cfg, "meta")
    assert ctx == LayerContext(
        sequence_parallel=False,  # tp 1: nothing to split
        params_dtype=torch.bfloat16,
        device="meta",
        context_parallel_algo="allgather",
        init_method_std=0.01,
        num_layers=cfg.model.num_layers,
        recompute="selective",
    )


def test_the_custom_example_names_no_setting_and_still_gets_the_recipe_s():
    spec = importlib.util.spec_from_file_location("custom_model_for_context", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from megacann.models import ChunkPlacement

    cfg = tiny_config(["model.precision=fp16", "distributed.context_parallel_algo=ulysses"])
    chunk = example.build_chunk(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "cpu")
    assert {block.self_attn.context_parallel_algo for block in chunk.layers.values()} == {"ulysses"}
    assert {p.dtype for p in chunk.parameters()} == {torch.float16}
    out_std = cfg.model.init_method_std / math.sqrt(2.0 * cfg.model.num_layers)
    assert _std(chunk.layers["0"].self_attn.o_proj.weight) == out_std


def _parallel_facts() -> dict:
    import torch.distributed as dist

    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    with LayerContext(sequence_parallel=True):
        norm = RMSNorm(8)
    facts = {"sp_at_tp2": LayerContext(sequence_parallel=True).sequence_parallel, "norm_sp": norm.sequence_parallel}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    torch.manual_seed(0)
    hidden = torch.randn(1, 4, 16)
    forgot = SelfAttention(16, 4)
    try:
        forgot(hidden)
        facts["forgot"] = "ran"
    except ValueError as error:
        facts["forgot"] = str(error)
    with LayerContext(context_parallel_algo="allgather"):
        told = SelfAttention(16, 4)
    facts["told_shape"] = tuple(told(hidden).shape)
    ps.destroy_model_parallel()
    dist.barrier()
    return facts


def test_sequence_parallel_needs_tp_and_a_forgotten_algorithm_is_an_error_under_cp():
    assert LayerContext(sequence_parallel=True).sequence_parallel is False  # one process
    for facts in run_on_ranks(_parallel_facts, 2, timeout=180):
        assert facts["sp_at_tp2"] and facts["norm_sp"]
        assert "built without context_parallel_algo" in facts["forgot"], facts["forgot"]
        assert "layer_context_from_config" in facts["forgot"]
        assert facts["told_shape"] == (1, 4, 16)
