"""Qwen3-Next started from a Hugging Face checkpoint (``model.init_from``, written by transformers, its DeltaNet
projections fused per key head) trains alike under tensor + sequence parallelism, expert parallelism,
pipeline stages and context parallelism with each attention algorithm, as on one process (gloo, CPU,
fp32): losses and gradient norms to 1e-5 relative, with the probes of the Qwen3.5 families
(:mod:`test_qwen3_5_parallel`: heads per TP rank, tokens per rank under SP and CP, each layer kind's
context-parallel algorithm and group, the layers of each stage, the experts of each EP rank) and the
dense layer of ``mlp_only_layers`` split by TP. The one-process model's logits before training equal
transformers'. Two spawns: world 2 runs the layouts, world 1 the one-process reference."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from qwen3_next_helpers import hf_next_logits, tiny_hf_qwen3_next
from test_qwen3_5_parallel import IDS, MOE_LAYOUTS, _check_layout, _run

pytestmark = pytest.mark.extended  # a slow multi-rank check: `make test-extended` runs it

MOE = ("MoELayer", 0)
# The weights are drawn at 0.03: at Qwen3.5-MoE's 0.05 the third step's gradient norm moved by 8e-6 (tp 2 + SP)
# to 1.1e-5 (cp 2) from one process's, the same under every layout, rounding grown by Adam's first steps
# (measured); at 0.03 every layout stays within 6e-7
WEIGHT_STD = 0.03


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    hf_dir = tiny_hf_qwen3_next(str(tmp_path_factory.mktemp("qwen3_next_hf") / "hf"), std=WEIGHT_STD)
    root = str(tmp_path_factory.mktemp("qwen3_next_runs"))
    one = run_on_ranks(_run, 1, args=(("one",), hf_dir, root + "/w1", "qwen3_next"), timeout=600)[0]["one"]
    return hf_dir, one, run_on_ranks(_run, 2, args=(MOE_LAYOUTS, hf_dir, root + "/w2", "qwen3_next"), timeout=900)


def test_init_from_gives_transformers_logits(runs):
    hf_dir, one, _ = runs
    torch.testing.assert_close(one["logits"], hf_next_logits(hf_dir, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_layouts_train_like_one_process(runs, layout):
    facts = _check_layout(runs, layout)
    assert runs[1]["experts"] == [0, 1, 2, 3]
    assert runs[1]["mlps"] == {0: MOE, 1: ("SwiGLUMLP", 80), 2: MOE, 3: MOE}  # mlp_only_layers [1], width 40
    if layout == "tp2_sp":  # the dense layer's MLP split too
        assert {f["mlps"][1] for f in facts} == {("SwiGLUMLP", 40)}
    if layout == "ep2":  # two experts per rank
        assert [f["experts"] for f in facts] == [[0, 1], [2, 3]]
