"""A torch pickle read as a skeleton, without building anything, and the
calls it would make judged before ``torch.load`` makes them.

**The skeleton.** :class:`SkeletonUnpickler` is the pure-Python unpickler
(its reads go through the file object's ``read``, so
:class:`ampnet.io.untrusted.torch_files.BoundedReader` caps them) with every
global replaced by an inert placeholder class that records each call of it
with its arguments, and every persistent id (a storage) by a
:class:`StorageRef` that keeps the id. No code of the pickle runs and no
tensor is allocated.

Building a dict or a set hashes its keys, and the hash of a tuple visits
every place of it: a key that holds the same tuple many times over (2**60
paths in a few hundred bytes) would make the unpickler, and ``torch.load``
after it, hash for ever. Before a key or set entry is hashed, the skeleton
counts its places (:func:`ampnet.io.untrusted.values.structure_problem`,
each distinct tuple once) and refuses one of more than
:data:`HASHED_ENTRIES`.

**The calls.** ``torch.load(weights_only=True)`` lets a pickle call a short
list of torch functions and classes. Some of them allocate what their
arguments say, not what the file holds: a tensor rebuilt over a storage with
a size and stride that reach past its end makes torch grow the storage (in
the legacy format, whose storages can grow), ``bytearray(n)``,
``torch.FloatTensor(n)`` or ``torch.UntypedStorage(n)`` allocate ``n``
elements, a quantized tensor its whole size. :func:`call_problem` judges one
recorded call (the qualified name of the global and its arguments): a tensor
must lie within the storage it is built on, and the calls that
``torch.save`` never writes with a size (the tensor and storage classes,
``bytearray`` of a number, quantized, nested and subclass tensors) are
refused, and so is a set, Counter or OrderedDict over entries too large to
hash.
"""

from __future__ import annotations

import _compat_pickle
import pickle
from typing import Any, BinaryIO, Callable, Iterable

import torch

from ampnet.io.untrusted.values import brief, structure_problem

__all__ = [
    "HASHED_ENTRIES", "HashedEntryError", "StorageRef", "SkeletonUnpickler", "hashed_problem",
    "TENSOR_REBUILDS", "call_problem",
]

#: The most entries (every place counted) of a tuple or frozenset that is a
#: dict key or a set entry; torch's own files use str and int keys.
HASHED_ENTRIES = 256


class HashedEntryError(ValueError):
    """A dict key or set entry too large to hash."""


class _Placeholder:
    """What every global of a skeleton becomes: it accepts any construction
    and any state, and does nothing."""

    module = ""
    name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Placeholder":
        return object.__new__(cls)

    def _ignore(self, *args: Any, **kwargs: Any) -> None:
        pass

    __init__ = __setstate__ = __setitem__ = append = extend = add = _ignore


class StorageRef(_Placeholder):
    """What a persistent id becomes: a placeholder that keeps the id."""

    def __init__(self, pid: Any) -> None:
        self.pid = pid


def hashed_problem(values: Iterable[Any], counts: dict[int, tuple[Any, int]]) -> str | None:
    """Why one of ``values`` (about to be hashed) is too large to hash; None
    when none is (``counts`` as :func:`ampnet.io.untrusted.values.structure_problem`
    takes it, shared between calls)."""
    for value in values:
        if isinstance(value, (tuple, frozenset)) and id(value) not in counts:
            found = structure_problem(value, HASHED_ENTRIES, counts)
            if found is not None:
                field, problem = found
                return f"a dict key or set entry{' at ' + field if field else ''} {problem}"
    return None


class SkeletonUnpickler(pickle._Unpickler):  # the pure-Python one: reads go through the file's read
    """Unpickles the skeleton of a pickle (see the module): ``calls`` lists
    ``(qualified name, arguments)`` of every call of a global,
    ``persistent_ids`` every persistent id.

    Raises
    ------
    HashedEntryError
      From ``load``: a dict key or set entry of more than
      :data:`HASHED_ENTRIES` entries.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file, encoding="latin1")
        self.persistent_ids: list[Any] = []
        self.calls: list[tuple[str, tuple]] = []
        self._counts: dict[int, tuple[Any, int]] = {}

    def find_class(self, module: str, name: str) -> type:
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as pickle maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        calls = self.calls

        def record(cls: type, *args: Any, **kwargs: Any) -> _Placeholder:
            calls.append((f"{module}.{name}", args))
            return object.__new__(cls)

        return type(name, (_Placeholder,), {"module": module, "name": name, "__new__": record})

    def persistent_load(self, pid: Any) -> Any:
        self.persistent_ids.append(pid)
        return StorageRef(pid)

    def _check_hashed(self, values: Iterable[Any]) -> None:
        problem = hashed_problem(values, self._counts)
        if problem:
            raise HashedEntryError(problem)


def _hashing(load: Callable[[Any], None], hashed: Callable[[list], Iterable[Any]]) -> Callable[[Any], None]:
    """The unpickler's ``load`` of an opcode that hashes ``hashed(stack)``,
    those entries checked first."""
    def checked(self: SkeletonUnpickler) -> None:
        self._check_hashed(hashed(self.stack))
        load(self)
    return checked


# the opcodes that build a dict or a set, and the entries on the stack they hash
# (SETITEMS and DICT: the items since the mark, key first)
for _opcode, _load, _hashed in (
    (pickle.SETITEM, pickle._Unpickler.load_setitem, lambda stack: stack[-2:-1]),
    (pickle.SETITEMS, pickle._Unpickler.load_setitems, lambda stack: stack[0::2]),
    (pickle.DICT, pickle._Unpickler.load_dict, lambda stack: stack[0::2]),
    (pickle.ADDITEMS, pickle._Unpickler.load_additems, lambda stack: stack),
    (pickle.FROZENSET, pickle._Unpickler.load_frozenset, lambda stack: stack),
):
    SkeletonUnpickler.dispatch[_opcode[0]] = _hashing(_load, _hashed)
del _opcode, _load, _hashed


# ---- the calls: what they would allocate ---------------------------------------


#: The functions that rebuild a tensor over a storage: their arguments
#: begin (storage, storage_offset, size, stride).
TENSOR_REBUILDS = frozenset({
    "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
})

#: Tensors that ampnet refuses anyway, and whose rebuilding may allocate
#: their declared size (or that no checkpoint holds).
_NEVER = frozenset({
    "torch._utils._rebuild_qtensor", "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_wrapper_subclass", "torch._utils._rebuild_device_tensor_from_numpy",
})


def _allocates_by_argument(name: str) -> bool:
    """Whether calling the global ``name`` allocates what its arguments
    ask (the tensor and storage classes)."""
    module, _, cls = name.rpartition(".")
    return module in ("torch", "torch.cuda", "torch.sparse", "torch.cuda.sparse", "torch.storage") and (
        cls.endswith(("Tensor", "Storage"))
    )


def _ints(value: Any) -> list[int] | None:
    """``value`` as a list of ints >= 0 (a tuple or list of them)."""
    if not isinstance(value, (tuple, list)):
        return None
    if not all(type(v) is int and v >= 0 for v in value):
        return None
    return list(value)


def _tensor_problem(name: str, args: tuple, storage_bytes: Callable[[Any], int | None],
                    dtype_of: Callable[[Any], torch.dtype | None]) -> str | None:
    if len(args) < 4:
        return f"{name} is called with {len(args)} arguments"
    storage, offset, size, stride = args[:4]
    nbytes = storage_bytes(storage)
    if nbytes is None:
        return f"{name} is called on {brief(storage)}, not a storage of the file"
    sizes, strides = _ints(size), _ints(stride)
    if sizes is None or strides is None or len(sizes) != len(strides) or not (
        type(offset) is int and offset >= 0
    ):
        return (
            f"a tensor has the offset {brief(offset)}, size {brief(size)} and stride "
            f"{brief(stride)} (ints >= 0, as many strides as sizes, are needed)"
        )
    dtype = dtype_of(storage) if name != "torch._utils._rebuild_tensor_v3" or len(args) < 7 else dtype_of(args[6])
    if dtype is None:
        return f"a tensor has the unknown dtype {brief(args[6] if len(args) > 6 else storage)}"
    extent = 0 if 0 in sizes else offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
    need = max(extent, offset) * dtype.itemsize
    if need > nbytes:
        return (
            f"a tensor of size {tuple(sizes)}, stride {tuple(strides)} and offset {offset} "
            f"reaches {need} bytes into a storage of {nbytes} bytes (torch would grow the "
            "storage to fit)"
        )
    return None


def _hashed_arguments(name: str, args: tuple) -> list[Any]:
    """What a call of the global ``name`` hashes: the entries of a set or
    Counter, the keys of an OrderedDict's pairs."""
    first = args[0] if args else None
    if name in ("builtins.set", "builtins.frozenset", "collections.Counter"):
        if isinstance(first, dict):
            return list(first)
        return list(first) if isinstance(first, (list, tuple, set, frozenset)) else []
    if name == "collections.OrderedDict" and isinstance(first, (list, tuple)):
        return [pair[0] for pair in first if isinstance(pair, (list, tuple)) and pair]
    return []


def call_problem(name: str, args: tuple, storage_bytes: Callable[[Any], int | None],
                 dtype_of: Callable[[Any], torch.dtype | None], tensors: bool = True,
                 counts: dict[int, tuple[Any, int]] | None = None) -> str | None:
    """Why the call of the global ``name`` with ``args`` could allocate more
    than the file holds; None when it cannot.

    Parameters
    ----------
    name : str
      The qualified name of the global (``"torch._utils._rebuild_tensor_v2"``).

    args : tuple
      Its arguments, as recorded (storages and globals as placeholders).

    storage_bytes : callable
      The bytes of a storage placeholder declared in the file; None for
      anything else.

    dtype_of : callable
      The dtype of a storage placeholder or of a dtype's global; None when
      unknown.

    tensors : bool, default True
      Whether to check tensors against their storages (a zip file's
      storages cannot grow: torch refuses such a tensor itself).

    counts : dict, optional
      Shared between the calls of one file: the tuples already counted
      before they are hashed (:func:`hashed_problem`).
    """
    hashed = hashed_problem(_hashed_arguments(name, args), {} if counts is None else counts)
    if hashed:
        return f"it calls {name} over {hashed}"
    if name in TENSOR_REBUILDS:
        return _tensor_problem(name, args, storage_bytes, dtype_of) if tensors else None
    if name in _NEVER:
        return f"it calls {name}, a kind of tensor that a checkpoint never holds"
    if _allocates_by_argument(name) and args:
        return f"it calls {name}{brief(args, 40, typed=False)}, which allocates what its arguments ask"
    if name == "builtins.bytearray" and args and not isinstance(args[0], (str, bytes)):
        return f"it calls bytearray({brief(args[0], 40, typed=False)}), which allocates what it is asked"
    return None
