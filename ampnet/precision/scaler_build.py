"""The loss scaler a net trains with, built from its settings
(:func:`build_scaler`): a copy of an instance on the net's device type, or
the class built with the net's ``grad_scaler__*`` settings."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ampnet.exceptions import amp_warn
from ampnet.precision.scaler import GradScaler, copy_to_device
from ampnet.precision.settings import PrecisionSettings, init_param_names, scaling_enabled

__all__ = ["build_scaler", "scaler_settings"]


def build_scaler(settings: PrecisionSettings, scaler_params: Mapping[str, Any]) -> GradScaler:
    """The loss scaler that ``settings`` ask for, on the policy's device type.

    ``scaler_params`` are the net's ``grad_scaler__*`` settings without the
    prefix (``net.get_params_for('grad_scaler')``), which
    :func:`~ampnet.precision.settings.build_settings` has checked: the net's
    parameters are their one stored copy, read here when a scaler is built.
    A class is built with them. An instance is a
    hyper-parameter: the net trains a copy on its own device type (``fit``
    must not change the instance, and clones must not share a training
    state). Where no loss scaling runs (AMP off, bfloat16) the copy is
    disabled, with the instance's settings, so that one net serves a grid
    over ``amp_enabled`` or ``amp_dtype``. :func:`~ampnet.precision.settings.build_settings`
    has refused the scalers that cannot scale on the net's device.
    """

    policy, scaler = settings.policy, settings.scaler
    kwargs = {k: v for k, v in scaler_params.items() if k != "enabled"}
    forced = scaler_params.get("enabled")
    enabled = scaling_enabled(policy, scaler_params)
    if isinstance(scaler, torch.amp.GradScaler):
        if kwargs or forced is not None or (scaler.is_enabled() and not enabled):
            scaler = _construct(type(scaler), policy.device_type, **{
                **scaler_settings(scaler), **kwargs, "enabled": enabled,
            })
        elif isinstance(scaler, GradScaler):
            scaler = copy_to_device(scaler, policy.device_type)
        else:  # torch's own: a new one with its settings and state, through its public API
            original = scaler
            scaler = _construct(type(original), policy.device_type, **scaler_settings(original))
            if original.is_enabled():
                scaler.load_state_dict(original.state_dict())
    else:
        scaler = _construct(scaler, policy.device_type, enabled=enabled, **kwargs)
    if policy.uses_scaler and not scaler.is_enabled():
        cause = ("grad_scaler__enabled=False" if forced is not None and not forced
                 else "the grad_scaler instance passed is disabled")
        amp_warn(
            f"float16 training without loss scaling ({cause}): "
            "small gradients underflow to zero in float16.")
    return scaler


def _construct(cls: type, device_type: str, **kwargs: Any) -> GradScaler:
    """``cls(**kwargs)`` on ``device_type``; a class without a ``device``
    parameter (``torch.cuda.amp.GradScaler``) is built as it is."""
    if "device" in init_param_names(cls):
        kwargs["device"] = device_type
    return cls(**kwargs)


def scaler_settings(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """The constructor settings of any torch scaler, read through its
    public getters (the current scale stands for ``init_scale``)."""
    if isinstance(scaler, GradScaler):
        return scaler.get_settings()
    return {
        "init_scale": scaler.get_scale(),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
        "enabled": scaler.is_enabled(),
    } if scaler.is_enabled() else {"enabled": False}
