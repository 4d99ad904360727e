"""Kept for ``from ampnet.checkpoint import Checkpoint, LoadInitState``; the
callbacks live in :mod:`ampnet.callbacks.checkpoint`."""

from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState, TrainEndCheckpoint

__all__ = ["Checkpoint", "TrainEndCheckpoint", "LoadInitState"]
