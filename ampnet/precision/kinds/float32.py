"""Float32 training (AMP off): skorch's training, as it is."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from skorch.utils import to_tensor

from ampnet.precision.component import NO_CONTEXT, Precision
from ampnet.precision.inputs import match_module_dtype
from ampnet.precision.settings import PrecisionSettings
from ampnet.utils.tree import map_tensors

__all__ = ["Float32Precision", "channels_last"]


def channels_last(t: Any) -> Any:
    """A 4-D floating tensor in channels_last strides; other tensors as they are."""
    if t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


class Float32Precision(Precision):
    """AMP off: no autocast, outputs as the module returns them, float64
    features cast to float32 for a float32 module (a float64 module keeps
    them)."""

    enabled = False

    @staticmethod
    def serves(settings: PrecisionSettings) -> bool:
        """Whether this kind runs ``settings``: AMP off."""
        return not settings.policy.enabled

    def forward_context(self) -> contextlib.AbstractContextManager:
        """No context: float32 as the module computes it."""
        return NO_CONTEXT

    def convert_input(self, x: Any, module: Any, device: Any) -> Any:
        """Features in the module's floating dtype (float64 to float32 for
        a float32 module); 4-D inputs to channels_last where the layout asks."""
        x = match_module_dtype(x, module, device)
        if not self._channels_last:
            return x
        return map_tensors(to_tensor(x, device=device), channels_last)

    def convert_output(self, y: Any) -> Any:
        """Outputs as the module returns them."""
        return y
