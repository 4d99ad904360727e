"""torch files checked in the format ``torch.load`` will read them in,
before it builds anything (:func:`check_torch_file` tells the two apart by
their first bytes, as ``torch.load`` does).

**The zip format** (what ``torch.save`` writes): every record must be
stored uncompressed and within the file's size (a compressed record could
expand without bound while it is read), and the pickle ``data.pkl`` must
pass :func:`check_zip_pickle` on its skeleton.

**The legacy format** (``torch.save(..., _use_new_zipfile_serialization
=False)``, the only format of torch < 1.6) is a row of pickles followed by
the raw bytes of each storage::

    magic number | protocol version | system info | the object (storages as
    persistent ids) | the list of storage keys | for each key: its element
    count (int64) and its bytes

``torch.load`` allocates each storage at the size its persistent id declares
while it unpickles the object, before it reads any storage bytes, so a file
of a few hundred bytes could make it allocate terabytes.
:func:`check_torch_legacy` reads the same structure first without building
anything (:mod:`ampnet.io.untrusted.pickles`: every global the pickles name
becomes an inert placeholder, so no code runs and no tensor is allocated):
each storage the object uses must be listed once in the key list, of a known
storage type, with an element count that its own header in the data section
repeats and whose bytes lie within the file; each tensor built on a storage
must lie within it (torch grows a legacy storage to fit its tensor), and no
call may allocate what its arguments ask; no pickle may hold more entries
than the file has bytes (:mod:`ampnet.io.untrusted.values`). A file cannot
hold more bytes than it is long, so what torch then allocates is at most the
file's size. :class:`BoundedReader` caps every read at the file's end (a
pickle opcode's declared length cannot make a read allocate more) and hides
the file descriptor from torch.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from types import MappingProxyType
from typing import Any, BinaryIO

import torch

from ampnet.io.untrusted.pickles import HashedEntryError, SkeletonUnpickler, StorageRef, call_problem
from ampnet.io.untrusted.values import brief as describe
from ampnet.io.untrusted.values import check_structure
from ampnet.utils.values import is_int

__all__ = [
    "LEGACY_MAGIC", "check_torch_legacy", "check_zip_pickle", "BoundedReader",
    "check_torch_zip", "check_torch_file",
]

#: How torch tells a zip file (``torch.serialization._is_zipfile``).
_ZIP_MAGIC = b"PK\x03\x04"

#: What ``zipfile`` raises on a damaged archive.
_ZIP_ERRORS = (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError)

#: How a legacy file begins: torch's magic number, pickled with protocol 2.
LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)

#: The protocol version that torch's legacy files carry.
_PROTOCOL_VERSION = 1001

#: torch's storage classes, as a legacy file names them, and their dtypes.
_STORAGE_DTYPES: "MappingProxyType[str, torch.dtype]" = MappingProxyType({
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
})

_STORAGE_MODULES = ("torch", "torch.cuda")


class BoundedReader(io.RawIOBase):
    """A read-only view of ``f`` (``size`` bytes long) whose reads never ask
    for more than what is left before the end, and that has no file
    descriptor (so ``torch.load`` reads it through ``read``).

    Parameters
    ----------
    f : binary file object
      Seekable; it stays owned (and closed) by the caller.

    size : int
      The file's length in bytes.
    """

    def __init__(self, f: BinaryIO, size: int) -> None:
        super().__init__()
        self._f = f
        self._size = size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def _left(self) -> int:
        return max(0, self._size - self._f.tell())

    def read(self, n: int | None = -1) -> bytes:
        left = self._left()
        n = left if n is None or n < 0 else min(n, left)
        return self._f.read(n)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._f.read(min(len(view), self._left()))
        view[: len(data)] = data
        return len(data)

    def readline(self, limit: int | None = -1) -> bytes:
        left = self._left()
        return self._f.readline(left if limit is None or limit < 0 else min(limit, left))


def _refuse(source: str, problem: str) -> ValueError:
    return ValueError(
        f"{source} is a torch file in the legacy format (torch < 1.6, or "
        f"_use_new_zipfile_serialization=False) that cannot be read: {problem}. Nothing "
        "was loaded. Fix: pass the file that torch.save wrote; if you trust this one, "
        "load it with torch.load and save it again with torch.save (zip format)."
    )


def _storage_size(pid: Any, source: str) -> tuple[Any, int, int] | None:
    """(key, element count, bytes) of a storage persistent id; None for
    other persistent ids (a module's source)."""
    if not (isinstance(pid, tuple) and pid and pid[0] in ("storage", b"storage")):
        if isinstance(pid, tuple) and pid and pid[0] in ("module", b"module"):
            return None
        raise _refuse(source, f"a persistent id {describe(pid)} is neither a storage nor a module")
    if len(pid) != 6:
        raise _refuse(source, f"a storage id holds {len(pid)} fields, not 6")
    _, storage_type, key, _location, numel, _view = pid
    dtype = _dtype_of(storage_type)
    if dtype is None:
        module, name = getattr(storage_type, "module", None), getattr(storage_type, "name", None)
        raise _refuse(source, f"storage {describe(key)} has the unknown type {module}.{name}")
    if not (isinstance(key, (str, bytes, int)) and is_int(numel) and numel >= 0):
        raise _refuse(
            source, f"storage {describe(key)} declares {describe(numel)} elements (an int >= 0 is "
            "needed)"
        )
    return key, numel, numel * dtype.itemsize


def _dtype_of(ref: Any) -> torch.dtype | None:
    """The dtype of a storage type's placeholder (or of a storage's, or of a
    dtype's global); None when unknown."""
    if isinstance(ref, StorageRef):
        pid = ref.pid
        ref = pid[1] if isinstance(pid, tuple) and len(pid) == 6 else None
    module, name = getattr(ref, "module", None), getattr(ref, "name", None)
    if module in _STORAGE_MODULES and name in _STORAGE_DTYPES:
        return _STORAGE_DTYPES[name]
    found = getattr(torch, name, None) if module == "torch" and isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


def _storage_bytes(ref: Any) -> int | None:
    """The bytes a storage placeholder holds: its declared element count,
    or its view's (a legacy storage view: key, offset, size), checked
    within it; None for anything else."""
    if not isinstance(ref, StorageRef):
        return None
    pid = ref.pid
    dtype = _dtype_of(ref)
    if not (isinstance(pid, tuple) and len(pid) == 6 and dtype is not None and is_int(pid[4])):
        return None
    numel, view = pid[4], pid[5]
    if view is None:
        return numel * dtype.itemsize
    if not (isinstance(view, tuple) and len(view) == 3 and is_int(view[1]) and is_int(view[2])):
        return None
    _, offset, size = view
    return size * dtype.itemsize if 0 <= offset and 0 <= size and offset + size <= numel else None


def _read_skeleton(reader: BoundedReader, source: str) -> tuple[list[Any], list[Any], list[tuple[str, tuple]]]:
    """The five pickles of a legacy file (magic, protocol, system info, the
    object, the keys) read as skeletons: (pickles, persistent ids, calls);
    ``reader`` is left after them."""
    pickles: list[Any] = []
    persistent_ids: list[Any] = []
    calls: list[tuple[str, tuple]] = []
    try:
        for _ in range(5):
            unpickler = SkeletonUnpickler(reader)
            pickles.append(unpickler.load())
            persistent_ids += unpickler.persistent_ids
            calls += unpickler.calls
    except HashedEntryError as exc:
        raise _refuse(source, str(exc)) from exc
    except Exception as exc:  # whatever a damaged pickle makes the unpickler raise
        raise _refuse(source, f"its pickles are damaged ({type(exc).__name__}: {exc})") from exc
    return pickles, persistent_ids, calls


def _check_shapes(prefix: str, size: int, parts: tuple[tuple[str, Any], ...],
                  persistent_ids: list[Any], calls: list[tuple[str, tuple]]) -> None:
    """Before anything walks them: no list inside itself, no more entries
    than the file has bytes, in each part, the storage ids and the call
    arguments (refused as ``f"{prefix}{part})"``)."""
    parts += (("storage ids", persistent_ids), ("call arguments", [args for _, args in calls]))
    for part, value in parts:
        check_structure(value, f"{prefix}{part})", size)


def _call_problem(calls: list[tuple[str, tuple]], tensors: bool) -> str | None:
    """The first of ``calls`` that :func:`ampnet.io.untrusted.pickles.call_problem`
    refuses, with its problem; None when none is."""
    counts: dict[int, tuple[Any, int]] = {}
    for name, args in calls:
        problem = call_problem(name, args, _storage_bytes, _dtype_of, tensors=tensors, counts=counts)
        if problem:
            return problem
    return None


def _declared_storages(keys: Any, persistent_ids: list[Any], source: str) -> dict[Any, tuple[int, int]]:
    """(element count, bytes) of each storage the object uses, by key,
    after the key list was found to list each of them exactly once."""
    if not (isinstance(keys, list) and all(isinstance(k, (str, bytes, int)) for k in keys)):
        raise _refuse(source, f"the storage key list is {describe(keys)}")
    declared: dict[Any, tuple[int, int]] = {}
    for pid in persistent_ids:
        found = _storage_size(pid, source)
        if found is not None and found[0] not in declared:
            declared[found[0]] = found[1:]
    if len(set(keys)) != len(keys) or set(keys) != set(declared):
        raise _refuse(
            source, f"the key list {describe(keys)} does not list each of the "
            f"{len(declared)} storages that the object uses exactly once"
        )
    return declared


def _check_data_section(f: BinaryIO, keys: list[Any], declared: dict[Any, tuple[int, int]],
                        position: int, size: int, source: str) -> None:
    """Each storage's data, from ``position`` on: its header repeats its
    element count, and its bytes lie within the file."""
    for key in keys:
        numel, nbytes = declared[key]
        if position + 8 + nbytes > size:
            raise _refuse(
                source, f"storage {key!r} declares {numel} elements ({nbytes} bytes), but only "
                f"{max(0, size - position - 8)} bytes of the file's {size} follow its header "
                "(a file cannot hold more than it is long)"
            )
        f.seek(position)
        (header,) = struct.unpack("<q", f.read(8))
        if header != numel:
            f.seek(0)
            raise _refuse(
                source, f"storage {key!r} declares {numel} elements, its data header {header}"
            )
        position += 8 + nbytes


def check_torch_legacy(f: BinaryIO, size: int, source: str) -> BoundedReader:
    """Check the structure of a legacy torch file (see the module's text)
    without building any of it.

    Parameters
    ----------
    f : binary file object
      The file, seekable; it is left at its start.

    size : int
      Its length in bytes.

    source : str
      How messages name it.

    Returns
    -------
    BoundedReader
      ``f`` behind a reader that ``torch.load`` may read.

    Raises
    ------
    ValueError
      Naming ``source``: a storage that declares more bytes than the file
      holds after it, one of an unknown type, one not listed (or listed
      twice) in the key list, a data header that disagrees with its
      declaration, a tensor that reaches past its storage, a call that
      allocates what its arguments ask, a structure that holds itself or
      more entries than the file has bytes, or one that is not a legacy
      file's.
    """
    reader = BoundedReader(f, size)
    reader.seek(0)
    try:
        pickles, persistent_ids, calls = _read_skeleton(reader, source)
        data_start = reader.tell()
    finally:
        reader.seek(0)
    parts = (("system information", pickles[2]), ("object", pickles[3]), ("storage key list", pickles[4]))
    _check_shapes(f"{source} (legacy format, its ", size, parts, persistent_ids, calls)
    if pickles[1] != _PROTOCOL_VERSION:
        raise _refuse(source, f"protocol version {describe(pickles[1])}, not {_PROTOCOL_VERSION}")
    keys = pickles[4]
    declared = _declared_storages(keys, persistent_ids, source)
    problem = _call_problem(calls, tensors=True)
    if problem:
        raise _refuse(source, problem)
    _check_data_section(f, keys, declared, data_start, size, source)
    f.seek(0)
    return reader


def check_zip_pickle(data: bytes, size: int, source: str) -> None:
    """Check the pickle (``data.pkl``) of a torch zip file on its skeleton
    (:mod:`ampnet.io.untrusted.pickles`) before ``torch.load`` builds it: no
    dict key or set entry too large to hash, no list inside itself nor more
    entries than the file's ``size`` in bytes (every place counted), and no
    call that allocates what its arguments ask
    (:func:`ampnet.io.untrusted.pickles.call_problem`; the file's storages
    cannot grow, so torch itself refuses a tensor that reaches past its
    storage).

    Raises
    ------
    ValueError
      Naming ``source``.
    """
    unpickler = SkeletonUnpickler(io.BytesIO(data))
    obj = None
    try:
        obj = unpickler.load()
    except HashedEntryError as exc:
        raise ValueError(f"{source} cannot be loaded: {exc}. Nothing was loaded.") from exc
    except Exception:  # a damaged or malicious pickle: torch.load refuses it with its own
        pass  # error, after the calls before the damage, which are checked here
    _check_shapes(f"{source} (its ", size, (("content", obj),), unpickler.persistent_ids, unpickler.calls)
    problem = _call_problem(unpickler.calls, tensors=False)
    if problem:
        raise ValueError(
            f"{source} cannot be loaded: {problem}; torch.save never writes such a call. "
            "Nothing was loaded. Fix: pass the file that save_params wrote."
        )


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
    except _ZIP_ERRORS as exc:
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
            except _ZIP_ERRORS as exc:
                raise ValueError(f"{source} cannot be read as a torch file ({type(exc).__name__}: "
                                 f"{exc}). Nothing was loaded.") from exc
            finally:
                f.seek(0)
            check_zip_pickle(data, size, source)


def check_torch_file(f: BinaryIO, source: str) -> BinaryIO:
    """Check a torch file in the format that ``torch.load`` will read it in
    (zip when it begins as a zip file does, else legacy): the zip format as
    :func:`check_torch_zip` checks it, the legacy format as
    :func:`check_torch_legacy` does.

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
    head = f.read(len(LEGACY_MAGIC))
    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    if head == LEGACY_MAGIC:
        return check_torch_legacy(f, size, source)
    check_torch_zip(f, source)
    if not head.startswith(_ZIP_MAGIC):  # a zip archive that torch would read as a legacy file
        raise ValueError(
            f"{source} cannot be read as a torch file: it does not begin as torch's zip "
            "format does (torch would read it as a legacy file, which it is not). Nothing "
            "was loaded. Fix: pass the file that save_params wrote."
        )
    return f
