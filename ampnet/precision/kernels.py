"""Fast optimizer kernels by default under AMP.

With AMP on (``amp_enabled=True``, or the AMP choice of ``'auto'``), an
optimizer from ``torch.optim`` whose kernel the user has not chosen (neither
``optimizer__fused`` nor ``optimizer__foreach`` set) is built with

- ``fused=True`` where torch has a fused kernel for that optimizer, device and
  parameter dtype and it steps correctly: Adam, AdamW, SGD and Adagrad, on the
  CPU and on CUDA (:func:`fused_works` checks it with one step on a small
  tensor of each device and dtype, which also catches torch's CPU fused SGD
  that skips bfloat16 updates, pytorch/pytorch#191763);
- else ``foreach=True`` where the optimizer has a foreach kernel, except for
  bfloat16/float16 parameters on the CPU: torch's CPU foreach kernels round
  their scalar factors to the tensors' dtype (``_foreach_mul_`` of bfloat16
  by 0.9 multiplies by 0.8984), which shrinks SGD's bfloat16 momentum by
  1.6% (measured, torch 2.13 and 2.15) and lifts the final loss of
  ``amp_master_weights='compensated'`` SGD 3% above float32's; these
  parameters keep torch's single-tensor kernel;
- else as the user configured it.

An explicit ``optimizer__fused=False`` (or any explicit ``fused``/``foreach``)
is kept as it is, as is ``differentiable=True`` (which neither kernel
supports). With AMP off nothing changes: the net builds its optimizer exactly
as skorch does. Fused optimizers receive the loss scaler's overflow flag on
the device (``found_inf``), so skipped steps work as with the other kernels.

The kernel is an implementation detail of the net, not of its state: loading
an optimizer state (:func:`keep_kernels`) keeps the loading optimizer's
``fused``/``foreach`` settings rather than the file's.

A kernel that ampnet chose follows the net's precision: when a fitted net
changes its precision layout (``set_params(amp_dtype=..., amp_level=...)``,
``amp_enabled``), an optimizer whose kernel ampnet chose
(:func:`ampnet.config.reconfigure.ampnet_kernels`) is rebuilt with the kernel chosen for the new
parameters (:func:`kernels_differ`), its state carried over: the kernel
chosen as above for them, and skorch's kernel with AMP off. Only a kernel
the user set is checked against (and may be refused by) the new settings.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import warnings
from typing import Any, Iterable, Mapping

import torch

from ampnet.utils.dtypes import LOW_PRECISION_DTYPES

__all__ = [
    "FUSED_OPTIMIZERS", "KERNEL_KEYS", "kernel_defaults", "kernels_differ", "fused_works",
    "keep_kernels", "set_kernels", "user_chose_kernel",
]

#: torch.optim classes with a fused kernel on the CPU and CUDA.
FUSED_OPTIMIZERS: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)

#: Parameter-group keys that choose an optimizer's kernel.
KERNEL_KEYS = ("fused", "foreach")

_PROBE_SIZE = 67  # several SIMD blocks and a tail
_PROBE_LR = 0.5


def _init_params(cls: type) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}


def fused_works(cls: type, kwargs: Mapping[str, Any], kinds: Iterable[tuple[torch.device, torch.dtype]]) -> bool:
    """Whether ``cls(..., fused=True, **kwargs)`` steps parameters of each
    (device, dtype) in ``kinds`` as its single-tensor kernel does.

    One step over a small tensor per kind, with ``kwargs`` (the net's
    hyper-parameters) and a learning rate large enough for the update to be
    visible in 16-bit floats, compared with the single-tensor kernel in
    float32 (within 5% of the update). A kernel that torch refuses for that
    device or dtype does not work.

    The answer depends on nothing else, so it is remembered for the last
    :data:`_MEMO_SIZE` (class, hyper-parameters, kinds, torch version): the
    nets of a grid search probe once. Hyper-parameters other than numbers,
    strings, booleans, None and tuples of these (a tensor, say) are probed
    every time.
    """
    settings = {k: v for k, v in kwargs.items() if k not in ("lr", *KERNEL_KEYS)}
    kinds = tuple(kinds)
    key = tuple(sorted(settings.items()))
    if not _by_value(key):
        return _probe(cls, settings, kinds)
    try:
        return _remembered_probe(cls, key, kinds, torch.__version__)
    except TypeError:  # an unhashable class or kind
        return _probe(cls, settings, kinds)


_MEMO_SIZE = 64


def _by_value(value: Any) -> bool:
    """Whether ``value`` is made of numbers, strings, booleans, None and
    tuples of these, which hash and compare by value."""
    if value is None or isinstance(value, (numbers.Number, str)):
        return True
    return isinstance(value, tuple) and all(_by_value(v) for v in value)


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _remembered_probe(cls: type, settings: tuple, kinds: tuple, version: str) -> bool:
    """:func:`_probe`, remembered (``version``, torch's, is part of the key)."""
    return _probe(cls, dict(settings), kinds)


def _probe(cls: type, settings: Mapping[str, Any], kinds: Iterable[tuple[torch.device, torch.dtype]]) -> bool:
    """The probe of :func:`fused_works`, every time."""
    for device, dtype in kinds:
        if not dtype.is_floating_point:
            return False
        try:
            start = 1.0 + torch.arange(_PROBE_SIZE, dtype=torch.float32, device=device) % 8 / 8
            grad = torch.where(torch.arange(_PROBE_SIZE, device=device) % 2 == 0, 1.0, -1.0)
            fused = torch.nn.Parameter(start.to(dtype))
            plain = torch.nn.Parameter(start.clone())
            fused.grad, plain.grad = grad.to(dtype), grad.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls([fused], lr=_PROBE_LR, fused=True, **settings).step()
                cls([plain], lr=_PROBE_LR, foreach=False, **settings).step()
        except Exception:  # refused for this device, dtype or setting
            return False
        update, expected = fused.detach().float() - start, plain.detach() - start
        if not bool(torch.isfinite(update).all()):
            return False
        if not bool(((update - expected).abs() <= 0.05 * expected.abs().clamp_min(0.05)).all()):
            return False
    return True


def kernel_defaults(cls: Any, kwargs: Mapping[str, Any], params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """The kernel setting that an AMP net adds to the optimizer ``cls``'s
    ``kwargs`` for ``params``: ``{'fused': True}``, ``{'foreach': True}``
    or nothing (the user chose, ``differentiable=True``, an optimizer outside
    ``torch.optim``, or one without either kernel)."""
    if user_chose_kernel(kwargs) or kwargs.get("differentiable"):
        return {}
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls.__module__.startswith("torch.optim")):
        return {}
    accepted = _init_params(cls)
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    if not tensors:
        return {}
    if cls in FUSED_OPTIMIZERS and "fused" in accepted:
        kinds = sorted({(p.device, p.dtype) for p in tensors}, key=str)
        if fused_works(cls, kwargs, kinds):
            return {"fused": True}
    if "foreach" in accepted and not any(p.device.type == "cpu" and p.dtype in LOW_PRECISION_DTYPES
                                         for p in tensors):
        return {"foreach": True}
    return {}


def user_chose_kernel(kwargs: Mapping[str, Any]) -> bool:
    """Whether the user's optimizer arguments ``kwargs`` (``optimizer__*``)
    choose the kernel (set ``fused`` or ``foreach``, to any value)."""
    return any(key in kwargs for key in KERNEL_KEYS)


def kernels_differ(optimizer: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether ``optimizer`` was built with another kernel than ``kwargs``
    (the arguments a rebuild would pass) asks for."""
    defaults = getattr(optimizer, "defaults", None)
    if not isinstance(defaults, Mapping):
        return False
    return any(bool(defaults.get(key)) != bool(kwargs.get(key)) for key in KERNEL_KEYS)


def keep_kernels(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` (an optimizer ``state_dict``) with the kernel settings of
    ``optimizer``'s own parameter groups in place of the saved ones, so that
    a state saved with another kernel (an AMP-off net, an older ampnet, a
    fused run) loads into this optimizer without changing its kernel. Other
    values are left as they are."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        return state
    merged = []
    for saved, own in zip(groups, optimizer.param_groups):
        if not isinstance(saved, Mapping):
            return state
        group = dict(saved)
        for key in KERNEL_KEYS:
            if key in own:
                group[key] = own[key]
        merged.append(group)
    return {**state, "param_groups": merged}


def set_kernels(optimizer: torch.optim.Optimizer, kwargs: Mapping[str, Any]) -> None:
    """Give ``optimizer`` the kernel that ``kwargs`` (the arguments a
    rebuild would pass) asks for, in place: its parameter groups' and
    defaults' ``fused``/``foreach`` (the class's defaults where ``kwargs``
    has none). torch's optimizers read them at every step, and their state
    is the same for every kernel."""
    params = _init_params(type(optimizer))
    for key in KERNEL_KEYS:
        if key not in params:
            continue
        default = params[key].default if params[key].default is not inspect.Parameter.empty else None
        value = kwargs.get(key, default)
        optimizer.defaults[key] = value
        for group in optimizer.param_groups:
            group[key] = value
    optimizer._step_supports_amp_scaling = bool(optimizer.defaults.get("fused"))
