"""precision.compile: torch.compile per transformer block trains like eager, with and without recompute.

The compiled runs use inductor (the backend a GPU run uses; on CPU it generates C++ kernels), except the
selective-recompute run, which graph-breaks around the recomputed attention and uses ``aot_eager`` to
keep the test short. One graph serves every block: parameters are graph inputs, not constants. The runs
use the reference ops (``precision.fused_ops=false``), as on CUDA, so inductor fuses their math itself
(megacann's C++ CPU kernels would be opaque calls in the graph).
"""

import pytest
from dist_harness import run_on_ranks

STEPS = 3
RUNS = {
    "eager": [],
    "compiled": ["precision.compile=true"],
    "eager_full": ["model.activation_checkpointing=full"],
    "compiled_full": ["model.activation_checkpointing=full", "precision.compile=true"],
    "eager_selective": ["model.activation_checkpointing=selective"],
    "compiled_selective": ["model.activation_checkpointing=selective", "precision.compile=aot_eager"],
}


def _train(runs: dict[str, list[str]]) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    results = {}
    for name, overrides in runs.items():
        counters.clear()
        cfg = tiny_config(["optim.clip_grad=0.5", "model.num_layers=3", "precision.fused_ops=false", *overrides])
        trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
        blocks = [
            m for chunk in trainer.model_chunks for m in chunk.modules() if type(m).__name__ == "TransformerBlock"
        ]
        losses, norms, grads = [], [], None
        for _ in range(STEPS):
            metrics = trainer.train_step()
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
            if grads is None:
                grads = {n: p.main_grad.clone() for n, p in trainer.model_chunks[0].named_parameters()}
        results[name] = {
            "losses": losses,
            "norms": norms,
            "grads": grads,
            "params": {n: p.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()},
            "compiled": [hasattr(b._forward, "_torchdynamo_orig_callable") for b in blocks],
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
        ps.destroy_model_parallel()
        torch._dynamo.reset()
    return results


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_train, 1, args=(RUNS,), timeout=600)[0]


def assert_close(actual: dict, expected: dict) -> None:
    """Traces to 1e-5 relative, first-step gradients to 1e-5 and weights after the steps to 1e-4 (norm-wise;
    Adam amplifies rounding differences), as the parallel-layout parity tests."""
    for key in ("losses", "norms"):
        assert len(actual[key]) == len(expected[key]) > 0, (key, actual[key], expected[key])
        for a, e in zip(actual[key], expected[key]):
            assert abs(a - e) <= 1e-5 * abs(e), (key, actual[key], expected[key])
    for key, rel in (("grads", 1e-5), ("params", 1e-4)):
        for name, ref in expected[key].items():
            err = (actual[key][name] - ref).norm().item()
            assert err <= rel * ref.norm().item(), f"{key} {name}: ||diff|| {err:.3e} vs ||ref|| {ref.norm():.3e}"


@pytest.mark.parametrize("recompute", ["", "_full", "_selective"])
def test_compiled_blocks_train_like_eager(runs, recompute):
    eager, compiled = runs["eager" + recompute], runs["compiled" + recompute]
    assert eager["compiled"] == [False] * 3 and compiled["compiled"] == [True] * 3
    assert_close(compiled, eager)


def test_one_graph_serves_every_block(runs):
    """Inductor compiled the block once for three layers (training mode), without graph breaks; with full
    recompute the backward reruns that same compiled forward."""
    for name in ("compiled", "compiled_full"):
        assert runs[name]["graphs"] == 1, (name, runs[name]["graphs"])
        assert runs[name]["graph_breaks"] == 0, name
    assert runs["eager"]["graphs"] == 0  # the counters see only compiled runs


def test_compile_refuses_what_it_cannot_do():
    import torch
    from training_helpers import tiny_config

    from megacann.config import ConfigError
    from megacann.layers import compile_blocks

    # every parallel layout compiles now (tests/test_compile_parallel.py)
    tiny_config(["precision.compile=true", "distributed.tensor_parallel_size=2"], world_size=2)
    with pytest.raises(ConfigError, match="did you mean 'inductor'"):
        tiny_config(["precision.compile=inductr"])
    with pytest.raises(ValueError, match=r"\['Linear'\] holds none"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_compiled_head_loss_kernels_match_on_cpu():
    """The opt-in CUDA head loss with compiled per-chunk arithmetic, compiled here on CPU: loss and the
    gradients of hidden and weight equal the eager kernels' (fp32 1e-5), with a short last chunk,
    ignored targets and padded vocabulary rows."""
    import torch

    from megacann import ops
    from megacann.ops import cuda, head_loss

    assert "compiled" in ops.implementations("vocab_parallel_head_loss")
    assert ops.selected("vocab_parallel_head_loss", "cuda") == "reference"  # opt-in until measured on a GPU
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 16, generator=g)
    weight = torch.randn(48, 16, generator=g) * 0.3  # 48 rows, the last 8 vocabulary padding
    target = torch.randint(0, 40, (2, 40), generator=g)
    target[0, :5] = -100
    results = []
    for kernels in (head_loss.TORCH_KERNELS, cuda.COMPILED_HEAD_KERNELS):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = head_loss.head_loss(h, w, target, vocab_size=40, chunk_size=32, kernels=kernels)
        (loss * torch.linspace(0.5, 1.5, 80).view(2, 40)).sum().backward()
        results.append((loss.detach(), h.grad, w.grad))
    assert len(results) == 2 and len(results[0]) == len(results[1]) == 3
    for eager, compiled in zip(*results):
        assert (compiled - eager).norm() <= 1e-5 * eager.norm()
    assert (results[0][0][0, :5] == 0).all()
