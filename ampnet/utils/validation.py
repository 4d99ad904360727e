"""Checks of untrusted values: what a loaded file holds, and flags that may
come as numpy booleans.

Every function here only inspects; none changes its arguments.
"""

from __future__ import annotations

import builtins
import difflib
import math
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

__all__ = [
    "is_bool", "is_int", "is_number", "as_float", "finite_number", "close_names", "describe", "type_name",
    "exception_text",
    "type_mismatch",
    "nesting_depth", "dtype_kind", "tensor_problem", "all_finite", "MAX_DEPTH",
]

#: Deepest nesting of lists and dicts accepted in a loaded JSON or state file.
MAX_DEPTH = 64


def is_bool(value: Any) -> bool:
    """Whether ``value`` is ``True``/``False``, as Python or numpy booleans
    (scikit-learn accepts both)."""
    return isinstance(value, (bool, np.bool_))


def named_with_hints(prefix: str, unknown: Any, valid: Any) -> str:
    """``prefix__name`` for each of the ``unknown`` names, with the closest
    ``valid`` one where there is one: ``'grad_scaler__growth_factr (did you
    mean grad_scaler__growth_factor?)'``, comma-separated."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(valid), n=1)
        hints.append(f"{prefix}__{key}" + (f" (did you mean {prefix}__{close[0]}?)" if close else ""))
    return ", ".join(hints)


def close_names(unknown: Any, valid: Any) -> str:
    """``' Did you mean amp_enabled (for amp_enable)?'`` for each of the
    ``unknown`` names with a close ``valid`` one (difflib's), ``''`` where
    none has one."""
    valid = list(valid)
    pairs = [(name, difflib.get_close_matches(name, valid, n=1)) for name in unknown]
    found = [f"{close[0]} (for {name})" for name, close in pairs if close]
    return f" Did you mean {', '.join(found)}?" if found else ""


def describe(value: Any, limit: int = 80) -> str:
    """``repr`` and type of ``value``; a type named like a builtin but from
    another module is qualified (``np.True_ (numpy.bool)``, not ``(bool)``).

    Never raises, and the text is at most ``limit`` characters plus the
    type's name: a value whose ``__repr__`` raises (or returns something
    that is not a str) is shown by its type alone, an int beyond Python's
    digit limit for ``str`` by its size.
    """
    cls = type(value)
    name = type_name(cls)
    try:
        text = repr(value)
    except Exception as exc:  # an int beyond the digit limit (ValueError), a hostile __repr__
        if isinstance(value, int) and isinstance(exc, ValueError):
            text = f"<an int of {int.bit_length(value)} bits>"
        else:
            text = f"<a {name} whose repr raised {type_name(type(exc))}>"
    if not isinstance(text, str) or type(text) is not str:  # a str subclass may be hostile too
        text = str.__str__(text) if isinstance(text, str) else "<no repr>"
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{text} ({name})"


def type_name(cls: type) -> str:
    """``cls``'s name, qualified by its package where a builtin has the
    same name; never raises (a class may define odd ``__module__`` or
    ``__name__`` attributes)."""
    try:
        name = type.__dict__["__name__"].__get__(cls)
        module = type.__dict__["__module__"].__get__(cls)
        if isinstance(module, str) and module != "builtins" and hasattr(builtins, name):
            name = f"{module.split('.')[0]}.{name}"
        return name
    except Exception:
        return "object"


def exception_text(exc: BaseException, limit: int = 120) -> str:
    """``'RuntimeError: boom'`` for an exception, bounded to ``limit``
    characters; never raises (an exception raised by a hostile value may
    have a hostile ``__str__``)."""
    name = type_name(type(exc))
    try:
        text = str(exc)
        if type(text) is not str:
            text = ""
    except Exception:
        text = ""
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{name}: {text}" if text else name


def is_number(value: Any) -> bool:
    """A real number that is not a boolean."""
    return isinstance(value, Real) and not is_bool(value)


def is_int(value: Any) -> bool:
    """An integer that is not a boolean."""
    return isinstance(value, Integral) and not is_bool(value)


def as_float(value: Any) -> float | None:
    """``value`` as a Python float, or None where it is not a real number or
    lies beyond float64's range (an int such as ``10**400``, which
    ``float()`` and ``math.isfinite`` refuse with ``OverflowError``)."""
    if not is_number(value):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        return None


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a real number (not a boolean) that converts to
    a finite float; ``10**400``, NaN and inf are not."""
    number = as_float(value)
    return number is not None and math.isfinite(number)


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
