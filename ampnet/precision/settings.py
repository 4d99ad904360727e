"""A net's precision parameters as a frozen :class:`PrecisionSettings`,
before anything is built.

Each value has been checked on its own by the parameter table
(``initialize`` and ``set_params`` parse them once, with
:func:`ampnet.config.reconfigure.parse`, and call :func:`build_settings` with
the checked values); :func:`build_settings` adds the checks that involve several
parameters (compensated weights need 'pure', float16 scaling needs a scaler
that can scale on the device, ...), raising with the parameters, the values,
the valid choices and a fix. It touches no net, module or scaler, so that
``initialize`` and ``set_params`` can check everything before they change
anything.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ampnet.precision.policy import PrecisionPolicy, resolve_precision
from ampnet.precision.scaler import GradScaler
from ampnet.precision.scaler_checks import validate_scaler_settings
from ampnet.utils.hints import named_with_hints

__all__ = [
    "PrecisionSettings", "build_settings", "scaling_enabled",
]


@dataclass(frozen=True)
class PrecisionSettings:
    """A net's precision parameters, checked.

    ``master_weights`` says whether float32 masters are kept,
    ``compensated`` whether low-precision weights are compensated instead
    (``amp_master_weights='compensated'``). ``scaler`` is the net's
    ``grad_scaler`` (the class, or the instance itself: no copy).

    The ``grad_scaler__*`` settings are not kept here: the net's parameters
    are their one stored copy (``get_params()``), and the live scaler holds
    the running state built from them (:func:`~ampnet.precision.scaler_build.build_scaler`
    takes them from the net when it builds one).
    """

    policy: PrecisionPolicy
    master_weights: bool = True
    compensated: bool = False
    fp32_modules: Any = None
    amp_modules: Any = None
    memory_format: str = "preserve"
    skip_nonfinite: bool = True
    scaler: Any = GradScaler
    float8: Any = None  # amp_dtype='float8': the amp_float8__* settings as (name, value) pairs, else None


def scaling_enabled(policy: PrecisionPolicy, scaler_params: Mapping[str, Any]) -> bool:
    """Whether the loss scaler is enabled: ``grad_scaler__enabled`` where
    set (``scaler_params`` are the ``grad_scaler__*`` settings without the
    prefix), else whether ``policy`` computes in float16."""
    forced = scaler_params.get("enabled")
    return policy.uses_scaler if forced is None else bool(forced)


def build_settings(params: Mapping[str, Any]) -> PrecisionSettings:
    """The :class:`PrecisionSettings` of ``params``: every AMP constructor
    parameter of a net, ``device`` and its ``grad_scaler__*`` settings, as
    :func:`ampnet.config.params.check_all` has parsed them one by one (choices
    in their canonical spelling; the parameter table holds the defaults, not
    this function); this adds the checks that involve several parameters.

    Raises
    ------
    TypeError
      A parameter missing from ``params``, naming it.
    TypeError, ValueError
      For the first invalid combination, naming the parameters, the values,
      the valid choices and a fix.
    """
    try:
        skip, scaler, masters = params["amp_skip_nonfinite"], params["grad_scaler"], params["amp_master_weights"]
        memory_format, fp32_modules, amp_modules = (
            params["memory_format"], params["amp_fp32_modules"], params["amp_modules"])
        float8 = _float8(params)
        policy = resolve_precision(params["amp_enabled"], "bfloat16" if float8 is not None else params["amp_dtype"],
                                   params["device"], params["amp_level"])
    except KeyError as exc:
        raise TypeError(
            f"build_settings needs every precision parameter of a net; {exc.args[0]!r} is missing. Fix: pass a "
            "net's parameters as parsed (ampnet.config.reconfigure.parse), or the parameter table's defaults "
            "(ampnet.config.params.constructor_defaults()) with device added.") from None
    compensated = isinstance(masters, str) and masters == "compensated"
    if compensated and not (policy.enabled and policy.level == "pure"):
        raise ValueError(
            "amp_master_weights='compensated' needs amp_enabled=True and amp_level='pure' "
            f"(got amp_enabled={params['amp_enabled']!r}, "
            f"amp_level={params['amp_level']!r}): it compensates the rounding "
            "of weights stored in low precision, and only 'pure' stores them so. Fix: "
            "set amp_enabled=True and amp_level='pure', or amp_master_weights=True."
        )
    scaler_params = _scaler_params(scaler, params)
    if scaler_params.get("enabled") and not policy.enabled:
        raise ValueError(
            "grad_scaler__enabled=True needs amp_enabled=True: loss scaling protects "
            "low-precision gradients and does nothing for float32 training. Fix: set "
            "amp_enabled=True, or drop grad_scaler__enabled."
        )
    settings = PrecisionSettings(
        policy=policy,
        master_weights=bool(masters) and not compensated,
        compensated=compensated,
        fp32_modules=fp32_modules,
        amp_modules=amp_modules,
        memory_format=memory_format,
        skip_nonfinite=bool(skip),
        scaler=scaler,
        float8=float8 if policy.enabled else None,
    )
    if settings.float8 is not None and policy.level != "mixed":
        raise ValueError(
            f"amp_dtype='float8' needs amp_level='mixed' (got amp_level={params['amp_level']!r}): float8 "
            "training keeps float32 weights and casts them to float8 in each matmul. Fix: amp_level='mixed', "
            "or amp_dtype='bfloat16' with amp_level='pure'.")
    uses_scaler = scaling_enabled(policy, scaler_params)
    ampnet_scaler = isinstance(scaler, GradScaler) or (isinstance(scaler, type) and issubclass(scaler, GradScaler))
    if compensated and uses_scaler and not ampnet_scaler:
        raise ValueError(
            "amp_master_weights='compensated' with float16 loss scaling unscales float16 "
            "gradients in place, which torch.amp.GradScaler refuses. Fix: "
            "grad_scaler=ampnet.GradScaler (the default), or amp_dtype='bfloat16'."
        )
    if (policy.enabled and policy.level == "pure" and not settings.master_weights
            and not compensated and uses_scaler):
        raise ValueError(
            "amp_level='pure' with amp_master_weights=False and float16 loss scaling: "
            "the loss scaler cannot unscale float16 gradients in place. Fix: keep "
            "amp_master_weights=True, use amp_master_weights='compensated' (float16 "
            "gradients are unscaled in place), or use amp_dtype='bfloat16'."
        )
    if uses_scaler:
        _check_scaler_device(scaler, policy.device_type)
    return settings


def _float8(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """``amp_dtype='float8'``'s ``amp_float8__*`` settings, as sorted
    ``(name, value)`` pairs without the prefix (None for other dtypes)."""
    if params["amp_dtype"] != "float8":
        return None
    return tuple(sorted((k.split("__", 1)[1], tuple(v) if isinstance(v, list) else v)
                        for k, v in params.items() if k.startswith("amp_float8__")))


def _public_name(cls: type) -> str:
    """``torch.amp.GradScaler`` rather than ``torch.amp.grad_scaler.GradScaler``."""
    if cls.__module__.startswith("ampnet.") and cls.__name__ == "GradScaler":
        return "ampnet.GradScaler"
    for package in (torch.amp, torch.cuda.amp):
        if getattr(package, cls.__name__, None) is cls:
            return f"{package.__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_scaler_device(scaler: Any, device_type: str) -> None:
    """Refuse a loss scaler that cannot scale on ``device_type``, rather
    than train float16 without loss scaling: a class without a ``device``
    parameter (``torch.cuda.amp.GradScaler``, CUDA only) on another device,
    and an instance that torch disabled when it was made for CUDA on a
    machine without CUDA (torch then keeps none of its settings)."""
    fix = ("Fix: grad_scaler=ampnet.GradScaler (the default class, or an instance such as "
           "ampnet.GradScaler(init_scale=256.0): it follows the net's device), "
           f"torch.amp.GradScaler('{device_type}', ...), or grad_scaler__enabled=False to train "
           "float16 without loss scaling.")
    if isinstance(scaler, type):
        if "device" not in init_param_names(scaler) and device_type != "cuda":
            raise ValueError(
                f"grad_scaler={_public_name(scaler)} scales on CUDA only (it "
                f"takes no device), but this net computes float16 on '{device_type}'. {fix}"
            )
        return
    made_for = getattr(scaler, "_device", None)
    if (isinstance(scaler, torch.amp.GradScaler) and not scaler.is_enabled() and made_for == "cuda"
            and not torch.cuda.is_available()):
        raise ValueError(
            f"grad_scaler={_public_name(type(scaler))}('cuda') was made "
            "on a machine without CUDA: torch disabled it then ('CUDA is not available. "
            "Disabling.') and kept none of its settings, so this float16 net would train "
            f"without loss scaling. {fix}"
        )


def _scaler_params(scaler: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``grad_scaler__*`` settings without the prefix, checked against
    the scaler class (to check them: :class:`PrecisionSettings` keeps none)."""
    kwargs = {k[len("grad_scaler__"):]: v for k, v in params.items() if k.startswith("grad_scaler__")}
    cls = scaler if isinstance(scaler, type) else type(scaler)
    valid = init_param_names(cls, exclude=("self", "device"))
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"Unknown loss-scaler parameter(s): {named_with_hints('grad_scaler', unknown, valid)}. Valid parameters of "
            f"{cls.__name__} are: {', '.join('grad_scaler__' + v for v in valid)}."
        )
    if isinstance(scaler, GradScaler):
        defaults = {k: v for k, v in scaler.get_settings().items() if k in ("init_scale", "min_scale", "max_scale")}
    elif isinstance(scaler, torch.amp.GradScaler):
        defaults = {"init_scale": scaler.get_scale()} if scaler.is_enabled() else {}
    else:
        defaults = {
            name: p.default for name, p in inspect.signature(cls).parameters.items()
            if name in ("init_scale", "min_scale", "max_scale") and p.default is not p.empty
        }
    validate_scaler_settings(**{**defaults, **{k: v for k, v in kwargs.items() if k != "enabled"}})
    if "enabled" in kwargs:
        validate_scaler_settings(enabled=kwargs["enabled"])
    return kwargs


def init_param_names(cls: type, exclude: tuple[str, ...] = ()) -> list[str]:
    """Keyword parameters of ``cls(...)``, following ``**kwargs`` up the MRO."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names + list(exclude):
                names.append(p.name)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names
