"""Where an ampnet warning points: the user's line, found by walking frames.

A warning found deep inside ampnet, skorch, torch, scikit-learn or joblib
is attributed to the innermost frame outside them (and outside Python's own
library: ``multiprocessing``, ``threading``, ``concurrent``): the user's
``net.fit(X, y)``, ``GridSearchCV(...).fit(X, y)`` or callback.

In a worker process of a parallel search (``GridSearchCV(n_jobs=2)``,
joblib's loky backend) no frame is the user's: the net was sent there by
pickling. A net records, when it is pickled, the user's line in the process
that pickles it (:func:`user_site`; joblib pickles in a helper thread, so the
thread that waits in the search is searched too), and a warning in the
worker points at that line: the user's ``search.fit(X, y)``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import FrameType
from typing import Any, NamedTuple

__all__ = ["Site", "user_frame", "user_site", "recorded_site"]

#: Packages whose frames are not the user's (joblib pickles with cloudpickle).
LIBRARIES = ("ampnet", "skorch", "torch", "sklearn", "joblib", "loky", "cloudpickle")

#: Attribute (in the net's ``__dict__``) holding the site recorded when the
#: net was pickled, as a plain tuple ``(filename, lineno, module)`` (a pickle
#: names no ampnet class for it).
SITE_ATTRIBUTE = "_amp_sent_from"


class Site(NamedTuple):
    """A line of user code: what ``warnings.warn_explicit`` needs."""

    filename: str
    lineno: int
    module: str


def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders of the libraries and of Python's standard library, folders
    of installed packages inside them that are not libraries)."""
    dirs, installed = [], []
    for name in LIBRARIES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib"):  # multiprocessing, threading, concurrent, runpy
        if paths.get(key):
            dirs.append(os.path.abspath(paths[key]) + os.sep)
    for key in ("purelib", "platlib"):  # site-packages: pytest, the user's own packages
        if paths.get(key):
            installed.append(os.path.abspath(paths[key]) + os.sep)
    return tuple(dirs), tuple(installed)


def _is_library(frame: FrameType, dirs: tuple[tuple[str, ...], tuple[str, ...]]) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith("<frozen "):  # importlib, runpy internals
        return True
    path = os.path.abspath(filename)
    library, installed = dirs
    if not path.startswith(library):
        return False
    owner = max((d for d in library if path.startswith(d)), key=len)
    # a package in site-packages (inside the standard library's folder) is the user's
    return not any(d.startswith(owner) and path.startswith(d) for d in installed)


def user_frame(frame: FrameType | None) -> tuple[FrameType | None, int]:
    """The innermost frame from ``frame`` outwards that is not a library's,
    and how many frames out it is (0: ``frame`` itself); ``(None, n)``
    where every frame is a library's."""
    dirs = _library_dirs()
    depth = 0
    while frame is not None and _is_library(frame, dirs):
        frame = frame.f_back
        depth += 1
    return frame, depth


def _site(frame: FrameType) -> Site:
    return Site(frame.f_code.co_filename, frame.f_lineno, str(frame.f_globals.get("__name__", "")))


def user_site() -> Site | None:
    """The user's line that led here: in this thread, else in the thread
    waiting for this one (the main thread, where joblib's helper threads
    pickle the work of a search); None where there is none."""
    frame, _ = user_frame(sys._getframe(1))
    if frame is not None:
        return _site(frame)
    current = threading.get_ident()
    frames = getattr(sys, "_current_frames", dict)()
    main = threading.main_thread().ident
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == current:
            continue
        frame, _ = user_frame(frames[ident])
        if frame is not None:
            return _site(frame)
    return None


def recorded_site(frame: FrameType | None) -> Site | None:
    """The :class:`Site` recorded by the innermost net (``self`` or ``net``
    of a frame from ``frame`` outwards) that was pickled with one."""
    while frame is not None:
        for name in ("self", "net"):
            owner: Any = frame.f_locals.get(name)
            site = getattr(owner, "__dict__", {}).get(SITE_ATTRIBUTE)
            if isinstance(site, tuple) and len(site) == 3 and isinstance(site[1], int):
                return Site(str(site[0]), site[1], str(site[2]))
        frame = frame.f_back
    return None
