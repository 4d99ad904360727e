"""Reading and checking the files of a net's state: torch and safetensors files through the checked
reader (the one place that calls ``torch.load``), the history, and a module's state against the module."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from ampnet.io.untrusted import (
    check_torch_file, check_values, is_path, max_bytes, open_untrusted, read_error, read_json, read_untrusted,
)
from ampnet.io.untrusted import brief as describe
from ampnet.utils.file_values import all_finite, dtype_kind, tensor_problem
from ampnet.utils.values import finite_number, is_int

__all__ = [
    "describe_target", "to_tensors", "from_tensors", "read_state", "read_params_file", "read_history",
    "check_module_state",
]


def describe_target(key: str, target: Any) -> str:
    if is_path(target):
        return f"{key} file {os.fspath(target)!r}"
    return f"{key} ({getattr(target, 'name', type(target).__name__)!r})"


def to_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, bool):
            out[key] = torch.tensor(value)
        elif isinstance(value, int):
            out[key] = torch.tensor(value, dtype=torch.int64)
        elif isinstance(value, float):
            out[key] = torch.tensor(value, dtype=torch.float64)
        else:
            out[key] = value
    return out


def from_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
        for key, value in state.items()
    }


def read_state(target: Any, source: str, safetensors: bool, map_location: Any,
                load_kwargs: dict[str, Any], limit: int) -> Any:
    """Read a torch or safetensors file: a path as
    :func:`ampnet.io.untrusted.open_untrusted` opens it (at most ``limit`` bytes;
    a torch file in zip format with uncompressed records, or in the legacy
    format with every declared storage within the file), or an open file.
    What it holds is checked by :func:`ampnet.io.untrusted.check_values`: no
    list inside itself nor more entries than the file has bytes (every
    place of a shared list counted), no int beyond float range, no tensor
    without values (meta, sparse, quantized).

    Parameters
    ----------
    target : str, os.PathLike or binary file object
      The file.

    source : str
      How messages name it (:func:`describe_target`).

    safetensors : bool
      Whether it is a safetensors file.

    map_location : torch.device, str or None
      As ``torch.load`` takes it.

    load_kwargs : dict
      Other arguments of ``torch.load`` (``{"weights_only": True}``).

    limit : int
      The largest size read (:func:`ampnet.io.untrusted.max_bytes`).

    Raises
    ------
    ValueError
      Naming ``source``: a file that cannot be read as this kind, or that
      :mod:`ampnet.io.untrusted` refuses.

    OSError
      A file that cannot be opened, naming ``source``.
    """
    if is_path(target):
        if safetensors:
            data = read_untrusted(target, source, limit)
            size: int | None = len(data)
            state = _read_state(data, source, True, map_location, load_kwargs)
        else:
            with open_untrusted(target, source, limit) as f:
                size = os.fstat(f.fileno()).st_size
                state = _read_state(check_torch_file(f, source), source, False, map_location,
                                    load_kwargs)
    else:
        size = _length(target)
        state = _read_state(target, source, safetensors, map_location, load_kwargs)
    return check_values(state, source, size)


def _length(f: Any) -> int | None:
    """The length of an open file (None when it cannot seek); its position
    is kept."""
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
    except (AttributeError, OSError, ValueError):
        return None
    return end if isinstance(end, int) else None


def read_params_file(path: Any, source: str | None = None, map_location: Any = "cpu") -> Any:
    """Read a parameters file (``params.pt``) with the checks and limits of
    ``load_params``: a regular file in its folder, at most
    :data:`ampnet.io.untrusted.TENSOR_FILE_MAX_BYTES`, torch's zip or legacy
    format within the file's size, ``weights_only=True`` (no code runs), and
    values that can be read as numbers (:func:`read_state`).

    Only what the file holds is read; it is not checked against a module
    (:func:`check_module_state` does that).

    Parameters
    ----------
    path : str or os.PathLike
      The file.

    source : str, optional
      How messages name it; default ``"f_params file '<path>'"``.

    map_location : torch.device, str or None, default "cpu"
      Where tensors are put, as ``torch.load`` takes it.

    Returns
    -------
    The object the file holds (a module ``state_dict``, with its
    ``_metadata``).

    Raises
    ------
    ValueError
      Naming the file: a special file (FIFO, device), a link out of its
      folder, a file too large, compressed or declaring more than it holds,
      one that is not a torch file, or one holding objects other than
      tensors and plain values.

    OSError
      A file that cannot be opened (``FileNotFoundError`` when missing).
    """
    if source is None:
        source = describe_target("f_params", path)
    return read_state(path, source, False, map_location, {"weights_only": True},
                      max_bytes("f_params"))


def _read_state(target: Any, source: str, safetensors: bool, map_location: Any,
                load_kwargs: dict[str, Any]) -> Any:
    try:
        if safetensors:
            # optional dependency: safetensors (only for use_safetensors=True)
            from safetensors.torch import load

            data = target if isinstance(target, bytes) else target.read()
            state = load(data)
            if map_location is not None and str(map_location) != "cpu":
                state = {k: v.to(map_location) for k, v in state.items()}
            return state
        return torch.load(target, map_location=map_location, **load_kwargs)
    except OSError as exc:
        raise read_error(source, exc) from exc
    except Exception as exc:  # whatever a damaged file makes the readers raise
        hint = (
            " It holds objects other than tensors and plain values, which a safe "
            "load refuses: it was not written by save_params, or it may be malicious."
            if isinstance(exc, pickle.UnpicklingError) else ""
        )
        kind = "safetensors" if safetensors else "torch"
        raise ValueError(
            f"{source} cannot be read as a {kind} file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else exc!r}).{hint} Fix: pass the file "
            "that save_params wrote, with the same use_safetensors setting."
        ) from exc


#: Counters of a history beyond this are not reached by any run.
_COUNT_MAX = 2**53


#: Epochs are numbered in int32 range (checkpoint names format them).
_EPOCH_MAX = 2**31 - 1


def _history_value_problem(key: str, value: Any) -> str | None:
    """What is wrong with one entry of an epoch or batch row, by its key."""
    if key.endswith(("_batch_count", "_batch_size")) or key in ("skipped_steps", "batch_size"):
        if not (is_int(value) and 0 <= value <= _COUNT_MAX):
            return f"{key!r} must be an int in [0, 2**53], got {describe(value)}"
    elif key.endswith("_best") or key == "step_skipped":
        if not isinstance(value, bool):
            return f"{key!r} must be true or false, got {describe(value)}"
    elif key == "dur":
        if not (finite_number(value) and value >= 0):
            return f"{key!r} must be a finite number >= 0 (seconds), got {describe(value)}"
    elif key == "loss_scale":
        if not (finite_number(value) and value > 0):
            return f"{key!r} must be a finite number > 0, got {describe(value)}"
    return None


def _history_row_problem(row: dict, previous: int) -> str | None:
    """What in one epoch row skorch or ampnet could not use later."""
    epoch = row.get("epoch", previous + 1)
    if not (is_int(epoch) and previous < epoch <= _EPOCH_MAX):
        return (
            f"'epoch' must be an int greater than the previous row's ({previous}), got "
            f"{describe(epoch)} (epochs are numbered up to 2**31 - 1)"
        )
    batches = row.get("batches", [])
    if not (isinstance(batches, list) and all(isinstance(b, dict) for b in batches)):
        return f"'batches' must be a list of dicts, got {describe(batches)}"
    for place, entries in [("", row)] + [(f"batch {j}: ", b) for j, b in enumerate(batches)]:
        for key, value in entries.items():
            problem = _history_value_problem(key, value)
            if problem:
                return place + problem
    return None


def read_history(target: Any, source: str) -> list:
    """Read a history file and check it against skorch's layout: a list of
    epoch rows, where present an increasing int ``epoch`` (at most
    2**31 - 1), ``batches`` (a list of dicts), ``*_batch_count``,
    ``*_batch_size`` and ``skipped_steps`` ints in [0, 2**53], boolean
    ``*_best`` and ``step_skipped`` flags, ``dur`` finite and >= 0 and
    ``loss_scale`` finite and > 0. Other entries (losses, scores) may hold
    any JSON value."""
    rows = read_json(target, source, "a JSON history", max_bytes("f_history"))
    if not (isinstance(rows, list) and all(isinstance(row, dict) for row in rows)):
        raise ValueError(
            f"{source} is not a skorch history: expected a JSON list of epoch dicts, got "
            f"{type(rows).__name__}."
        )
    previous = 0
    for index, row in enumerate(rows):
        problem = _history_row_problem(row, previous)
        if problem:
            raise ValueError(
                f"{source} is not a valid skorch history: in row {index}, {problem}. "
                "Nothing was loaded."
            )
        previous = row.get("epoch", previous + 1)
    return rows


def check_module_state(module: torch.nn.Module, state: Any, source: str, attr: str) -> None:
    """Check a module ``state_dict`` against ``module``: the same keys,
    dense tensors of the same shapes and dtype kinds (floating, integer,
    bool, complex), finite parameters, and buffers that are finite where
    the module's are.

    Raises
    ------
    ValueError
      Naming ``source`` and the entries in error.
    """
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{source} does not hold a module state_dict for net.{attr}: got "
            f"{type(state).__name__}."
        )
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(map(str, set(state) - set(own)))
    shapes, others = [], []
    for key, value in own.items():
        if key not in state or key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        saved = state[key]
        problem = tensor_problem(saved)
        if problem:
            others.append(f"{key} is {problem}")
        elif dtype_kind(saved) != dtype_kind(value):
            others.append(f"{key} holds {saved.dtype} values, the net {value.dtype} ({dtype_kind(value)})")
        elif not torch.nn.parameter.is_lazy(value) and saved.shape != value.shape:
            shapes.append(
                f"{key}: {tuple(saved.shape)} in the file, {tuple(value.shape)} in the net"
            )
        elif not all_finite(saved) and (
            isinstance(value, torch.nn.Parameter) or torch.nn.parameter.is_lazy(value)
            or all_finite(value.detach())
        ):
            what = "parameter" if isinstance(value, torch.nn.Parameter) else "buffer"
            others.append(f"{what} {key} holds NaN or inf values")
    if missing or unexpected or shapes or others:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:6]}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:6]}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:4]))
        parts += others[:4]
        raise ValueError(
            f"{source} does not match net.{attr}: {', '.join(parts)}. Was another file "
            "passed (e.g. the optimizer file as f_params), or was the module built with "
            "other sizes? Nothing was loaded."
        )
