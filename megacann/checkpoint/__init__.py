"""Checkpoints: the training state of every rank, given as explicit parts, saved atomically, loadable
under any layout.

On disk a checkpoint is a torch.distributed.checkpoint (DCP) directory of whole, layout-free tensors
(``model/<name>``, ``optim/<name>/<state>``) plus ``megacann.json`` and the resolved recipe; see
docs/checkpoints.md. Weights going in and out of other formats (Hugging Face, consolidated, PEFT) are
:mod:`megacann.interop`'s.
"""

from megacann.checkpoint.checkpointer import Checkpointer
from megacann.checkpoint.files import find_resume_checkpoint, latest_checkpoint, list_complete_checkpoints
from megacann.checkpoint.metadata import CheckpointError, read_info
from megacann.checkpoint.state import CheckpointFiles, CheckpointParts

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointParts",
    "Checkpointer",
    "find_resume_checkpoint",
    "latest_checkpoint",
    "list_complete_checkpoints",
    "read_info",
]
