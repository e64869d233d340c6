"""gpt-oss started from a Hugging Face checkpoint (``model.init_from``, written by transformers) trains alike
under tensor + sequence parallelism (the experts split over TP, their down-projection biases added in
shares), expert parallelism, pipeline stages and context parallelism with each algorithm (Ulysses: each
rank's block of heads with its sinks; ring and all-gather: each query's sink added once after its blocks
merge, on the sliding layers too) as on one process (gloo, CPU, fp32): losses and gradient norms to 1e-5
relative. Each layout shows it is on: the query heads and attention sinks per TP rank, tokens per rank
under SP and CP (and the algorithm the attention runs), each expert's slice per TP rank, the experts of
each EP rank, the layers of each stage. Two spawns: world 2 runs the layouts, world 1 the one-process
reference."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from gpt_oss_helpers import tiny_hf_gpt_oss
from test_training_parity import assert_close_trace

STEPS = 3
SEQ = 16  # longer than the sliding window (5): the sliding layers differ from the full ones
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", f"data.seq_length={SEQ}", "data.batch_size=2", "data.tokenizer=byte"]
ACCUM2 = "optim.grad_accum_steps=2"
# global batch 4 sequences everywhere: micro-batch 2 x dp x accumulation
LAYOUTS = {
    "one": [ACCUM2],
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", ACCUM2],
    "ep2": ["distributed.expert_parallel_size=2", "optim.grad_accum_steps=1"],  # dp 2 (ep within it)
    "pp2": ["distributed.pipeline_parallel_size=2", ACCUM2],
    **{
        f"cp2_{algo}": ["distributed.context_parallel_size=2", f"distributed.context_parallel_algo={algo}", ACCUM2]
        for algo in ("ulysses", "ring", "allgather")
    },
}
WORLD2 = tuple(name for name in LAYOUTS if name != "one")


def _run(layouts: tuple[str, ...], hf_dir: str, root: str) -> dict:
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import synthetic_data_factory

    from megacann import parallel_state as ps
    from megacann.layers.moe import moe_layers
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    results = {}
    for layout in layouts:
        ps.destroy_model_parallel()
        model = {"type": "gpt_oss", "precision": "fp32", "init_from": hf_dir}  # the sizes come from config.json
        extra = [f"experiment.output_dir={root}/{layout}", f"optim.max_steps={STEPS}"]
        cfg = recipe(COMMON + extra + LAYOUTS[layout], model=model, world_size=dist.get_world_size())
        trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
        chunk = trainer.model_chunks[0]
        first = next(iter(chunk.layers.values()))  # this stage's first layer
        seen: list = []
        first.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(args[0].shape[1]))
        trace = [trainer.train_step() for _ in range(STEPS)]
        attn, moe = first.self_attn, moe_layers(chunk)[0]
        expert = moe.experts[str(moe.experts.first_expert)]
        results[layout] = {
            "losses": [m["loss"] for m in trace],
            "norms": [m["grad_norm"] for m in trace],
            "tokens": sorted(set(seen)),
            "q_proj": tuple(attn.q_proj.weight.shape),
            "sinks": tuple(attn.sinks.shape),
            "gate_up": (tuple(expert.gate_up_proj.weight.shape), tuple(expert.gate_up_proj.bias.shape)),
            "experts": sorted(int(e) for e in moe.experts),
            "layers": [int(i) for i in chunk.layers],
            "windows": [block.self_attn.sliding_window for block in chunk.layers.values()],
            "cp_algo": attn.context_parallel_algo,
        }
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    # the published clamp (7): with the helper's 1.5 many activations sit on the clamp's kink, and Adam grows
    # the rounding differences of the layouts (equal at step 1 to 1e-7) to 1e-5 by step 3 (measured)
    hf_dir = tiny_hf_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss_hf") / "hf"), swiglu_limit=7.0)
    root = str(tmp_path_factory.mktemp("gpt_oss_runs"))
    one = run_on_ranks(_run, 1, args=(("one",), hf_dir, root + "/w1"), timeout=600)[0]["one"]
    return one, run_on_ranks(_run, 2, args=(WORLD2, hf_dir, root + "/w2"), timeout=600)


@pytest.mark.parametrize("layout", WORLD2)
def test_layouts_train_like_one_process(runs, layout):
    one, world2 = runs
    facts = [rank[layout] for rank in world2]
    for got in facts:
        assert_close_trace(got["losses"], one["losses"], 1e-5)
        assert_close_trace(got["norms"], one["norms"], 1e-5)
    assert one["windows"] == [5, None, 5, None] and one["tokens"] == [SEQ]
    assert one["q_proj"] == (96, 64) and one["sinks"] == (4,) and one["gate_up"] == ((64, 64), (64,))
    if layout == "tp2_sp":  # half the heads and sinks, half of each expert, half the tokens per rank
        assert {f["q_proj"] for f in facts} == {(48, 64)} and {f["sinks"] for f in facts} == {(2,)}
        assert {f["gate_up"] for f in facts} == {((32, 64), (32,))}
        assert {f["tokens"][0] for f in facts} == {SEQ // 2}
    elif layout == "pp2":  # two layers per stage, each with its own kind of attention
        assert [(f["layers"], f["windows"]) for f in facts] == [([0, 1], [5, None]), ([2, 3], [5, None])]
    elif layout.startswith("cp2_"):  # half the tokens per rank, all heads and their sinks, the algorithm asked
        assert {f["tokens"][0] for f in facts} == {SEQ // 2} and {f["sinks"] for f in facts} == {(4,)}
        assert {f["cp_algo"] for f in facts} == {layout.removeprefix("cp2_")}
    else:  # two experts per rank, whole
        assert [f["experts"] for f in facts] == [[0, 1], [2, 3]] and one["experts"] == [0, 1, 2, 3]
        assert {f["gate_up"] for f in facts} == {((64, 64), (64,))}
