"""MoE under context parallelism trains like one process, auxiliary losses included: the load-balancing and
z-losses are taken over the whole sequence (token counts and loss shares summed over the cp group), so the
logged values and the loss trace equal one process's (fp32, relative 1e-5)."""

import pytest
from layout_fuzz import MOE, Layout, compare

AUX = [*MOE, "model.moe_aux_loss_coeff=1e-2", "model.num_layers=2"]
CP2 = "distributed.context_parallel_size=2"


def _assert_equal_to_one_process(layouts):
    problems = {name: found for name, found in compare(layouts).items() if found}
    assert not problems, problems


def test_moe_auxiliary_losses_over_the_whole_sequence_at_cp2():
    _assert_equal_to_one_process([Layout(0, 2, AUX, [CP2], steps=3, label="moe_cp2_ring")])


@pytest.mark.extended
def test_moe_auxiliary_losses_at_cp2_with_tp_ep_and_ulysses():
    layouts = [
        Layout(
            0,
            4,
            AUX,
            [CP2, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
            label="tp2_sp_cp2",
        ),
        Layout(0, 4, AUX, [CP2, "distributed.expert_parallel_size=2"], dp=2, label="cp2_dp2_ep2"),
        Layout(
            0,
            4,
            AUX,
            [CP2, "distributed.context_parallel_algo=ulysses", "distributed.zero_optimization=1"],
            dp=2,
            label="ulysses_zero1",
        ),
    ]
    _assert_equal_to_one_process(layouts)
