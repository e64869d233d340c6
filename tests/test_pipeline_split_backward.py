"""The backward split into B (input gradient) and W (weight gradients) gives exactly the fused backward's
gradients, for every layer type that has weights: column- and row-parallel linear, vocab-parallel embedding,
the head, norms, the router and grouped experts, LoRA adapters. Checked bit for bit on two tensor-parallel
ranks with sequence parallelism (collectives inside the backward) and full activation checkpointing, on a
first chunk (embedding, no input) and a last chunk (head and loss, hidden states in). The layers are built
as a zero-bubble schedule prepares them, and the test checks which layer types B really left to W (their
weight-gradient closures; the fused head loss's recomputes its logits in W) and which it computed itself
(norms, router). Extended: the same in bf16 with the fp32 GEMM route forced (megacann.ops.bf16_matmul)."""

import pytest
from dist_harness import run_on_ranks
from tiny_recipes import TINY_MOE

TP2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
MOE = [
    *TINY_MOE,
    "model.moe_shared_experts=1",
    "data.seq_length=16",
]
VARIANTS = {
    "moe_tp2_sp_recompute": [*MOE, *TP2, "model.activation_checkpointing=full"],
    "dense_lora_tp2": ["model.num_layers=2", *TP2, "lora=true", "lora_rank=4", "lora_alpha=8.0"]
    + ["lora_target_modules=all-linear"],
    # the overlapped column-parallel projection, selective recompute, the unfused head (logits, then loss)
    "dense_tp2_overlap_selective": ["model.num_layers=2", *TP2, "distributed.tp_comm_overlap=true"]
    + ["model.activation_checkpointing=selective", "precision.fused_ops=false"],
}
# extended: multi-token prediction on the last chunk: its depth's projections, its embedding copy and the
# shared head's fused loss (the head's weight used twice, both deferred)
MTP_VARIANTS = {"mtp_tp2": ["model.num_layers=2", *TP2, "model.mtp_num_layers=1"]}
# the layer types whose weight gradients B leaves to W (closures); the others' come with B
DEFERRED = {
    "moe_tp2_sp_recompute": {
        "ColumnParallelLinear",
        "RowParallelLinear",
        "VocabParallelEmbedding",
        "ExpertProjection",
        "LMHead",  # the fused head loss: W recomputes the logits chunk by chunk
    },
    "dense_lora_tp2": {"LoRAAdapter"},
    "dense_tp2_overlap_selective": {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LMHead"},
    "mtp_tp2": {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LMHead"},
}
COMPUTED_IN_B = {
    "moe_tp2_sp_recompute": {"RMSNorm", "TopKRouter"},
    "dense_lora_tp2": set(),
    "dense_tp2_overlap_selective": {"RMSNorm"},
    "mtp_tp2": {"RMSNorm"},
}
LAYER_TYPES = {
    "moe_tp2_sp_recompute": {
        "ColumnParallelLinear",
        "RowParallelLinear",
        "VocabParallelEmbedding",
        "LMHead",
        "RMSNorm",
        "TopKRouter",
        "ExpertProjection",  # the grouped experts' weights
    },
    "dense_lora_tp2": {"LoRAAdapter"},
    "dense_tp2_overlap_selective": {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LMHead"},
    "mtp_tp2": {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LMHead", "RMSNorm"},
}


def _owners(chunk) -> dict:
    """Parameter name -> class of the module that holds it."""
    return {
        f"{prefix}.{name}" if prefix else name: type(module).__name__
        for prefix, module in chunk.named_modules()
        for name, _ in module.named_parameters(recurse=False)
    }


def _split_checks(variants: dict) -> dict:
    import torch
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.models import ChunkPlacement
    from megacann.models.contract import backward_objective
    from megacann.models.spec import get_model_spec
    from megacann.pipeline.split_backward import (
        backward_input,
        backward_weight,
        graph_leaves,
        prepare_split_backward,
        trainable_parameters,
    )
    from megacann.training import finetune
    from megacann.training.runtime import setup_runtime

    results = {}
    for name, overrides in variants.items():
        ps.destroy_model_parallel()
        cfg = tiny_config(overrides, world_size=dist.get_world_size())
        setup_runtime(cfg)
        spec = get_model_spec(cfg.model.type)
        chunks = [
            spec.build(cfg, ChunkPlacement((0,), pre_process=True, post_process=False)),
            spec.build(cfg, ChunkPlacement((1,), pre_process=False, post_process=True)),
        ]
        finetune.prepare_model_chunks(cfg, chunks)
        prepare_split_backward(chunks)  # as build_model_chunks does under a split-backward schedule
        batch = next(iter(SyntheticData(cfg, 0, 1).train))
        g = torch.Generator().manual_seed(ps.get_tensor_model_parallel_rank())
        hidden = None
        per_type: dict = {}
        input_grad_equal = []
        deferred_types, b_types = set(), set()
        for chunk in chunks:
            owners = _owners(chunk)
            params = trainable_parameters(chunk)
            named = {n: p for n, p in chunk.named_parameters() if p.requires_grad}

            def run(x, chunk=chunk, spec=spec, batch=batch, g=g):
                out = spec.forward_step(chunk, batch, x)
                objective = backward_objective(out, normalizer=100.0, aux_weight=0.5)
                outputs, grads = [], []
                if out.hidden_states is not None and out.token_loss is None:
                    outputs.append(out.hidden_states)
                    grads.append(torch.randn(out.hidden_states.shape, generator=g.manual_seed(1)))
                if objective is not None:
                    outputs.append(objective)
                    grads.append(None)
                return out, outputs, grads

            x = None if hidden is None else hidden.clone().requires_grad_()
            out, outputs, grads = run(x)
            torch.autograd.backward(outputs, grad_tensors=grads)
            fused = {n: p.grad.clone() for n, p in named.items() if p.grad is not None}
            fused_dx = None if x is None else x.grad.clone()
            for p in params:
                p.grad = None
            x = None if hidden is None else hidden.clone().requires_grad_()
            _, outputs, grads = run(x)
            dx = backward_input(outputs, grads, [x] if x is not None else [])  # the first chunk: no input
            dx = dx[0] if x is not None else None
            untouched = all(p.grad is None for p in params)  # B leaves the weights alone
            store = outputs[0]._megacann_pending_weight_grads
            by_id = {id(p): owners[n] for n, p in named.items()}
            for weights, _ in store._closures:  # a parameter, or a view or product of one (LoRA's B laid out)
                deferred_types.update(
                    by_id[id(leaf)] for w in weights for leaf in ([w] if w.is_leaf else graph_leaves([w]))
                )
            b_types.update(by_id[id(p)] for p, _ in store._grads)
            backward_weight(outputs, grads, params)
            split = {n: p.grad.clone() for n, p in named.items() if p.grad is not None}
            if x is not None:
                input_grad_equal.append(torch.equal(dx, fused_dx) and x.grad is None)
            assert fused.keys() == split.keys() and fused
            for n in fused:
                per_type.setdefault(owners[n], []).append(untouched and torch.equal(fused[n], split[n]))
            hidden = out.hidden_states.detach() if out.hidden_states is not None else hidden
        results[name] = {
            "per_type": {k: all(v) for k, v in per_type.items()},
            "input_grad": input_grad_equal,
            "deferred": deferred_types,
            "computed_in_b": b_types,
        }
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def split_results():
    return run_on_ranks(_split_checks, 2, args=(VARIANTS,), timeout=300)


@pytest.fixture(scope="module")
def mtp_split_results():
    return run_on_ranks(_split_checks, 2, args=(MTP_VARIANTS,), timeout=300)


def _split_checks_bf16_routed(variants: dict) -> dict:
    """:func:`_split_checks` in bf16 with the fp32 GEMM route forced (MEGACANN_CPU_BF16_MATMUL=fp32): the
    routed products (projections, the overlapped one, LoRA, experts, head loss) defer exactly as before."""
    from megacann.ops import bf16_matmul

    bf16 = {name: [*overrides, "model.precision=bf16"] for name, overrides in variants.items()}
    return {"routed": bf16_matmul.enabled(), **_split_checks(bf16)}


@pytest.mark.extended
def test_b_plus_w_equals_the_fused_backward_in_bf16_on_the_fp32_gemm_route():
    results = run_on_ranks(_split_checks_bf16_routed, 2, args=(VARIANTS,), env={"MEGACANN_CPU_BF16_MATMUL": "fp32"})
    assert all(r.pop("routed") for r in results)
    for variant in sorted(VARIANTS):
        _check_variant(results, variant)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_b_plus_w_equals_the_fused_backward_per_layer_type(split_results, variant):
    _check_variant(split_results, variant)


@pytest.mark.extended
def test_b_plus_w_equals_the_fused_backward_with_multi_token_prediction(mtp_split_results):
    _check_variant(mtp_split_results, "mtp_tp2")


def _check_variant(split_results: list, variant: str) -> None:
    for rank, result in enumerate(split_results):
        got = result[variant]
        assert LAYER_TYPES[variant] <= set(got["per_type"]), (rank, sorted(got["per_type"]))
        assert all(got["per_type"].values()), (rank, got["per_type"])
        assert got["input_grad"] == [True], rank  # the last chunk's input gradient, bit for bit
        assert got["deferred"] == DEFERRED[variant], (rank, got["deferred"])
        assert COMPUTED_IN_B[variant] <= got["computed_in_b"], (rank, got["computed_in_b"])
        assert not DEFERRED[variant] & got["computed_in_b"], got["computed_in_b"]  # no bias in these models
