"""DeepSeek-V4 started from a Hugging Face checkpoint (``model.init_from``, written by transformers) trains
alike under tensor parallelism with and without sequence parallelism (heads, sinks and output groups split;
the hash-routed layers given each rank's share of the token ids), expert parallelism and pipeline
parallelism (two stages passing the residual streams flattened, the token ids on both) as on one process
(gloo, CPU, fp32): losses and gradient norms to 1e-5 relative. Each layout shows it is on: the heads and
sinks per TP rank, the tokens each rank's layers see under SP, the experts of each EP rank, the layers of
each stage and the streams the second stage receives; and every rank's hash tables are the checkpoint's.
Context parallelism 2 (all-gather; chunks of 6 tokens, so windows of 8, compressed windows of 4 and 8 and
the indexer's top-k cross the ranks): each rank's layers see half the tokens and run the all-gather path.
Tensor (+ sequence) parallelism 2 x context parallelism 2 (world 4): each rank holds half the heads and
sinks and a quarter of the tokens, and runs the all-gather path. Three spawns: world 2 runs the layouts,
world 4 the tp x cp one, world 1 the one-process reference."""

from __future__ import annotations

import pytest
from deepseek_v4_helpers import tiny_hf_v4
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended  # a slow multi-rank check: `make test-extended` runs it

STEPS = 3
SEQ = 24  # past the sliding window (8); 6 compressed sparse entries (rate 4) and 3 heavily compressed (rate 8)
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", f"data.seq_length={SEQ}", "data.batch_size=2", "data.tokenizer=byte"]
ACCUM2 = "optim.grad_accum_steps=2"
# global batch 4 sequences everywhere: micro-batch 2 x dp x accumulation
LAYOUTS = {
    "one": [ACCUM2],
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", ACCUM2],
    "tp2": ["distributed.tensor_parallel_size=2", ACCUM2],
    "ep2": ["distributed.expert_parallel_size=2", "optim.grad_accum_steps=1"],  # dp 2 (ep within it)
    "pp2": ["distributed.pipeline_parallel_size=2", ACCUM2],
    "cp2": ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=allgather", ACCUM2],
}
# world 4: tp 2 x cp 2 with sequence parallelism (dp 1)
LAYOUTS["tp2_sp_cp2"] = LAYOUTS["tp2_sp"][:2] + LAYOUTS["cp2"]
WORLD4 = ("tp2_sp_cp2",)
HASHED = (0, 3)  # the hash-routed layers


def _run(layouts: tuple[str, ...], hf_dir: str, root: str) -> dict:
    import torch
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import synthetic_data_factory
    from transformers import DeepseekV4ForCausalLM

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    hf_layers = DeepseekV4ForCausalLM.from_pretrained(hf_dir).model.layers
    tables = {layer: hf_layers[layer].mlp.gate.tid2eid for layer in HASHED}
    results = {}
    for layout in layouts:
        ps.destroy_model_parallel()
        model = {"type": "deepseek_v4", "precision": "fp32", "init_from": hf_dir}  # the sizes come from config.json
        extra = [f"experiment.output_dir={root}/{layout}", f"optim.max_steps={STEPS}"]
        cfg = recipe(COMMON + extra + LAYOUTS[layout], model=model, world_size=dist.get_world_size())
        trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
        chunk = trainer.model_chunks[0]
        first = chunk.layers[min(chunk.layers, key=int)]
        seen, received = [], []
        first.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(tuple(args[0].shape[1:3])))

        def receiving(module, args, kwargs, received=received):
            if kwargs.get("hidden_states") is not None:  # from the previous stage
                received.append(tuple(kwargs["hidden_states"].shape))

        chunk.register_forward_pre_hook(receiving, with_kwargs=True)
        trace = [trainer.train_step() for _ in range(STEPS)]
        results[layout] = {
            "losses": [m["loss"] for m in trace],
            "norms": [m["grad_norm"] for m in trace],
            "streams": sorted(set(seen)),  # (tokens, streams) the first layer reads
            "q_b_proj": tuple(first.self_attn.q_b_proj.weight.shape),
            "sinks": tuple(first.self_attn.sinks.shape),
            "experts": sorted(int(e) for e in first.mlp.experts),
            "table": all(
                torch.equal(chunk.layers[str(i)].mlp.router.token_to_experts, tables[i])
                for i in HASHED
                if str(i) in chunk.layers
            ),  # fmt: skip
            "layers": sorted(int(i) for i in chunk.layers),
            "received": sorted(set(received)),
            "cp_algo": first.self_attn.context_parallel_algo,
            "cp_path": first.self_attn._context_group() is not None,  # the all-gather path, not one process
        }
    return results


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("transformers")
    # the published clamp (10): with the helper's small one many activations sit on the clamp's kink
    hf_dir = tiny_hf_v4(str(tmp_path_factory.mktemp("deepseek_v4_hf") / "hf"), swiglu_limit=10.0)
    return hf_dir, str(tmp_path_factory.mktemp("deepseek_v4_runs"))


@pytest.fixture(scope="module")
def one(hf):
    return run_on_ranks(_run, 1, args=(("one",), hf[0], hf[1] + "/w1"), timeout=600)[0]["one"]


@pytest.fixture(scope="module")
def world2(hf):
    layouts = tuple(layout for layout in LAYOUTS if layout not in ("one", *WORLD4))
    return run_on_ranks(_run, 2, args=(layouts, hf[0], hf[1] + "/w2"), timeout=600)


@pytest.fixture(scope="module")
def world4(hf):
    return run_on_ranks(_run, 4, args=(WORLD4, hf[0], hf[1] + "/w4"), timeout=900)


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2", "ep2", "pp2", "cp2", "tp2_sp_cp2"])
def test_layouts_train_like_one_process(request, one, layout):
    facts = [rank[layout] for rank in request.getfixturevalue("world4" if layout in WORLD4 else "world2")]
    for got in facts:
        assert_close_trace(got["losses"], one["losses"], 1e-5)
        assert_close_trace(got["norms"], one["norms"], 1e-5)
        assert got["table"]  # the checkpoint's hash table on every rank
    assert one["table"] and one["streams"] == [(SEQ, 2)]
    assert one["q_b_proj"] == (64, 16) and one["sinks"] == (4,) and one["experts"] == [0, 1, 2, 3]
    assert one["layers"] == [0, 1, 2, 3] and one["received"] == []
    if layout == "pp2":  # two layers a stage; the second receives both streams flattened, [b, s, 2 · 32]
        assert [f["layers"] for f in facts] == [[0, 1], [2, 3]]
        assert [f["received"] for f in facts] == [[], [(2, SEQ, 64)]]
    elif layout.startswith("tp2") or layout == "cp2":
        tp, cp = (2 if layout.startswith("tp2") else 1), (2 if layout.endswith("cp2") else 1)
        # half the heads and their sinks per TP rank
        assert {f["q_b_proj"] for f in facts} == {(64 // tp, 16)} and {f["sinks"] for f in facts} == {(4 // tp,)}
        tokens = SEQ // cp // (tp if "_sp" in layout else 1)  # each rank's share of the sequence under CP / SP
        assert {f["streams"][0] for f in facts} == {(tokens, 2)}
        assert {f["cp_path"] for f in facts} == {cp == 2} and not one["cp_path"]  # attended by all-gather under CP
        assert cp == 1 or {f["cp_algo"] for f in facts} == {"allgather"}
    else:  # two experts per rank
        assert [f["experts"] for f in facts] == [[0, 1], [2, 3]]
