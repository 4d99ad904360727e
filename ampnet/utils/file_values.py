"""Checks of what a loaded file holds: a tensor a load can use, nesting depth, and whether a loaded
value can replace the live one it stands for.

Every function here only inspects; none changes its arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ampnet.utils.values import describe, finite_number, is_bool, is_number

__all__ = ["MAX_DEPTH", "dtype_kind", "tensor_problem", "all_finite", "nesting_depth", "type_mismatch"]


#: Deepest nesting of lists and dicts accepted in a loaded JSON or state file.
MAX_DEPTH = 64

def dtype_kind(t: torch.Tensor) -> str:
    """``'bool'``, ``'complex'``, ``'floating'`` or ``'integer'``."""
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    return "floating" if t.is_floating_point() else "integer"

def tensor_problem(value: Any) -> str | None:
    """Why ``value`` is not a plain tensor that can be loaded."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} instead of a tensor"
    if value.layout != torch.strided:
        return f"a {value.layout} tensor instead of a dense one"
    if value.device.type == "meta" or value.is_quantized:
        return f"a {value.device.type} {value.dtype} tensor without loadable values"
    return None

def all_finite(value: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or inf (always true for integers)."""
    if dtype_kind(value) not in ("floating", "complex"):
        return True
    return bool(torch.isfinite(value).all())

def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of lists, tuples and dicts in ``value``, counted without
    recursion; stops counting at ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, Mapping)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            children = item.values() if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest

def type_mismatch(reference: Any, value: Any, path: str, finite: bool = False,
                  depth: int = 0) -> str | None:
    """Why ``value`` cannot replace ``reference`` (a value of the same field
    in a live object), or None when it can.

    Numbers replace numbers (``finite``: only finite ones, so not an int
    beyond float range such as ``10**400``), booleans booleans, strings
    strings; a one-element tensor may stand for a number where it holds a
    value (not a meta, sparse or quantized tensor); lists and tuples replace
    each other, element by element with the same length (any length when
    the reference is empty); a dict may hold only keys of the reference
    dict. A reference of None accepts anything. Never raises for a hostile
    ``value``: every problem is returned as text.
    """
    if depth > MAX_DEPTH:
        return f"{path} is nested deeper than {MAX_DEPTH} levels"
    if reference is None:
        return None
    if is_bool(reference):
        return None if is_bool(value) else f"{path} must be True or False, got {describe(value)}"
    if is_number(reference) or (isinstance(reference, torch.Tensor) and reference.numel() == 1):
        number = value
        if isinstance(value, torch.Tensor):
            problem = tensor_problem(value)
            if problem is not None:
                return f"{path} must be a number, got {problem}"
            if value.numel() == 1 and not value.is_complex():
                number = value.item()
        if not is_number(number):
            return f"{path} must be a number, got {describe(value)}"
        if finite and not finite_number(number):
            return f"{path} must be a finite number, got {describe(value)}"
        return None
    if isinstance(reference, str):
        return None if isinstance(value, str) else f"{path} must be a str, got {describe(value)}"
    if isinstance(reference, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            return f"{path} must be a list, got {describe(value)}"
        if reference and len(value) != len(reference):
            return f"{path} must have {len(reference)} entries, got {len(value)}"
        for i, item in enumerate(value):
            ref = reference[i] if reference else None
            problem = type_mismatch(ref, item, f"{path}[{i}]", finite, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(reference, Mapping):
        if not isinstance(value, Mapping):
            return f"{path} must be a dict, got {describe(value)}"
        unknown = sorted(str(k) for k in value if k not in reference)
        if unknown:
            return f"{path} holds unknown keys {unknown[:6]}"
        for key, item in value.items():
            problem = type_mismatch(reference[key], item, f"{path}[{key!r}]", finite, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(reference, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            return f"{path} must be a tensor, got {describe(value)}"
        if value.shape != reference.shape:
            return f"{path} must have shape {tuple(reference.shape)}, got {tuple(value.shape)}"
        return None
    return None
