"""Every plan of every schedule, pinned: the plans of p 1-5 stages and 1-12 micro-batches, for each schedule
name, each virtual size its builder takes, training and forward only, are written as one canonical text
whose sha256 is recorded here. A refactor of the schedules' code must leave every plan byte-identical;
a changed plan (one action moved, one transfer renamed) changes the digest. A layout a schedule refuses
(interleaved micro-batches not a multiple of the stages, dualpipev under 2p) is recorded by its message."""

from __future__ import annotations

import hashlib

from megacann.pipeline.plan import build_plan

# (schedule, virtual sizes its builder takes); None picks 1F1B or interleaved from the virtual size
CASES = (
    (None, (None, 1, 2, 3, 4)),
    ("1f1b", (None, 1)),
    ("interleaved", (2, 3, 4)),
    ("zb1p", (None, 1)),
    ("zbv", (None, 1, 2)),
    ("dualpipev", (None, 1, 2)),
)
STAGES = range(1, 6)
MICRO_BATCHES = range(1, 13)
DIGEST = "02145506513509736611f296ee0111ba6aaae960ca2bbb4256de9bfe9d0ed689"


def plans_text() -> str:
    """The canonical text of every plan: a header line per (schedule, p, v, m, forward only, stage), then
    the plan's actions, one ``repr`` a line, or the builder's refusal."""
    lines = []
    for schedule, virtual_sizes in CASES:
        for p in STAGES:
            for v in virtual_sizes:
                for m in MICRO_BATCHES:
                    for forward_only in (False, True):
                        for stage in range(p):
                            lines.append(f"# {schedule} p={p} v={v} m={m} forward_only={forward_only} stage={stage}")
                            try:
                                plan = build_plan(p, stage, m, v, forward_only, schedule)
                            except ValueError as error:
                                lines.append(f"refused: {error}")
                                continue
                            lines += [repr(action) for action in plan]
    return "\n".join(lines) + "\n"


def test_every_plan_is_the_recorded_one():
    text = plans_text()
    assert hashlib.sha256(text.encode()).hexdigest() == DIGEST, (
        "a schedule's plan changed: every plan must stay as recorded (write plans_text() to a file before "
        "and after the change and diff the two to see which)"
    )


def test_the_text_covers_every_schedule_and_refusal():
    """The digest is of real plans: every schedule appears, with transfers, split backwards and refusals."""
    text = plans_text()
    for needle in (
        "# zbv p=5 v=2 m=12 forward_only=False stage=4",
        "BackwardWeight(chunk=1, micro_batch=11)",
        "VExchange(transfers=(Transfer(peer=1, send=True, kind='activation', chunk=0)",
        "Exchange(send_forward=True, send_backward=True, recv_forward=1, recv_backward=0)",
        "refused: the interleaved 1F1B schedule (virtual_pipeline_size 3)",
        "refused: distributed.pipeline_schedule 'dualpipev' needs at least 2 x pipeline_parallel_size = 10",
    ):
        assert needle in text, needle
