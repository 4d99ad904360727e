"""Reading a value that may be hostile: whether it is a bool (numpy booleans too), an int or a number,
its float, and its description and that of an exception for a message (bounded, never raising).

Every function here only inspects; none changes its arguments.
"""

from __future__ import annotations

import builtins
import math
from numbers import Integral, Real
from typing import Any

import numpy as np

__all__ = ["is_bool", "describe", "type_name", "exception_text", "is_number", "is_int", "as_float", "finite_number"]


def is_bool(value: Any) -> bool:
    """Whether ``value`` is ``True``/``False``, as Python or numpy booleans
    (scikit-learn accepts both)."""
    return isinstance(value, (bool, np.bool_))

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
