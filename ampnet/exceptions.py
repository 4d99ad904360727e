"""Exceptions and warnings raised by ampnet."""

from __future__ import annotations

import os
import sys
import warnings

from skorch.exceptions import SkorchException

__all__ = ["AmpWarning", "AmpDivergenceError", "AmpStateError", "amp_warn"]


class AmpWarning(UserWarning):
    """Mixed precision was requested but brings no benefit, or something
    was adapted that the user should know about (never silently)."""


class AmpDivergenceError(SkorchException, RuntimeError):
    """Training stopped because too many optimizer steps in a row were
    skipped for non-finite gradients (see ``amp_max_consecutive_skips``)."""


class AmpStateError(SkorchException, RuntimeError):
    """The training step was used in a way that would give wrong gradients,
    e.g. an unscaled ``loss.backward()`` while loss scaling is active."""


#: Packages whose frames a warning looks past to find the user's call.
_LIBRARIES = ("ampnet", "skorch", "torch", "sklearn", "joblib")


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def amp_warn(message: str, category: type[Warning] = AmpWarning) -> None:
    """Warn with ``category``, attributed to the user's line.

    The warning points at the innermost frame outside ampnet, skorch, torch,
    scikit-learn and joblib: the user's ``net.fit(X, y)``,
    ``GridSearchCV(...).fit(X, y)`` or callback, wherever in the library the
    condition was found. Where every frame is a library frame, it points at
    the caller of this function.
    """
    dirs = _library_dirs()
    frame = sys._getframe(1)
    level = 2  # the caller of amp_warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
