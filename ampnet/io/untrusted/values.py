"""What a file held, checked before anything else reads it: its shape
(:func:`check_structure`), then its numbers (:func:`check_values`).

**Shape.** A pickle (and so a torch file) can hold the same list, tuple or
dict in many places: each place costs two bytes (a memo reference), yet a
walk that visits every place visits it again. Nested ``k`` levels deep, a
list that holds its inner list twice has ``2**k`` paths, so a file of a few
KB can make any check that walks it (or a ``repr`` of it) run for ever; a
list can also hold itself. :func:`structure_problem` counts the places of a
structure the way a walk would reach them, without walking them (each
distinct list, tuple and dict is visited once, from the counts of its
entries), and :func:`check_structure` refuses:

- a list, tuple or dict that holds itself (directly or deeper);
- more entries, every place counted, than the file has bytes (at least
  :data:`MIN_ENTRIES`): a structure as ``torch.save`` or ``json.dump``
  writes it costs at least one byte per entry, a shared tuple of settings
  included.

Every later check then walks at most one entry per byte of the file.
:func:`brief` is the bounded ``describe`` of the io package: it shows the
first entries of a structure, never its whole ``repr``.

**Numbers.** Python ints have no size limit, so a JSON or pickle file can
hold ``10**400``; ``float()``, ``math.isfinite`` and string formatting of
such an int raise ``OverflowError``. A pickle can also hold tensors without
values (``torch.empty((), device="meta")``), whose ``item()`` raises
``RuntimeError``. :func:`unusable_value` finds the first such value, so that
:func:`ampnet.io.state_files.read_state` and :func:`ampnet.io.untrusted.opening.read_json`
refuse the file with its name and the field before any field check reads
it; the field checks use the overflow-safe tests of
:mod:`ampnet.utils.values` (``as_float``, ``finite_number``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ampnet.utils.file_values import MAX_DEPTH, tensor_problem
from ampnet.utils.values import as_float, is_number, type_name

__all__ = [
    "MIN_ENTRIES", "structure_problem", "check_structure", "brief", "refusal", "unusable_value",
    "check_values",
]

#: The fewest entries a structure may hold, whatever the file's size.
MIN_ENTRIES = 1 << 16

_CONTAINERS = (list, tuple, set, frozenset, Mapping)


def _children(item: Any, top: bool = False) -> list[tuple[str, Any]]:
    """The entries of a container, with their path steps (a top-level str
    key as it is, deeper ones indexed; a dict's own attributes, such as a
    ``state_dict``'s ``_metadata``, included)."""
    if isinstance(item, Mapping):
        children = [
            (key if top and isinstance(key, str) else f"[{brief(key, 40, typed=False)}]", child)
            for key, child in item.items()
        ]
        extra = getattr(item, "__dict__", None)
        if isinstance(extra, dict):
            children += [(f".{name}", child) for name, child in extra.items()]
        return children
    if isinstance(item, (set, frozenset)):
        return [(f"<{i}>", child) for i, child in enumerate(item)]
    return [(f"[{i}]", child) for i, child in enumerate(item)]


def structure_problem(data: Any, max_entries: int,
                      counts: dict[int, tuple[Any, int]] | None = None) -> tuple[str, str] | None:
    """The first field of ``data`` that holds itself, or the field that
    holds more than ``max_entries`` entries with every place counted.

    Parameters
    ----------
    data : object
      What a file held (lists, tuples, sets and dicts are walked; anything
      else counts as one entry).

    max_entries : int
      The most entries accepted.

    counts : dict, optional
      The entries of the lists, tuples and dicts counted so far (by id,
      with the object, which it keeps alive), shared between calls over
      parts of one structure so that each is counted once.

    Returns
    -------
    (field, problem) or None
      ``field`` as a path (``"['state'][0]"``; ``""`` for ``data``).
    """
    if counts is None:
        counts = {}  # id -> (object, entries, every place counted)
    open_ids: set[int] = set()
    # (item, path, its entries, next entry, entries counted so far)
    stack: list[list[Any]] = []
    walked = 0  # entries walked: the walk stops after max_entries of them

    def enter(item: Any, path: str) -> str | None:
        if id(item) in open_ids:
            return path
        open_ids.add(id(item))
        stack.append([item, path, _children(item, item is data), 0, 1])
        return None

    if not isinstance(data, _CONTAINERS):
        return None
    enter(data, "")
    while stack:
        frame = stack[-1]
        item, path, children, index, total = frame
        if total > max_entries or walked > max_entries:
            return _short_path(path), (
                f"holds {_about(total)} entries or more when each place of a list, tuple or dict "
                f"that it holds several times over is counted, more than the {max_entries} that "
                "a file of its size can hold"
            )
        if index < len(children):
            frame[3] += 1
            walked += 1
            step, child = children[index]
            if not isinstance(child, _CONTAINERS):
                frame[4] += 1
            elif id(child) in counts:
                frame[4] += counts[id(child)][1]
            else:
                cycle = enter(child, path + step)
                if cycle is not None:
                    return _short_path(cycle), "holds itself (a list, tuple or dict inside itself)"
            continue
        stack.pop()
        open_ids.discard(id(item))
        counts[id(item)] = (item, total)
        if stack:
            stack[-1][4] += total
    return None


def _short_path(path: str) -> str:
    return path if len(path) <= 80 else path[:77] + "..."


def _about(n: int) -> str:
    return str(n) if n < 10**9 else f"more than 2**{n.bit_length() - 1}"


def refusal(source: str, found: tuple[str, str], why: str) -> ValueError:
    """The error that refuses file ``source``: ``found`` is (the field, or
    '' for the whole content; the problem), ``why`` what is wrong with it."""
    field, problem = found
    where = f"field {field}" if field else "its content"
    return ValueError(f"{source} cannot be loaded: {where} {problem}. {why}. Nothing was loaded. "
                      "Fix: pass the file that save_params wrote.")


def check_structure(data: Any, source: str, size: int | None) -> Any:
    """``data``, after :func:`structure_problem` found nothing in it with a
    limit of ``size`` entries (at least :data:`MIN_ENTRIES`).

    Parameters
    ----------
    data : object
      What the file held.

    source : str
      How messages name the file.

    size : int or None
      The file's length in bytes; None when unknown (then
      :data:`MIN_ENTRIES` times 256, the entries of a 16 MiB file).

    Raises
    ------
    ValueError
      Naming ``source`` and the field.
    """
    limit = max(MIN_ENTRIES, size if size is not None else MIN_ENTRIES * 256)
    found = structure_problem(data, limit)
    if found is not None:
        raise refusal(source, found, "ampnet never writes such a structure (a file built to make a load walk "
                                     "without end?)")
    return data


#: A structure of at most this many entries (every place counted) is shown
#: by its own ``repr``.
_SMALL = 64


def _repr(value: Any) -> str:
    """``repr(value)``; never raises."""
    try:
        return repr(value)
    except ValueError:  # an int beyond Python's digit limit for str
        return f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else "<no repr>"
    except Exception:  # a hostile object's repr
        return "<no repr>"


def _text(value: Any, room: int) -> str:
    """A ``repr`` of ``value`` cut to about ``room`` characters, built from
    as many entries as fit (never the whole of a large structure)."""
    if room <= 0:
        return ""
    if isinstance(value, (str, bytes, bytearray)):
        return repr(value[:room])[: room + 1]
    if not isinstance(value, _CONTAINERS) or structure_problem(value, _SMALL) is None:
        return _repr(value)[: room + 1]  # a small structure: its own repr, which is short
    ends = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
    parts, used = [ends[0]], 1
    items = value.items() if isinstance(value, Mapping) else value
    for n, entry in enumerate(items):
        if used >= room:
            parts.append("...")
            break
        if n:
            parts.append(", ")
            used += 2
        if isinstance(value, Mapping):
            key, entry = entry
            text = _text(key, room - used) + ": "
            text += _text(entry, room - used - len(text))
        else:
            text = _text(entry, room - used)
        parts.append(text)
        used += len(text)
    parts.append(ends[1])
    return "".join(parts)


def brief(value: Any, width: int = 80, typed: bool = True) -> str:
    """``repr`` and type of ``value``, as :func:`ampnet.utils.values.describe`
    gives them, but built from at most ``width`` characters of entries: a
    structure of any size (or one that holds the same list many times over)
    costs no more than its first entries.

    Parameters
    ----------
    value : object
      What to describe.

    width : int, default 80
      The most characters of ``repr`` shown (cut with ``...``).

    typed : bool, default True
      Whether the type follows, in parentheses.
    """
    text = _text(value, width + 1)
    if len(text) > width:
        text = text[: width - 3] + "..."
    return f"{text} ({type_name(type(value))})" if typed else text


# ---- numbers: every value usable as a number or a tensor ----------------------


def _value_problem(value: Any) -> str | None:
    if is_number(value) and as_float(value) is None:
        return (
            f"holds the number {brief(value)}, beyond the range of a float "
            "(about 1.8e308)"
        )
    if isinstance(value, torch.Tensor):
        problem = tensor_problem(value)
        if problem:
            return f"is {problem}"
    return None


def _number_children(item: Any, top: bool) -> list[tuple[str, Any]]:
    """The entries that :func:`unusable_value` walks: as :func:`_children`,
    but sets left out, keys shown by their ``repr`` and of a dict's own
    attributes only a ``state_dict``'s ``_metadata`` (the fields that
    refusals have always named)."""
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
        children = _number_children(item, depth == 0)
        if children:
            seen.add(id(item))
            stack.extend((path + key, child, depth + 1) for key, child in reversed(children))
    return None


def check_values(data: Any, source: str, size: int | None = None) -> Any:
    """``data``, after :func:`check_structure` (no list
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
