"""Where a pipeline's model chunks sit: the one object the partitioner, the executor and the simulator ask.

The model is cut into ``stages x chunks`` segments in model order. Two placements exist:

- :data:`LOOP` (1F1B, interleaved 1F1B, zb1p): chunk c of stage s is segment ``c * stages + s``; a
  micro-batch loops through the stages once per chunk, so stage 0's chunk 0 takes the model's input and
  the last stage's last chunk holds the head and the loss;
- :data:`V` (zbv, dualpipev): two chunks per stage, chunk 0 of stage s is segment s and chunk 1 segment
  ``2 * stages - 1 - s``. The model goes down the stages through chunk 0 and back up through chunk 1, so
  stage 0 holds both the embedding and the head; on the last stage chunk 0 hands its output to chunk 1 in
  place (and chunk 1 its input gradient back to chunk 0), and each chunk talks over its own communication
  lane (:mod:`megacann.pipeline.overlap`).
"""

from __future__ import annotations

from typing import Optional

from megacann.pipeline.actions import ACTIVATION


class Placement:
    """The loop placement; :class:`VPlacement` overrides what the V changes."""

    kind = "loop"
    fixed_chunks: Optional[int] = None  # chunks per stage whatever virtual_pipeline_size says (None: it decides)
    chunk_time_fraction = 1.0  # a chunk's share of a stage's compute time, relative to one whole stage

    def chunks(self, virtual_size: Optional[int]) -> int:
        """Model chunks per stage for ``distributed.virtual_pipeline_size``."""
        return self.fixed_chunks or virtual_size or 1

    def segment(self, stages: int, stage: int, chunk: int, chunks: int) -> int:
        """The model segment (0 .. stages x chunks - 1, in model order) that ``chunk`` of ``stage`` holds."""
        return chunk * stages + stage

    def is_model_first(self, stage: int, chunk: int) -> bool:
        """The chunk takes the model's input (holds the embedding)."""
        return stage == 0 and chunk == 0

    def is_model_last(self, stages: int, stage: int, chunk: int, chunks: int) -> bool:
        """The chunk holds the head and computes the loss."""
        return stage == stages - 1 and chunk == chunks - 1

    def loss_stage(self, stages: int) -> int:
        """The stage whose last chunk holds the head."""
        return stages - 1

    def producer(self, stages: int, stage: int, chunk: int, kind: str) -> tuple[int, int]:
        """(stage, chunk) whose output feeds ``chunk`` of ``stage`` (kind ACTIVATION) or whose input
        gradient it receives (GRADIENT)."""
        if kind == ACTIVATION:
            return (stage - 1, chunk) if stage > 0 else (stages - 1, chunk - 1)
        return (stage + 1, chunk) if stage < stages - 1 else (0, chunk + 1)

    def local_handoff(self, stages: int, stage: int, chunk: int, kind: str) -> bool:
        """Whether the chunk's output (ACTIVATION) or input gradient (GRADIENT) stays on this stage,
        handed to its other chunk in place instead of sent."""
        return False

    def lane(self, chunk: int) -> int:
        """The communication lane the chunk's actions run on."""
        return 0

    def __repr__(self) -> str:
        return f"<{self.kind} placement>"


class VPlacement(Placement):
    """Two chunks per stage in a V (see the module docstring)."""

    kind = "v"
    fixed_chunks = 2
    chunk_time_fraction = 0.5  # each of the V's two chunks holds half of a stage's layers

    def segment(self, stages: int, stage: int, chunk: int, chunks: int) -> int:
        if chunks != 2:
            raise ValueError(f"the V placement holds two chunks per stage, got virtual_size {chunks}")
        return stage if chunk == 0 else 2 * stages - 1 - stage

    def is_model_last(self, stages: int, stage: int, chunk: int, chunks: int = 2) -> bool:
        return stage == 0 and chunk == 1

    def loss_stage(self, stages: int) -> int:
        return 0

    def producer(self, stages: int, stage: int, chunk: int, kind: str) -> tuple[int, int]:
        sender = 0 if kind == ACTIVATION else 1  # the chunk whose results travel down the stages
        if chunk == sender:
            return stage - 1, sender
        return (stage, sender) if stage == stages - 1 else (stage + 1, chunk)

    def local_handoff(self, stages: int, stage: int, chunk: int, kind: str) -> bool:
        return stage == stages - 1 and chunk == (0 if kind == ACTIVATION else 1)

    def lane(self, chunk: int) -> int:
        return chunk


LOOP = Placement()
V = VPlacement()
# set by build_model_chunks on each chunk: its placement's kind ("loop" or "v"), for code that runs the
# chunks outside a schedule (the generator: megacann.generation.pipeline_stages)
PLACEMENT_ATTR = "_megacann_pipeline_placement"
