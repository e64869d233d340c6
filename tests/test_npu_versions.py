"""The torch_npu and CANN versions scripts/check_env.py judges (megacann/env_report.py): the minimums
megacann states (megacann.ops.npu_api, docs/operations.md) and what each older CANN lacks."""

import pytest

from megacann.env_report import cann_release, cann_verdict, torch_npu_verdict
from megacann.ops.npu_api import MINIMUM_CANN, MINIMUM_TORCH_NPU


def test_cann_versions_sort_in_release_order():
    order = ["7.0.RC1", "7.0.0", "7.0", "8.0.RC1", "8.0.RC2", "8.0.RC3", "8.0.0", "8.1.RC1", "8.3.RC1", "8.5.0"]
    assert sorted(order, key=cann_release) == order
    assert cann_release("8.0.rc1") == cann_release("8.0.RC1")


def test_the_minimum_cann_and_what_older_ones_lack():
    assert (MINIMUM_CANN, MINIMUM_TORCH_NPU) == ("8.3.RC1", "2.7.1")
    for fine in ("8.3.RC1", "8.5.0", "9.1.0"):
        assert cann_verdict(fine) == "ok"
    no_lengths = "npu_fusion_attention has no actual_seq_qlen/actual_seq_kvlen: packed documents run one attention"
    assert cann_verdict("8.2.RC1") == "too old: megacann is meant for CANN >= 8.3.RC1"
    rc1 = cann_verdict("8.0.RC1")
    assert rc1.startswith("too old: megacann is meant for CANN >= 8.3.RC1; this one: " + no_lengths)
    assert "TND" not in rc1
    for seven in ("7.0.RC1", "7.0.0"):
        assert cann_verdict(seven) == (
            "too old: megacann is meant for CANN >= 8.3.RC1; this one: npu_fusion_attention has no TND layout; "
            + no_lengths
            + " call per document"
        )
    assert cann_verdict(None).startswith("source CANN's set_env.sh")
    assert cann_verdict("unknown") == "unrecognised version (megacann is meant for CANN >= 8.3.RC1)"


@pytest.mark.parametrize(
    "npu, torch_version, verdict",
    [
        ("2.7.1", "2.7.1", "matches torch"),
        ("2.7.1.post2", "2.7.1+cpu", "matches torch"),
        ("2.1.0.post13", "2.1.0", "too old: megacann needs torch_npu >= 2.7.1"),
        ("2.8.0", "2.7.1", "mismatch: torch_npu 2.8.0 is built for another torch than 2.7.1"),
    ],
)
def test_torch_npu_verdicts(npu, torch_version, verdict):
    assert torch_npu_verdict(npu, torch_version) == verdict


def test_check_env_reports_an_old_torch_npu_and_cann(monkeypatch):
    """What check_env.py prints (environment_report's software lines) for torch_npu 2.1.0 on CANN 8.0.RC1."""
    from megacann import env_report

    installed = {"torch_npu": "2.1.0.post13"}
    monkeypatch.setattr(env_report, "_package_version", lambda name: installed.get(name))
    monkeypatch.setattr(env_report, "cann_version", lambda: "8.0.RC1")
    lines = {item.name: item.line() for item in env_report.software_items()}
    assert lines["torch_npu"] == "torch_npu      2.1.0.post13  [too old: megacann needs torch_npu >= 2.7.1]"
    assert lines["CANN"].startswith(
        "CANN           8.0.RC1  [too old: megacann is meant for CANN >= 8.3.RC1; this one: "
    )
