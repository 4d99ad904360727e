"""One writer per directory: the lock file that every ampnet save takes.

A save (``save_params``, a ``Checkpoint``, ``export``) holds a lock file,
``.ampnet-lock``, in each directory it writes, from before it cleans up
temporary files that killed writers left until its files are committed. The
file holds the writer's process id, host name and a random token, and is
created atomically (written in full to a temporary name, then linked into
place, which fails if a lock exists). A second writer therefore finds the
lock and gets a :class:`DirectoryLockedError`; it never removes the first
writer's temporary files.

A lock whose writer is gone is stale and is taken over:

- on the same host, when no process with its id exists (POSIX; an id
  outside 1 .. 2**31 - 1, such as ``2**70``, names no process);
- from another host, on Windows, or unreadable: when it was not refreshed
  for :data:`STALE_AFTER_S` seconds (a writer refreshes it after every
  file).

A lock file is untrusted like every file of a folder: its ``since`` field
only serves the message of :class:`DirectoryLockedError`, which leaves it
out when it is not a time (NaN, ``1e300``); no field of a lock file makes
a save or a fit raise anything but that error.

A :class:`ampnet.callbacks.checkpoint.Checkpoint` takes the lock of its
directory for the whole fit (``scope="fit"``: at ``on_train_begin``,
released at ``on_train_end``), so that a second run sharing the folder is
refused before it trains instead of overwriting the first run's
checkpoints or failing after an epoch. The saves of the fit's own process
go ahead under it. skorch does not call ``on_train_end`` when ``fit``
raises: the lock of a fit that raised stays until the next fit of the same
process takes it over, or the process ends (then it is stale, as above).

A load reads without the lock; it takes the lock only to complete a save
that a killed writer left pending (a journal, :func:`ampnet.io.atomic.recover`),
so that no file of a folder is renamed by a process that does not hold its
lock. While another writer holds the lock, a load waits up to
:data:`ampnet.io.atomic.RECOVER_WAIT_S` seconds for it to complete its own
journal, then raises :class:`DirectoryLockedError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from typing import Any, Iterator

from ampnet.exceptions import DirectoryLockedError
from ampnet.io.untrusted import LOCK_MAX_BYTES, read_untrusted

__all__ = [
    "LOCK_NAME", "STALE_AFTER_S", "REFRESH_EVERY_S", "DirectoryLockedError", "DirectoryLock",
    "directory_locks",
]

#: Name of the lock file in a directory being written.
LOCK_NAME = ".ampnet-lock"

#: Seconds after which a lock of another host (or an unreadable one) that
#: was not refreshed is stale.
STALE_AFTER_S = 600.0

#: Seconds between refreshes of a lock held for a whole fit (well below
#: :data:`STALE_AFTER_S`, so that other hosts see it live).
REFRESH_EVERY_S = 60.0

_VERSION = 1

_SCOPES = ("save", "fit")


def _holder_of(path: str) -> dict[str, Any] | None:
    """The content of a lock file, or None when it cannot be read as one."""
    try:
        if os.path.islink(path):  # ampnet never writes one
            return None
        data = json.loads(read_untrusted(path, repr(path), LOCK_MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("pid"), int)
            and isinstance(data.get("host"), str) and isinstance(data.get("token"), str)):
        return None
    return data


#: The largest process id (``pid_t`` is a C int); a lock naming a larger one
#: names no process.
_PID_MAX = 2**31 - 1


def _alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this host (ids outside
    1 .. 2**31 - 1 name none)."""
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell
    return True


def _age(path: str) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _is_stale(path: str, holder: dict[str, Any] | None) -> bool:
    # on Windows os.kill(pid, 0) would send Ctrl-C: the age decides there
    if holder is not None and holder["host"] == socket.gethostname() and os.name != "nt":
        return not _alive(holder["pid"])
    return _age(path) > STALE_AFTER_S


def _since(value: Any) -> str:
    """`` since HH:MM:SS`` for a lock's ``since`` field; ``""`` for one that
    is not a time this machine can show (NaN, 1e300, 10**400, a str)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    try:
        return time.strftime(" since %H:%M:%S", time.localtime(value))
    except (OverflowError, ValueError, OSError):
        return ""


class DirectoryLock:
    """The lock of one directory, held by this process (see the module).

    Parameters
    ----------
    directory : str
      The directory (an existing one).
    """

    def __init__(self, directory: str, scope: str = "save") -> None:
        if scope not in _SCOPES:
            raise ValueError(f"DirectoryLock scope must be one of {_SCOPES}, got {scope!r}.")
        self.directory = directory
        self.scope = scope
        self.path = os.path.join(directory, LOCK_NAME)
        self.token = uuid.uuid4().hex
        self.held = False
        self.borrowed = False
        self.refreshed = 0.0

    def _own_fit_lock(self, holder: dict[str, Any] | None) -> bool:
        """Whether ``holder`` is a fit's lock taken by this process."""
        return (
            holder is not None and holder.get("scope") == "fit" and holder["pid"] == os.getpid()
            and holder["host"] == socket.gethostname()
        )

    def acquire(self) -> "DirectoryLock":
        """Take the lock, taking over a stale one.

        Raises
        ------
        DirectoryLockedError
          When another writer holds it.
        """
        content = json.dumps({
            "ampnet_lock_version": _VERSION, "pid": os.getpid(), "host": socket.gethostname(),
            "token": self.token, "since": time.time(), "scope": self.scope,
        }).encode()
        for _ in range(3):
            if self._create(content):
                self.held = True
                self.refreshed = time.monotonic()
                return self
            holder = _holder_of(self.path)
            if not os.path.lexists(self.path):
                continue  # released meanwhile
            if self._own_fit_lock(holder):
                if self.scope == "save":  # a save of the fit that holds the directory
                    self.borrowed = True
                    return self
                # a fit of this process that raised (skorch skips on_train_end then)
                self._break(holder)
                continue
            if not _is_stale(self.path, holder):
                raise self._locked_error(holder)
            self._break(holder)
        raise self._locked_error(_holder_of(self.path))

    def _create(self, content: bytes) -> bool:
        """Create the lock file with ``content`` at once; False if one exists."""
        temp = os.path.join(self.directory, f".{LOCK_NAME}.{self.token}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(temp, self.path)  # fails if a lock exists: never replaces one
                return True
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                 | getattr(os, "O_NOFOLLOW", 0), 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(content)
                return True
        finally:
            with contextlib.suppress(OSError):
                os.remove(temp)

    def _break(self, holder: dict[str, Any] | None) -> None:
        """Remove a stale lock, unless another writer replaced it meanwhile."""
        aside = os.path.join(self.directory, f".{LOCK_NAME}.{self.token}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        taken = _holder_of(aside)
        same = (taken is None and holder is None) or (
            taken is not None and holder is not None and taken["token"] == holder["token"]
        )
        if not same:  # a fresh lock was moved aside: put it back if its place is free
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            os.remove(aside)

    def refresh(self, every: float = 0.0) -> None:
        """Mark the lock as in use (its age tells other hosts it is live),
        if ``every`` seconds passed since the last time."""
        if (self.held or self.borrowed) and time.monotonic() - self.refreshed >= every:
            self.refreshed = time.monotonic()
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock file if it is still this writer's (a borrowed
        one stays with the fit that holds it)."""
        self.borrowed = False
        if not self.held:
            return
        self.held = False
        holder = _holder_of(self.path)
        if holder is not None and holder["token"] == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def _locked_error(self, holder: dict[str, Any] | None) -> DirectoryLockedError:
        if holder is None:
            who = "another process (its lock file cannot be read)"
        else:
            when = _since(holder.get("since"))
            who = f"process {holder['pid']} on host {holder['host']!r}{when}"
        doing = (
            "is training with a Checkpoint there" if holder is not None
            and holder.get("scope") == "fit" else "is saving there"
        )
        what = (
            f"Cannot train with a Checkpoint in {self.directory!r}" if self.scope == "fit"
            else f"Cannot save into {self.directory!r}"
        )
        return DirectoryLockedError(
            f"{what}: {who} {doing} (lock file {self.path!r}). ampnet allows one writer per "
            "directory, so that one run never replaces or removes the other's files. Nothing "
            "was written. Fix: give each run its own directory (Checkpoint(dirname=...)); if "
            f"no other process writes there, remove {LOCK_NAME!r} (it is also taken over once "
            f"its writer is gone, or after {STALE_AFTER_S:.0f} s for a writer on another host)."
        )


@contextlib.contextmanager
def directory_locks(directories: list[str]) -> Iterator[list[DirectoryLock]]:
    """Hold the lock of every directory (sorted) for the ``with`` block.

    Raises
    ------
    DirectoryLockedError
      When another writer holds one of them; the locks taken so far are
      released.
    """
    locks: list[DirectoryLock] = []
    try:
        for directory in sorted(set(directories)):
            locks.append(DirectoryLock(directory).acquire())
        yield locks
    finally:
        for lock in reversed(locks):
            lock.release()
