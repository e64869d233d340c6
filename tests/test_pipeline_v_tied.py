"""Tied embeddings and multi-token prediction under the V schedules (zbv, dualpipev). Stage 0 holds the
embedding (chunk 0) and its copies in chunk 1 (the tied head's ``lm_head.weight``, MTP's
``mtp_embed_tokens.weight``): separate parameters, whose gradients that rank sums itself before the
optimizer. Each run equals one process (loss and gradient-norm traces 1e-5, equal lengths; weights 1e-4),
follows its plan, and ends with every copy bitwise equal to the embedding; dualpipev's pairs ran at once.

All ``extended`` (the default tier trains dualpipev with tied embeddings and MTP in
tests/test_pipeline_v_training.py): pp 2 zbv and dualpipev tied, dualpipev MoE with one MTP depth, zbv
with MTP, bf16 tied against fp32; dp 2 with ZeRO-1, 2 and 3; a bit-for-bit resume of dualpipev tied with
dropout, whose Hugging Face directory holds one embedding. Machinery shared with the zero-bubble tests."""

import json
import os

import pytest
import test_pipeline_zero_bubble_training as zb
import torch
from test_checkpoint_resume import STEPS as RESUME_STEPS
from test_checkpoint_resume import _check as check_resumed
from test_pipeline_dualpipev_overlap import check_pairs_ran_at_once
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended

PP2, M2, M4, M8, TIED = zb.PP2, zb.M2, zb.M4, "optim.grad_accum_steps=8", zb.TIED
ZBV, DUALPIPEV = "distributed.pipeline_schedule=zbv", "distributed.pipeline_schedule=dualpipev"
MTP1 = "model.mtp_num_layers=1"
MOE4 = [*zb.MOE, "model.num_layers=4"]  # four blocks for the V of pp 2
COPIES = ("lm_head.weight", "mtp_embed_tokens.weight")  # chunk 1's copies of embed_tokens.weight
for name, overrides in {
    "tied_m4": [M4, TIED],
    "tied_mtp_m8": [M8, TIED, MTP1],
    "mtp_m4": [M4, MTP1],
    "moe4_mtp_m4": [M4, *MOE4, MTP1],
}.items():
    zb.REFERENCES.setdefault(name, overrides)

WORLD2 = {  # (overrides, one-process reference)
    "pp2_zbv_tied": ([PP2, ZBV, M4, TIED], "tied_m4"),
    "pp2_dualpipev_tied": ([PP2, DUALPIPEV, M4, TIED], "tied_m4"),
    "pp2_dualpipev_moe_mtp": ([PP2, DUALPIPEV, M4, *MOE4, MTP1], "moe4_mtp_m4"),
    "pp2_zbv_mtp": ([PP2, ZBV, M4, MTP1], "mtp_m4"),
}
BF16 = {"pp2_zbv_tied_bf16": [PP2, ZBV, M4, TIED, "model.precision=bf16"]}  # against fp32 "tied_m4", loosely
ZERO = "distributed.zero_optimization"
WORLD4 = {
    "pp2_zbv_dp2_zero2_tied": ([PP2, ZBV, M2, TIED, f"{ZERO}=2", "distributed.overlap_grad_reduce=true"], "tied_m4"),
    "pp2_dualpipev_dp2_zero1_tied_mtp": ([PP2, DUALPIPEV, M4, TIED, MTP1, f"{ZERO}=1"], "tied_mtp_m8"),
    "pp2_zbv_dp2_zero3_tied": ([PP2, ZBV, M2, TIED, f"{ZERO}=3"], "tied_m4"),
}
# resumed bit for bit through test_checkpoint_resume's matrix (dropout on); its last step writes hf_<steps>
RESUME = {"pp2_dualpipev_tied": [PP2, DUALPIPEV, M4, TIED, f"logging.hf_save_interval={RESUME_STEPS}"]}


def _split_copies(got: dict, ref: dict) -> dict:
    """``got`` without chunk 1's copies of the embedding, the names the one-process run ``ref`` lacks (its
    tied head reads the embedding; its MTP too), each checked bitwise equal to it after the last step."""
    params = dict(got["params"])
    held = {name for run in ref["runs"] for name in run["params"] or {}}
    copies = [name for name in COPIES if name in params and name not in held]
    assert copies, sorted(params)
    for name in copies:
        assert torch.equal(params.pop(name), params["embed_tokens.weight"]), name
    return {**got, "params": params}


def _check_v_run(got: dict, entry: tuple, references: dict) -> None:
    """Equal to one process, its plan followed, each copy on the rank of the embedding (stage 0) and tied."""
    holders = 0
    for run in got["runs"]:
        names = run["params"] or {}
        assert ("embed_tokens.weight" in names) == any(c in names for c in COPIES), sorted(names)
        holders += "embed_tokens.weight" in names
    assert holders > 0
    zb._check_run(_split_copies(got, references[entry[1]]), entry, references, split=True)
    overrides = entry[0]
    if DUALPIPEV in overrides:  # its pairs ran at once (distributed.dualpipev_overlap auto), on every rank
        from megacann.pipeline.v_schedules import dualpipev_pairs

        m = int(dict(o.split("=", 1) for o in overrides)["optim.grad_accum_steps"])
        per_stage = len(got["runs"]) // 2  # pp 2, stage-major ranks
        for rank, run in enumerate(got["runs"]):
            check_pairs_ran_at_once(run["probe"], len(dualpipev_pairs(2, rank // per_stage, m)))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    runs = {**WORLD2, **{name: (overrides, None) for name, overrides in BF16.items()}}
    root = str(tmp_path_factory.mktemp("vtie2"))
    return (*zb._layouts(2, runs, RESUME, root), root)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    names = {ref for _, ref in [*WORLD2.values(), *WORLD4.values()]}
    return zb._references(names, str(tmp_path_factory.mktemp("vtieref")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return zb._layouts(4, WORLD4, {}, str(tmp_path_factory.mktemp("vtie4")))[0]


@pytest.mark.parametrize("layout", sorted(WORLD2))
def test_v_schedules_with_tied_embeddings_or_mtp_match_one_process(world2, reference, layout):
    got = world2[0][layout]
    assert len(got["losses"]) == len(got["norms"]) == len(reference[WORLD2[layout][1]]["losses"]) == zb.STEPS
    _check_v_run(got, WORLD2[layout], reference)


@pytest.mark.parametrize("layout", sorted(WORLD4))
def test_v_schedules_tied_under_zero_match_one_process(world4, reference, layout):
    _check_v_run(world4[layout], WORLD4[layout], reference)


def test_bf16_v_schedule_with_tied_embeddings_trains_like_fp32_and_stays_tied(world2, reference):
    got = world2[0]["pp2_zbv_tied_bf16"]
    _split_copies(got, reference["tied_m4"])  # the copy bitwise equal to the embedding after the bf16 steps
    assert len(got["losses"]) == zb.STEPS
    assert_close_trace(got["losses"], reference["tied_m4"]["losses"], 2e-2)
    assert got["losses"][-1] < got["losses"][0]
    zb._check_trace(got, split=True)


def test_dualpipev_tied_resumes_bit_for_bit_and_exports_one_embedding(world2):
    resumed, root = world2[1], world2[2]
    check_resumed(resumed, "pp2_dualpipev_tied")
    weights = resumed["pp2_dualpipev_tied"]["weights"]
    assert torch.equal(weights["lm_head.weight"], weights["embed_tokens.weight"])
    hf = f"hf_{RESUME_STEPS}"
    assert hf in resumed["pp2_dualpipev_tied"]["final"]
    from safetensors.torch import load_file

    directory = os.path.join(root, "pp2_dualpipev_tied", "stopped", hf)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in tensors
    assert torch.equal(tensors["model.embed_tokens.weight"], weights["embed_tokens.weight"].to(torch.float32))
