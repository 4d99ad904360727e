"""Where a tensor is, as torch's ``.to(device)`` sees it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_on"]


def is_on(t: torch.Tensor, device: Any) -> bool:
    """Whether ``t.to(device)`` (skorch's ``to_tensor(t, device)``) leaves ``t``
    where it is: ``device`` None, or the same device; a device without an
    index means its type's current device (for CUDA, ``torch.cuda.current_device()``)."""
    if device is None:
        return True
    if device == "cpu":
        return t.is_cpu
    device = device if isinstance(device, torch.device) else torch.device(device)
    if t.device.type != device.type:
        return False
    if device.type == "cpu":  # "cpu:0" copies
        return device.index is None
    if device.index is not None:
        return t.device.index == device.index
    return device.type != "cuda" or t.device.index == torch.cuda.current_device()
