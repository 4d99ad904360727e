"""Whether the device a net is given exists on this machine.

skorch passes ``device`` straight to ``.to()``, so a device that is not
there fails deep inside torch (``AssertionError: Torch not compiled with
CUDA enabled``, ``RuntimeError: PyTorch is not linked with support for mps
devices``). :func:`check_device` raises one clear ``ValueError`` instead, at
``initialize()``, with AMP on or off.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

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


def check_device(device: Any, name: str = "device") -> None:
    """Raise a ``ValueError`` if ``device`` is not usable on this machine.

    ``None`` (skorch's "leave the module where it is"), strings that are not
    torch devices (skorch hands them to ``.to()``, which a custom module may
    accept; with AMP on, :func:`ampnet.precision.policy.resolve_precision` refuses
    them) and devices whose availability torch cannot report are accepted.

    Parameters
    ----------
    device : str, torch.device or None
      The net's ``device``.

    name : str (default='device')
      The parameter name used in the message.

    Raises
    ------
    ValueError
      ``device`` names a device type that is not available (``'cuda'`` without CUDA, ``'cuda:3'`` on a machine with two
      GPUs, ``'mps'`` off Apple silicon, ``'xla'`` without ``torch_xla``).
    """
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        # not a torch device string: skorch passes it to .to(), which custom
        # modules may accept; with AMP on, resolve_precision refuses it
        return
    if dev.type in ("cpu", "meta"):
        return
    ok, count = _available(dev.type)
    label = _NAMES.get(dev.type, dev.type)
    if ok is False:
        raise ValueError(
            f"{name}={device!r}, but {label} is not available on this machine "
            f"({_why_not(dev.type)}). Fix: {name}='cpu', or {_how_to_get(dev.type, label)}."
        )
    if ok and count is not None and dev.index is not None and dev.index >= count:
        raise ValueError(
            f"{name}={device!r}, but this machine has {count} {label} device(s) "
            f"(indices 0 to {count - 1}). Fix: {name}='{dev.type}:0' or another index below "
            f"{count}."
        )
