"""Numbers read from a file: a check that every value a load hands on can be
used as a number (or a tensor) without raising something other than a
``ValueError``.

Python ints have no size limit, so a JSON or pickle file can hold
``10**400``; ``float()``, ``math.isfinite`` and string formatting of such an
int raise ``OverflowError``. A pickle can also hold tensors without values
(``torch.empty((), device="meta")``), whose ``item()`` raises
``RuntimeError``. :func:`unusable_value` finds the first such value in a
loaded structure, so that :func:`ampnet.io.files.read_state` and
:func:`ampnet.io.atomic.read_json` refuse the file with its name and the
field before any field check reads it; :func:`finite_number` is the
overflow-safe test that the field checks use (defined in
:mod:`ampnet.utils.validation`, the lower layer, and re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# as_float and finite_number live in the lower layer (ampnet.utils.validation, whose
# type_mismatch needs them) and are re-exported here for the field checks
from ampnet.io.structure import brief as describe
from ampnet.io.structure import check_structure, refusal
from ampnet.utils.validation import MAX_DEPTH, as_float, finite_number, is_number, tensor_problem

__all__ = ["as_float", "finite_number", "unusable_value", "check_values"]


def _value_problem(value: Any) -> str | None:
    if is_number(value) and as_float(value) is None:
        return (
            f"holds the number {describe(value)}, beyond the range of a float "
            "(about 1.8e308)"
        )
    if isinstance(value, torch.Tensor):
        problem = tensor_problem(value)
        if problem:
            return f"is {problem}"
    return None


def _children(item: Any, top: bool) -> list[tuple[str, Any]]:
    if isinstance(item, Mapping):
        children = [
            (key if top and isinstance(key, str) else f"[{key!r}]", child)
            for key, child in item.items()
        ]
        metadata = getattr(item, "_metadata", None)  # a module state_dict's
        if isinstance(metadata, Mapping):
            children.append(("._metadata", metadata))
        return children
    if isinstance(item, (list, tuple)):
        return [(f"[{i}]", child) for i, child in enumerate(item)]
    return []


def unusable_value(data: Any, limit: int = MAX_DEPTH) -> tuple[str, str] | None:
    """The first value in ``data`` (dicts, lists and tuples, walked without
    recursion to ``limit`` levels) that no number check can read: an int
    beyond float64's range, or a tensor without loadable values (meta,
    sparse, quantized).

    Returns
    -------
    (field, problem) or None
      ``field`` as a path: a top-level key as it is, deeper ones indexed
      (``"state[0]['step']"``; ``""`` for ``data`` itself); ``problem``
      says what it holds.
    """
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    seen: set[int] = set()
    while stack:
        path, item, depth = stack.pop()
        problem = _value_problem(item)
        if problem:
            return path, problem
        if depth >= limit or id(item) in seen:
            continue
        children = _children(item, depth == 0)
        if children:
            seen.add(id(item))
            stack.extend((path + key, child, depth + 1) for key, child in reversed(children))
    return None


def check_values(data: Any, source: str, size: int | None = None) -> Any:
    """``data``, after :func:`ampnet.io.structure.check_structure` (no list
    inside itself, at most one entry per byte of the file, every place of a
    shared list counted) and :func:`unusable_value` found nothing in it.

    Parameters
    ----------
    data : object
      What the file held.

    source : str
      How messages name the file.

    size : int or None
      The file's length in bytes (None: unknown).

    Raises
    ------
    ValueError
      Naming ``source``, the field and the value.
    """
    check_structure(data, source, size)
    found = unusable_value(data)
    if found is not None:
        raise refusal(source, found, "Numbers in a checkpoint are finite floats or ints within float range, "
                                     "tensors are dense with values")
    return data
