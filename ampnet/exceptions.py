"""Exceptions and warnings raised by ampnet."""

from __future__ import annotations

import sys
import warnings
from typing import TypeVar

from skorch.exceptions import SkorchException

from ampnet.utils.warning_site import recorded_site, user_frame, user_site

__all__ = ["AmpWarning", "AmpDivergenceError", "AmpStateError", "DirectoryLockedError", "amp_warn"]

T = TypeVar("T")


class AmpWarning(UserWarning):
    """Mixed precision was requested but brings no benefit, or something
    was adapted that the user should know about (never silently)."""


class AmpDivergenceError(SkorchException, RuntimeError):
    """Training stopped because too many optimizer steps in a row were
    skipped for non-finite gradients (see ``amp_max_consecutive_skips``)."""


class AmpStateError(SkorchException, RuntimeError):
    """The training step was used in a way that would give wrong gradients,
    e.g. an unscaled ``loss.backward()`` while loss scaling is active."""


class DirectoryLockedError(AmpStateError, OSError):
    """Another process is saving into the same directory (ampnet allows one
    writer per directory, see ``ampnet.io.lock``). Also an ``OSError``:
    a save that could not write."""


def amp_warn(message: str, category: type[Warning] = AmpWarning) -> None:
    """Warn with ``category``, attributed to the user's line.

    The warning points at the innermost frame outside ampnet, skorch, torch,
    scikit-learn, joblib and Python's standard library: the user's
    ``net.fit(X, y)``, ``GridSearchCV(...).fit(X, y)`` or callback, wherever
    in the library the condition was found. Where no frame of this thread is
    the user's (a worker of a parallel search), it points at the user's line
    in the main thread (joblib's threading backend), else at the line
    recorded when the net was pickled to this process (loky's worker
    processes: the user's ``search.fit(X, y)``, see
    ``ampnet.utils.warning_site``), else at the caller of this function.
    """
    caller = sys._getframe(1)
    frame, depth = user_frame(caller)
    if frame is not None:
        warnings.warn(message, category, stacklevel=depth + 2)
        return
    site = user_site() or recorded_site(caller)
    if site is None:
        warnings.warn(message, category, stacklevel=2)
        return
    # the registry of the calling module, as warnings.warn keeps one per module
    registry = caller.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, site.filename, site.lineno,
                           module=site.module, registry=registry)
