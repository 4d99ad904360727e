"""Natural mistakes caught at the first training batch of an epoch.

skorch trains on, silently, with two mistakes that a new user makes:

- a classifier keeps skorch's default ``criterion=NLLLoss``, for which skorch
  takes the log of the module's output as probabilities, but the module
  returns logits: the log of negative values is NaN, and training ends with
  garbage (a new user saw 0.25-0.64 accuracy on scikit-learn's wine, NaN log loss);
- ``y`` holds floats where ``CrossEntropyLoss`` or ``NLLLoss`` need class
  indices: torch raises "expected scalar type Long but found Float";
- a 1-D ``y`` for a regressor whose module returns ``(n, 1)``: ``MSELoss``
  broadcasts them to ``(n, n)`` (:func:`ampnet.training.user_inputs.check_target_shape`
  refuses it, with the fix ``y.reshape(-1, 1)``);
- the reverse of the first: ``criterion=CrossEntropyLoss`` with a module
  that already returns probabilities (a softmax in ``forward``): the softmax
  is applied twice, training slows down, and ``predict_proba`` squashes the
  probabilities towards uniform ones.

:func:`check_loss_inputs` names the mistake and the fix: an
:class:`~ampnet.exceptions.AmpWarning` for the first (training goes on, as
skorch's, whose own tests fit such nets to exercise other features), a
``ValueError`` for the second (in place of torch's error). The net calls it in ``get_loss`` for the first training batch of each
``fit`` or ``partial_fit`` only: a reduction of the batch's outputs and one
read on the host, for a classifier with ``NLLLoss`` or
``CrossEntropyLoss``; none otherwise.
Outputs that are probabilities (a softmax in ``forward``), binary
classifiers (``BCEWithLogitsLoss``) and probability targets for
``CrossEntropyLoss`` (``y`` of the output's shape) pass. With
``CrossEntropyLoss``, outputs count as probabilities only when every row
of the batch (two rows at least) is non-negative and sums to 1.

:func:`check_loss_value` refuses, at every ``get_loss``, a criterion that
returns no floating tensor (a tuple, a Python number), which ``backward``
cannot differentiate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from skorch.classifier import NeuralNetClassifier

from ampnet.utils.dtypes import LOW_PRECISION_DTYPES
from ampnet.exceptions import amp_warn
from ampnet.training.user_inputs import check_target_shape

__all__ = ["check_loss_inputs", "check_loss_value", "probabilities_summing_to_one", "PROBABILITY_TOLERANCE",
           "SOFTMAX_TOLERANCE"]

#: How far a row of probabilities may sum from 1 (float16 and bfloat16
#: softmax outputs sum to 1 within a few 1e-3).
PROBABILITY_TOLERANCE = 0.05

#: How far a row may sum from 1 to count as a softmax's output under
#: ``CrossEntropyLoss`` (logits that all happen to sum to 1 are unlikely).
SOFTMAX_TOLERANCE = 0.01

_CLASS_INDEX_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)


def _module_name(net: Any) -> str:
    module = getattr(net, "module_", None)
    module = getattr(module, "_orig_mod", module)
    return type(module).__name__ if module is not None else "the module"


def _check_target(net: Any, criterion: Any, y_pred: torch.Tensor, y_true: Any) -> None:
    if not (isinstance(y_true, torch.Tensor) and y_true.is_floating_point()):
        return
    if y_pred.dim() != y_true.dim() + 1:  # CrossEntropyLoss: class probabilities as targets
        return
    values = torch.unique(y_true.detach()[:64].float().cpu())[:4].tolist()
    shown = ", ".join(repr(float(v)) for v in values[:3]) + (", ..." if len(values) > 3 else "")
    raise ValueError(
        f"y holds floating-point values (dtype {str(y_true.dtype).replace('torch.', '')}: "
        f"{shown}), but {type(criterion).__name__} needs class indices, integers from 0 "
        f"to n_classes - 1. Fix: pass y as integers, e.g. y.astype(numpy.int64) (or "
        "sklearn.preprocessing.LabelEncoder().fit_transform(y) for any labels); to predict "
        "continuous values use AmpNetRegressor."
    )


def _check_probabilities(net: Any, y_pred: torch.Tensor) -> bool:
    if y_pred.dim() < 2 or not y_pred.is_floating_point() or y_pred.shape[1] < 2:
        return False
    pred = y_pred.detach()
    sums = pred.sum(dim=1)
    finite = torch.isfinite(sums)  # non-finite outputs are the step's guard's business
    negative = pred.amin(dim=1) < 0
    off = (sums - 1).abs() > PROBABILITY_TOLERANCE
    if not bool(((negative | off) & finite).any()):  # the one host read
        return False
    rows = pred.movedim(1, -1)[finite]
    sums = sums[finite]
    amp_warn(
        f"{type(net).__name__} trains with criterion=NLLLoss (skorch's default for a "
        "classifier, unless criterion is set), which takes the log of the module's output as class probabilities, but "
        f"{_module_name(net)} does not return probabilities: on the first training batch its "
        f"outputs range from {float(rows.min()):.3g} to {float(rows.max()):.3g} and its rows "
        f"sum to {float(sums.min()):.3g} ... {float(sums.max()):.3g}, not 1 (logits?). Training "
        "on them gives NaN losses and a useless model. Fix: criterion=torch.nn.CrossEntropyLoss "
        "for a module that returns logits (predict_proba then applies the softmax), or end "
        "the module's forward with torch.softmax(..., dim=-1)."
    )
    return True


def _check_not_softmaxed(net: Any, y_pred: torch.Tensor, y_true: Any) -> None:
    if y_pred.dim() != 2 or not y_pred.is_floating_point() or y_pred.shape[0] < 2 or y_pred.shape[1] < 2:
        return
    if isinstance(y_true, torch.Tensor) and y_true.dim() == y_pred.dim():  # probability targets
        return
    pred = y_pred.detach().float()
    sums = pred.sum(dim=1)
    if not bool(((pred.amin() >= 0) & ((sums - 1).abs().amax() <= SOFTMAX_TOLERANCE))):  # the one host read
        return
    amp_warn(
        f"{type(net).__name__} trains with criterion=CrossEntropyLoss, which applies a softmax "
        f"to the module's output itself, but {_module_name(net)} already returns probabilities: "
        "on the first training batch its outputs are >= 0 and every row sums to 1. The softmax "
        "is applied twice: training slows down and predict_proba squashes the probabilities "
        "towards uniform ones. Fix: return logits (drop the final softmax from forward), or keep "
        "it and use criterion=torch.nn.NLLLoss (skorch's default for a classifier)."
    )


def check_loss_inputs(net: Any, y_pred: Any, y_true: Any) -> bool:
    """Warn about, or refuse, the mistakes described in this module.

    Parameters
    ----------
    net : ampnet net
      The net computing the loss (its ``criterion_`` decides what applies).

    y_pred : torch.Tensor
      The module's output, before skorch's log for ``NLLLoss``.

    y_true : torch.Tensor or None
      The targets of the batch.

    Returns
    -------
    not_probabilities : bool
      True when it warned that the outputs are not probabilities under
      ``NLLLoss`` (the net keeps it for the diagnosis of a non-finite loss
      at the end of the fit, :func:`ampnet.diagnostics.flight.nonfinite_loss_message`).
    """
    check_target_shape(net, y_pred, y_true)  # a 1-D y for a regressor's (n, 1) output
    criterion = getattr(net, "criterion_", None)
    criterion = getattr(criterion, "_orig_mod", criterion)
    if not (isinstance(criterion, _CLASS_INDEX_LOSSES) and isinstance(y_pred, torch.Tensor)):
        return False
    _check_target(net, criterion, y_pred, y_true)
    if isinstance(net, NeuralNetClassifier) and isinstance(criterion, torch.nn.NLLLoss):
        return _check_probabilities(net, y_pred)
    if isinstance(net, NeuralNetClassifier) and isinstance(criterion, torch.nn.CrossEntropyLoss):
        _check_not_softmaxed(net, y_pred, y_true)
    return False


def check_loss_value(net: Any, loss: Any) -> None:
    """Raise a TypeError, naming the criterion and the fix, unless ``loss``
    (what ``get_loss`` computed) is a floating tensor."""
    if isinstance(loss, torch.Tensor) and loss.is_floating_point():
        return
    criterion = net.__dict__.get("criterion_")
    if criterion is not None:
        name = type(criterion).__name__
    else:
        name = getattr(getattr(net, "criterion", None), "__name__", "the criterion")
    what = (f"a {type(loss).__name__} of {len(loss)}" if isinstance(loss, (tuple, list))
            else f"a {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
    raise TypeError(
        f"The criterion {name} returned {what} ({str(loss)[:80]}), but get_loss must return "
        "the loss as a floating tensor, which backward() differentiates. Fix: make the "
        "criterion's forward return the loss tensor (e.g. 'return loss', not 'return loss, "
        "parts'; torch operations, not Python numbers), or override get_loss to pick it."
    )


# ---- predict_proba of a low-precision softmax ------------------------------------------------

#: Rows that already sum to 1 within this are left as they are (a float32 softmax, AMP off).
_FLOAT32_SUM = 1e-6


def probabilities_summing_to_one(net: Any, proba: Any) -> Any:
    """``predict_proba``'s rows renormalized to sum to 1 (in float64, cast
    back to their dtype) where a classifier's module computed its softmax in
    low precision.

    scikit-learn's convention is class probabilities whose rows sum to 1
    (calibration and ``log_loss`` rely on it); a softmax computed in
    bfloat16 or float16 (a ``torch.nn.Softmax`` or ``torch.softmax`` at the
    end of the module, under autocast or in ``amp_level='pure'``) is
    rounded to 8 or 11 significant bits, so its float32 rows sum to 1 only
    within about 4e-3 (bfloat16) or 5e-4 (float16). Dividing each row by
    its sum (in float64) restores it to float32's precision without
    changing the ranking of the classes (``predict`` is unchanged).

    Only where every condition holds: ``net`` is a classifier
    (``NeuralNetClassifier``; binary classifiers' rows already sum to 1)
    training with AMP in a low-precision dtype; ``proba`` is a 2-D float
    array with at least two columns, finite and non-negative; and its rows
    sum to 1 within the rounding of that dtype (its ``eps``), but not all
    within float32's (1e-6). Anything else (AMP off, logits, log-probabilities,
    rows already summing to 1) is returned unchanged, as the same object.
    """
    if not isinstance(net, NeuralNetClassifier) or not isinstance(proba, np.ndarray):
        return proba
    prec = net.__dict__.get("precision_")
    dtype = getattr(getattr(prec, "policy", None), "compute_dtype", None)
    if not (getattr(prec, "enabled", False) and dtype in LOW_PRECISION_DTYPES):
        return proba
    if proba.ndim != 2 or proba.shape[1] < 2 or proba.shape[0] == 0 or proba.dtype.kind != "f":
        return proba
    if not np.isfinite(proba).all() or (proba < 0).any():
        return proba
    sums = proba.sum(axis=1, dtype=np.float64)
    off = float(np.abs(sums - 1.0).max())
    if off <= _FLOAT32_SUM or off > torch.finfo(dtype).eps:
        return proba
    return (proba / sums[:, None]).astype(proba.dtype, copy=False)
