"""The non-finite gradient check, on the device."""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["check_and_unscale_", "nonfinite_grads", "grads_by_device_dtype", "unscale_flag", "fused_check_fits",
           "fused_nonfinite"]

#: Up to this many gradient values per device and dtype, one fused kernel
#: checks them (fewest dispatches); above, one sum per tensor (read-only,
#: about half the memory traffic: the fused check writes every value back).
_FUSED_CHECK_MAX_NUMEL = 1 << 20

#: On a CPU, where a dispatch costs about as much as reading a few hundred
#: thousand values, one sum per tensor once the tensors hold more than this
#: many values on average, whatever their total; the fused check otherwise.
_CPU_SUM_MIN_PER_TENSOR = 1 << 18


def _kernel_takes(grad: torch.Tensor) -> bool:
    """Whether torch's fused check-and-unscale kernel takes ``grad``'s dtype
    on its device: every floating dtype on a CPU; float32 and float16 on
    CUDA (torch 2.11's CUDA kernel has no bfloat16: a pure bf16 net's
    gradients)."""
    return grad.device.type == "cpu" or grad.dtype in (torch.float32, torch.float16)


def check_and_unscale_(
    grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor, write: bool = True,
) -> None:
    """torch's fused non-finite check and unscale of ``grads`` (one device,
    one dtype): ``found`` becomes > 0 when a value is inf or NaN, and each
    value is multiplied by ``inv_scale`` in float32 and rounded back in
    place (``write=False``: a check only, ``grads`` untouched).

    Where the device's kernel lacks the dtype, the same arithmetic runs on
    a float32 copy that is written back: bitwise the kernel's result (it
    also computes in float32 and rounds once).
    """
    if _kernel_takes(grads[0]):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
    else:
        _through_float32(grads, found, inv_scale, write)


def _through_float32(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor, write: bool) -> None:
    """:func:`check_and_unscale_` on float32 copies of ``grads``, written back."""
    wide = [g.float() for g in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(wide, found, inv_scale)
    if write:
        torch._foreach_copy_(grads, wide)


def _fused_check_pays(device: torch.device, grads: list[torch.Tensor]) -> bool:
    """Whether one fused check of ``grads`` beats one sum per tensor."""
    numel = sum(map(torch.Tensor.numel, grads))
    if device.type == "cpu":
        return numel <= _CPU_SUM_MIN_PER_TENSOR * len(grads)
    return numel <= _FUSED_CHECK_MAX_NUMEL


def _total(flags: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """The largest of the per-group ``flags`` (a zero on ``device`` for none)."""
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    # the largest, not the sum: a fused optimizer skips on a flag of exactly 1
    return torch.stack(flags).amax() if len(flags) > 1 else flags[0]


def grads_by_device_dtype(
    params: Iterable[torch.Tensor], coalesce: tuple[torch.dtype, ...] | None = None,
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The gradients of ``params`` (sparse ones as their values, coalesced
    first: all of them, or those of the dtypes ``coalesce`` names), grouped
    by device and dtype for torch's foreach kernels; parameters without a
    gradient are left out."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = (g.coalesce() if coalesce is None or g.dtype in coalesce else g)._values()
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def nonfinite_grads(
    params: Iterable[torch.Tensor], device: torch.device | None = None, one: torch.Tensor | None = None,
) -> torch.Tensor:
    """A float32 scalar tensor, > 0 when a gradient of ``params`` holds NaN
    or inf; computed on the device, without a host read (``one``: a float32
    one on the gradients' device, to use instead of a new one).

    The gradients are left bitwise unchanged. Small gradient sets (on a
    CPU: sets of small tensors) are checked with torch's fused non-finite
    check; large ones with one sum per tensor (NaN and inf propagate into
    it), so a gradient whose finite values sum beyond the float32 range also
    counts as non-finite.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads:  # the common case: dense gradients of one device and dtype, briefly
        first = grads[0]
        dev, dtype = first.device, first.dtype
        for g in grads:
            if g.is_sparse or g.dtype != dtype or g.device != dev:
                break
        else:
            if _fused_check_pays(dev, grads) and _kernel_takes(first):
                unit = one if one is not None and one.device == dev else torch.ones((), dtype=torch.float32, device=dev)
                found = unit.new_zeros(())
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, unit)
                return found if device is None or dev == device else found.to(device, non_blocking=True)
    groups = grads_by_device_dtype(params)
    flags = []
    for (dev, _), grads in groups.items():
        if _fused_check_pays(dev, grads):
            unit = one if one is not None and one.device == dev else torch.ones((), dtype=torch.float32, device=dev)
            found = unit.new_zeros(())
            check_and_unscale_(grads, found, unit, write=False)
        else:
            sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
            found = (~sums.isfinite()).any().to(torch.float32)
        flags.append(found if device is None or found.device == device else found.to(device, non_blocking=True))
    return _total(flags, device)


def fused_check_fits(params: list[torch.Tensor], sparse: bool) -> bool:
    """Whether :func:`nonfinite_grads` checks the gradients of ``params``
    with its fused check whenever they all have one, decided once from the
    parameters: one device and dtype, dense (``sparse``: a module of theirs
    may give sparse gradients, which it takes its other way), and a size
    for which the fused check pays. Then :func:`fused_nonfinite` gives the
    same flag, with less Python."""
    if not params or sparse:
        return False
    first = params[0]
    for p in params:
        if p.layout != torch.strided or p.dtype != first.dtype or p.device != first.device:
            return False
    return _kernel_takes(first) and _fused_check_pays(first.device, params)


def fused_nonfinite(grads: list[torch.Tensor], one: torch.Tensor) -> torch.Tensor:
    """:func:`nonfinite_grads`'s fused check of ``grads`` (dense, of one
    device and dtype, where :func:`fused_check_fits`), ``one`` a float32 one
    on their device: a new float32 flag, > 0 where a value is inf or NaN;
    the gradients bitwise unchanged."""
    found = one.new_zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return found


def unscale_flag(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The flag that torch's ``GradScaler.unscale_`` records for these
    gradients, computed beforehand: a float32 scalar tensor on ``device``,
    > 0 when a gradient of ``params`` holds NaN or inf; no host read.

    It runs the same fused check as torch's unscale, with a scale of one
    (the values are written back unchanged): per device and dtype, over the
    values of sparse gradients (float16 ones coalesced, into a copy, as
    torch coalesces them before its check). A net that uses torch's own
    scaler reads its overflow flags this way, through no private state of
    the scaler.
    """
    groups = grads_by_device_dtype(params, coalesce=(torch.float16,))
    flags = []
    with torch.no_grad():
        for (dev, _), grads in groups.items():
            found = torch.zeros((), dtype=torch.float32, device=dev)
            check_and_unscale_(grads, found, torch.ones((), dtype=torch.float32, device=dev), write=False)
            flags.append(found.to(device, non_blocking=True))
    return _total(flags, device)
