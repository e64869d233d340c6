"""Layout fuzzing (tests/layout_fuzz.py): a fixed, seeded sample of layouts, each trained a few steps and
compared with one process (fp32, relative 1e-5) with probes proving its modes were on. The sample runs in
`make test-extended`; `make fuzz` draws more. The generator's own checks run in the default suite."""

import pytest
from layout_fuzz import STEPS, Layout, check_layout, fuzz, sample_layout

# chosen so that together they cover every mode the generator draws (checked below)
SAMPLE = {2: [0, 2, 5, 7, 12, 26, 28, 34, 49], 4: [3, 4, 6, 9, 11, 14, 16, 18, 23, 34]}
FEATURES = {
    "tensor parallel": "tensor_parallel_size=2",
    "tensor parallel 4": "tensor_parallel_size=4",
    "sequence parallel": "sequence_parallel=true",
    "ring attention": "context_parallel_algo=ring",
    "all-gather attention": "context_parallel_algo=allgather",
    "ulysses attention": "context_parallel_algo=ulysses",
    "pipeline": "pipeline_parallel_size=2",
    "virtual pipeline": "virtual_pipeline_size=2",
    "uneven pipeline layers": "pipeline_layers=",
    "ZeRO-1": "zero_optimization=1",
    "ZeRO-2": "zero_optimization=2",
    "ZeRO-3": "zero_optimization=3",
    "optimizer offload": "offload_optimizer=true",
    "expert parallel": "expert_parallel_size=2",
    "LoRA": "lora=true",
    "full recompute": "activation_checkpointing=full",
    "selective recompute": "activation_checkpointing=selective",
    "tied embeddings": "tie_word_embeddings=true",
    "vocabulary tp does not divide": "vocab_size=203",
    "packed documents": "[packed]",
    "MoE": "model.type=moe",
    "SGD": "optim.name=sgd",
    "Adam": "optim.name=adam",
}


def test_a_seed_replays_the_same_valid_layout():
    for world in (2, 4):
        first = sample_layout(11, world)
        again = sample_layout(11, world)
        assert first.describe() == again.describe()
        assert first.describe() != sample_layout(12, world).describe()


def test_the_fixed_sample_covers_every_mode():
    described = [sample_layout(seed, world).describe() for world, seeds in SAMPLE.items() for seed in seeds]
    missing = [name for name, marker in FEATURES.items() if not any(marker in d for d in described)]
    assert not missing, f"the fixed sample no longer covers: {missing}"


def _run(losses, **probes):
    rank = {"pp_rank": 0, "forwards": [STEPS * 2 * 4], "seq": [32], "recomputes": 0, "core_recomputes": 0}
    rank["local_experts"] = []
    rank.update(optimizer="MixedPrecisionOptimizer", inner_optimizer="RegistryAdamW", sharded=False, offloaded=False)
    rank.update(tp_splits=[2], dense_elems=1000, expert_elems=0, state_elems=2000)
    rank.update(probes)
    rank.setdefault("trainable", ["layers.0.mlp.weight"])
    return {"losses": losses, "norms": [1.0] * len(losses), "probes": [rank]}


def test_the_check_sees_a_wrong_trace_and_a_mode_that_was_off():
    layout = Layout(
        seed=0, world=2, parallel=["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
    )
    ref = _run([5.0, 4.0, 3.0])
    assert check_layout(layout, _run([5.0, 4.0, 3.0], seq=[16]), ref) == []
    assert "losses differ" in check_layout(layout, _run([5.0, 4.0, 3.00004], seq=[16]), ref)[0]
    assert "losses differ" in check_layout(layout, _run([5.0, 4.0], seq=[16]), ref)[0]  # a short trace
    (problem,) = check_layout(layout, _run([5.0, 4.0, 3.0]), ref)  # blocks saw the whole sequence: SP was off
    assert "sequence lengths [32], expected [16]" in problem
    assert "failed" in check_layout(layout, {"error": "Traceback ...", "probes": [None]}, ref)[0]


def test_the_check_sees_unsplit_layers_the_wrong_optimizer_and_unsharded_state():
    tp = Layout(seed=0, world=2, parallel=["distributed.tensor_parallel_size=2"])  # no sequence parallelism
    ref = _run([5.0, 4.0, 3.0])
    assert check_layout(tp, _run([5.0, 4.0, 3.0]), ref) == []
    (problem,) = check_layout(tp, _run([5.0, 4.0, 3.0], tp_splits=[1]), ref)  # ran unsplit
    assert problem == "rank 0: linear layers split [1] ways, expected [2]"
    sgd = Layout(seed=0, world=2, model=["optim.name=sgd"], parallel=tp.parallel)
    (problem,) = check_layout(sgd, _run([5.0, 4.0, 3.0], inner_optimizer="SGD"), ref)  # one momentum only
    assert problem == "rank 0: 2000 optimizer-state elements, expected 1000 for ZeRO 0"
    assert check_layout(sgd, _run([5.0, 4.0, 3.0], inner_optimizer="SGD", state_elems=1000), ref) == []
    (problem,) = check_layout(sgd, _run([5.0, 4.0, 3.0], state_elems=1000), ref)
    assert problem == "rank 0: optim.name=sgd built RegistryAdamW"

    # ZeRO over 4 data-parallel ranks, experts over 2 of them (ep 2): 1000 / 4 + 400 / 2 elements each
    zero = ["distributed.zero_optimization=2", "distributed.expert_parallel_size=2"]
    moe = Layout(seed=0, world=4, model=["model.num_experts=4"], parallel=zero, dp=4)
    sharded = dict(tp_splits=[1], sharded=True, expert_elems=400, local_experts=[2])
    assert check_layout(moe, _run([5.0, 4.0, 3.0], state_elems=2 * 450, **sharded), ref) == []
    assert check_layout(moe, _run([5.0, 4.0, 3.0], state_elems=2 * 452, **sharded), ref) == []  # padding
    for state in (2 * 1400, 2 * 350):  # not sharded; experts sharded as if dense
        (problem,) = check_layout(moe, _run([5.0, 4.0, 3.0], state_elems=state, **sharded), ref)
        assert problem == f"rank 0: {state} optimizer-state elements, expected 900 for ZeRO 2"


@pytest.mark.extended
@pytest.mark.parametrize("world", sorted(SAMPLE))
def test_sampled_layouts_train_like_one_process(world):
    problems = {seed: found for seed, found in fuzz(SAMPLE[world], world).items() if found}
    report = "\n".join(
        f"seed {seed} (replay: python scripts/fuzz_layouts.py --world {world} --seed {seed}): "
        f"{sample_layout(seed, world).describe()}\n  " + "\n  ".join(found)
        for seed, found in problems.items()
    )
    assert not problems, report
