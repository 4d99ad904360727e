"""Compensated low-precision weights (``amp_level='pure'``,
``amp_master_weights='compensated'``): no float32 masters; the optimizer
steps the weights and keeps their rounding error in its state
(:mod:`ampnet.precision.compensated`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ampnet.precision import compensated as comp
from ampnet.precision.component import _fused_flags
from ampnet.precision.kinds.pure import PurePrecision
from ampnet.precision.settings import PrecisionSettings

__all__ = ["CompensatedPrecision"]


class CompensatedPrecision(PurePrecision):
    """Pure precision without masters: gradients unscaled in the weights'
    own dtype (float16 included), and every optimizer step runs on the
    compensation buffers, which are then folded into the weights."""

    _unscale_kwargs = {"allow_fp16": True}  # float16 weights and gradients

    @staticmethod
    def serves(settings: PrecisionSettings) -> bool:
        """Whether this kind runs ``settings``: ``'pure'`` with compensated weights."""
        return settings.policy.enabled and settings.compensated

    def step_context(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """Around ``optimizer.step()``: the step on the compensation buffers
        (:func:`ampnet.precision.compensated.compensated_step`), a fused
        optimizer receiving the overflow flag on the device."""
        return _compensated_step(optimizer, self._fused_found(optimizer))


@contextlib.contextmanager
def _compensated_step(optimizer: torch.optim.Optimizer, found: torch.Tensor | None) -> Iterator[Any]:
    with comp.compensated_step(optimizer):
        if found is None:
            yield
        else:
            with _fused_flags(optimizer, found):
                yield
