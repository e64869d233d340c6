"""megacann-plan: the 7B seed recipe's figures against the formulas, and the estimates against memory
measured on CPU runs of small models (1 and 4 gloo ranks): parameter, gradient and optimizer bytes read from
the tensors, activation bytes as the peak of what autograd keeps saved during real training steps."""

import os
import subprocess
import sys

import pytest
from dist_harness import run_on_ranks

from megacann.cli import plan_main
from megacann.config import load_config
from megacann.pipeline.plan import build_plan
from megacann.planning import estimate_stages, layout_of, rank_layouts, unsharded_bytes
from megacann.planning.activations import layer_activation_bytes
from megacann.planning.estimate import replay_in_flight
from megacann.training.recipe import prepare_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_7B = os.path.join(ROOT, "examples/configs/llama/llama_7b.yaml")
PSI_7B = 6_738_415_616  # 32 x 202,383,360 per layer + 2 x 32000 x 4096 + 4096 (final norm)


def test_seed_7b_unsharded_and_divided_by_its_layout():
    cfg = load_config(SEED_7B)
    prepare_recipe(cfg)  # the model family fills its defaults
    u = unsharded_bytes(cfg, PSI_7B)
    assert (u["weights"], u["grads"], u["optimizer"]) == (2 * PSI_7B, 4 * PSI_7B, 12 * PSI_7B)  # 18 B/param
    assert u["paper_total"] == 16 * PSI_7B and round(16 * 7e9 / 1e9) == 112  # the ~112 GB of the ZeRO count
    stages = estimate_stages(cfg, layout_of(cfg))
    # tp 4 splits each layer: q, k, v, o 4096 x 1024 rows, gate/up/down 4096 x 2752, norms replicated
    per_layer = 4 * 4096 * 1024 + 3 * 4096 * 2752 + 2 * 4096
    embedding = 32256 // 4 * 4096  # 32000 padded to a multiple of 128 x tp
    assert [s.params for s in stages] == [
        8 * per_layer + embedding,
        8 * per_layer,
        8 * per_layer,
        8 * per_layer + 4096 + embedding,
    ]
    for s in stages:  # bf16 weights, fp32 grads, master + Adam halved by ZeRO-1 over dp 2
        assert (s.weights, s.grads, s.optimizer) == (2 * s.params, 4 * s.params, 12 * s.params / 2)
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]  # 1F1B with 4 micro-batches
    tokens, a = 16 * 4096, 2  # micro-batch 16 of 4096 tokens, bf16
    none = tokens * (a * (4 * 4096 + 2 + (2 * 4096 + 2 * 4096 + 4 * 11008) // 4) + 4 * 32 // 4)  # 32 kv heads
    layout = layout_of(cfg)
    assert layer_activation_bytes(cfg, layout, "none") == none
    assert layer_activation_bytes(cfg, layout, "full") == tokens * a * 4096


def test_megacann_plan_command_shows_the_seed_recipe_and_ranked_layouts():
    cli = os.path.join(os.path.dirname(sys.executable), "megacann-plan")
    proc = subprocess.run(
        [cli, "--config", SEED_7B, "--world_size", "32", "--device_memory_gb", "64", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "weights 13.5 GB (bf16, 2 B/param) + gradients 27.0 GB (fp32 buffers, 4 B/param) + optimizer 80.9 GB" in out
    assert (
        "the ZeRO paper's count (2 + 2 + 12 = 16 B/param, bf16 gradients): 107.8 GB; for a round 7e9 parameters: 112.0 GB"
        in out
    )
    assert "-- the recipe's layout: tp 4 x pp 4 x dp 2, ZeRO-1, recompute none, micro-batch 16 x 4 (world 32)" in out
    assert "largest: stage 0," in out and "pipeline: 1F1B, 4 micro-batches, bubble 42.9%" in out
    ranked = [line for line in out.splitlines() if line[:3] in (" 1.", " 2.", " 3.")]
    assert len(ranked) == 3 and all("of 57.6 GB" in line and "est. time x" in line for line in ranked)


def test_megacann_plan_entry_point_refuses_a_typo_and_plans_wide_heads(capsys):
    """The command's entry point in-process (the test above starts the installed command)."""
    assert plan_main(["--config", SEED_7B, "optim.learnig_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'optim.lr'" in err and "Traceback" not in err
    mistral = os.path.join(os.path.dirname(SEED_7B), "..", "mistral", "tiny.yaml")
    assert plan_main(["--config", mistral, "--world_size", "2"]) == 0
    assert "model: mistral" in capsys.readouterr().out  # heads of head_dim 48 = 1.5 x hidden / heads


def test_ranked_layouts_fit_and_respect_the_recipe():
    cfg = load_config(SEED_7B)
    prepare_recipe(cfg)  # the model family fills its defaults
    ranked = rank_layouts(cfg, 32, 64e9)
    assert ranked and all(max(s.total for s in r.stages) <= 0.9 * 64e9 for r in ranked)
    for r in ranked:
        lay = r.layout
        assert lay.world_size == 32 and lay.micro_batch * lay.dp * lay.num_microbatches == 128  # same global batch
        assert lay.tp <= 8  # tensor parallelism inside a node
    factors = [round(r.time_factor, 4) for r in ranked]
    assert factors == sorted(factors)
    # 121 GB of weights, gradients and optimizer state over 32 devices is 3.8 GB each before activations: only
    # layouts with the optimizer in host memory fit 3 GB; weights and fp32 gradients alone (40 GB) do not fit 1 GB
    small = rank_layouts(cfg, 32, 3e9)
    assert small and all(r.layout.offload_optimizer for r in small)
    assert rank_layouts(cfg, 32, 1e9) == []


# -- measured on CPU ------------------------------------------------------------------------------------


class SavedTensorTracker:
    """Live bytes of the distinct storages autograd keeps saved for backward (parameters left out)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.refs, self.live, self.peak = exclude, {}, 0, 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return tensor
        return _Held(self, tensor, ptr, storage.nbytes())

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, tracker, tensor, ptr, nbytes):
        self.tracker, self.tensor, self.ptr, self.nbytes = tracker, tensor, ptr, nbytes
        count = tracker.refs.get(ptr, 0)
        tracker.refs[ptr] = count + 1
        if count == 0:
            tracker.live += nbytes
            tracker.peak = max(tracker.peak, tracker.live)

    def __del__(self):
        self.tracker.refs[self.ptr] -= 1
        if self.tracker.refs[self.ptr] == 0:
            del self.tracker.refs[self.ptr]
            self.tracker.live -= self.nbytes


def planned_stages(overrides: list[str], world: int):
    """A tiny recipe's layout at ``world`` ranks and the planner's estimate of each pipeline stage."""
    from training_helpers import tiny_config

    cfg = tiny_config(overrides, world_size=world)
    layout = layout_of(cfg)
    return layout, estimate_stages(cfg, layout)


def planned_in_flight(layout, stage_index: int, stage) -> float:
    """The planner's peak of saved activation bytes of a stage: its chunk's saved bytes replayed over the
    stage's schedule."""
    plan = build_plan(layout.pp, stage_index, layout.num_microbatches, layout.vpp if layout.vpp > 1 else None)
    return replay_in_flight(plan, stage.chunk_saved)[0]


def _measure(runs: dict[str, list[str]]):
    """For each recipe: this rank's pipeline stage, parameter / gradient / optimizer bytes of its optimizer,
    and the peak of saved activation bytes over two training steps."""
    import warnings

    import torch
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.optimizer.memory import optimizer_memory
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    warnings.simplefilter("ignore")
    out = {}
    for name, overrides in runs.items():
        cfg = tiny_config(overrides, world_size=dist.get_world_size())
        runtime = setup_runtime(cfg)
        data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        trainer = Trainer(cfg, runtime, data=data)
        params = {p.untyped_storage().data_ptr() for chunk in trainer.model_chunks for p in chunk.parameters()}
        tracker = SavedTensorTracker(params)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            for _ in range(2):
                trainer.train_step()
        memory = optimizer_memory(trainer.optimizer)
        out[name] = (ps.get_pipeline_model_parallel_rank(), memory, tracker.peak, tracker.live)
        ps.destroy_model_parallel()
    return out


# the formulas describe the reference operators (with the fused head loss): measured exactly
COMMON = [
    "model.num_layers=4",
    "data.seq_length=32",
    "data.batch_size=2",
    "logging.log_interval=1",
    "precision.fused_ops=[vocab_parallel_head_loss]",
    "precision.fp32_ops=[]",
]
RUNS_4 = {
    "tp2 pp2 sp fp32": [
        *COMMON,
        "distributed.tensor_parallel_size=2",
        "distributed.pipeline_parallel_size=2",
        "distributed.sequence_parallel=true",
        "optim.grad_accum_steps=4",
    ],
    "pp2 vpp2 dp2 zero1 bf16 selective": [
        *COMMON,
        "distributed.pipeline_parallel_size=2",
        "distributed.virtual_pipeline_size=2",
        "optim.grad_accum_steps=4",
        "distributed.zero_optimization=1",
        "model.precision=bf16",
        "model.activation_checkpointing=selective",
    ],
    "gpt dp4 zero2 full": [
        *COMMON,
        "model.type=gpt",
        "distributed.zero_optimization=2",
        "optim.grad_accum_steps=1",
        "distributed.overlap_grad_reduce=true",
        "model.activation_checkpointing=full",
    ],
}
# context parallelism: per-rank activations over s/cp tokens (ring: the layer terms as they are; Ulysses:
# its copies, with replicated kv heads at cp 4 > 2 kv heads); ZeRO shards over dp x cp
RUNS_4["cp2 tp2 sp ring"] = [
    *COMMON,
    "distributed.context_parallel_size=2",
    "distributed.tensor_parallel_size=2",
    "distributed.sequence_parallel=true",
    "optim.grad_accum_steps=2",
]
RUNS_4["gpt cp2 pp2 ulysses zero1 bf16"] = [
    *COMMON,
    "model.type=gpt",
    "model.precision=bf16",
    "distributed.context_parallel_size=2",
    "distributed.context_parallel_algo=ulysses",
    "distributed.pipeline_parallel_size=2",
    "distributed.zero_optimization=1",
    "optim.grad_accum_steps=4",
]
RUNS_4["cp4 ulysses"] = [
    *COMMON,
    "distributed.context_parallel_size=4",
    "distributed.context_parallel_algo=ulysses",
    "optim.grad_accum_steps=2",
]
RUNS_1 = {
    "llama bf16 none": [*COMMON, "model.precision=bf16", "optim.grad_accum_steps=2"],
    "llama unfused loss": [*COMMON, "precision.fused_ops=false", "optim.grad_accum_steps=2"],
}


def _compare(runs, results, world):
    """Planner vs measurement for every run and rank; returns the largest relative activation error."""

    worst = 0.0
    for name, overrides in runs.items():
        layout, stages = planned_stages(overrides, world)
        for rank_result in results:
            stage_index, memory, peak, live = rank_result[name]
            stage = stages[stage_index]
            assert live == 0, (name, live)  # everything saved was released by backward
            # static memory: exact up to ZeRO's padding of buckets to a multiple of dp
            assert memory["params"] == stage.weights, (name, memory, stage)
            assert memory["grads"] == pytest.approx(stage.grads, rel=0.02), (name, memory, stage)
            assert memory["optimizer_states"] == pytest.approx(stage.optimizer, rel=0.02), (name, memory, stage)
            predicted = planned_in_flight(layout, stage_index, stage)
            error = abs(peak - predicted) / peak  # exact when measured; 0.5% catches any real drift
            worst = max(worst, error)
            assert error < 0.005, (name, stage_index, peak, predicted)
    return worst


def test_estimates_match_memory_measured_on_one_rank():
    results = run_on_ranks(_measure, 1, args=(RUNS_1,), timeout=300)
    _compare(RUNS_1, results, 1)


@pytest.mark.extended
def test_estimates_match_memory_measured_on_four_ranks():
    results = run_on_ranks(_measure, 4, args=(RUNS_4,), timeout=600)
    _compare(RUNS_4, results, 4)
