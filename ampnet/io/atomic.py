"""Crash-safe writes of one file or of a group of files.

Every file is written to a temporary file in its target directory, flushed
to disk, and renamed into place (``os.replace``, atomic on POSIX and
Windows). A group of files (a checkpoint) is committed all at once through
a small journal: once every temporary file is complete, a journal listing
the pending renames is written atomically into each target directory, the
renames are done and the journal is removed. A process killed before the
journal exists leaves every old file in place; a process killed after it
leaves a journal that :func:`recover` completes (it is called before every
save and every load, and renames only while it holds the folder's lock), so
a reader sees either the whole old group or the whole new one, never a mix.

A journal is untrusted input (a checkpoint folder may come from anywhere):
each one lists only renames inside its own directory, from an ampnet
temporary file (``.<name>.<12 hex digits>.ampnet-tmp``) to ``<name>``.
:func:`recover` checks the whole journal before it touches anything and
refuses any other entry (absolute paths, ``..``, separators, symbolic
links, other names) with a ValueError naming the journal. A group that
spans several directories is therefore committed directory by directory:
each directory holds its whole old or whole new files.

Write errors (a full disk) raise an OSError naming the target file; the
old files are then unchanged.

One writer per directory: a save holds the directory's lock file
(:mod:`ampnet.io.lock`) while it writes, so a second writer gets a
:class:`~ampnet.io.lock.DirectoryLockedError` and never removes the first
one's temporary files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
import uuid
from typing import Any, Callable, Iterable, Mapping

from ampnet.io.lock import DirectoryLock, DirectoryLockedError, directory_locks
from ampnet.io.untrusted import JOURNAL_MAX_BYTES, is_path, read_untrusted
from ampnet.io.untrusted import brief as describe

__all__ = [
    "atomic_write_group", "recover", "is_path", "write_key", "TEMP_SUFFIX",
    "JOURNAL_NAME",
]

#: Suffix of the temporary files (``.<name>.<random>.ampnet-tmp``).
TEMP_SUFFIX = ".ampnet-tmp"

#: Name of the journal file of a pending group commit.
JOURNAL_NAME = ".ampnet-journal.json"

_JOURNAL_VERSION = 1

_JOURNAL_KEYS = ("ampnet_journal_version", "moves", "journals")

_TEMP_NAME = re.compile(r"\.(?P<base>.+)\.[0-9a-f]{12}" + re.escape(TEMP_SUFFIX), re.DOTALL)

Writer = Callable[[str], None]


#: What to do about a write error, by errno.
_ADVICE = {
    errno.ENOSPC: "free space or choose another directory",
    getattr(errno, "EDQUOT", -1): "free space (the disk quota is used up) or choose another directory",
    errno.EFBIG: "raise the file size limit (ulimit -f) or choose another directory",
    errno.EACCES: "check the permissions of the directory, or choose another one",
    errno.EPERM: "check the permissions of the directory, or choose another one",
    errno.EROFS: "choose a directory on a writable file system",
    errno.ENOENT: "check that the directory exists and that no other program removes files "
    "in it while ampnet saves",
}


def _write_error(target: str, exc: OSError) -> OSError:
    """An OSError that names ``target``, the cause of ``exc`` and what to do."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno == errno.ENOSPC:
        cause = "the disk is full (" + cause + ")"
    advice = _ADVICE.get(exc.errno, "check the directory and the file system")
    error = OSError(
        exc.errno,
        f"Could not write {target!r}: {cause}. Nothing of this save was committed; "
        f"the previous files are unchanged. Fix: {advice}, then save again",
        target,
    )
    return error


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


def _write_journal(directory: str, moves: list[tuple[str, str]]) -> str:
    """Write the journal of the renames in ``directory`` (names only, so
    that a copied or moved directory recovers)."""
    path = os.path.join(directory, JOURNAL_NAME)
    data = {
        "ampnet_journal_version": _JOURNAL_VERSION,
        "moves": [
            [os.path.basename(t), os.path.basename(f)]
            for t, f in moves
            if os.path.dirname(f) == directory
        ],
        "journals": [JOURNAL_NAME],
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


def _journal_error(path: str, problem: str) -> ValueError:
    return ValueError(
        f"{path!r} is not an ampnet journal: {problem}. ampnet writes its journals "
        "atomically and lists in them only its own temporary files of the journal's "
        "directory, so another program wrote this file (or it came with a downloaded "
        "folder). Nothing was changed. Fix: remove it if no ampnet save is running."
    )


def _own_name(name: Any) -> bool:
    """Whether ``name`` names an entry of the journal's own directory."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\x00" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and os.path.basename(name) == name
        and not os.path.splitdrive(name)[0]
        and not os.path.isabs(name)
    )


def _journal_data(path: str) -> dict | None:
    """The JSON object of the journal at ``path``, a regular file within
    the size limit, with the keys and the version that ampnet writes; None
    without one."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        raise _journal_error(path, "it is a symbolic link")
    if not stat.S_ISREG(info.st_mode):
        raise _journal_error(path, "it is not a regular file")
    if info.st_size > JOURNAL_MAX_BYTES:
        raise _journal_error(path, f"it is larger than {JOURNAL_MAX_BYTES} bytes")
    try:
        raw = read_untrusted(path, repr(path), JOURNAL_MAX_BYTES)
    except ValueError as exc:  # swapped for a link or a special file since the check
        raise _journal_error(path, str(exc)) from exc
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError
        raise _journal_error(path, f"it is not UTF-8 JSON ({type(exc).__name__})") from exc
    if not isinstance(data, dict):
        raise _journal_error(path, f"expected a JSON object, got {type(data).__name__}")
    if sorted(data) != sorted(_JOURNAL_KEYS):
        raise _journal_error(
            path, f"expected the keys {list(_JOURNAL_KEYS)}, found {sorted(map(str, data))[:8]}"
        )
    version = data["ampnet_journal_version"]
    if type(version) is not int or version != _JOURNAL_VERSION:
        raise _journal_error(
            path, f"ampnet_journal_version is {describe(version)}, expected {_JOURNAL_VERSION}"
        )
    return data


def _journal_moves(path: str, moves: Any, journals: Any) -> list[tuple[str, str]]:
    """The renames a journal lists: each from an ampnet temporary file of
    its directory to the file it was written for, no two onto one name."""
    if not isinstance(moves, list) or not isinstance(journals, list):
        raise _journal_error(path, "'moves' and 'journals' must be lists")
    pairs: list[tuple[str, str]] = []
    for entry in moves:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise _journal_error(path, f"the move {describe(entry)} is not a [temporary, final] pair")
        temp, final = entry
        match = _TEMP_NAME.fullmatch(temp) if _own_name(temp) else None
        if match is None or match.group("base") != final:
            raise _journal_error(
                path, f"the move {describe(entry)} is not from an ampnet temporary file of "
                "this directory to the file it was written for"
            )
        if not _own_name(final) or final == JOURNAL_NAME or _TEMP_NAME.fullmatch(final):
            raise _journal_error(path, f"the move {describe(entry)} targets {final!r}")
        pairs.append((temp, final))
    finals = [final for _, final in pairs]
    if len(set(finals)) != len(finals):
        raise _journal_error(path, "it moves two files onto the same name")
    if any(name != JOURNAL_NAME for name in journals):
        raise _journal_error(
            path, f"'journals' may list only {JOURNAL_NAME!r}, got {describe(journals)}"
        )
    return pairs


def _check_moved_files(directory: str, path: str, pairs: list[tuple[str, str]]) -> None:
    """Refuse a move whose temporary file is a link, or whose temporary
    file or target is a directory."""
    for temp, final in pairs:
        for name, kind in ((temp, "temporary file"), (final, "target")):
            try:
                mode = os.lstat(os.path.join(directory, name)).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode) and kind == "temporary file":
                raise _journal_error(path, f"the {kind} {name!r} is a symbolic link")
            if stat.S_ISDIR(mode):
                raise _journal_error(path, f"the {kind} {name!r} is a directory")


def _read_journal(directory: str, path: str) -> list[tuple[str, str]] | None:
    """The renames of the journal at ``path``, checked; None without one.

    Raises
    ------
    ValueError
      Naming the journal, for anything that ampnet does not write.
    """
    data = _journal_data(path)
    if data is None:
        return None
    pairs = _journal_moves(path, data["moves"], data["journals"])
    _check_moved_files(directory, path, pairs)
    return pairs


#: Seconds a load waits for the writer that holds a folder's lock to
#: complete the journal it left there.
RECOVER_WAIT_S = 2.0


def recover(directories: Iterable[str]) -> None:
    """Complete a group commit that a killed process left pending, holding
    the lock of each directory that has a journal while its files are
    renamed (:mod:`ampnet.io.lock`; a Checkpoint's lock of this process is
    borrowed), so that no file is renamed by a process that does not hold
    its folder's lock (see :func:`_recover_held`).

    Raises
    ------
    DirectoryLockedError
      Another writer holds the lock and its journal is still there after
      :data:`RECOVER_WAIT_S` seconds; nothing was renamed.

    ValueError
      As :func:`_recover_held`; also for a folder where no lock can be
      taken (read-only), naming the journal.
    """
    for directory in sorted({os.path.abspath(d or ".") for d in directories}):
        journal = os.path.join(directory, JOURNAL_NAME)
        if not os.path.lexists(journal):
            continue
        lock = _lock_for_recovery(directory, journal)
        if lock is None:  # its writer completed it meanwhile
            continue
        try:
            _recover_held([directory])
        finally:
            lock.release()


def _lock_for_recovery(directory: str, journal: str) -> DirectoryLock | None:
    """The lock of ``directory``, to complete ``journal``; None when the
    journal went while waiting for its writer."""
    deadline = time.monotonic() + RECOVER_WAIT_S
    while True:
        try:
            return DirectoryLock(directory).acquire()
        except DirectoryLockedError as exc:
            if not os.path.lexists(journal):
                return None
            if time.monotonic() >= deadline:
                raise DirectoryLockedError(
                    f"Cannot load from {directory!r}: a save that another writer is committing "
                    f"there is pending (journal {journal!r}), and that writer holds the folder's "
                    f"lock ({exc}). Nothing was loaded and nothing renamed. Fix: load again once "
                    "that save is done."
                ) from exc
            time.sleep(0.05)
        except OSError as exc:  # no lock can be created there: a read-only folder
            moves = _read_journal(directory, journal) or [("", JOURNAL_NAME)]
            raise _pending_error(journal, moves[0][1], exc) from exc


def _recover_held(directories: Iterable[str]) -> None:
    """Complete a group commit that a killed process left pending; the
    caller holds the lock of every directory.

    For each directory holding a journal, check the whole journal, then
    rename the listed temporary files into place (those already renamed
    are skipped) and remove the journal. Idempotent: a process killed
    during recovery is recovered again later.

    Raises
    ------
    ValueError
      If a journal exists but is not one that ampnet wrote: not UTF-8
      JSON, other keys or types, or an entry that is not a rename from an
      ampnet temporary file to its target in the journal's own directory.
      Nothing is changed then. Also, naming the journal, the file and the
      fix, when a rename fails (a read-only folder): the files are then
      part old, part new save, and a load must not read them.
    """
    for directory in sorted({os.path.abspath(d or ".") for d in directories}):
        path = os.path.join(directory, JOURNAL_NAME)
        moves = _read_journal(directory, path)
        if moves is None:
            continue
        for temp, final in moves:
            try:
                os.replace(os.path.join(directory, temp), os.path.join(directory, final))
            except FileNotFoundError:  # already renamed
                continue
            except OSError as exc:  # a read-only folder: the save cannot be completed
                raise _pending_error(path, final, exc) from exc
        _remove_quietly(path)
        _fsync_dir(directory)


def _pending_error(journal: str, final: str, exc: OSError) -> ValueError:
    """The error for a pending save that cannot be completed."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    return ValueError(
        f"The checkpoint in {os.path.dirname(journal)!r} holds a save that a stopped process "
        f"left pending (journal {journal!r}), and it cannot be completed: renaming its "
        f"temporary file to {final!r} failed ({type(exc).__name__}: {cause}; the folder "
        "is read-only?). Its files are the old and the new save mixed, so nothing was "
        "loaded. Fix: make the folder writable and load again (the save is then "
        "completed), or copy the folder to a writable place and load from the copy."
    )


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

    A target that is a symbolic link is replaced by the new file: the link
    goes, and the file it pointed to is never written (a link planted in a
    downloaded checkpoint folder cannot redirect a save out of it). Links in
    the directories above a target are followed.

    Raises
    ------
    ValueError
      Two targets that are the same file, or a path without a file name
      (``''``, a name ending in a separator); nothing is written then.

    IsADirectoryError
      A target that is an existing directory; nothing is written then.

    DirectoryLockedError
      Another process is saving into one of the directories (an OSError);
      nothing is written then.

    OSError
      A write that fails (a full disk), naming the target and the cause;
      then no target path is changed and the temporary files are removed.

    Exception
      Whatever a writer raises; then no target path is changed and the
      temporary files are removed.
    """
    paths: dict[str, Writer] = {}
    seen: set[str] = set()
    for target, write in writers.items():
        if is_path(target):
            final = _final_path(target)
            if os.path.normcase(final) in seen:
                raise ValueError(
                    f"Two targets of one save are the same file {final!r}; give each its "
                    "own. Nothing was written."
                )
            seen.add(os.path.normcase(final))
            paths[final] = write
    for target, write in writers.items():
        if not is_path(target):
            write(target)
    if not paths:
        return
    directories = sorted({os.path.dirname(p) for p in paths})
    with contextlib.ExitStack() as stack:
        try:
            locks = stack.enter_context(directory_locks(directories))
        except DirectoryLockedError:
            raise
        except OSError as exc:  # the directory cannot be written at all
            where = os.path.dirname(os.fspath(exc.filename)) if exc.filename else None
            target = next((p for p in paths if os.path.dirname(p) == where), next(iter(paths)))
            raise _write_error(target, exc) from exc
        _commit(paths, directories, locks)


def _commit(paths: dict[str, Writer], directories: list[str], locks: list[DirectoryLock]) -> None:
    """Write and commit the group while holding the directories' locks."""
    _recover_held(directories)
    _remove_orphans(paths)
    moves: list[tuple[str, str]] = []
    try:
        for final, write in paths.items():
            try:
                temp = _new_temp(final)
                moves.append((temp, final))
                write(temp)
                _fsync_file(temp)
            except OSError as exc:
                raise _write_error(final, exc) from exc
            for lock in locks:
                lock.refresh()
    except BaseException:
        for temp, _ in moves:
            _remove_quietly(temp)
        raise
    if len(moves) == 1:
        temp, final = moves[0]
        try:
            os.replace(temp, final)
        except BaseException as exc:
            _remove_quietly(temp)
            if isinstance(exc, OSError):
                raise _write_error(final, exc) from exc
            raise
        _fsync_dir(directories[0])
        return
    written = []
    try:
        for directory in directories:
            try:
                written.append(_write_journal(directory, moves))
            except OSError as exc:
                raise _write_error(os.path.join(directory, JOURNAL_NAME), exc) from exc
    except BaseException:
        # not committed: no journal may survive, or recovery would roll forward
        for journal in written:
            _remove_quietly(journal)
        for temp, _ in moves:
            _remove_quietly(temp)
        raise
    _recover_held(directories)


def _final_path(target: Any) -> str:
    """The path a save writes for ``target``: its directory with links
    resolved, and its own name (a link there is replaced, not followed).

    Raises
    ------
    ValueError
      For a path without a file name.

    IsADirectoryError
      For an existing directory.
    """
    text = os.fspath(target)
    base = os.path.basename(text)
    if base in ("", ".", ".."):
        raise ValueError(
            f"Cannot save to {text!r}: it names no file (an empty path, or one ending in a "
            "separator or '.'). Nothing was written. Fix: pass a file name, e.g. 'model.onnx'."
        )
    final = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(text))), base)
    if os.path.isdir(final) and not os.path.islink(final):
        raise IsADirectoryError(
            errno.EISDIR,
            f"Cannot save to {text!r}: it is a directory. Nothing was written. Fix: pass a "
            "file name inside it",
            text,
        )
    return final


def write_key(target: Any) -> str:
    """The path a save of ``target`` writes (links in its directories
    resolved, not its own name), with the case folded where the file
    system ignores it: two spellings of one target compare equal."""
    text = os.fspath(target)
    directory = os.path.realpath(os.path.dirname(os.path.abspath(text)))
    return os.path.normcase(os.path.join(directory, os.path.basename(text)))
