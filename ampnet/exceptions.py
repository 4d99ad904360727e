"""Exceptions and warnings raised by ampnet."""

from skorch.exceptions import SkorchException

__all__ = ["AmpWarning", "AmpDivergenceError", "AmpStateError"]


class AmpWarning(UserWarning):
    """Mixed precision was requested but brings no benefit, or something
    was adapted that the user should know about (never silently)."""


class AmpDivergenceError(SkorchException, RuntimeError):
    """Training stopped because too many optimizer steps in a row were
    skipped for non-finite gradients (see ``amp_max_consecutive_skips``)."""


class AmpStateError(SkorchException, RuntimeError):
    """The training step was used in a way that would give wrong gradients,
    e.g. an unscaled ``loss.backward()`` while loss scaling is active."""
