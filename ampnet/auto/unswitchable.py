"""What ``amp_enabled='auto'`` may choose, checked when a net is initialized
or its parameters change (the net calls :func:`check_choosable` after
:mod:`ampnet.config.reconfigure` planned the change, before anything
changes): settings that cannot be switched to and from float32 between two
steps are refused (:func:`refuse_unswitchable`), and the mixed-precision
candidate must be a valid setting with the net's others.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ampnet.config.params import is_auto
from ampnet.precision import build_settings

__all__ = ["check_choosable", "refuse_unswitchable"]


def check_choosable(values: Mapping[str, Any] | None) -> None:
    """Refuse ``amp_enabled='auto'`` with settings it cannot choose between
    (``values``: the net's parsed parameters, as planned; None: nothing to
    check). On a device without autocast there is nothing to choose: the
    device's choice is float32, and nothing is refused.

    Raises
    ------
    ValueError, TypeError
      Naming the parameter, its value and the fix.
    """
    if values is None or not is_auto(values.get("amp_enabled")):
        return
    device = _device(values.get("device"))
    if device is not None and torch.amp.is_autocast_available(device.type) and (
            device.type != "cuda" or torch.cuda.is_available()):
        refuse_unswitchable(values)
        # what 'auto' may choose must be valid (a master-weights setting narrows it to 'pure')
        build_settings({**values, "amp_enabled": True})


def _device(value: Any) -> torch.device | None:
    try:
        return torch.device(value or "cpu")
    except (RuntimeError, TypeError):
        return None


def refuse_unswitchable(params: Mapping[str, Any]) -> None:
    """Refuse ``'auto'`` with settings that cannot be switched to and from
    float32 between two steps (``params``: checked constructor values).

    Raises
    ------
    ValueError
      Naming the parameter, its value and the fix.
    """
    if params.get("amp_dtype") == "float8":
        raise ValueError(
            "amp_enabled='auto' chooses between float32 and bfloat16 or float16 mixed precision, never float8 "
            "(on a CPU float8 is only emulated; on a GPU it pays on large matmuls only, which a short "
            "measurement does not decide). Fix: pin it, with amp_enabled=True and amp_dtype='float8', or "
            "amp_dtype='auto'.")
    for name, default in (("amp_level", "mixed"), ("amp_master_weights", True), ("amp_modules", None)):
        value = params.get(name, default)
        if value != default and not (value is default):
            raise ValueError(
                f"amp_enabled='auto' chooses between float32 and mixed precision, measured in the fit's own "
                f"steps, and cannot switch to {name}={value!r} between two steps (the weights or their "
                f"precision regions would be rebuilt). Fix: pin it, with amp_enabled=True and {name}={value!r}, "
                f"or keep {name}={default!r} with amp_enabled='auto'.")
