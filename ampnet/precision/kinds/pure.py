"""Pure precision (``amp_level='pure'``): the weights stored in low
precision, updated through float32 master copies (or without them,
``amp_master_weights=False``), under autocast as in mixed precision."""

from __future__ import annotations

from ampnet.precision.kinds.mixed import MixedPrecision
from ampnet.precision.settings import PrecisionSettings

__all__ = ["PurePrecision"]


class PurePrecision(MixedPrecision):
    """Mixed precision's forward and loss over low-precision weights. The
    layout (:meth:`~ampnet.precision.component.Precision.attach`) narrows
    the weights and keeps the float32 masters; :meth:`gather_grads` moves
    the gradients into them and :meth:`after_step` copies the updated
    masters back into the weights."""

    @staticmethod
    def serves(settings: PrecisionSettings) -> bool:
        """Whether this kind runs ``settings``: AMP on, ``amp_level='pure'``."""
        return settings.policy.enabled and settings.policy.level == "pure"
