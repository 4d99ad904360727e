"""float64 inputs, AMP on or off.

scikit-learn hands nets float64 arrays (``StandardScaler`` in a
``Pipeline``), while torch modules are float32. skorch passes them through
and torch fails with "mat1 and mat2 must have the same dtype"; with AMP on,
ampnet has always cast them to float32. :func:`match_module_dtype` gives AMP
off the same behaviour, so that a grid over ``amp_enabled`` works: float64
inputs are cast to float32 when the module's floating parameters are all
float32, and stay float64 for a float64 module. Inputs of any other dtype
are passed on untouched (the same objects), so float32 training stays
bitwise skorch's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from skorch.utils import to_tensor

from ampnet.utils.tree import cast_floating, iter_tensors

__all__ = ["match_module_dtype", "has_float64", "autocast_dtype_error"]


def has_float64(x: Any) -> bool:
    """Whether ``x`` (a tensor, array, or tuple/list/dict of them) holds float64."""
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.float64
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64
    if isinstance(x, Mapping):
        return any(has_float64(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(has_float64(v) for v in x)
    return False


def _module_is_float32(module: Any) -> bool:
    """True when ``module`` has floating parameters and all are float32."""
    if not isinstance(module, torch.nn.Module):
        return False
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return dtypes == {torch.float32}


def match_module_dtype(x: Any, module: Any, device: Any) -> Any:
    """Cast float64 tensors in ``x`` to float32 for a float32 ``module``.

    Parameters
    ----------
    x : input batch
      What skorch's ``infer`` receives.

    module : torch.nn.Module or None
      The net's ``module_``.

    device : str, torch.device or None
      The net's device (numpy inputs are converted to tensors on it).

    Returns
    -------
    x, or a copy whose float64 tensors are float32.
    """
    if not has_float64(x) or not _module_is_float32(module):
        return x
    return cast_floating(to_tensor(x, device=device), torch.float32, only=(torch.float64,))


def _float64_params(module: Any) -> list[str]:
    if not isinstance(module, torch.nn.Module):
        return []
    return [n for n, p in module.named_parameters() if p.dtype == torch.float64]


def autocast_dtype_error(exc: RuntimeError, x: Any, module: Any, policy_name: str) -> TypeError | None:
    """The error to raise for a dtype failure of the forward under
    autocast, saying what is wrong; None when ``exc`` is no dtype failure.

    ``x`` is the input as the module received it. A module with float64
    parameters is named as the cause (autocast leaves float64 operations
    alone, so float64 weights meet low-precision activations); otherwise
    the input's dtype is.
    """
    text = str(exc)
    if not ("dtype" in text or "scalar type" in text or "type (" in text):
        return None
    wide = _float64_params(module)
    if wide:
        shown = ", ".join(wide[:4]) + (f" and {len(wide) - 4} more" if len(wide) > 4 else "")
        return TypeError(
            f"The module failed under {policy_name} autocast: its parameters are float64 ({shown}). "
            "Autocast computes in low precision only from float32 and leaves float64 operations "
            f"alone, so float64 weights meet low-precision activations: {text}. Fix: build the module "
            "in float32 (drop dtype=torch.float64 or .double() from it), or train it in float64 "
            "with amp_enabled=False."
        )
    dtypes = [str(t.dtype) for t in iter_tensors(x)]
    return TypeError(
        f"The module failed under {policy_name} autocast with an input of "
        f"dtype {', '.join(dtypes) or type(x).__name__}: {text}. Fix: pass float32 "
        "features (e.g. X.astype(numpy.float32)); integer inputs only suit layers "
        "such as nn.Embedding."
    )
