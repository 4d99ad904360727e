"""What a fitted net offers for serving: low-precision inference copies
and export.

:class:`ConversionMixin` is mixed into :class:`ampnet.AmpNetMixin`; it only
adds public methods (no skorch method is overridden here).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch

from ampnet.config.params import check
from ampnet.precision import parse_amp_dtype

__all__ = ["ConversionMixin"]


class ConversionMixin:
    """``low_precision_state``, ``convert_for_inference`` and ``export``."""

    def low_precision_state(self) -> contextlib.AbstractContextManager:
        """Context manager: inside it, ``module_.state_dict()`` -- and so
        ``save_params(f_params=...)`` and checkpoints -- hold the weights as
        the module stores them (low precision in ``'pure'``).

        Outside it, a ``'pure'`` net's module state dict holds float32
        weights (its master copies), and ``load_state_dict`` /
        ``load_params`` refresh the masters at full precision from either.

        Examples
        --------
        >>> with net.low_precision_state():
        ...     net.save_params(f_params="weights-bf16.pt")
        """
        return self.precision_.params_as(self.__dict__.get("module_"), "low")

    def convert_for_inference(self, dtype: str | torch.dtype = "auto"):
        """Return a copy of this fitted net that predicts with low-precision
        weights; this net is left unchanged.

        The copy is the same net with ``amp_enabled=True``, ``amp_level='pure'``
        and ``amp_dtype=dtype``: parameters are stored in ``dtype`` except
        those of normalization layers and ``amp_fp32_modules``; ``amp_modules``
        is respected. It pickles like any net. ``partial_fit`` continues
        training it as ``'pure'`` (float32 masters are made from this net's
        float32 weights); ``fit`` re-initializes and trains ``'pure'`` from
        scratch, as skorch's ``fit`` always does. A net with
        ``amp_master_weights='compensated'`` stays compensated in its own
        dtype; converted to another dtype it gets float32 masters (made from
        its weights plus their compensation). Call
        ``trim_for_prediction()`` on the copy to drop the optimizer and the
        masters when it only predicts.

        Parameters
        ----------
        dtype : str or torch.dtype (default='auto')
          ``'auto'``: this net's low-precision dtype when AMP is on, else
          the device default of ``amp_dtype='auto'``; or any ``amp_dtype``
          value.

        Returns
        -------
        net
          The converted, fitted copy.
        """
        self.check_is_fitted()
        policy = self.precision_policy_
        if isinstance(dtype, str) and dtype.strip().lower() == "auto" and policy.enabled:
            dtype = policy.compute_dtype
        target = parse_amp_dtype(dtype)
        changes = dict(amp_enabled=True, amp_dtype=dtype, amp_level="pure")
        if check("amp_master_weights", self.amp_master_weights) == "compensated" and target != policy.compute_dtype:
            # the compensation belongs to the old dtype's rounding: float32 masters
            # are made from the weights plus their compensation
            changes["amp_master_weights"] = True
        new = copy.deepcopy(self)
        verbose, new.verbose = new.verbose, 0
        try:
            new.set_params(**changes)
        finally:
            new.verbose = verbose
        return new

    def export(
        self,
        path: str | os.PathLike,
        X_example: Any,
        format: str = "onnx",
        dtype: str | torch.dtype | None = None,
    ) -> str:
        """Write the fitted net as a model that runs without ampnet or skorch
        and returns what ``predict_proba`` returns (float32).

        The module is exported from its float32 weights (the masters in
        ``amp_level='pure'``), on the CPU, with a dynamic batch size; the net
        is not changed. See ``ampnet.serving.export``.

        Parameters
        ----------
        path : str or os.PathLike
          The file to write (atomically: a temporary file in the same
          directory, renamed into place).

        X_example : numpy array, torch tensor or DataFrame
          A few rows of input, as ``predict_proba`` takes them; they fix the
          feature shape and the input dtype (float32 for float features).

        format : str (default='onnx')
          ``'onnx'`` (needs ``pip install "ampnet[onnx]"``) or
          ``'torch.export'`` (a ``.pt2`` file for ``torch.export.load``).

        dtype : None, str or torch.dtype (default=None)
          None: float32 weights. ``'float16'`` or ``'bfloat16'``
          (``torch.export`` only): parameters stored and computed in that
          dtype, except normalization layers and ``amp_fp32_modules``.

        Returns
        -------
        path : str
          The path written.
        """
        # the exporter loads torch.onnx / torch.export, which importing ampnet need not
        from ampnet.serving.export import export_net

        return export_net(self, path, X_example, format=format, dtype=dtype)
