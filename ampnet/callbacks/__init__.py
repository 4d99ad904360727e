"""ampnet's callbacks: skorch callbacks that know about mixed precision."""

from ampnet.callbacks.monitoring import AmpMonitor

__all__ = ["AmpMonitor"]
