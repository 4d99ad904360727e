"""The inputs a new user passes first, made to work or refused with the fix.

Two kinds of data that scikit-learn estimators take, but on which a skorch
net fails or trains wrongly:

- **a pandas DataFrame** ``X``: skorch passes a DataFrame to the module as
  one keyword argument per column (``module(f0=..., f1=...)``, each a
  ``(batch, 1)`` tensor), which is what a module whose ``forward`` takes
  the column names wants, and what every other module refuses with
  ``TypeError: forward() got an unexpected keyword argument 'f0'``.
  :func:`prepare_fit_inputs` keeps skorch's behaviour where ``forward``
  takes a keyword argument named after a column (or ``**kwargs``);
  otherwise a DataFrame of numeric (and boolean) columns becomes one
  ``float32`` array, as scikit-learn's estimators read it, and a DataFrame
  with other columns (strings, categories, dates) is refused with a
  ``ValueError`` that names them and the fix. A pandas ``y`` becomes a
  numpy array (``float32`` where it holds floats): skorch cannot batch a
  DataFrame ``y`` at all.
- **a 1-D** ``y`` **for a regressor** whose module returns ``(n, 1)``:
  ``MSELoss`` (and ``L1Loss``, ``SmoothL1Loss``, ``HuberLoss``) broadcast
  ``(n, 1)`` against ``(n,)`` to ``(n, n)`` and train on a wrong loss, with
  only torch's "Using a target size ... different to the input size"
  ``UserWarning``. skorch's documentation asks for ``y.reshape(-1, 1)``.
  Whether ``y`` needs the reshape depends on the module's output (a module
  that returns ``(n,)`` trains correctly on a 1-D ``y``), which is known at
  the first training batch: :func:`check_target_shape` (called there by
  ``ampnet.training.output_checks.check_loss_inputs``) refuses the mismatch
  with a ``ValueError`` naming both shapes and the fix, instead of
  reshaping ``y`` behind the user's back.

The net calls :func:`prepare_fit_inputs` at the start of ``partial_fit``
(which ``fit`` calls), before anything reads the data.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from skorch.classifier import NeuralNetBinaryClassifier, NeuralNetClassifier

__all__ = ["check_target_shape", "prepare_fit_inputs", "prepare_input"]

#: torch's element-wise losses that broadcast a target of another shape
#: against the input (with a UserWarning) instead of refusing it.
BROADCASTING_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss)


def _is_frame(x: Any) -> bool:
    """A pandas DataFrame (skorch's own test for pandas data, ``iloc``, and two dimensions)."""
    return hasattr(x, "iloc") and hasattr(x, "columns") and getattr(x, "ndim", 0) == 2


def _is_pandas(x: Any) -> bool:
    """A pandas DataFrame or Series."""
    return hasattr(x, "iloc") and hasattr(x, "to_numpy")


def _forward_signature(net: Any) -> inspect.Signature | None:
    """The signature of the module's ``forward`` (of ``module_`` once
    initialized, else of the ``module`` parameter, class or instance);
    None when it cannot be read."""
    module = net.__dict__.get("module_", getattr(net, "module", None))
    module = getattr(module, "_orig_mod", module)  # torch.compile
    forward = getattr(module, "forward", None)
    if forward is None:
        return None
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    if isinstance(module, type):  # the unbound function of a class: drop ``self``
        params = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=params)
    return signature


def _takes_columns(signature: inspect.Signature | None, columns: list) -> bool:
    """Whether ``forward`` is written for skorch's one-keyword-per-column
    call: it takes ``**kwargs``, or a keyword argument named after a column."""
    if signature is None:
        return True  # unknown: leave the data as skorch passes it
    keywords = set()
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return True
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            keywords.add(p.name)
    return any(str(c) in keywords for c in columns)


def prepare_input(net: Any, X: Any) -> Any:
    """``X`` as the module can take it: a pandas DataFrame of numeric
    columns as a ``float32`` array, unless the module's ``forward`` takes
    the columns as keyword arguments (skorch's behaviour, kept); any other
    ``X`` unchanged.

    Parameters
    ----------
    net : ampnet net
      The net whose module receives ``X``.

    X : any
      The input data as passed to ``fit``, ``partial_fit`` or ``predict``.

    Returns
    -------
    X : any
      ``X`` itself, or the DataFrame's values as a ``float32`` array of
      shape ``(n_rows, n_columns)``.

    Raises
    ------
    ValueError
      A DataFrame with non-numeric columns for a module that does not take
      the columns as keyword arguments.
    """
    if not _is_frame(X):
        return X
    columns = list(X.columns)
    signature = _forward_signature(net)
    if _takes_columns(signature, columns):
        return X
    from pandas.api.types import is_numeric_dtype  # pandas is there: X is a DataFrame

    other = [(c, str(dtype)) for c, dtype in X.dtypes.items() if not is_numeric_dtype(dtype)]
    if other:
        shown = ", ".join(f"{c!r} ({dtype})" for c, dtype in other[:5]) + (", ..." if len(other) > 5 else "")
        raise ValueError(
            f"X is a pandas DataFrame with {len(other)} non-numeric column{'s' if len(other) > 1 else ''} "
            f"({shown}), and the module's forward{signature} takes no keyword argument named after "
            "a column, so it cannot take the columns one by one as skorch passes them. Fix: encode "
            "those columns as numbers (e.g. sklearn.preprocessing.OneHotEncoder or OrdinalEncoder in "
            "a sklearn.compose.ColumnTransformer, in a Pipeline before the net), then pass "
            "X.to_numpy(dtype='float32'); or write forward to take the columns as keyword arguments.")
    # a writable copy: pandas' copy-on-write may hand out a read-only view, which torch warns about
    return np.array(X.to_numpy(dtype=np.float32, na_value=np.nan), copy=True)


def _prepare_target(y: Any) -> Any:
    """A pandas ``y`` as a writable numpy array (``float32`` for floats);
    anything else unchanged."""
    if not _is_pandas(y):
        return y
    values = np.array(y.to_numpy())  # a writable copy (pandas may hand out a read-only view)
    if values.dtype.kind == "f":
        values = values.astype(np.float32)
    return values


def _classifier_target(net: Any, y: Any) -> Any:
    """A numpy ``y`` in the dtype the classifier's loss takes: class indices
    as int64 for ``NeuralNetClassifier`` (int32 and other integer kinds
    cast), 0/1 labels (int or bool) as float32 for
    ``NeuralNetBinaryClassifier``; text labels refused with the fix."""
    if not isinstance(y, np.ndarray) or not isinstance(net, (NeuralNetClassifier, NeuralNetBinaryClassifier)):
        return y
    if y.dtype.kind in "US" or (y.dtype.kind == "O" and y.size and all(isinstance(v, str) for v in y.flat[:64])):
        shown = ", ".join(repr(str(v)) for v in np.unique(y.ravel()[:64].astype(str))[:3])
        raise ValueError(
            f"y holds text labels ({shown}, ...), but {type(net).__name__} trains on numbers "
            f"({'class indices 0 to n_classes - 1' if isinstance(net, NeuralNetClassifier) else '0 and 1'}). "
            "Fix: y = sklearn.preprocessing.LabelEncoder().fit_transform(y)"
            + ("." if isinstance(net, NeuralNetClassifier) else ", or y = (y == positive_label).astype('float32')."))
    if isinstance(net, NeuralNetBinaryClassifier):
        if y.dtype.kind == "f":
            return y.astype(np.float32, copy=False)  # the loss compares them with float32 logits
        if y.dtype.kind not in "biu":
            return y
        values = np.unique(y)
        if not set(values.tolist()) <= {0, 1}:
            raise ValueError(
                f"y holds the labels {values[:4].tolist()}{' ...' if len(values) > 4 else ''}, but "
                f"{type(net).__name__} takes 0 and 1 (as floats: BCEWithLogitsLoss). Fix: "
                "y = (y == positive_label).astype('float32'), or AmpNetClassifier for more than two classes.")
        return y.astype(np.float32)  # BCEWithLogitsLoss takes float targets
    if y.dtype.kind in "iu" and y.dtype != np.int64:
        return y.astype(np.int64)  # CrossEntropyLoss/NLLLoss take int64 class indices
    return y


def prepare_fit_inputs(net: Any, X: Any, y: Any) -> tuple[Any, Any]:
    """``X`` and ``y`` of a ``fit`` or ``partial_fit`` as the net can train
    on them (see the module's docstring): a DataFrame ``X`` through
    :func:`prepare_input`, a pandas ``y`` as a numpy array, a classifier's
    ``y`` in the dtype its loss takes.

    Parameters
    ----------
    net : ampnet net
      The net being fitted.

    X : any
      The training input.

    y : any
      The training target, or None.

    Returns
    -------
    X, y : tuple
      The inputs to train on; the objects passed in where nothing applies.
    """
    return prepare_input(net, X), _classifier_target(net, _prepare_target(y))


def check_target_shape(net: Any, y_pred: Any, y_true: Any) -> None:
    """Refuse a target whose shape a broadcasting loss would silently
    broadcast against the module's output.

    With ``MSELoss``, ``L1Loss``, ``SmoothL1Loss`` or ``HuberLoss``, an
    output of shape ``(n, 1)`` and a target of shape ``(n,)`` (or the
    reverse) broadcast to ``(n, n)``: the loss compares every prediction
    with every target. Called for the first training batch of a fit.

    Parameters
    ----------
    net : ampnet net
      The net computing the loss (its ``criterion_`` decides whether the
      check applies).

    y_pred : torch.Tensor
      The module's output for the batch.

    y_true : torch.Tensor or None
      The batch's target.

    Raises
    ------
    ValueError
      The shapes differ and broadcast to a larger shape; the message names
      both shapes and the fix (``y.reshape(-1, 1)`` for a 1-D ``y``).
    """
    criterion = getattr(net, "criterion_", None)
    criterion = getattr(criterion, "_orig_mod", criterion)
    if not (isinstance(criterion, BROADCASTING_LOSSES) and isinstance(y_pred, torch.Tensor)
            and isinstance(y_true, torch.Tensor)):
        return
    pred, true = tuple(y_pred.shape), tuple(y_true.shape)
    if pred == true:
        return
    try:
        broadcast = tuple(torch.broadcast_shapes(pred, true))
    except RuntimeError:
        return  # torch refuses these shapes itself, with its own error
    if broadcast == pred:
        return  # e.g. a target of one value per batch: what the user wrote
    name = type(criterion).__name__
    if len(true) == 1 and pred == (true[0], 1):
        fix = ("Fix: pass y as a column, y.reshape(-1, 1) (skorch's regressors expect a 2-D y), "
               "or make forward return shape (n,) (e.g. .squeeze(-1)).")
    elif len(pred) == 1 and true == (pred[0], 1):
        fix = "Fix: pass y as 1-D, y.ravel(), or make forward return shape (n, 1)."
    else:
        fix = "Fix: give y the shape of the module's output."
    raise ValueError(
        f"y has shape {true} per batch, but the module returns shape {pred}: {name} would "
        f"broadcast them to {broadcast} and compare every prediction with every target, a wrong "
        f"loss that trains a useless model (torch only warns about it). {fix}")
