"""Where ``ampnet.GradScaler`` keeps its state, and reading that of a
scaler pickled by ampnet 0.3 (which kept its settings and scale in torch's
own fields): the attributes it owns, its settings' plain Python types, and
the conversion of a 0.3 pickle's ``__dict__``, read as data only."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SETTING_NAMES", "ONLY_IN_0_3", "cast_setting", "as_float", "own_state", "state_of_0_3"]

#: The settings of a scaler (``get_settings()``), in constructor order.
SETTING_NAMES = (
    "init_scale", "growth_factor", "backoff_factor", "growth_interval",
    "min_scale", "max_scale", "hysteresis", "dynamic", "enabled",
)
_INT_SETTINGS = ("growth_interval", "hysteresis")
_BOOL_SETTINGS = ("dynamic", "enabled")

def cast_setting(name: str, value: Any) -> Any:
    """A setting as the plain Python type the scaler keeps."""
    if name in _INT_SETTINGS:
        return int(value)
    if name in _BOOL_SETTINGS:
        return bool(value)
    return float(value)


def as_float(value: Any) -> float:
    """A scale as a Python float (a state may hold a one-element tensor)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def own_state(device: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The attributes that a :class:`GradScaler` keeps its state in, for a
    scaler that has not scaled yet."""
    return {
        "_ampnet_device": device,
        "_ampnet_settings": settings,
        "_start_scale": settings["init_scale"],  # the scale tensor starts here
        "_start_good_steps": 0,
        "_loss_scale": None,
        "_good_steps": None,
        "_overflow_count": 0,
        "_streak": None,
        "_step_records": {},
        "_planned": None,
        "scaled_in_step": False,
    }


#: Attributes of ampnet 0.3's scaler that this version keeps elsewhere
#: (``_ampnet_settings``); torch's own fields stay, as torch's part.
ONLY_IN_0_3 = ("_init_scale_setting", "_min_scale", "_max_scale", "_hysteresis", "_dynamic", "_allow_fp16")


def state_of_0_3(state: dict[str, Any]) -> dict[str, Any]:
    """The attributes of this version from the ``__dict__`` of a scaler
    pickled by ampnet 0.3, which kept its settings and scale in torch's
    fields: the pickle's keys are read as data, never torch's live state."""
    enabled = bool(state["_enabled"])
    settings = {
        "init_scale": state["_init_scale_setting"],
        "growth_factor": state["_growth_factor"],
        "backoff_factor": state["_backoff_factor"],
        "growth_interval": state["_growth_interval"],
        "min_scale": state["_min_scale"],
        "max_scale": state["_max_scale"],
        "hysteresis": state["_hysteresis"],
        "dynamic": state["_dynamic"],
        "enabled": enabled,
    }
    own = own_state(str(state["_device"]), {k: cast_setting(k, v) for k, v in settings.items()})
    if enabled:  # torch's __getstate__ put the scale and the tracker there as plain values
        own["_start_scale"] = as_float(state["_init_scale"])
        own["_start_good_steps"] = int(state["_init_growth_tracker"])
    own["_overflow_count"] = int(state.get("_overflow_count", 0))
    own["scaled_in_step"] = bool(state.get("scaled_in_step", False))
    return own
