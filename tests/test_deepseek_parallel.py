"""The deepseek_v3 family started from a Hugging Face checkpoint (``model.init_from``, written by
transformers: low-rank q, YaRN, interleaved RoPE, value heads narrower than q/k heads, group-limited
routing) trains alike under tensor + sequence parallelism, pipeline stages, expert parallelism (also with
ZeRO-1) and context parallelism (ring, all-gather and Ulysses, the padded heads carried by each) as on one
process (gloo, CPU, fp32): losses and gradient norms to 1e-5 relative. Each layout shows it is on: the
latent attention's shards (up-projections split by heads, down-projections whole), tokens per rank under
SP / CP, the layers of each stage, the experts of each rank. Two more layouts (tp 2 + SP, pp 2) start
from a checkpoint with a multi-token prediction depth (latent attention + MoE layer, on the last stage)
and match one process in its loss too. Two spawns: world 2 runs every layout, world 1 the references.
"""

from __future__ import annotations

import pytest
from deepseek_helpers import tiny_deepseek_with_mtp, tiny_hf_deepseek
from dist_harness import run_on_ranks
from test_qwen_parallel import ACCUM2, LAYOUTS, SEQ, STEPS, _trainer
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended

RUNS = {
    **{k: LAYOUTS[k] for k in ("tp2_sp", "pp2", "ep2", "cp2", "cp2_ulysses")},
    "cp2_allgather": ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=allgather", ACCUM2],
    # ZeRO-1 over dp 2 with the experts spread (the frozen routing bias has no optimizer state)
    "ep2_zero1": [*LAYOUTS["ep2"], "distributed.zero_optimization=1"],
}
MTP_RUNS = {"mtp_tp2_sp": LAYOUTS["tp2_sp"], "mtp_pp2": LAYOUTS["pp2"]}


def _train(trainer) -> dict:
    from megacann.layers.moe import moe_layers

    seen: list = []
    layers = {int(i): block for chunk in trainer.model_chunks for i, block in chunk.layers.items()}
    layers[min(layers)].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    attn = layers[min(layers)].self_attn
    trace = [trainer.train_step() for _ in range(STEPS)]
    shards = (attn.q_b_proj.weight, attn.kv_b_proj.weight, attn.q_a_proj.weight)
    return {
        "losses": [m["loss"] for m in trace],
        "norms": [m["grad_norm"] for m in trace],
        "mtp": [m.get("mtp_loss") for m in trace],
        "has_mtp": any(getattr(chunk, "mtp", None) is not None for chunk in trainer.model_chunks),
        "tokens": sorted(set(seen)),
        "layers": sorted(layers),
        "shards": tuple(tuple(w.shape) for w in shards),
        "experts": sorted({int(e) for chunk in trainer.model_chunks for m in moe_layers(chunk) for e in m.experts}),
    }


def _world(runs: dict, hf_dirs: dict, root: str) -> dict:
    """``runs``: layout name -> (checkpoint kind, overrides)."""
    return {
        name: _train(_trainer("deepseek_v3", hf_dirs[kind], overrides, f"{root}/{name}"))
        for name, (kind, overrides) in runs.items()
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("deepseek_hf")
    tiny_deepseek_with_mtp(str(root / "mtp"))
    return {"plain": tiny_hf_deepseek(str(root / "hf"), "yarn"), "mtp": str(root / "mtp")}


@pytest.fixture(scope="module")
def world2(hf_dirs, tmp_path_factory):
    runs = {**{k: ("plain", v) for k, v in RUNS.items()}, **{k: ("mtp", v) for k, v in MTP_RUNS.items()}}
    return run_on_ranks(_world, 2, args=(runs, hf_dirs, str(tmp_path_factory.mktemp("ds2"))), timeout=1200)


@pytest.fixture(scope="module")
def world1(hf_dirs, tmp_path_factory):
    runs = {"one": ("plain", [ACCUM2]), "one_mtp": ("mtp", [ACCUM2])}
    return run_on_ranks(_world, 1, args=(runs, hf_dirs, str(tmp_path_factory.mktemp("ds1"))), timeout=900)[0]


@pytest.mark.parametrize("layout", sorted(RUNS) + sorted(MTP_RUNS))
def test_layouts_train_like_one_process(world1, world2, layout):
    mtp = layout.startswith("mtp_")
    reference = world1["one_mtp" if mtp else "one"]
    assert len(reference["losses"]) == STEPS and reference["layers"] == [0, 1, 2, 3]
    assert reference["has_mtp"] == mtp and (reference["mtp"][0] > 0 if mtp else reference["mtp"][0] is None)
    for rank in world2:
        assert_close_trace(rank[layout]["losses"], reference["losses"], 1e-5)
        assert_close_trace(rank[layout]["norms"], reference["norms"], 1e-5)
        if mtp:  # the multi-token prediction loss, logged apart, alike too
            assert_close_trace(rank[layout]["mtp"], reference["mtp"], 1e-5)
    facts = [rank[layout] for rank in world2]
    # q_b_proj: 4 heads x (16 + 8) rows over a 32-wide q latent; kv_b_proj: 4 x (16 + 12) over 24; q_a_proj whole
    assert reference["shards"] == ((96, 32), (112, 24), (32, 64)) and reference["tokens"] == [SEQ]
    layout = layout.removeprefix("mtp_")
    if layout == "tp2_sp":
        assert {f["shards"] for f in facts} == {((48, 32), (56, 24), (32, 64))}
        assert {f["tokens"][0] for f in facts} == {SEQ // 2}
    elif layout == "pp2":
        assert [f["layers"] for f in facts] == [[0, 1], [2, 3]]
        assert [f["has_mtp"] for f in facts] == [False, mtp]  # the depth sits on the last stage
    elif layout.startswith("cp2"):
        assert {f["tokens"][0] for f in facts} == {SEQ // 2}
    elif layout.startswith("ep2"):
        assert [f["experts"] for f in facts] == [[0, 1, 2, 3], [4, 5, 6, 7]] and reference["experts"] == list(range(8))
