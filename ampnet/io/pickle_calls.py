"""What the calls of a torch pickle would allocate, judged before torch
makes them.

``torch.load(weights_only=True)`` lets a pickle call a short list of torch
functions and classes. Some of them allocate what their arguments say, not
what the file holds: a tensor rebuilt over a storage with a size and stride
that reach past its end makes torch grow the storage (in the legacy format,
whose storages can grow), ``bytearray(n)``, ``torch.FloatTensor(n)`` or
``torch.UntypedStorage(n)`` allocate ``n`` elements, a quantized tensor its
whole size. :func:`call_problem` judges one recorded call (the qualified
name of the global and its arguments, as the skeleton reader of
:mod:`ampnet.io.legacy` records them): a tensor must lie within the storage
it is built on, and the calls that ``torch.save`` never writes with a size
(the tensor and storage classes, ``bytearray`` of a number, quantized,
nested and subclass tensors) are refused, and so is a set, Counter or
OrderedDict over entries too large to hash
(:data:`ampnet.io.skeleton.HASHED_ENTRIES`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ampnet.io.skeleton import hashed_problem
from ampnet.io.structure import brief

__all__ = ["TENSOR_REBUILDS", "call_problem"]

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
      before they are hashed (:func:`ampnet.io.skeleton.hashed_problem`).
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
