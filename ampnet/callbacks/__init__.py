"""ampnet's callbacks: skorch callbacks that know about mixed precision."""

from ampnet.callbacks.monitoring import AmpMonitor
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState, TrainEndCheckpoint

__all__ = ["AmpMonitor", "Checkpoint", "LoadInitState", "TrainEndCheckpoint"]
