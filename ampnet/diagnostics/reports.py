"""What a net reports about its precision and memory: ``net.precision_report``
and ``net.memory_report``.

:class:`ReportsMixin` is mixed into :class:`ampnet.AmpNetMixin`; it only adds
public methods (no skorch method is overridden here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ampnet.diagnostics.report import build_report

if TYPE_CHECKING:
    from ampnet.precision import MemoryReport

__all__ = ["ReportsMixin"]


class ReportsMixin:
    """``precision_report`` and ``memory_report``."""

    def precision_report(self, X: Any, y: Any = None, *, dtype: Any = None):
        """Run one forward and backward pass on the first batch of ``X`` and
        report, per module, the dtypes and ranges seen.

        The net is left unchanged (gradients, buffers such as BatchNorm
        statistics, the random state and train/eval modes are restored).

        Parameters
        ----------
        X : input data
          Anything ``fit`` accepts; only the first batch is used.

        y : target data or None (default=None)
          Without a target the backward pass uses the sum of the outputs.

        dtype : str, torch.dtype or None (default=None)
          The target low-precision dtype for the range and underflow
          analysis; None: the net's dtype, or the device default when AMP is
          off.

        Returns
        -------
        report : ampnet.diagnostics.report.PrecisionReport
          ``str(report)`` is a text table, ``report.to_dicts()`` a list of
          dicts, ``report.recommended_fp32_modules`` the modules it suggests
          for ``amp_fp32_modules``.
        """
        if not self.initialized_:
            self.initialize()
        return build_report(self, X, y, dtype)

    def memory_report(self) -> "MemoryReport":
        """The bytes of this net's training state now, by role: parameters,
        gradients, float32 master weights, compensation buffers and
        optimizer state (after ``fit``: the state between two training
        steps).

        Activations and the temporaries of a step are not counted; a tensor
        counts ``numel() * element_size()`` bytes. See
        ``ampnet.precision.memory``.

        Returns
        -------
        report : ampnet.precision.memory.MemoryReport
          ``report.total``, ``report.to_dict()``; ``str(report)`` is a table.

        Examples
        --------
        >>> net.fit(X, y)
        >>> print(net.memory_report())
        >>> net.memory_report().total
        """
        if not self.initialized_:
            self.check_is_fitted()
        optimizers = [getattr(self, n + "_", None) for n in self._optimizers]
        optimizers = [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]
        return self.precision_.memory(self.__dict__.get("module_"), optimizers)
