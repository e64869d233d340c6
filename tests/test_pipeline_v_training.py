"""The V-shaped schedules (zbv, dualpipev) train exactly as one process and each rank executes its plan
exactly (the forwards, B, W, fused backwards and V transfers recorded by ``run_plan(trace=...)``); the V
placement is really on: stage 0 holds the embedding, the first and the last layer block and the head.

pp 2 with uneven layer blocks is the default tier, both with tied embeddings and one multi-token prediction
depth (the tied head's copy of the embedding and MTP sit in stage 0's chunk 1, the embedding in its chunk 0;
one reference for both); pp 4 and the combinations with TP + SP, dp + ZeRO-1,
context parallelism (zbv with recompute; dualpipev with its pairs at once), MoE with expert parallelism, LoRA, and bit-for-bit resume are
``extended``. Machinery shared with the zero-bubble tests (test_pipeline_zero_bubble_training)."""

import re

import pytest
import test_pipeline_zero_bubble_training as zb
from test_pipeline_dualpipev_overlap import check_pairs_ran_at_once

PP2, PP4 = zb.PP2, zb.PP4
ZBV, DUALPIPEV = "distributed.pipeline_schedule=zbv", "distributed.pipeline_schedule=dualpipev"
M2, M4, M8 = zb.M2, zb.M4, "optim.grad_accum_steps=8"
SMALL = ["model.num_layers=5", "model.hidden_size=32", "model.ffn_hidden_size=64", "data.seq_length=16"]
TIED_MTP = [zb.TIED, "model.mtp_num_layers=1"]
zb.REFERENCES.setdefault("small_tied_mtp_m4", [M4, *SMALL, *TIED_MTP])
zb.REFERENCES.setdefault("m8", [M8])  # one-process references of the dp 2 runs below
MOE4 = [*zb.MOE, "model.num_layers=4"]  # four blocks for the V of pp 2
zb.REFERENCES.setdefault("moe4_m4", [M4, *MOE4])
zb.REFERENCES.setdefault("moe4_m8", [M8, *MOE4])
zb.REFERENCES.setdefault("l8_m8", [M8, "model.num_layers=8"])

WORLD2 = {  # (overrides, reference); blocks [1,2,1,1] in model order: stage 0 holds layers 0 and 4
    "pp2_zbv_uneven_tied_mtp": (
        [PP2, ZBV, M4, *SMALL, *TIED_MTP, "distributed.pipeline_layers=[1,2,1,1]"],
        "small_tied_mtp_m4",
    ),
    "pp2_dualpipev_uneven_tied_mtp": (
        [PP2, DUALPIPEV, M4, *SMALL, *TIED_MTP, "distributed.pipeline_layers=[2,1,1,1]"],
        "small_tied_mtp_m4",
    ),
}
# which layers each stage's two chunks hold (chunk 0: block s, chunk 1: block 2p - 1 - s)
PLACED = {"pp2_zbv_uneven_tied_mtp": [[0, 4], [1, 2, 3]], "pp2_dualpipev_uneven_tied_mtp": [[0, 1, 4], [2, 3]]}
TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
WORLD4 = {
    "pp4_zbv": ([PP4, ZBV, M4, "model.num_layers=8"], "l8_m4"),
    "pp4_dualpipev": ([PP4, DUALPIPEV, M8, "model.num_layers=8"], "l8_m8"),
    "pp2_zbv_tp2_sp": ([PP2, ZBV, M4, *TP2_SP], "m4"),
    "pp2_dualpipev_tp2_sp": ([PP2, DUALPIPEV, M4, *TP2_SP], "m4"),
    "pp2_zbv_dp2_zero1": ([PP2, ZBV, M2, "distributed.zero_optimization=1"], "m4"),
    "pp2_dualpipev_dp2_zero1": ([PP2, DUALPIPEV, M4, "distributed.zero_optimization=1"], "m8"),
    "pp2_zbv_cp2_recompute": (
        [PP2, ZBV, M4, "distributed.context_parallel_size=2", "model.activation_checkpointing=full"],
        "m4",
    ),
    "pp2_dualpipev_cp2": ([PP2, DUALPIPEV, M4, "distributed.context_parallel_size=2"], "m4"),  # pairs at once
    "pp2_zbv_moe_ep2": ([PP2, ZBV, M2, *MOE4, "distributed.expert_parallel_size=2"], "moe4_m4"),
    "pp2_dualpipev_moe_ep2": ([PP2, DUALPIPEV, M4, *MOE4, "distributed.expert_parallel_size=2"], "moe4_m8"),
    "pp2_zbv_lora_tp2": ([PP2, ZBV, M4, *zb.LORA, "distributed.tensor_parallel_size=2"], "lora_m4"),
}
zb.REFERENCES.setdefault("l8_m4", [M4, "model.num_layers=8"])
# saved and resumed through test_checkpoint_resume's matrix (with dropout: every RNG stream restored)
RESUME_WORLD4 = {
    "pp4_zbv": [PP4, ZBV, M4, "model.num_layers=8"],
    "pp2_dualpipev_dp2_zero1": [PP2, DUALPIPEV, M4, "distributed.zero_optimization=1"],
}


def _check_v_placement(got: dict, layers: list[list[int]], mtp: bool = False) -> None:
    """Each stage holds exactly its V blocks: stage 0 the embedding and the head as well (and the MTP
    depths with ``mtp``; a tied head there is a copy of its own, checked equal by the parity check)."""
    for stage, run in enumerate(got["runs"]):
        names = run["params"]  # every rank of a pp 2 world owns its weights
        held = sorted({int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))})
        assert held == layers[stage], (stage, held)
        assert ("embed_tokens.weight" in names) == (stage == 0)
        assert ("lm_head.weight" in names) == (stage == 0)
        assert any(n.startswith("mtp.layers.0.") for n in names) == (mtp and stage == 0), stage
        chunks_run = {a.chunk for a in run["trace"] if type(a).__name__ == "Forward"}
        assert chunks_run == {0, 1}, stage


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return zb._layouts(2, WORLD2, {}, str(tmp_path_factory.mktemp("v2")))[0]


@pytest.fixture(scope="module")
def reference2(tmp_path_factory):
    return zb._references(["small_tied_mtp_m4"], str(tmp_path_factory.mktemp("vref2")))


@pytest.mark.parametrize("layout", sorted(WORLD2))
def test_pp2_v_schedule_uneven_matches_one_process_and_follows_its_plan(world2, reference2, layout):
    got = world2[layout]
    assert len(got["losses"]) == len(got["norms"]) == len(reference2[WORLD2[layout][1]]["losses"]) == zb.STEPS
    zb._check_run(got, WORLD2[layout], reference2, split=True)  # both split backwards (dualpipev: zero-bubble phases)
    _check_v_placement(got, PLACED[layout], mtp="mtp" in layout)
    if "dualpipev" in layout:  # its pairs ran at once (distributed.dualpipev_overlap auto)
        from megacann.pipeline.v_schedules import dualpipev_pairs

        for stage, run in enumerate(got["runs"]):
            check_pairs_ran_at_once(run["probe"], len(dualpipev_pairs(2, stage, 4)))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return zb._layouts(4, WORLD4, RESUME_WORLD4, str(tmp_path_factory.mktemp("v4")))


@pytest.fixture(scope="module")
def reference4(tmp_path_factory):
    return zb._references({ref for _, ref in WORLD4.values()}, str(tmp_path_factory.mktemp("vref4")))


@pytest.mark.extended
@pytest.mark.parametrize("layout", sorted(WORLD4))
def test_extended_v_layouts_match_one_process_and_follow_their_plans(world4, reference4, layout):
    got = world4[0][layout]
    zb._check_run(got, WORLD4[layout], reference4, split=True)
    if "dualpipev" in layout:  # its pairs ran at once (distributed.dualpipev_overlap auto), on every rank
        from megacann.pipeline.v_schedules import dualpipev_pairs

        m = int(dict(o.split("=", 1) for o in WORLD4[layout][0])["optim.grad_accum_steps"])
        pp = got["runs"][0]["sizes"]["pipeline_parallel_size"]
        for rank, run in enumerate(got["runs"]):
            check_pairs_ran_at_once(run["probe"], len(dualpipev_pairs(pp, rank // (4 // pp), m)))


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(RESUME_WORLD4))
def test_extended_v_schedules_resume_bit_for_bit(world4, name):
    zb._check_resume(world4[1], name)
