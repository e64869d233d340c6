"""The deepseek_v32 family started from a Hugging Face checkpoint (``model.init_from``, written by
transformers, index_topk 6 under 16-token sequences, the indexer loss on) trains alike under tensor +
sequence parallelism, pipeline stages and expert parallelism as on one process (gloo, CPU, fp32): losses,
gradient norms and the indexer loss to 1e-5 relative. Probes: the keys each query read (fewer than the
causal ones: the sparse selection ran), the indexer whole on every TP rank beside the split up-projections,
tokens per rank under SP, the layers of each stage, the experts of each rank. The dense warm-up too under
tp 2 + SP and pp 2 (no key chosen, only the indexers trainable; no gradient crosses the stages, each stage
backs up its own indexer losses), with 1F1B and with zb1p (weight gradients apart: the W actions ran). Two
spawns: world 2 runs every layout, world 1 the references."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from test_deepseek_v32_models import tiny_hf_deepseek_v32
from test_qwen_parallel import ACCUM2, LAYOUTS, SEQ, STEPS, _trainer
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended

WARMUP = "model.indexer_warmup=true"
# the sparse stage under each layout; the dense warm-up (only the indexers train) under tp 2 + SP
RUNS = {
    **{k: LAYOUTS[k] for k in ("tp2_sp", "pp2", "ep2")},
    **{f"warmup_{k}": [*LAYOUTS[k], WARMUP] for k in ("tp2_sp", "pp2")},
    "warmup_pp2_zb1p": [*LAYOUTS["pp2"], "distributed.pipeline_schedule=zb1p", WARMUP],  # split backward
}
CAUSAL_KEYS = (SEQ + 1) / 2  # keys per query read by dense causal attention, on average
KEYS_READ = sum(min(t + 1, 6) for t in range(SEQ)) / SEQ  # ... by index_topk 6


def _train(trainer) -> dict:
    import functools

    from megacann.layers.moe import moe_layers
    from megacann.pipeline.actions import BackwardWeight

    seen, read, actions = [], [], []
    trainer.forward_backward = functools.partial(trainer.forward_backward, trace=actions)
    layers = {int(i): block for chunk in trainer.model_chunks for i, block in chunk.layers.items()}
    first = layers[min(layers)]
    first.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    indexer = first.self_attn.indexer
    select = indexer.select
    indexer.select = lambda *args: read.append(select(*args)) or read[-1]
    trace = [trainer.train_step() for _ in range(STEPS)]
    attn = first.self_attn
    return {
        "losses": [m["loss"] for m in trace],
        "norms": [m["grad_norm"] for m in trace],
        "split_backward": any(isinstance(action, BackwardWeight) for action in actions),
        "indexer": [m["indexer_kl"] for m in trace],
        "keys_read": sorted({float(mask.sum(-1).float().mean()) for mask in read}),
        "tokens": sorted(set(seen)),
        "trainable": sorted(
            {".indexer." in name for c in trainer.model_chunks for name, p in c.named_parameters() if p.requires_grad}
        ),
        "layers": sorted(layers),
        "shards": tuple(tuple(w.shape) for w in (attn.q_b_proj.weight, indexer.wq_b.weight, indexer.wk.weight)),
        "experts": sorted({int(e) for chunk in trainer.model_chunks for m in moe_layers(chunk) for e in m.experts}),
    }


def _world(runs: dict, hf_dir: str, root: str) -> dict:
    return {
        name: _train(_trainer("deepseek_v32", hf_dir, overrides, f"{root}/{name}")) for name, overrides in runs.items()
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_deepseek_v32(str(tmp_path_factory.mktemp("dsv32_hf") / "hf"))


@pytest.fixture(scope="module")
def world2(hf_dir, tmp_path_factory):
    return run_on_ranks(_world, 2, args=(RUNS, hf_dir, str(tmp_path_factory.mktemp("dsv32_2"))), timeout=1200)


@pytest.fixture(scope="module")
def world1(hf_dir, tmp_path_factory):
    runs = {"one": [ACCUM2], "one_warmup": [ACCUM2, WARMUP]}
    return run_on_ranks(_world, 1, args=(runs, hf_dir, str(tmp_path_factory.mktemp("dsv32_1"))), timeout=900)[0]


@pytest.mark.parametrize("layout", sorted(RUNS))
def test_layouts_train_like_one_process(world1, world2, layout):
    warmup = layout.startswith("warmup_")
    reference = world1["one_warmup" if warmup else "one"]
    assert len(reference["losses"]) == STEPS and reference["layers"] == [0, 1, 2, 3]
    assert all(loss > 1.0 for loss in reference["indexer"])  # summed over 4 layers, far from 0
    if warmup:  # dense attention (no key chosen), the indexers' weights the only trainable ones
        assert reference["keys_read"] == [] and reference["trainable"] == [True]
        assert all(f["keys_read"] == [] and f["trainable"] == [True] for f in (r[layout] for r in world2))
    else:  # query t read min(t + 1, index_topk = 6) keys: 81/16 on average, not dense causal attention's 8.5
        assert reference["keys_read"] == [KEYS_READ] and KEYS_READ < CAUSAL_KEYS
        assert reference["trainable"] == [False, True]
    for rank in world2:
        for key in ("losses", "norms", "indexer"):
            assert_close_trace(rank[layout][key], reference[key], 1e-5)
    facts = [rank[layout] for rank in world2]
    # q_b_proj: 4 heads x (16 + 8) rows over the 32-wide q latent; the indexer: 8 heads x 16 over it, wk 16 x 64
    assert reference["shards"] == ((96, 32), (128, 32), (16, 64)) and reference["tokens"] == [SEQ]
    layout = layout.removeprefix("warmup_")
    if layout == "tp2_sp":
        assert {f["shards"] for f in facts} == {((48, 32), (128, 32), (16, 64))}  # the indexer whole on each rank
        assert {f["tokens"][0] for f in facts} == {SEQ // 2}
        assert {tuple(f["keys_read"]) for f in facts} == {tuple(reference["keys_read"])}
    elif layout.startswith("pp2"):  # zb1p: weight gradients apart from the input gradients (W actions)
        assert [f["layers"] for f in facts] == [[0, 1], [2, 3]]
        assert {f["split_backward"] for f in facts} == {layout.endswith("_zb1p")}
    elif layout == "ep2":
        assert [f["experts"] for f in facts] == [[0, 1, 2, 3], [4, 5, 6, 7]] and reference["experts"] == list(range(8))
