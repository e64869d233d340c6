"""Checkpoints: save, find and load the full training state of every rank."""

from megacann.checkpoint.files import find_resume_checkpoint, latest_checkpoint, list_complete_checkpoints
from megacann.checkpoint.state import load_checkpoint, save_checkpoint

__all__ = [
    "find_resume_checkpoint",
    "latest_checkpoint",
    "list_complete_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
