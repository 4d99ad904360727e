"""Crash-safe writes of one file or of a group of files.

Every file is written to a temporary file in its target directory, flushed
to disk, and renamed into place (``os.replace``, atomic on POSIX and
Windows). A group of files (a checkpoint) is committed all at once through
a small journal: once every temporary file is complete, a journal listing
the pending renames is written atomically into each target directory, the
renames are done and the journal is removed. A process killed before the
journal exists leaves every old file in place; a process killed after it
leaves a journal that :func:`recover` completes (it is called before every
save and every load), so a reader sees either the whole old group or the
whole new one, never a mix.

Assumes one writer per directory at a time, as a checkpoint has.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any, Callable, Iterable, Mapping

__all__ = ["atomic_write_group", "recover", "is_path", "TEMP_SUFFIX", "JOURNAL_NAME"]

#: Suffix of the temporary files (``.<name>.<random>.ampnet-tmp``).
TEMP_SUFFIX = ".ampnet-tmp"

#: Name of the journal file of a pending group commit.
JOURNAL_NAME = ".ampnet-journal.json"

_JOURNAL_VERSION = 1

Writer = Callable[[str], None]


def is_path(target: Any) -> bool:
    """Whether ``target`` names a file (str or path-like), as opposed to an
    open file object."""
    return isinstance(target, (str, os.PathLike))


def read_json(target: Any, source: str, what: str) -> Any:
    """Parse JSON from a path or an open text file.

    Raises
    ------
    ValueError
      ``"{source} is not {what} (...)"`` for unparsable content.
    """
    try:
        if is_path(target):
            with open(target, encoding="utf-8") as f:
                return json.load(f)
        return json.load(target)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{source} is not {what} ({exc}).") from exc


def _fsync_file(path: str) -> None:
    with open(path, "r+b") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: str) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temp(final: str) -> str:
    directory, base = os.path.split(final)
    while True:
        temp = os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
        try:
            # 0o666 lets the umask decide the mode, as for a plain open()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return temp


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _write_journal(directory: str, moves: list[tuple[str, str]], journals: list[str]) -> str:
    path = os.path.join(directory, JOURNAL_NAME)
    data = {
        "ampnet_journal_version": _JOURNAL_VERSION,
        # relative to the journal, so that a copied or moved directory recovers
        "moves": [[os.path.relpath(t, directory), os.path.relpath(f, directory)] for t, f in moves],
        "journals": [os.path.relpath(j, directory) for j in journals],
    }
    temp = _new_temp(path)
    try:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        _remove_quietly(temp)
        raise
    return path


def recover(directories: Iterable[str]) -> None:
    """Complete a group commit that a killed process left pending.

    For each directory holding a journal, rename the listed temporary files
    into place (those already renamed are skipped) and remove the journals.
    Idempotent: a process killed during recovery is recovered again later.

    Raises
    ------
    ValueError
      If a journal exists but is not one that ampnet wrote.
    """
    for directory in sorted({os.path.abspath(d or ".") for d in directories}):
        path = os.path.join(directory, JOURNAL_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            continue
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path!r} is not a readable ampnet journal ({exc}). ampnet writes its "
                "journals atomically, so another program wrote this file. Fix: remove it."
            ) from exc
        if not (isinstance(data, dict) and data.get("ampnet_journal_version") == _JOURNAL_VERSION):
            raise ValueError(
                f"{path!r} is not an ampnet journal of version {_JOURNAL_VERSION}. "
                "Fix: remove it if no ampnet save is running."
            )
        touched = {directory}
        for temp, final in data["moves"]:
            temp, final = os.path.join(directory, temp), os.path.join(directory, final)
            with contextlib.suppress(FileNotFoundError):  # already renamed
                os.replace(temp, final)
            touched.add(os.path.dirname(final))
        for other in data["journals"]:
            _remove_quietly(os.path.normpath(os.path.join(directory, other)))
        _remove_quietly(path)
        for d in touched:
            _fsync_dir(d)


def _remove_orphans(finals: Iterable[str]) -> None:
    """Remove temporary files left by writers killed before their commit."""
    by_dir: dict[str, set[str]] = {}
    for final in finals:
        directory, base = os.path.split(final)
        by_dir.setdefault(directory, set()).add(base)
    for directory, bases in by_dir.items():
        for name in os.listdir(directory or "."):
            if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
                continue
            stem = name[1 : -len(TEMP_SUFFIX)].rsplit(".", 1)[0]
            if stem in bases or stem == JOURNAL_NAME:
                _remove_quietly(os.path.join(directory, name))


def atomic_write_group(writers: Mapping[Any, Writer]) -> None:
    """Write several files so that they replace their old versions together.

    Parameters
    ----------
    writers : dict
      Maps each target (a path, or an open file object) to a function that
      writes the content to the path it is given. Paths are written
      atomically as one group; file objects are written directly (their
      atomicity is up to their owner).

    Raises
    ------
    Exception
      Whatever a writer raises; then no target path is changed and the
      temporary files are removed.
    """
    paths = {os.path.abspath(os.fspath(t)): w for t, w in writers.items() if is_path(t)}
    for target, write in writers.items():
        if not is_path(target):
            write(target)
    if not paths:
        return
    directories = sorted({os.path.dirname(p) for p in paths})
    recover(directories)
    _remove_orphans(paths)
    moves: list[tuple[str, str]] = []
    try:
        for final, write in paths.items():
            temp = _new_temp(final)
            moves.append((temp, final))
            write(temp)
            _fsync_file(temp)
    except BaseException:
        for temp, _ in moves:
            _remove_quietly(temp)
        raise
    if len(moves) == 1:
        os.replace(*moves[0])
        _fsync_dir(directories[0])
        return
    journals = [os.path.join(d, JOURNAL_NAME) for d in directories]
    written = []
    try:
        for directory in directories:
            written.append(_write_journal(directory, moves, journals))
    except BaseException:
        # not committed: no journal may survive, or recovery would roll forward
        for journal in written:
            _remove_quietly(journal)
        for temp, _ in moves:
            _remove_quietly(temp)
        raise
    recover(directories)
