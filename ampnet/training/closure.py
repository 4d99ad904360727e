"""Optimizers stepped through skorch's closure path (LBFGS, and custom
optimizers whose step takes an optional closure): which ones, and what
cannot be combined with them."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ampnet.exceptions import amp_warn

__all__ = ["needs_closure", "may_use_closure", "uses_closure"]



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


def uses_closure(net: Any, scaling: bool, skip_nonfinite: bool, accumulation: int) -> bool:
    """Whether ``net``'s optimizers take skorch's closure path; refuse what
    cannot work.

    Optimizers that require a closure (LBFGS) take skorch's closure path,
    which loss scaling and gradient accumulation cannot share. Without
    loss scaling, custom optimizers (outside ``torch.optim``) whose step
    takes an optional closure keep skorch's path too, so that they get the
    closure as in skorch.

    Raises
    ------
    ValueError
      A closure optimizer with loss scaling or gradient accumulation.
    """
    optimizers = {
        n: getattr(net, n + "_", None) for n in net._optimizers if getattr(net, n + "_", None) is not None
    }
    closure = [n for n, opt in optimizers.items() if needs_closure(opt)]
    if not closure:
        optional = [n for n, opt in optimizers.items() if may_use_closure(opt)]
        on = bool(optional and not scaling and accumulation == 1)
        if on and skip_nonfinite:
            names = ", ".join(f"{n} ({type(optimizers[n]).__name__})" for n in optional)
            amp_warn(
                f"Optimizer {names} takes an optional closure, so ampnet steps it through "
                "skorch's closure path, as skorch does: the non-finite guard "
                "(amp_skip_nonfinite), step_skipped records and LR-scheduler holding do not "
                "apply to it. Set amp_skip_nonfinite=False to accept this, or use an "
                "optimizer from torch.optim.")
        return on
    names = ", ".join(f"{n} ({type(optimizers[n]).__name__})" for n in closure)
    if scaling:
        raise ValueError(
            f"Optimizer {names} needs a closure, which cannot be combined with float16 "
            "loss scaling: every closure evaluation would see scaled gradients and "
            "only the first would be checked for overflow. Fix: use "
            "amp_dtype='bfloat16' (no loss scaling), amp_enabled=False, or a "
            "first-order optimizer such as torch.optim.Adam."
        )
    if accumulation > 1:
        raise ValueError(
            f"Optimizer {names} needs a closure, which cannot be combined with "
            f"gradient_accumulation_steps={accumulation}. Fix: set gradient_accumulation_steps=1."
        )
    return True
