"""The kinds of precision: one module per kind, each a subclass of
:class:`~ampnet.precision.component.Precision` that says what it does at
every hook of a training step.

- :mod:`~ampnet.precision.kinds.float32`: AMP off, skorch's float32 training;
- :mod:`~ampnet.precision.kinds.mixed`: autocast over float32 weights, with
  an optional loss scaler (``amp_level='mixed'``);
- :mod:`~ampnet.precision.kinds.pure`: low-precision weights, with float32
  master copies or without (``amp_level='pure'``);
- :mod:`~ampnet.precision.kinds.compensated`: low-precision weights with
  their rounding error kept (``amp_master_weights='compensated'``);
- :mod:`~ampnet.precision.kinds.float8`: torchao's float8 matmuls for the
  linear layers, bfloat16 autocast elsewhere (``amp_dtype='float8'``).

:func:`precision_class` chooses the kind from the checked settings: the
most specific subclass whose ``serves(settings)`` accepts them. A new kind
is one new module here (a subclass with its ``serves`` and its hooks,
imported below) and its rows in the parameter table (:mod:`ampnet.config.params`).
"""

from __future__ import annotations

from ampnet.precision.component import Precision, precision_class
from ampnet.precision.kinds.compensated import CompensatedPrecision
from ampnet.precision.kinds.float32 import Float32Precision
from ampnet.precision.kinds.float8 import Float8Precision
from ampnet.precision.kinds.mixed import MixedPrecision
from ampnet.precision.kinds.pure import PurePrecision

__all__ = ["precision_class", "KINDS", "CompensatedPrecision", "Float32Precision", "Float8Precision",
           "MixedPrecision", "PurePrecision"]

#: ampnet's kinds (a kind of its own is any subclass of Precision that defines serves).
KINDS: tuple[type[Precision], ...] = (Float32Precision, MixedPrecision, PurePrecision, CompensatedPrecision,
                                      Float8Precision)
