"""The one place where a load opens a file of a checkpoint folder.

A checkpoint folder may come from anywhere, so every file in it is opened
as untrusted:

- **Regular files only.** A FIFO, a device (``/dev/zero``), a socket or a
  directory is refused before it is opened, and again after (the file is
  opened with ``O_NONBLOCK``, so that a FIFO swapped in between cannot
  block, and ``O_NOFOLLOW``; ``fstat`` must then report a regular file).
- **Links stay in the folder.** A symbolic link is followed only to a file
  in the directory that holds the link (or below it); a link that leaves
  it (``history.json -> ../outside.txt``, ``-> /dev/zero``) is refused.
  The directory itself may be reached through links.
- **A size limit per kind of file** (:mod:`ampnet.io.kinds`): larger files
  are refused before they are read, and no more than the limit is read.
- **torch files** must be in torch's zip format with every record stored
  uncompressed, as ``torch.save`` writes them (and a pickle whose skeleton
  :func:`ampnet.io.legacy.check_zip_pickle` accepts), or in torch's legacy format
  with every storage it declares held in the file
  (:mod:`ampnet.io.legacy`), so that reading one never allocates more than
  the file's size (a compressed record could expand without bound, a
  legacy storage declare any size). :func:`check_torch_file` tells the two
  apart by their first bytes, as ``torch.load`` does.

Every refusal is a ValueError that names the file; a file that cannot be
opened raises an OSError that names it.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from typing import Any, BinaryIO

from ampnet.io.legacy import check_torch_legacy, check_zip_pickle, is_torch_legacy

__all__ = ["open_untrusted", "read_untrusted", "check_torch_file", "check_torch_zip", "read_error"]

#: How torch tells a zip file (``torch.serialization._is_zipfile``).
_ZIP_MAGIC = b"PK\x03\x04"

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
                "ampnet reads from this kind of file (see ampnet.io.kinds). Nothing was "
                "loaded. Fix: pass the file that save_params wrote."
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


def check_torch_zip(f: BinaryIO, source: str) -> None:
    """Refuse a torch file that is not in torch's zip format with records
    stored uncompressed and within the file's size; ``f`` is left at its
    start.

    Raises
    ------
    ValueError
      Naming ``source``.
    """
    f.seek(0, io.SEEK_END)
    size = f.tell()
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as exc:
        raise ValueError(
            f"{source} cannot be read as a torch file: it is not in torch's zip format "
            f"({type(exc).__name__}: {exc}). ampnet reads only the zip format that "
            "torch.save writes, and torch's legacy format (torch < 1.6). Nothing was loaded. "
            "Fix: pass the file that save_params wrote, with the same use_safetensors setting."
        ) from exc
    finally:
        f.seek(0)
    compressed = [r.filename for r in records if r.compress_type != zipfile.ZIP_STORED]
    if compressed or sum(r.file_size for r in records) > size:
        raise ValueError(
            f"{source} cannot be read as a torch file: it holds compressed records "
            f"{compressed[:4]} or records larger than the file; torch.save stores every record uncompressed, and a compressed one could "
            "expand without bound while it is read. Nothing was loaded. Fix: pass the file "
            "that save_params wrote."
        )
    for record in records:
        if record.filename == "data.pkl" or record.filename.endswith("/data.pkl"):
            try:
                with zipfile.ZipFile(f) as archive:
                    data = archive.read(record)
            except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as exc:
                raise ValueError(f"{source} cannot be read as a torch file ({type(exc).__name__}: "
                                 f"{exc}). Nothing was loaded.") from exc
            finally:
                f.seek(0)
            check_zip_pickle(data, size, source)


def check_torch_file(f: BinaryIO, source: str) -> BinaryIO:
    """Check a torch file in the format that ``torch.load`` will read it in
    (zip when it begins as a zip file does, else legacy): the zip format as
    :func:`check_torch_zip` checks it, the legacy format as
    :func:`ampnet.io.legacy.check_torch_legacy` does.

    Returns
    -------
    file object
      What to pass to ``torch.load``: ``f`` itself (zip), or ``f`` behind a
      reader that never reads past its end (legacy); at its start.

    Raises
    ------
    ValueError
      Naming ``source``: neither format, or a file that the checks refuse.
    """
    f.seek(0)
    head = f.read(len(_ZIP_MAGIC))
    f.seek(0)
    if head != _ZIP_MAGIC and is_torch_legacy(f):
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
        return check_torch_legacy(f, size, source)
    check_torch_zip(f, source)
    if head != _ZIP_MAGIC:  # a zip archive that torch would read as a legacy file
        raise ValueError(
            f"{source} cannot be read as a torch file: it does not begin as torch's zip "
            "format does (torch would read it as a legacy file, which it is not). Nothing "
            "was loaded. Fix: pass the file that save_params wrote."
        )
    return f
