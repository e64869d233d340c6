"""The custom-model example in docs/layers.md runs, as written, on one and on two TP ranks, and both
give the same losses."""

from __future__ import annotations

import pathlib
import re

import pytest
from dist_harness import run_on_ranks

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "layers.md"


def doc_code() -> str:
    """Every ```python block of the document, in order."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, f"no python code block in {DOC}"
    return "\n".join(blocks)


def _run_doc_example() -> list[float]:
    namespace = {"__name__": "docs_layers_example"}
    exec(compile(doc_code(), str(DOC), "exec"), namespace)
    return namespace["main"]()


@pytest.mark.extended
def test_doc_example_same_loss_on_one_and_two_ranks():
    one = run_on_ranks(_run_doc_example, world_size=1, timeout=180)[0]
    two = run_on_ranks(_run_doc_example, world_size=2, timeout=180)
    assert len(one) == 3 and one[-1] < one[0], one  # it trains
    for rank_losses in two:
        assert len(rank_losses) == len(one), (rank_losses, one)
        for a, b in zip(rank_losses, one):
            assert abs(a - b) <= 1e-5 * abs(b), (rank_losses, one)
