"""Trained parity under every instruction-set variant of the C++ kernel loops this machine runs
(megacann/ops/isa.py: baseline, avx2 and, where the CPU has it, avx512, which the automatic choice leaves
out): layouts trained on 2 gloo ranks equal one process (fp32, relative 1e-5) with every op the kernels
serve run by the chosen variant, in the ranks and in the one-process run alike."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from layout_fuzz import MOE, Layout, check_layout, run_layouts

from megacann.ops import cpp, isa

pytestmark = pytest.mark.extended

TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
LAYOUTS = [
    Layout(0, 2, ["model.num_layers=2"], TP2_SP, packed=True, label="llama_tp2_sp_packed"),
    Layout(
        0, 2, [*MOE, "model.num_layers=2", "model.moe_aux_loss_coeff=1e-2"],
        ["distributed.expert_parallel_size=2", "distributed.zero_optimization=1"], dp=2, label="moe_ep2_zero1",
    ),
]  # fmt: skip
VARIANTS = isa.built_variants() if cpp.available() else ()


def _under(variant: str, reference: bool) -> dict:
    """run_layouts with the kernels' loops of ``variant``; what ran is returned beside the traces."""
    from megacann.ops import registry

    with isa.use(variant):
        results = run_layouts(LAYOUTS, reference)
        ran = {"isa": isa.current(), "rms_norm": registry.selected("rms_norm", "cpu")}
    return {"results": results, "ran": ran}


@pytest.mark.parametrize("variant", VARIANTS)
def test_layouts_train_like_one_process_under_each_variant(variant):
    got = run_on_ranks(_under, 2, args=(variant, False), timeout=600)
    ref = run_on_ranks(_under, 1, args=(variant, True), timeout=600)[0]
    for ran in [r["ran"] for r in got] + [ref["ran"]]:
        assert ran == {"isa": variant, "rms_norm": "cpp"}, ran  # the C++ kernels, this variant's loops
    problems = {
        layout.name: check_layout(layout, got[0]["results"][layout.name], ref["results"][layout.name])
        for layout in LAYOUTS
    }
    assert not any(problems.values()), problems
