"""Compensated low-precision weights (``amp_master_weights='compensated'``).

In ``amp_level='pure'`` without float32 masters, an optimizer that updates
bfloat16 weights in place rounds every update to the weight's precision:
an update smaller than half a unit in the last place (ulp) is lost. Here
each low-precision weight ``p`` keeps a compensation buffer ``c`` of its
own dtype, and the true weight is ``p + c`` (Kahan summation, as torch-optimi
does inside its own optimizers with ``kahan_sum=True``).

The mechanism works with torch's own optimizers as they are, fused and
foreach kernels included, because the optimizer itself adds its update to
the compensation buffer: during ``optimizer.step()`` each compensated
parameter's ``.data`` is ``c`` (small, so the update is added at full
bfloat16 precision), and afterwards the representable part moves into the
weight::

    c += update                  # the optimizer's own in-place step, on c
    new = p + c                  # rounded to the weight's dtype
    c += p - new                 # what the rounding left out (exact)
    p = new

The optimizer reads the weight's value in one place only, weight decay,
which it would apply to ``c`` alone; the rest of the decay, on ``p``, is
added here: L2 decay (``grad + wd * w``) goes into the gradient the
optimizer reads, decoupled decay (``w * (1 - lr * wd)``) into ``c``. This is
why only optimizers whose update reads the weight nowhere else are
accepted (:data:`SUPPORTED`).

The buffers are optimizer state (``optimizer.state[p]['ampnet_compensation']``),
created at a parameter's first step: they are saved and loaded with the
optimizer (``save_params(f_optimizer=...)``, checkpoints), pickled with
the net and identical on every data-parallel rank. The optimizer's own
state tensors (momentum, second moments) are created like the parameter,
in the low-precision dtype.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ampnet.utils.dtypes import LOW_PRECISION_DTYPES

__all__ = [
    "KEY",
    "SUPPORTED",
    "check_optimizer",
    "check_fused_sgd",
    "FLOAT16_SAFE",
    "compensated_step",
    "compensation_of",
    "pop_compensation",
]

#: The optimizer-state key of a parameter's compensation buffer.
KEY = "ampnet_compensation"

#: Optimizers whose update reads the weight only through ``weight_decay``.
SUPPORTED: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


#: Optimizers whose state stays meaningful in float16 (no second moment, no eps).
FLOAT16_SAFE: tuple[type, ...] = (torch.optim.SGD, torch.optim.Rprop)


def check_optimizer(optimizer: torch.optim.Optimizer, name: str = "optimizer",
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Refuse an optimizer that compensated weights in ``dtype`` cannot serve.

    Raises
    ------
    ValueError
      Naming the optimizer, the supported ones and the alternatives.
    """
    found = f"{name}={type(optimizer).__module__}.{type(optimizer).__name__}"
    if not isinstance(optimizer, SUPPORTED):
        names = ", ".join(cls.__name__ for cls in SUPPORTED)
        raise ValueError(
            f"amp_master_weights='compensated' steps the compensation buffers through the "
            f"optimizer, which works for torch.optim's {names} (their update reads the weight "
            f"only through weight_decay); got {found}. Fix: use one of these optimizers, or "
            "amp_master_weights=True (float32 masters), or amp_master_weights=False with an "
            "optimizer that compensates by itself (e.g. torch-optimi's, kahan_sum=True)."
        )
    if dtype == torch.float16 and not isinstance(optimizer, FLOAT16_SAFE):
        raise ValueError(
            f"amp_master_weights='compensated' with amp_dtype='float16' keeps the optimizer "
            f"state in float16, where {type(optimizer).__name__}'s eps and squared gradients "
            "below 6e-8 are zero (its step divides by zero); got "
            f"{found}. Fix: amp_dtype='bfloat16' (the same memory, float32's range), "
            "amp_master_weights=True (float32 masters and state), or torch.optim.SGD."
        )


def check_fused_sgd(optimizer: torch.optim.Optimizer, name: str, dtype: torch.dtype) -> None:
    """Refuse ``torch.optim.SGD(fused=True)`` that will step ``dtype``
    parameters where torch's fused kernel skips their update (torch
    2.12-2.13 on CPU, pytorch/pytorch#191763), found by one step on a
    64-element tensor on the optimizer's device.

    Raises
    ------
    ValueError
      Naming the optimizer, the torch issue and the fix.
    """
    if not (isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("fused")):
        return
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    for device in sorted(devices, key=str):
        probe = torch.nn.Parameter(torch.zeros(64, dtype=dtype, device=device))
        probe.grad = torch.ones_like(probe)
        torch.optim.SGD([probe], lr=1.0, fused=True).step()
        if not bool((probe.detach() == -1).all()):
            kind = str(dtype).replace("torch.", "")
            raise ValueError(
                f"{name}=torch.optim.SGD(fused=True) does not update {kind} parameters on "
                f"{device.type} in torch {torch.__version__} (its fused kernel skips whole SIMD "
                "blocks: pytorch/pytorch#191763), and this net's optimizer steps parameters "
                f"stored in {kind}. Fix: optimizer__fused=False (the foreach kernel), or "
                "amp_master_weights=True (float32 masters)."
            )


def _low_params(optimizer: torch.optim.Optimizer) -> list[tuple[dict, list[torch.nn.Parameter]]]:
    """(group, its low-precision parameters that have a gradient) per group."""
    out = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None and p.dtype in LOW_PRECISION_DTYPES]
        if params:
            out.append((group, params))
    return out


def _nonzero(value: float | torch.Tensor) -> bool:
    # a tensor setting counts as set: reading its value would sync the device
    return isinstance(value, torch.Tensor) or value != 0


@contextlib.contextmanager
def compensated_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around ``optimizer.step()``: the optimizer updates the compensation
    buffers of the low-precision parameters, which are then folded into
    the weights. Nothing changes if the step raises."""
    groups = _low_params(optimizer)
    if not groups:
        yield
        return
    state = optimizer.state
    entries: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    decoupled: list[tuple[float | torch.Tensor, list[int]]] = []
    with torch.no_grad():
        for group, params in groups:
            wd = group.get("weight_decay", 0)
            first = len(entries)
            for p in params:
                comp = state[p].get(KEY) if p in state else None
                if comp is None:
                    comp = torch.zeros_like(p)
                entries.append((p, p.data, comp, p.grad))
            if not _nonzero(wd):
                continue
            if group.get("decoupled_weight_decay", False):
                decoupled.append((group["lr"] * wd, list(range(first, len(entries)))))
            else:
                # the optimizer adds wd * c to the gradient; wd * p goes in
                # here (out of place, as torch does: the gradient is kept)
                sign = -1.0 if group.get("maximize", False) else 1.0
                grads = [e[3] for e in entries[first:]]
                weights = [e[1] for e in entries[first:]]
                if isinstance(wd, torch.Tensor):
                    moved = torch._foreach_add(grads, torch._foreach_mul(weights, sign * wd))
                else:
                    moved = torch._foreach_add(grads, weights, alpha=sign * wd)
                for p, g in zip(params, moved):
                    p.grad = g
    for p, _, comp, _ in entries:
        p.data = comp
    try:
        yield
    finally:
        for p, data, _, grad in entries:
            p.data = data
            p.grad = grad
    with torch.no_grad():
        for factor, index in decoupled:
            comps = [entries[i][2] for i in index]
            weights = [entries[i][1] for i in index]
            if isinstance(factor, torch.Tensor):
                torch._foreach_sub_(comps, torch._foreach_mul(weights, factor))
            else:
                torch._foreach_add_(comps, weights, alpha=-factor)
        weights = [e[1] for e in entries]
        comps = [e[2] for e in entries]
        new = torch._foreach_add(weights, comps)
        torch._foreach_sub_(weights, new)  # p - new: exact
        torch._foreach_add_(comps, weights)
        torch._foreach_copy_(weights, new)
    for p, _, comp, _ in entries:
        state[p][KEY] = comp


def compensation_of(optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, torch.Tensor]:
    """The compensation buffers in ``optimizers``' state, by ``id`` of the parameter."""
    found = {}
    for optimizer in optimizers:
        for p, st in optimizer.state.items():
            comp = st.get(KEY) if isinstance(st, dict) else None
            if isinstance(comp, torch.Tensor):
                found[id(p)] = comp
    return found


def drop_compensation(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` a new state without compensation buffers (the
    weights were replaced: their old rounding residues no longer apply).
    The old state object is left as it was, so a snapshot of it restores."""
    new = type(optimizer.state)(dict) if hasattr(optimizer.state, "default_factory") else {}
    for p, st in optimizer.state.items():
        new[p] = {k: v for k, v in st.items() if k != KEY} if isinstance(st, dict) else st
    optimizer.state = new


def pop_compensation(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Remove the compensation buffers from ``optimizers``' state."""
    for optimizer in optimizers:
        for st in optimizer.state.values():
            if isinstance(st, dict):
                st.pop(KEY, None)
