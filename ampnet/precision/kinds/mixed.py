"""Mixed precision: autocast over float32 weights (``amp_level='mixed'``),
with the loss scaler where float16 needs one."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from skorch.utils import to_tensor

from ampnet.precision.component import NO_CONTEXT, Precision
from ampnet.precision.kinds.float32 import channels_last
from ampnet.precision.settings import PrecisionSettings
from ampnet.utils.dtypes import LOW_PRECISION_DTYPES
from ampnet.utils.placement import is_on
from ampnet.utils.tree import cast_floating, map_tensors

__all__ = ["MixedPrecision"]

#: Output dtypes that convert_output casts to float32 under AMP.
TO_FLOAT32 = (*LOW_PRECISION_DTYPES, torch.float64)
_FLOAT64_ONLY = (torch.float64,)


class MixedPrecision(Precision):
    """Autocast in the net's low-precision dtype for the forward pass and
    the loss (only inside ``amp_modules`` where the layout scopes it);
    float32 features and outputs. The loss scaler, where enabled, scales
    the loss in :meth:`backward` and is unscaled once in :meth:`check`."""

    enabled = True

    @staticmethod
    def serves(settings: PrecisionSettings) -> bool:
        """Whether this kind runs ``settings``: AMP on."""
        return settings.policy.enabled

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast for the forward pass and the loss (off for the rest of
        the model when only ``amp_modules`` run in low precision); nothing
        where that context is entered already (a step's forward and loss)."""
        device_type = self._device_type
        if self._scoped:
            if not torch.is_autocast_enabled(device_type):
                return NO_CONTEXT
            return torch.autocast(device_type, enabled=False)
        if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == self._dtype:
            return NO_CONTEXT
        return torch.autocast(device_type, dtype=self._dtype)

    def convert_input(self, x: Any, module: Any, device: Any) -> Any:
        """float64 features to float32; 4-D inputs to channels_last where the
        layout asks. A batch of the array path, on the device, as it is."""
        layout_cl = self._channels_last
        if type(x) is torch.Tensor and not layout_cl and x.dtype != torch.float64 and is_on(x, device):
            return x  # a batch of the array path, on the device: nothing to convert
        x = cast_floating(to_tensor(x, device=device), torch.float32, only=_FLOAT64_ONLY)
        if layout_cl:
            x = map_tensors(x, channels_last)
        return x

    def convert_output(self, y: Any) -> Any:
        """Floating outputs to float32 (low precision, and float64 from a
        module that computes in it)."""
        if type(y) is torch.Tensor:
            return y.to(torch.float32) if y.dtype in TO_FLOAT32 else y
        return cast_floating(y, torch.float32, only=TO_FLOAT32)
