"""Checkpoint files and resuming from them: atomic saves, safe loads, and a linear-time, transactional
``load_state_dict`` that places every entry where a fresh optimizer would keep it."""

from ._files import CheckpointError, UnsafeCheckpointError, load, save
from ._resume import load_state_dict

__all__ = ["save", "load", "load_state_dict", "CheckpointError", "UnsafeCheckpointError"]
