"""Checks of loss-scaler settings and of loaded scaler states: every value
is refused with its name, what it holds and the valid range before a scaler
is built or a state is loaded."""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

import torch

from ampnet.precision.scaler_state import cast_setting
from ampnet.utils.values import describe, exception_text, is_bool
from ampnet.utils.file_values import tensor_problem
from ampnet.utils.values import is_int as _is_int
from ampnet.utils.values import is_number as _is_number

__all__ = ["validate_scaler_settings", "validate_scaler_state", "STATE_VERSION", "FLOAT32_TINY", "FLOAT32_MAX"]

STATE_VERSION = 1


#: The scale is a float32 tensor: it must stay within float32's normal
#: positive range, or it turns into 0 or inf.
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_RANGE = f"[{FLOAT32_TINY:.8g}, {FLOAT32_MAX:.8g}]"

#: Step counters live in int32 tensors.
_INT32_MAX = 2**31 - 1


def _finite(value: Any) -> bool:
    """A real number that is not NaN or infinite; an int too large for a
    float (``10**400``) counts as finite, so that the range checks refuse
    it by the range (``math.isfinite`` raises OverflowError for it)."""
    if not _is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return isinstance(value, Integral)


def _shown(value: Any) -> str:
    """``repr(value)``, or for a long one (a 400-digit int) its start with
    the type."""
    text = repr(value)
    return text if len(text) <= 80 else describe(value)


def _in_float32_range(value: Any) -> bool:
    return _finite(value) and FLOAT32_TINY <= value <= FLOAT32_MAX


def _rule(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be scaler setting ``name``, or None."""
    if name in ("init_scale", "min_scale", "max_scale"):
        if not (_finite(value) and value > 0):
            return "must be a finite number > 0, e.g. 65536.0"
        if not _in_float32_range(value):
            return (f"must lie within float32's normal positive range {_RANGE}, because the "
                    "scale is a float32 tensor (a smaller value becomes 0, a larger one inf); "
                    "e.g. 65536.0")
    elif name == "growth_factor":
        if not (_finite(value) and value > 1):
            return "must be a finite number > 1, e.g. 2.0"
        if value > FLOAT32_MAX:
            return f"must be at most float32's largest value {FLOAT32_MAX:.8g}, e.g. 2.0"
    elif name == "backoff_factor":
        if not (_is_number(value) and 0 < value < 1):
            return "must be a number in (0, 1), e.g. 0.5"
        if value < FLOAT32_TINY:
            return f"must be at least float32's smallest normal value {FLOAT32_TINY:.8g}, e.g. 0.5"
    elif name in ("growth_interval", "hysteresis"):
        if not (_is_int(value) and 1 <= value <= _INT32_MAX):
            return ("must be an int >= 1 and at most 2**31 - 1 (the scaler counts steps in int32 "
                    "tensors), e.g. 2000 for growth_interval, 1 for hysteresis")
    elif name in ("enabled", "dynamic"):
        if not is_bool(value):
            return "must be True or False"
    return None


#: The settings that :func:`_setting_problems` checks, in the order of its lines.
_CHECKED = ("init_scale", "min_scale", "max_scale", "growth_factor", "backoff_factor", "growth_interval",
            "hysteresis", "enabled", "dynamic")


def _value_rule(name: str, value: Any) -> tuple[str | None, Any]:
    """(why ``value`` cannot be setting ``name`` or None, the plain Python
    value the scaler keeps): checked as given, then as converted. Never
    raises for a hostile value (one whose comparisons or conversions
    raise): that is a rule too."""
    try:
        rule = _rule(name, value)
        if rule is not None:
            return rule, None
        converted = cast_setting(name, value)
        rule = _rule(name, converted)  # the value the scaler keeps
        if rule is not None:
            return f"is {converted!r} as the scaler keeps it, which {rule}", None
        return None, converted
    except Exception as exc:  # noqa: BLE001 - raised by the value's own methods
        return (f"could not be read as a number (it raised {exception_text(exc)}); pass a plain "
                "Python or numpy number"), None


def _bounds_rule(plain: dict[str, Any], p: str) -> tuple[str, str] | None:
    """(the setting, why) where the plain values of ``min_scale``,
    ``max_scale`` and ``init_scale`` do not fit together (``p`` put in front
    of the names in the rule); None when they do."""
    if "min_scale" not in plain or "max_scale" not in plain:
        return None
    lo, hi = plain["min_scale"], plain["max_scale"]
    if lo > hi:
        return "min_scale", f"must not exceed {p}max_scale={hi!r}"
    if "init_scale" in plain and not lo <= plain["init_scale"] <= hi:
        return "init_scale", (f"must lie within [{p}min_scale, {p}max_scale] = [{lo!r}, {hi!r}]; "
                              "change init_scale or widen the bounds")
    return None


def _setting_problems(settings: dict[str, Any], prefix: str, quoted: bool = False) -> list[str]:
    """One line per bad setting: ``{prefix}{name}={value} ({type}): {rule}``
    (``'{name}' = ...`` when ``quoted``, for the fields of a state).

    A value is checked as given and as the plain Python type the scaler
    keeps (``float(value)``, ``int(value)``): a number whose conversion
    raises, or gives a value out of range, is refused here rather than
    when the scaler takes it (:func:`_value_rule`); then the bounds
    together (:func:`_bounds_rule`).
    """
    rules: list[tuple[str, str]] = []
    plain: dict[str, Any] = {}
    for name in _CHECKED:
        if name in settings:
            rule, converted = _value_rule(name, settings[name])
            if rule is None:
                plain[name] = converted
            else:
                rules.append((name, rule))
    if not rules:
        found = _bounds_rule(plain, "" if quoted else prefix)
        rules += [found] if found else []
    return [
        (f"'{name}' = " if quoted else f"{prefix}{name}=") + f"{describe(settings[name])}: {rule}"
        for name, rule in rules
    ]


def validate_scaler_settings(prefix: str = "grad_scaler__", **settings: Any) -> None:
    """Check loss-scaler settings; raise one ValueError that lists every problem.

    Only the settings passed are checked. ``prefix`` is put in front of each
    name in the message, so that it names the parameter as the user set it.
    ``init_scale``, ``min_scale`` and ``max_scale`` must lie within
    float32's normal positive range, ``growth_factor`` must be at most
    float32's largest value and ``backoff_factor`` at least its smallest
    normal value, so that the scale (a float32 tensor) never becomes 0 or
    inf. Booleans may be numpy booleans.

    Raises
    ------
    ValueError
      If any setting is out of range or of the wrong type.
    """
    problems = _setting_problems(settings, prefix)
    if problems:
        raise ValueError(
            "Invalid loss-scaler settings:\n- " + "\n- ".join(problems)
            + "\nFix: pass values in the ranges given (e.g. the defaults)."
        )


#: Entries of a scaler state_dict, with what each must hold (settings are
#: checked as in validate_scaler_settings).
_TRACKERS = {
    "_growth_tracker": "an int in [0, 2**31 - 1] (torch keeps it in an int32 tensor)",
    "_overflow_streak": "an int >= 0 and at most 2**31 - 1 (ampnet keeps it in an int32 tensor)",
}
_SETTINGS_IN_STATE = (
    "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
    "hysteresis", "dynamic",
)


def _check_is_scaler_state(state: Any, source: str) -> None:
    """Refuse what is no enabled scaler's state: not a dict, an empty one
    (a disabled scaler's), or one without the keys every state has."""
    if not isinstance(state, dict):
        raise ValueError(
            f"{source} does not hold a loss-scaler state: expected a dict, got "
            f"{type(state).__name__}."
        )
    if not state:
        raise ValueError(
            f"{source} holds an empty loss-scaler state: it was saved from a disabled "
            "scaler (AMP off, or bfloat16 without loss scaling) and cannot initialize "
            "an enabled one (a float16 net). Fix: load it into a net with the precision it was "
            "saved with; or, to go on in float16 from float32 or bfloat16 weights, load the other "
            "files without it: load_params(..., f_grad_scaler=None), or, for a resume, "
            "Checkpoint(..., f_grad_scaler=None) in the LoadInitState (the scale then starts at "
            "init_scale; that Checkpoint saves no scaler either, so give the saving one its own)."
        )
    required = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(
            f"{source} is not a loss-scaler state: keys {missing} are missing (found "
            f"{sorted(map(str, state))[:8]}). Was another file (parameters, optimizer) "
            "passed as f_grad_scaler?"
        )


def _read_scale(state: dict, source: str) -> Any:
    """The saved loss scale as a number (a one-element tensor read), after
    it was found to be finite and > 0."""
    scale = state["scale"]
    if isinstance(scale, torch.Tensor):
        readable = scale.numel() == 1 and not scale.is_complex() and tensor_problem(scale) is None
        scale = scale.item() if readable else float("nan")
    if not (_finite(scale) and scale > 0):
        raise ValueError(
            f"{source} has an invalid loss scale {describe(state['scale'])}: the scale must "
            "be a finite number > 0 (a NaN or zero scale would skip every step or write NaN "
            "into the weights), a float or a one-element tensor with a value. Nothing was "
            "loaded. Fix: pass the file that save_params wrote, or f_grad_scaler=None."
        )
    return scale


def _version_problem(state: dict) -> str | None:
    """Why the state's format version cannot be read here, or None."""
    if "ampnet_scaler_version" not in state:
        return None
    version = state["ampnet_scaler_version"]
    if not (_is_int(version) and version >= 1):
        return f"'ampnet_scaler_version' = {describe(version)} must be an int >= 1"
    if version > STATE_VERSION:
        return (f"format version {version} is newer than this ampnet reads "
                f"({STATE_VERSION}); upgrade ampnet")
    return None


def validate_scaler_state(state: Any, source: str = "the state dict") -> None:
    """Check a scaler ``state_dict`` field by field before anything is
    loaded from it.

    Raises
    ------
    ValueError
      Naming ``source`` and the field: not a dict, saved from a disabled
      scaler, missing keys (a foreign file), a scale that is NaN, zero,
      negative, infinite or outside float32's range, a setting or tracker of
      the wrong type or out of range, or a newer format version.
    """
    _check_is_scaler_state(state, source)
    scale = _read_scale(state, source)
    problems = []
    if not _in_float32_range(scale):
        problems.append(
            f"'scale' = {_shown(scale)} lies outside float32's normal positive range {_RANGE} "
            "(the scale is a float32 tensor)"
        )
    bad_keys = sorted(repr(k) for k in state if not isinstance(k, str))
    if bad_keys:
        problems.append(f"keys {bad_keys[:6]} are not strings")
    settings = {k: state[k] for k in _SETTINGS_IN_STATE if k in state}
    problems += _setting_problems(settings, "'", quoted=True)
    for key, rule in _TRACKERS.items():
        if key in state and not (_is_int(state[key]) and 0 <= state[key] <= _INT32_MAX):
            problems.append(f"'{key}' = {describe(state[key])} must be {rule}")
    version = _version_problem(state)
    if version:
        problems.append(version)
    if problems:
        raise ValueError(
            f"{source} holds an invalid loss-scaler state: " + "; ".join(problems)
            + ". Nothing was loaded."
        )
