"""The skeleton of a torch pickle: its structure read without building
anything, so that what ``torch.load`` would build can be judged first.

:class:`SkeletonUnpickler` is the pure-Python unpickler (its reads go
through the file object's ``read``, so :class:`ampnet.io.legacy.BoundedReader`
caps them) with every global replaced by an inert placeholder class that
records each call of it with its arguments, and every persistent id
(a storage) by a :class:`StorageRef` that keeps the id. No code of the
pickle runs and no tensor is allocated.

Building a dict or a set hashes its keys, and the hash of a tuple visits
every place of it: a key that holds the same tuple many times over (2**60
paths in a few hundred bytes) would make the unpickler, and ``torch.load``
after it, hash for ever. Before a key or set entry is hashed, the skeleton
counts its places (:func:`ampnet.io.structure.structure_problem`, each
distinct tuple once) and refuses one of more than :data:`HASHED_ENTRIES`.
"""

from __future__ import annotations

import _compat_pickle
import pickle
from typing import Any, BinaryIO, Iterable

from ampnet.io.structure import structure_problem

__all__ = ["HASHED_ENTRIES", "HashedEntryError", "StorageRef", "SkeletonUnpickler", "hashed_problem"]

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class StorageRef(_Placeholder):
    """What a persistent id becomes: a placeholder that keeps the id."""

    def __init__(self, pid: Any) -> None:
        self.pid = pid


def hashed_problem(values: Iterable[Any], counts: dict[int, tuple[Any, int]]) -> str | None:
    """Why one of ``values`` (about to be hashed) is too large to hash; None
    when none is (``counts`` as :func:`ampnet.io.structure.structure_problem`
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

    def _load_setitem(self) -> None:
        self._check_hashed(self.stack[-2:-1])
        pickle._Unpickler.load_setitem(self)

    def _load_setitems(self) -> None:  # the items since the mark are on the stack
        self._check_hashed(self.stack[0::2])
        pickle._Unpickler.load_setitems(self)

    def _load_dict(self) -> None:
        self._check_hashed(self.stack[0::2])
        pickle._Unpickler.load_dict(self)

    def _load_additems(self) -> None:
        self._check_hashed(self.stack)
        pickle._Unpickler.load_additems(self)

    def _load_frozenset(self) -> None:
        self._check_hashed(self.stack)
        pickle._Unpickler.load_frozenset(self)

    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset
