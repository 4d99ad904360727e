"""Small helpers shared by ampnet's modules."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "cast_floating",
    "needs_closure",
    "may_use_closure",
    "grads_are_finite",
    "has_nonfinite",
    "optimizer_params_with_grad",
]


def _closure_param(optimizer: torch.optim.Optimizer) -> inspect.Parameter | None:
    try:
        return inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return None


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (e.g. LBFGS)."""
    param = _closure_param(optimizer)
    return param is not None and param.default is inspect.Parameter.empty


def may_use_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes an optional closure that it may
    evaluate in its own way: true for optimizers outside ``torch.optim``
    (torch's own call an optional closure once, before updating)."""
    if _closure_param(optimizer) is None:
        return False
    return not type(optimizer).__module__.startswith("torch.optim")


def optimizer_params_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of ``optimizer`` that received a gradient."""
    return [
        p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    ]


#: Up to this many gradient values per device and dtype, one fused kernel
#: checks them (fewest dispatches); above, one sum per tensor (read-only,
#: about half the memory traffic).
_FUSED_CHECK_MAX_NUMEL = 1 << 20


def grads_are_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every gradient of ``params`` is finite.

    The gradients are left bitwise unchanged. Small gradient sets are
    checked with torch's fused non-finite check; large ones with one sum
    per tensor (NaN and inf propagate into it), so a gradient whose finite
    values sum beyond the float32 range also counts as non-finite.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce()._values()
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in groups.items():
        if sum(g.numel() for g in grads) <= _FUSED_CHECK_MAX_NUMEL:
            found = torch.zeros((), dtype=torch.float32, device=device)
            one = torch.ones((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            if found.item():
                return False
        elif not torch.stack([g.sum(dtype=torch.float32) for g in grads]).isfinite().all():
            return False
    return True


def has_nonfinite(obj: Any) -> bool:
    """Whether a (possibly nested) batch holds a floating NaN or inf."""
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, Mapping):
        return any(has_nonfinite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_nonfinite(v) for v in obj)
    return False


_LOW = (torch.float16, torch.bfloat16)


def cast_floating(obj: Any, dtype: torch.dtype, only: tuple = _LOW) -> Any:
    """Cast tensors of a dtype in ``only`` found in ``obj`` (walking tuples,
    lists and dicts) to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype in only and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floating(o, dtype, only) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floating(o, dtype, only) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(v, dtype, only)) for k, v in obj.items())
    return obj
