"""The unscale of ``ampnet.GradScaler``: the optimizer's gradients divided
by the loss scale in place, and inf/NaN flagged, with torch's public fused
op (the scaler's own code; no private state of torch's scaler)."""

from __future__ import annotations

import torch

from ampnet.precision.checks import check_and_unscale_

__all__ = ["unscale_in_place"]


def unscale_in_place(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, allow_fp16: bool) -> torch.Tensor:
    """Multiply ``optimizer``'s gradients by ``inv_scale`` in place and flag
    inf/NaN in them, as torch's scaler does: one fused kernel per device and
    dtype; a sparse float16 gradient is coalesced first (duplicates summed
    in float16 may overflow), others are checked over their values. Returns
    the flag, a float32 tensor on ``inv_scale``'s device (> 0: found).

    Raises
    ------
    ValueError
      A float16 gradient without ``allow_fp16``.
    """
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if param.grad.is_sparse:
                    if param.grad.dtype is torch.float16:
                        param.grad = param.grad.coalesce()
                    grad = param.grad._values()
                else:
                    grad = param.grad
                groups.setdefault(grad.device, {}).setdefault(grad.dtype, []).append(grad)
        home = inv_scale.device
        found = torch.full((), 0.0, dtype=torch.float32, device=home)
        flags = [found]
        for device, by_dtype in groups.items():
            if device == home:
                flag, inv = found, inv_scale
            else:
                flag = torch.full((), 0.0, dtype=torch.float32, device=device)
                inv = inv_scale.to(device, non_blocking=True, copy=True)
                flags.append(flag)
            for grads in by_dtype.values():
                check_and_unscale_(grads, flag, inv)
    if len(flags) == 1:
        return found
    return torch.stack([f.to(home, non_blocking=True) for f in flags]).sum()
