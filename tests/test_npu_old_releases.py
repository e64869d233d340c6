"""megacann on torch_npu / CANN releases that lack a feature its NPU route uses (the fake's ``old_api``
modes, tests/fake_torch_npu/), op by op:

- packed documents without ``actual_seq_qlen`` / ``actual_seq_kvlen`` (CANN 7.0: no TND layout either;
  8.0.RC1: TND without them) run one BSND call per document, with the outputs and gradients of the
  one-call TND path, and say so once;
- a build refusing ``npu_grouped_matmul(group_type=2)`` at run time gets the experts' weight gradients as
  one product per expert, equal to the grouped kernel's, said once and not tried again.

The whole model trained through each fallback: tests/test_npu_training.py.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from fake_torch_npu import GROUP_TYPE_2_REFUSAL, forget_npu_checks, make_fake_torch_npu
from layers_reference import rel_err

from megacann.ops import registry

NO_LENGTHS = ("cann7.0", "cann8.0.rc1")  # releases whose npu_fusion_attention takes no actual_seq_*


@pytest.fixture
def install(monkeypatch):
    """Install a fake of the named release (``False``: the newest API); undone after the test."""
    registry.configure()

    def put(old_api):
        npu = make_fake_torch_npu(old_api=old_api)
        monkeypatch.setitem(sys.modules, "torch_npu", npu)
        forget_npu_checks()
        return npu

    yield put
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    forget_npu_checks()


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megacann.ops" and "torch_npu" in r.getMessage()]


def test_each_old_release_refuses_what_it_lacks():
    q = torch.randn(6, 4, 16)
    lens = dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6])
    for old_api in NO_LENGTHS:
        attend = make_fake_torch_npu(old_api=old_api).npu_fusion_attention
        with pytest.raises(TypeError, match="actual_seq_qlen"):
            attend(q, q, q, 4, "TND", **lens)
    with pytest.raises(AssertionError, match="input_layout must be one of BSH, SBH, BSND, BNSD"):
        make_fake_torch_npu(old_api="cann7.0").npu_fusion_attention(q, q, q, 4, "TND")
    with pytest.raises(AssertionError, match="TND needs actual_seq_qlen"):
        make_fake_torch_npu(old_api="cann8.0.rc1").npu_fusion_attention(q, q, q, 4, "TND")
    assert make_fake_torch_npu().npu_fusion_attention(q, q, q, 4, "TND", **lens)[0].shape == q.shape

    x, grad = torch.randn(5, 3), torch.randn(5, 2)
    sizes = torch.tensor([2, 3])
    weight_grad = dict(group_list=sizes, split_item=3, group_type=2, group_list_type=1)
    refusing = make_fake_torch_npu(old_api="group_type_2_refused").npu_grouped_matmul
    with pytest.raises(RuntimeError, match=GROUP_TYPE_2_REFUSAL):
        refusing([x.t()], [grad], **weight_grad)
    rows = refusing([x], [torch.randn(3, 2)] * 2, group_list=sizes, split_item=2, group_type=0, group_list_type=1)
    assert rows[0].shape == (5, 2)  # group_type 0 still works
    assert make_fake_torch_npu().npu_grouped_matmul([x.t()], [grad], **weight_grad)[0].shape == (2, 3, 2)


def _packed_attention(install, old_api, **kwargs):
    """Output, q/k/v gradients and the fake's calls of one packed attention forward and backward."""
    npu = install(old_api)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    segment_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [7] * 12])
    out = registry.resolve("scaled_dot_product_attention", "npu")(q, k, v, segment_ids=segment_ids, **kwargs)
    out.backward(torch.randn(out.shape, generator=g))
    return out.detach(), [t.grad for t in (q, k, v)], npu.calls


@pytest.mark.parametrize("old_api", NO_LENGTHS)
@pytest.mark.parametrize("mask", ["causal", "full", "window"])
def test_packed_attention_without_sequence_lengths_runs_per_document(install, caplog, old_api, mask):
    caplog.set_level(logging.WARNING, logger="megacann.ops")
    kwargs = {"causal": mask != "full", "scale": 0.3, "sliding_window": 3 if mask == "window" else None}
    want, want_grads, calls = _packed_attention(install, False, **kwargs)
    assert [c.args[4] for c in calls] == ["TND"]  # the newest API: one call for the batch
    assert _fallback_lines(caplog) == []

    out, grads, calls = _packed_attention(install, old_api, **kwargs)
    layouts = [(c.args[4], tuple(c.args[0].shape)) for c in calls]
    assert layouts == [("BSND", (1, n, 4, 16)) for n in (5, 4, 3, 12)]  # one call per document, in place
    modes = {c.kwargs.get("sparse_mode") for c in calls}
    assert modes == {"causal": {2}, "full": {None}, "window": {4}}[mask]
    assert rel_err(out, want) < 1e-6
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) < 1e-6
    registry.resolve("scaled_dot_product_attention", "npu")  # asking again says nothing more
    assert _fallback_lines(caplog) == [
        "megacann.ops: scaled_dot_product_attention falls back from 'TND with actual_seq_qlen/kvlen' to one BSND "
        "call per document: torch_npu "
        + make_fake_torch_npu(old_api).__version__
        + " found, its npu_fusion_attention takes no 'actual_seq_qlen' (an older API)"
    ]


def test_the_attention_fallback_is_said_when_the_op_is_resolved(install, caplog):
    caplog.set_level(logging.WARNING, logger="megacann.ops")
    install("cann8.0.rc1")
    registry.selection("npu")  # what a run does at its start: no attention has run yet
    (line,) = _fallback_lines(caplog)
    assert "one BSND call per document" in line and "torch_npu 2.6.0" in line
    assert registry.selected("scaled_dot_product_attention", "npu") == "npu"  # unpacked batches keep the kernel


def _experts(install, old_api, backwards=1):
    """Grouped matmul forward and ``backwards`` backward passes: output, gradients, the fake's calls."""
    npu = install(old_api)
    assert registry.selected("grouped_matmul", "npu") == "torch_npu"
    g = torch.Generator().manual_seed(1)
    sizes = [3, 0, 4, 2]
    x = torch.randn(sum(sizes), 8, generator=g, requires_grad=True)
    weights = [torch.randn(5, 8, generator=g, requires_grad=True) for _ in sizes]
    for _ in range(backwards):
        out = registry.resolve("grouped_matmul", "npu")(x, weights, sizes)
        out.backward(torch.randn(out.shape, generator=g))
    return out.detach(), [x.grad, *(w.grad for w in weights)], npu.calls


def test_grouped_matmul_weight_gradient_without_group_type_2(install, caplog):
    caplog.set_level(logging.WARNING, logger="megacann.ops")
    want, want_grads, calls = _experts(install, False, backwards=2)
    assert [c.kwargs["group_type"] for c in calls] == [0, 0, 2] * 2
    out, grads, calls = _experts(install, "group_type_2_refused", backwards=2)
    # refused once (the call is recorded, then raises), never tried again: the gradient per expert
    assert [c.kwargs["group_type"] for c in calls] == [0, 0, 2, 0, 0]
    assert torch.equal(out, want)
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) < 1e-6
    (line,) = _fallback_lines(caplog)
    assert line.startswith("megacann.ops: torch_npu 2.6.0 refuses npu_grouped_matmul(group_type=2) (")
    assert line.endswith(f"{GROUP_TYPE_2_REFUSAL}): one product per expert from now on")


def test_other_grouped_matmul_errors_are_raised(install, monkeypatch):
    """Only the known refusal of group_type=2 falls back; another failure of that call is the user's to see."""
    npu = install(False)
    x = torch.randn(4, 8, requires_grad=True)
    weights = [torch.randn(5, 8, requires_grad=True) for _ in range(2)]
    out = registry.resolve("grouped_matmul", "npu")(x, weights, [1, 3])
    kernel = npu.npu_grouped_matmul

    def out_of_memory_in_the_weight_gradient(*args, **kwargs):
        if kwargs["group_type"] == 2:
            raise RuntimeError("aclnnGroupedMatmul failed: out of memory")
        return kernel(*args, **kwargs)

    monkeypatch.setattr(npu, "npu_grouped_matmul", out_of_memory_in_the_weight_gradient)
    with pytest.raises(RuntimeError, match="out of memory"):
        out.sum().backward()
    assert [c.kwargs["group_type"] for c in npu.calls] == [0, 0]  # forward, input gradient (the kernel)
