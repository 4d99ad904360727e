"""The one place where a load opens a file of a checkpoint folder (and
reads JSON from it), and the kinds of file a checkpoint holds.

A checkpoint folder may come from anywhere, so every file in it is opened
as untrusted (:func:`open_untrusted`, :func:`read_untrusted`):

- **Regular files only.** A FIFO, a device (``/dev/zero``), a socket or a
  directory is refused before it is opened, and again after (the file is
  opened with ``O_NONBLOCK``, so that a FIFO swapped in between cannot
  block, and ``O_NOFOLLOW``; ``fstat`` must then report a regular file).
- **Links stay in the folder.** A symbolic link is followed only to a file
  in the directory that holds the link (or below it); a link that leaves
  it (``history.json -> ../outside.txt``, ``-> /dev/zero``) is refused.
  The directory itself may be reached through links.
- **A size limit per kind of file** (:data:`KINDS`, :func:`max_bytes`):
  larger files are refused before they are read, and no more than the
  limit is read.
- **torch files** are then checked by
  :func:`ampnet.io.untrusted.torch_files.check_torch_file`, so that reading
  one never allocates more than the file's size.

Every refusal is a ValueError that names the file; a file that cannot be
opened raises an OSError that names it. :func:`read_json` parses what it
read, nested at most ``MAX_DEPTH`` levels, its values checked
(:func:`ampnet.io.untrusted.values.check_values`).

The kinds of file (:data:`KINDS`) are one table: their default names,
whether a checkpoint may lack them, and the most bytes a load reads from
each. ``save_params``, ``load_params``, ``Checkpoint`` and
``TrainEndCheckpoint`` spell the ``f_*`` arguments out in their signatures
(for help and ``get_params``); everything else that lists the kinds uses
this table.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, BinaryIO

from ampnet.io.untrusted.values import check_values
from ampnet.utils.file_values import MAX_DEPTH, nesting_depth

__all__ = [
    "open_untrusted", "read_untrusted", "read_error", "read_json", "is_path", "FileKind", "KINDS", "OPTIONAL_FILES",
    "TENSOR_FILE_MAX_BYTES", "JOURNAL_MAX_BYTES", "LOCK_MAX_BYTES", "max_bytes", "MiB",
]

_KINDS_OF_FILE = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)

_CHUNK = 1 << 24

_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_BINARY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def read_error(source: str, exc: OSError) -> OSError:
    """An OSError (of the same kind) that names ``source`` and the cause."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    error = type(exc)(exc.errno, f"{source} could not be read: {cause}", exc.filename)
    return error


def _what(mode: int) -> str | None:
    """What a non-regular file is, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, name in _KINDS_OF_FILE:
        if test(mode):
            return name
    return "not a regular file"


def _special_file_error(source: str, what: str) -> ValueError:
    return ValueError(
        f"{source} is {what}, not a regular file. ampnet reads only regular files from a "
        "checkpoint (a FIFO would block the load, a device such as /dev/zero never ends). "
        "Nothing was loaded. Fix: replace it with the file that save_params wrote."
    )


def _inside(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # another drive on Windows
        return False


def open_untrusted(path: Any, source: str, max_bytes: int) -> BinaryIO:
    """Open ``path`` for binary reading under the rules of this module.

    Parameters
    ----------
    path : str or os.PathLike
      The file, as the checkpoint or the caller names it.

    source : str
      How messages name it (``"f_history file 'run/history.json'"``).

    max_bytes : int
      The largest size accepted.

    Returns
    -------
    file : binary file object, positioned at the start; close it.

    Raises
    ------
    ValueError
      A link that leaves its folder, a file that is not a regular file, or
      one larger than ``max_bytes``.

    OSError
      A file that cannot be opened (``FileNotFoundError`` when missing).
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.realpath(os.path.dirname(path))
    own = os.path.join(folder, os.path.basename(path))
    try:
        info = os.lstat(own)
        target = own
        if stat.S_ISLNK(info.st_mode):
            target = os.path.realpath(own)
            if not _inside(target, folder):
                raise ValueError(
                    f"{source} is a symbolic link to {target!r}, outside its folder "
                    f"{folder!r}. ampnet follows links in a checkpoint only to files in the "
                    "same folder (a link in a downloaded folder could make a load read, and "
                    "the next save replace, a file anywhere). Nothing was loaded. Fix: if "
                    "you trust that file, pass its own path, or copy it into the folder."
                )
            info = os.stat(target)
        what = _what(info.st_mode)
        if what is not None:
            raise _special_file_error(source, what)
        fd = os.open(target, _FLAGS)
    except OSError as exc:
        raise read_error(source, exc) from exc
    try:
        info = os.fstat(fd)
        what = _what(info.st_mode)
        if what is not None:  # swapped in after the check above
            raise _special_file_error(source, what)
        if info.st_size > max_bytes:
            raise ValueError(
                f"{source} is {info.st_size} bytes, more than the {max_bytes} bytes that "
                "ampnet reads from this kind of file (see ampnet.io.untrusted.KINDS). Nothing "
                "was loaded. Fix: pass the file that save_params wrote."
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_untrusted(path: Any, source: str, max_bytes: int) -> bytes:
    """The bytes of ``path`` (see :func:`open_untrusted`); at most
    ``max_bytes`` are read, and a file that grew past them is refused."""
    chunks, total = [], 0
    with open_untrusted(path, source, max_bytes) as f:
        try:
            while total <= max_bytes:
                chunk = f.read(min(_CHUNK, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except OSError as exc:
            raise read_error(source, exc) from exc
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ValueError(
            f"{source} grew past {max_bytes} bytes while it was read. Nothing was loaded."
        )
    return data


def is_path(target: Any) -> bool:
    """Whether ``target`` names a file (str or path-like), as opposed to an
    open file object."""
    return isinstance(target, (str, os.PathLike))


def read_json(target: Any, source: str, what: str, max_bytes: int) -> Any:
    """Parse JSON from a path (opened as :func:`open_untrusted`
    does) or an open file, at most ``max_bytes`` long and nested at most
    :data:`ampnet.utils.file_values.MAX_DEPTH` levels deep.

    Raises
    ------
    ValueError
      ``"{source} is not {what} (...)"`` for content that is not UTF-8 JSON
      or is nested too deeply, or that holds an int beyond float range
      (:func:`ampnet.io.untrusted.values.check_values`); see :func:`open_untrusted`
      for links, special files and sizes.
    """
    if is_path(target):
        raw = read_untrusted(target, source, max_bytes)
    else:
        raw = target.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise ValueError(f"{source} is larger than {max_bytes} bytes; it is not {what}.")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ValueError(f"{source} is not {what} ({reason}).") from exc
    except TypeError as exc:  # a file object that yields neither str nor bytes
        raise ValueError(f"{source} is not {what} ({exc}).") from exc
    if nesting_depth(data) > MAX_DEPTH:
        raise ValueError(
            f"{source} is not {what}: its lists and dicts are nested more than "
            f"{MAX_DEPTH} levels deep, which ampnet never writes."
        )
    return check_values(data, source, len(raw))


# ---- the kinds of file, and the most bytes read from each ----------------------

MiB = 1 << 20

#: Parameter, optimizer and criterion files (and any other ``f_<name>``):
#: tensors of any size, so the limit only rules out the absurd.
TENSOR_FILE_MAX_BYTES = 1 << 40

#: A journal lists a few renames.
JOURNAL_MAX_BYTES = 1 * MiB

#: A lock file holds a process id, a host name and a token.
LOCK_MAX_BYTES = 4096


@dataclass(frozen=True)
class FileKind:
    """One kind of checkpoint file.

    Parameters
    ----------
    key : str
      The argument that names it (``'f_params'``).

    default : str
      Its name in a ``Checkpoint`` folder.

    max_bytes : int
      The most bytes a load reads from it; a larger file is refused.

    optional : bool
      Whether a checkpoint may lack it (an older checkpoint, or skorch's
      ``Checkpoint``): it is then skipped with an ``AmpWarning``.

    consequence : str
      For optional kinds: what a load without the file loses.
    """

    key: str
    default: str
    max_bytes: int
    optional: bool = False
    consequence: str = ""


#: Every kind, in the order of the ``f_*`` arguments.
KINDS: "MappingProxyType[str, FileKind]" = MappingProxyType({
    kind.key: kind
    for kind in (
        FileKind("f_params", "params.pt", TENSOR_FILE_MAX_BYTES),
        FileKind("f_optimizer", "optimizer.pt", TENSOR_FILE_MAX_BYTES),
        FileKind("f_criterion", "criterion.pt", TENSOR_FILE_MAX_BYTES),
        FileKind("f_history", "history.json", 256 * MiB),
        FileKind(
            "f_grad_scaler", "grad_scaler.pt", 1 * MiB, optional=True,
            consequence="the loss scale restarts from grad_scaler__init_scale",
        ),
        FileKind(
            "f_rng_state", "rng_state.pt", 16 * MiB, optional=True,
            consequence="random numbers (shuffling, dropout) will differ from an "
            "uninterrupted run",
        ),
        FileKind(
            "f_lr_schedulers", "lr_schedulers.json", 16 * MiB, optional=True,
            consequence="skorch rebuilds the learning-rate schedulers from the history, "
            "which is not exact",
        ),
    )
})

#: Checkpoint files that older checkpoints lack; they load with a warning.
OPTIONAL_FILES = tuple(key for key, kind in KINDS.items() if kind.optional)


def max_bytes(key: str) -> int:
    """The most bytes a load reads from the file of ``key`` (any other
    ``f_<name>`` holds a state dict, as a parameter file does)."""
    kind = KINDS.get(key)
    return kind.max_bytes if kind is not None else TENSOR_FILE_MAX_BYTES
