"""The one walker over nested batches: tensors inside tuples, named tuples,
lists and dicts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from ampnet.utils.dtypes import LOW_PRECISION_DTYPES

__all__ = ["map_tensors", "iter_tensors", "cast_floating", "has_nonfinite", "nonfinite_flag"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``;
    containers keep their type, other objects are returned unchanged."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside ``obj``, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from iter_tensors(value)


def cast_floating(obj: Any, dtype: torch.dtype, only: tuple = LOW_PRECISION_DTYPES) -> Any:
    """Cast the tensors of ``obj`` whose dtype is in ``only`` to ``dtype``."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.dtype in only and t.dtype != dtype else t)


def nonfinite_flag(obj: Any) -> torch.Tensor | None:
    """A boolean tensor, True when a floating tensor of ``obj`` holds NaN or
    inf, computed without reading the device (None: no floating tensor)."""
    flags = [(~torch.isfinite(t)).any() for t in iter_tensors(obj) if t.is_floating_point()]
    if not flags:
        return None
    return torch.stack([f.to(flags[0].device) for f in flags]).any()


def has_nonfinite(obj: Any) -> bool:
    """Whether a (possibly nested) batch holds a floating NaN or inf."""
    return any(
        t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in iter_tensors(obj)
    )
