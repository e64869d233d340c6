"""Checkpoints: the training state of every rank, given as explicit parts, saved atomically, loadable
under any layout.

On disk a checkpoint is a torch.distributed.checkpoint (DCP) directory of whole, layout-free tensors
(``model/<name>``, ``optim/<name>/<state>``) plus ``megacann.json`` and the resolved recipe; see
docs/checkpoints.md.
"""

from megacann.checkpoint.checkpointer import Checkpointer
from megacann.checkpoint.files import find_resume_checkpoint, latest_checkpoint, list_complete_checkpoints
from megacann.checkpoint.metadata import CheckpointError, read_info
from megacann.checkpoint.state import CheckpointParts

__all__ = [
    "CheckpointError",
    "CheckpointParts",
    "Checkpointer",
    "find_resume_checkpoint",
    "latest_checkpoint",
    "list_complete_checkpoints",
    "read_info",
]
