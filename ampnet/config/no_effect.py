"""Settings that have no effect: one :class:`~ampnet.exceptions.AmpWarning`
at ``initialize()`` that names them and says how to make them count.

Nothing in ampnet is silently ignored: ``amp_level='pure'`` without
``amp_enabled=True`` trains in float32, ``memory_format='channels_last'``
on a model without 4-D parameters changes nothing, and a loss-scaler setting
under bfloat16 (which needs no loss scaling) is never used. Each is legal
(a grid over ``amp_enabled`` sets them on AMP-off nets too), so it warns
rather than raises.

The loss scaler's settings (``grad_scaler``, ``grad_scaler__*``) are not
reported where no loss scaling runs (AMP off, bfloat16): they are only ever
read by a float16 net, and one net's settings serve a grid over
``amp_enabled`` or ``amp_dtype`` (``grad_scaler__enabled=True`` turns
scaling on under bfloat16).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ampnet.exceptions import amp_warn
from ampnet.config.params import PARAMS, amp_only, is_auto, parsed
from ampnet.utils.values import describe

__all__ = ["ineffective_settings", "warn_ineffective_settings", "is_default"]

def _default(net: Any, name: str) -> Any:
    row = PARAMS.get(name)
    if row is not None:
        return row.default
    for klass in type(net).__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        param = inspect.signature(init).parameters.get(name)
        if param is not None and param.default is not param.empty:
            return param.default
    return inspect.Parameter.empty


def is_default(net: Any, name: str) -> bool:
    """Whether ``net``'s parameter ``name`` holds its ``__init__`` default
    (a prefixed setting, ``amp_float8__recipe``, its table default where not set)."""
    if "__" in name:
        value, default = getattr(net, name, PARAMS[name].default), PARAMS[name].default
    else:
        value, default = getattr(net, name), _default(net, name)
    if value is default:
        return True
    if name in PARAMS and not isinstance(default, type):
        try:  # one rule for string choices: 'Mixed ' is the default 'mixed'
            value = parsed(net, name)
        except (ValueError, TypeError):
            return False
    if isinstance(value, str) and isinstance(default, str):
        return str.lower(str.strip(value)) == default
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # values without a plain == (arrays, tensors)
        return False


def _setting(name: str, value: Any) -> str:
    if isinstance(value, type):
        return f"{name}={value.__name__}"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value whose __repr__ raises
        text = describe(value)
    return f"{name}={text}"


def _has_4d(module: Any) -> bool:
    return any(t.dim() == 4 for t in [*module.parameters(), *module.buffers()])


def ineffective_settings(net: Any) -> list[str]:
    """Sentences naming each setting of an initialized ``net`` that has no
    effect, with the fix; empty when every setting acts."""
    policy = net.precision_policy_
    notes = []
    auto = is_auto(net.amp_enabled)  # they narrow its candidates
    if auto:
        pass
    elif not policy.enabled:
        names = [n for n in amp_only() if not is_default(net, n)]
        shown = [_setting(n, getattr(net, n, None)) for n in names]
        if shown:
            one = len(shown) == 1
            notes.append(
                f"amp_enabled=False, so {', '.join(shown)} {'has' if one else 'have'} no "
                "effect: the net trains in float32. Set amp_enabled=True to use "
                f"{'it, or leave it at its default' if one else 'them, or leave them at their defaults'}."
            )
    else:
        if policy.level == "mixed" and parsed(net, "amp_master_weights") is False:
            notes.append(
                "amp_master_weights=False has no effect with amp_level='mixed' (the weights "
                "are float32 already). Set amp_level='pure' to use it, or drop it."
            )
        float8 = [n for n in amp_only() if n.startswith("amp_float8__") and not is_default(net, n)]
        if float8 and parsed(net, "amp_dtype") != "float8":
            one = len(float8) == 1
            notes.append(
                f"{', '.join(_setting(n, getattr(net, n)) for n in float8)} {'has' if one else 'have'} no effect "
                f"with amp_dtype={parsed(net, 'amp_dtype')!r}: {'it sets' if one else 'they set'} float8 training. "
                f"Set amp_dtype='float8' to use {'it' if one else 'them'}, or drop {'it' if one else 'them'}.")
        layout = getattr(net, "amp_layout_", None)
        if policy.level == "pure" and layout is not None and not layout.low_precision_params:
            notes.append(
                "amp_level='pure' stores no parameter in low precision here: every float32 "
                "parameter belongs to a normalization layer, to amp_fp32_modules or outside "
                "amp_modules. It trains as amp_level='mixed'."
            )
    module = getattr(net, "module_", None)
    if parsed(net, "memory_format") == "channels_last" and isinstance(module, torch.nn.Module):
        if not _has_4d(module):
            notes.append(
                f"memory_format='channels_last' has no effect: {type(module).__name__} has no "
                "4-D parameters or buffers (it is for convolutional models). Use "
                "memory_format='preserve'."
            )
    return notes


def warn_ineffective_settings(net: Any) -> None:
    """One :class:`~ampnet.exceptions.AmpWarning` listing the settings of
    ``net`` that have no effect, if any."""
    notes = ineffective_settings(net)
    if notes:
        amp_warn(" ".join(notes))
