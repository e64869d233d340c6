"""What a split backward's B leaves for its W (megacann.planning.deferred) against the tensors a real B leaves:
tiny LLaMA, GPT and MoE chunks (a middle chunk and the last, with the head) run forward and B on 1 and 2
gloo ranks, and the bytes of the distinct storages the WeightGradStore's closures capture, the gradients it
holds and the received output gradient, less the saved activations and the parameters, equal the formula's
to the byte. Then the replay: zb1p and zbv hold them from each B to its W, 1F1B and interleaved 1F1B are
what they were."""

import contextlib
import functools

import torch
from dist_harness import run_on_ranks
from test_planner import COMMON
from test_planner_moe import MOE_MODEL

from megacann.planning import layout_of
from megacann.planning.deferred import chunk_held_bytes

# two chunks of two layers each: layers 0-1 in the middle of the model, 2-3 with the final norm and head
GROUPED = "precision.fused_ops=[vocab_parallel_head_loss,grouped_matmul]"
CHUNKS = (((0, 1), False), ((2, 3), True))
RUNS_1 = {
    "llama fp32": [*COMMON],
    "llama unfused bf16": [*COMMON, "precision.fused_ops=false", "model.precision=bf16"],
    "gpt fp32": [*COMMON, "model.type=gpt"],  # biases, LayerNorm's two parameters per width
    "moe fp32": [*COMMON, *MOE_MODEL],  # layers 0 and 2 MoE with a shared expert, 1 and 3 dense
    "moe unshared fp32": [*COMMON, *MOE_MODEL, "model.moe_shared_experts=0"],
    "moe grouped fp32": [*COMMON, *MOE_MODEL, GROUPED],  # the routed experts' weight gradients deferred
}
RUNS_2 = {
    "tp2 sp": [*COMMON, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "tp2": [*COMMON, "distributed.tensor_parallel_size=2"],  # the received gradient is the last down_proj's
    "moe tp2 sp": [
        *COMMON,
        *MOE_MODEL,
        GROUPED,
        "distributed.tensor_parallel_size=2",
        "distributed.sequence_parallel=true",
    ],
}


def _tensors(obj, found: list, depth: int = 0) -> None:
    """The tensors a closure captures (through nested closures, tuples and lists)."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, found, depth + 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for cell in obj.__closure__:
            with contextlib.suppress(ValueError):  # an empty cell
                _tensors(cell.cell_contents, found, depth + 1)


def _keep(saved: list, tensor):
    saved.append(tensor)
    return tensor


def _same(tensor):
    return tensor


def _held_after_b(runs: dict) -> dict:
    """Per run and chunk: the bytes B leaves for W beyond the saved activations and the parameters."""
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.models import ChunkPlacement
    from megacann.models.spec import get_model_spec
    from megacann.models.step_loss import backward_objective
    from megacann.ops import head_loss
    from megacann.pipeline.split_backward import backward_input
    from megacann.training.runtime import setup_runtime

    head_loss._EARLY_MISSED[0] = True  # the device path: no weight gradient summed in the forward on CPU
    results = {}
    for name, overrides in runs.items():
        ps.destroy_model_parallel()
        cfg = tiny_config(overrides, world_size=dist.get_world_size())
        setup_runtime(cfg)
        cfg.distributed.pipeline_schedule = "zb1p"  # layers built as a split-backward schedule builds them
        spec = get_model_spec(cfg.model.type)
        batch = next(iter(SyntheticData(cfg, 0, 1).train))
        for layers, last in CHUNKS:
            chunk = spec.build(cfg, ChunkPlacement(layers, pre_process=False, post_process=last))
            params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
            b, s = batch["tokens"].shape
            s_local = s // ps.get_tensor_model_parallel_world_size() if cfg.distributed.sequence_parallel else s
            x = torch.randn(b, s_local, cfg.model.hidden_size, dtype=next(chunk.parameters()).dtype)
            x.requires_grad_()
            saved: list = []  # kept alive: no later tensor reuses their memory
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_keep, saved), _same):
                out = spec.forward_step(chunk, batch, x)
                objective = backward_objective(out, normalizer=100.0, aux_weight=0.5)
            outputs, grads = ([objective], [None]) if last else ([out.hidden_states], [torch.randn_like(x)])
            backward_input(outputs, grads, [x])
            store = outputs[0]._megacann_pending_weight_grads
            found: list = []
            for _, compute in store._closures:
                _tensors(compute, found)
            found += [g for _, g in store._grads] + [g for g in grads if g is not None]
            known = params | {t.untyped_storage().data_ptr() for t in [*saved, x, *outputs]}
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
            results[(name, last)] = sum(n for ptr, n in storages.items() if ptr not in known)
    ps.destroy_model_parallel()
    return results


def _compare(runs: dict, results: list, world: int) -> None:
    from training_helpers import tiny_config

    for name, overrides in runs.items():
        cfg = tiny_config(overrides, world_size=world)
        layout = layout_of(cfg)
        for layers, last in CHUNKS:
            predicted = chunk_held_bytes(cfg, layout, list(layers), False, last, {})
            for rank_result in results:
                assert rank_result[(name, last)] == predicted, (name, layers, rank_result[(name, last)], predicted)


def test_what_b_leaves_for_w_on_one_rank_to_the_byte():
    _compare(RUNS_1, run_on_ranks(_held_after_b, 1, args=(RUNS_1,), timeout=300), 1)


def test_what_b_leaves_for_w_on_two_tensor_parallel_ranks_to_the_byte():
    _compare(RUNS_2, run_on_ranks(_held_after_b, 2, args=(RUNS_2,), timeout=300), 2)
