"""What a split backward's B leaves for its W (megacann.planning.deferred) against the tensors a real B leaves:
tiny LLaMA, GPT, MoE and latent-attention chunks (a middle chunk and the last, with the head; full
recompute, activation offload, tp 2 with and without sequence parallelism) run forward and B on 1 and 2
gloo ranks: the bytes of the distinct storages the WeightGradStore's closures capture, the gradients it
holds and the received output gradient (parameters and the executor's buffers left out) equal the
formula's to the byte, and no other saved activation outlives B. Then the replay: zb1p, zbv and dualpipev
hold that from each B to its W instead of the activations, 1F1B and interleaved 1F1B are what they were."""

import contextlib
import dataclasses
import functools
import weakref

import pytest
import torch
from dist_harness import run_on_ranks
from test_planner import COMMON
from test_planner_mla import MLA
from test_planner_moe import MOE_MODEL

from megacann.pipeline.plan import Backward, BackwardInput, BackwardWeight, Forward, build_plan
from megacann.planning import estimate_stages, layout_of
from megacann.planning.activations import boundary_tensor_bytes
from megacann.planning.deferred import (
    chunk_held_bytes,
    head_held_terms,
    layer_held_terms,
    layer_rebuilt_input_terms,
)
from megacann.planning.estimate import replay_in_flight
from megacann.planning.report import layout_lines

TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
GROUPED = "precision.fused_ops=[vocab_parallel_head_loss,grouped_matmul]"  # the routed experts' products defer
# two chunks of two layers each: layers 0-1 in the middle of the model, 2-3 with the final norm and head
CHUNKS = (((0, 1), False), ((2, 3), True))
RUNS_1 = {
    "llama fp32": [*COMMON],
    "llama unfused bf16": [*COMMON, "precision.fused_ops=false", "model.precision=bf16"],
    "gpt fp32": [*COMMON, "model.type=gpt"],  # biases, LayerNorm's two parameters per width
    # layers 0 and 2 MoE with a shared expert, 1 and 3 dense; the reference grouped matmul's weight gradients
    # come with B
    "moe fp32": [*COMMON, *MOE_MODEL],
    "moe unshared fp32": [*COMMON, *MOE_MODEL, "model.moe_shared_experts=0"],
    "moe grouped fp32": [*COMMON, *MOE_MODEL, GROUPED],
    # B rebuilds the layers' activations: W's closures keep the products' inputs
    "llama full recompute": [*COMMON, "model.activation_checkpointing=full"],
    "moe grouped full recompute": [*COMMON, *MOE_MODEL, GROUPED, "model.activation_checkpointing=full"],
    "llama offloaded layer 2": [*COMMON, "training.activation_offload_layers=[2]"],
    # latent attention (layers 0-1 dense, 2-3 MoE)
    "mla fp32": [*COMMON, *MLA, GROUPED],
    "mla full recompute": [*COMMON, *MLA, GROUPED, "model.activation_checkpointing=full"],
    "mtp 2 depths": [*COMMON, "model.mtp_num_layers=2"],
    "mtp unfused": [*COMMON, "model.mtp_num_layers=1", "precision.fused_ops=false"],
}
RUNS_2 = {
    "tp2 sp": [*COMMON, *TP2_SP],
    "tp2": [*COMMON, "distributed.tensor_parallel_size=2"],  # the received gradient is the last down_proj's
    "tp2 sp full recompute": [*COMMON, *TP2_SP, "model.activation_checkpointing=full"],
    "mla tp2 sp full recompute": [*COMMON, *MLA, GROUPED, *TP2_SP, "model.activation_checkpointing=full"],
    "moe tp2 sp": [*COMMON, *MOE_MODEL, GROUPED, *TP2_SP],
    "mtp tp2 sp": [*COMMON, *TP2_SP, "model.mtp_num_layers=1"],
    "mtp tp2": [*COMMON, "distributed.tensor_parallel_size=2", "model.mtp_num_layers=1"],
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
    saved.append(weakref.ref(tensor))
    return tensor


def _same(tensor):
    return tensor


def _held_after_b(runs: dict) -> dict:
    """Per run and chunk: (the bytes of what B leaves for W, the bytes of the saved activations still alive
    after B that W does not keep); parameters and the executor's buffers left out."""
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.config.offload_keys import offloaded_layer_ids
    from megacann.layers.activation_offload import offload_layer_activations
    from megacann.models import ChunkPlacement
    from megacann.models.contract import backward_objective
    from megacann.models.spec import get_model_spec
    from megacann.ops import head_loss
    from megacann.pipeline.split_backward import backward_input, prepare_split_backward
    from megacann.training.runtime import setup_runtime

    head_loss._EARLY_MISSED[0] = True  # the device path: no weight gradient summed in the forward on CPU
    results = {}
    for name, overrides in runs.items():
        ps.destroy_model_parallel()
        cfg = tiny_config(overrides, world_size=dist.get_world_size())
        setup_runtime(cfg)
        spec = get_model_spec(cfg.model.type)
        batch = next(iter(SyntheticData(cfg, 0, 1).train))
        for layers, last in CHUNKS:
            chunk = spec.build(cfg, ChunkPlacement(layers, pre_process=False, post_process=last))
            offload_layer_activations([chunk], offloaded_layer_ids(cfg))  # as the trainer does
            prepare_split_backward([chunk])  # as build_model_chunks does under a split-backward schedule
            params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
            b, s = batch["tokens"].shape
            s_local = s // ps.get_tensor_model_parallel_world_size() if cfg.distributed.sequence_parallel else s
            x = torch.randn(b, s_local, cfg.model.hidden_size, dtype=next(chunk.parameters()).dtype)
            x.requires_grad_()
            saved: list = []  # weak references: B frees what W does not keep
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
            known = params | {t.untyped_storage().data_ptr() for t in [x, *outputs]}  # the executor's buffers
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
            held = sum(n for ptr, n in storages.items() if ptr not in known)
            alive = [t for t in (ref() for ref in saved) if t is not None]
            freed = {t.untyped_storage().data_ptr() for t in alive} - known - set(storages)
            results[(name, last)] = (
                held,
                sum(t.untyped_storage().nbytes() for t in alive if t.untyped_storage().data_ptr() in freed),
            )
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
                assert rank_result[(name, last)] == (predicted, 0), (name, layers, rank_result[(name, last)], predicted)


def test_what_b_leaves_for_w_on_one_rank_to_the_byte():
    _compare(RUNS_1, run_on_ranks(_held_after_b, 1, args=(RUNS_1,), timeout=300), 1)


def test_what_b_leaves_for_w_on_two_tensor_parallel_ranks_to_the_byte():
    _compare(RUNS_2, run_on_ranks(_held_after_b, 2, args=(RUNS_2,), timeout=300), 2)


# -- the replay -----------------------------------------------------------------------------------------

PIPELINE = ["model.num_layers=8", "optim.grad_accum_steps=4"]


def _stages(pp: int, schedule: str, *overrides: str):
    cfg = tiny_config_of([*PIPELINE, f"distributed.pipeline_parallel_size={pp}", *overrides], pp)
    layout = dataclasses.replace(layout_of(cfg), schedule=schedule)
    return cfg, layout, estimate_stages(cfg, layout)


def tiny_config_of(overrides: list, world: int):
    from training_helpers import tiny_config

    return tiny_config(overrides, world_size=world)


def _walk(plan, saved: list, after_b: list) -> tuple[float, int]:
    """(peak bytes, micro-batches waiting for their W at that moment), action by action: a chunk's
    activations from its F to its B (or fused backward), what it holds after B until its W."""
    alive, waiting, peak, at_peak = [0] * len(saved), [0] * len(saved), 0.0, 0
    for action in plan:
        c = getattr(action, "chunk", None)
        if isinstance(action, Forward):
            alive[c] += 1
        elif isinstance(action, BackwardInput):
            alive[c], waiting[c] = alive[c] - 1, waiting[c] + 1
        elif isinstance(action, Backward):
            alive[c] -= 1
        elif isinstance(action, BackwardWeight):
            waiting[c] -= 1
        now = sum(n * s + w * h for n, w, s, h in zip(alive, waiting, saved, after_b))
        if now > peak:
            peak, at_peak = now, sum(waiting)
    return peak, at_peak


def _after_b(cfg, layout, stage, index: int, pp: int, schedule: str) -> list:
    """What each chunk of the stage holds from B to W: the model's first chunk (no B) its activations and
    buffers and the received gradient; the others what B leaves and the output kept for W."""
    boundary = boundary_tensor_bytes(cfg, layout)
    out = []
    for c, (saved, buffers, held) in enumerate(zip(stage.chunk_saved, stage.chunk_buffers, stage.chunk_held)):
        last = (index == 0 and c == 1) if schedule in ("zbv", "dualpipev") else index == pp - 1
        out.append(saved + buffers + held if index == 0 and c == 0 else held + (0 if last else boundary))
    return out


@pytest.mark.parametrize("pp, schedule", [(2, "zb1p"), (4, "zb1p"), (2, "zbv"), (4, "zbv"), (2, "dualpipev")])
def test_split_schedules_hold_what_b_leaves_from_b_to_w(pp, schedule):
    cfg, layout, stages = _stages(pp, schedule)
    first = boundary_tensor_bytes(cfg, layout)
    for index, stage in enumerate(stages):
        plan = build_plan(pp, index, layout.num_microbatches, None, schedule=schedule)
        per_chunk = [a + b for a, b in zip(stage.chunk_saved, stage.chunk_buffers)]
        after = _after_b(cfg, layout, stage, index, pp, schedule)
        peak, waiting = _walk(plan, per_chunk, after)
        assert stage.activations == peak and all(held > 0 for held in stage.chunk_held), (index, stage)
        assert replay_in_flight(plan, per_chunk, after)[0] == peak
        before = replay_in_flight(plan, per_chunk)[0]  # activations kept until W, nothing else (main's estimate)
        if index == 0 and schedule == "zb1p":  # the model's first chunk: its B has no input, the gradient waits
            assert stage.chunk_held == [first] and waiting >= 1
            assert stage.activations == before + waiting * first  # the peak grows by what waits at that moment
        elif index > 0:  # B frees the graph: what waits for W is less than the activations were
            assert all(a < s for a, s in zip(after, per_chunk)) and stage.activations <= before


def test_a_middle_chunk_holds_its_layers_and_the_last_its_head():
    cfg, layout, stages = _stages(4, "zb1p")
    layer = sum(layer_held_terms(cfg, layout, 0).values()) + sum(layer_rebuilt_input_terms(cfg, layout, 0).values())
    assert stages[1].chunk_held == [2 * layer]  # the received gradient is the last down_proj's own
    assert stages[3].chunk_held == [2 * layer + sum(head_held_terms(cfg, layout).values())]


# stage activations of main before this change (1F1B and interleaved 1F1B hold nothing from B to W)
MAIN_1F1B = {
    ("1f1b", 4, ()): [2078720.0, 1606656.0, 1071104.0, 552960.0],
    ("interleaved", 4, ("optim.grad_accum_steps=8", "distributed.virtual_pipeline_size=2")): [
        3059712.0,
        2594304.0,
        2017792.0,
        1458688.0,
    ],
}


@pytest.mark.parametrize("schedule, pp, overrides", list(MAIN_1F1B))
def test_1f1b_and_interleaved_estimates_are_unchanged(schedule, pp, overrides):
    _, _, stages = _stages(pp, schedule, *overrides)
    assert [s.activations for s in stages] == MAIN_1F1B[(schedule, pp, overrides)]
    assert all(held == 0.0 for s in stages for held in s.chunk_held)


def test_the_report_names_what_b_leaves_for_w():
    cfg, layout, stages = _stages(4, "zbv")
    largest = max(stages, key=lambda s: s.total)
    text = "\n".join(layout_lines(cfg, layout, 0))
    held = ", ".join(f"chunk {c} {b / 2**20:,.1f} MiB" for c, b in enumerate(largest.chunk_held))
    assert f"split backward: B leaves for W per micro-batch on stage {largest.stage}: {held} (" in text
    cfg, layout, _ = _stages(4, "1f1b")
    assert "split backward" not in "\n".join(layout_lines(cfg, layout, 0))
