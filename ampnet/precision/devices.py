"""Whether the device a net is given exists on this machine.

skorch passes ``device`` straight to ``.to()``, so a device that is not
there fails deep inside torch (``AssertionError: Torch not compiled with
CUDA enabled``, ``RuntimeError: PyTorch is not linked with support for mps
devices``). :func:`check_device` raises one clear ``ValueError`` instead, at
``initialize()``, with AMP on or off.
"""

from __future__ import annotations

import importlib.util
import operator
from numbers import Integral
from typing import Any

import numpy as np
import torch

from ampnet.utils.values import describe

__all__ = ["check_device"]

_NAMES = {"cuda": "CUDA", "mps": "MPS (Apple GPU)", "xpu": "XPU (Intel GPU)", "xla": "XLA (TPU)"}


def _available(kind: str) -> tuple[bool | None, int | None]:
    """(available, device count) for a device type; None: cannot tell."""
    if kind == "cuda":
        ok = torch.cuda.is_available()
        return ok, torch.cuda.device_count() if ok else 0
    if kind == "mps":
        return bool(torch.backends.mps.is_available()), None
    if kind == "xla":
        return importlib.util.find_spec("torch_xla") is not None, None
    backend = getattr(torch, kind, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available):
        ok = bool(is_available())
        count = getattr(backend, "device_count", None)
        return ok, (count() if ok and callable(count) else None)
    return None, None


def _why_not(kind: str) -> str:
    if kind == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"torch {torch.__version__} is a CPU-only build"
        return "no GPU was found"
    if kind == "xla":
        return "torch_xla is not installed"
    return f"torch {torch.__version__} reports it unavailable"


def _how_to_get(kind: str, label: str) -> str:
    if kind == "xla":
        return "install torch_xla on a machine with a TPU"
    if kind == "cuda":
        return "run on a machine with an NVIDIA GPU and a CUDA build of torch"
    return f"run on a machine that has {label}"


_FIX = "Fix: device='cpu', device='cuda' (or 'cuda:0') for the GPU, or None to leave the module where it is."
_KINDS = ("None, a device string such as 'cpu', 'cuda', 'cuda:0' or 'mps', a torch.device, or an int >= 0 "
          "(an accelerator index, as torch.device(0) reads it)")
#: The largest index torch.device takes (an int64).
_MAX_INDEX = 2**63 - 1


def _unavailable(name: str, device: Any, kind: str) -> ValueError:
    """The refusal of a device of ``kind`` that this machine does not have."""
    label = _NAMES.get(kind, kind)
    return ValueError(
        f"{name}={device!r}, but {label} is not available on this machine "
        f"({_why_not(kind)}). Fix: {name}='cpu', or {_how_to_get(kind, label)}."
    )


def check_device(device: Any, name: str = "device") -> None:
    """Raise a ``ValueError`` if ``device`` is not a device, or not usable
    on this machine.

    Accepted: ``None`` (skorch's "leave the module where it is"), strings
    that ``torch.device`` reads, ``torch.device`` objects and ints >= 0 (an
    accelerator index), where the device exists or torch cannot tell. A
    string torch does not read (``'gpu'``) is refused here, AMP on or off:
    skorch would hand it to the module's ``.to()``, which raises torch's
    ``RuntimeError`` at ``initialize()``, after ``set_params`` had taken it.

    Parameters
    ----------
    device : str, torch.device, int or None
      The net's ``device``.

    name : str (default='device')
      The parameter name used in the message.

    Raises
    ------
    ValueError
      ``device`` is of another type (a bool, a float such as ``0.5`` or NaN),
      a negative or too large int, the ``'meta'`` device (it holds no
      values: nothing can be trained or predicted there), or a device type
      that is not available (``'cuda'`` without CUDA, ``'cuda:3'`` on a
      machine with two GPUs, ``'mps'`` off Apple silicon, ``'xla'`` without
      ``torch_xla``).
    """
    if device is None:
        return
    if isinstance(device, str):
        device = str.__str__(device)  # a str subclass is read as the str it holds
    elif isinstance(device, Integral) and not isinstance(device, (bool, np.bool_)):
        try:
            index = operator.index(device)  # numpy ints too
        except Exception:  # noqa: BLE001 - a hostile __index__ is refused below
            index = None
        if type(index) is not int or not 0 <= index <= _MAX_INDEX:
            raise ValueError(
                f"{name} must be {_KINDS}; got {describe(device)}, which is not a device index "
                f"(an int in [0, 2**63 - 1]). {_FIX}")
        device = index
    elif not isinstance(device, torch.device):
        raise ValueError(f"{name} must be {_KINDS}; got {describe(device)}. {_FIX}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        if isinstance(device, int):
            # an accelerator index where this torch has no accelerator at all (a CPU-only
            # build refuses torch.device(0)): the missing device's own error, as for 'cuda:0'
            raise _unavailable(name, device, "cuda") from None
        raise ValueError(
            f"{name} must be a torch device such as 'cpu', 'cuda', 'cuda:1' or 'mps'; got {describe(device)}. "
            f"{_FIX}") from None
    shown = describe(device)
    if dev.type == "meta":
        raise ValueError(
            f"{name}={shown} is torch's device without data: a module there holds no values, so "
            f"nothing can be trained or predicted on it. {_FIX}")
    if dev.type == "cpu":
        return
    ok, count = _available(dev.type)
    label = _NAMES.get(dev.type, dev.type)
    if ok is False:
        raise _unavailable(name, device, dev.type)
    if ok and count is not None and dev.index is not None and dev.index >= count:
        raise ValueError(
            f"{name}={device!r}, but this machine has {count} {label} device(s) "
            f"(indices 0 to {count - 1}). Fix: {name}='{dev.type}:0' or another index below "
            f"{count}."
        )
