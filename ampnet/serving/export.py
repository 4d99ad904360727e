"""Export a fitted net for serving: an ONNX file or a ``torch.export`` program.

:func:`export_net` (the net's :meth:`~ampnet.AmpNetMixin.export`) writes a
model that runs without ampnet or skorch and returns what ``predict_proba``
returns: the module's first output in float32, after skorch's prediction
nonlinearity (softmax for a classifier trained with ``CrossEntropyLoss``,
sigmoid as two columns for a binary classifier, none for a regressor).

The module is copied with float32 weights (the float32 master copies of an
``amp_level='pure'`` net), on the CPU, in eval mode; the net is not changed.
With ``dtype='float16'`` or ``'bfloat16'`` the copy stores in that dtype the
parameters that ``amp_level='pure'`` would (every floating parameter except
those of normalization layers, of ``amp_fp32_modules`` and, with
``amp_modules``, of the modules outside them), together with the floating
buffers of their modules. Every module that owns floating parameters casts
its floating inputs to its parameters' dtype (a forward pre-hook on the
copy), so float32 islands compute in float32 inside a low-precision model.
The model takes the input dtype of ``X_example`` (float32 for float
features) and a batch dimension of any size; an integer ``X_example`` is
refused for a module that cannot compute on integers (its first layer is
not an ``nn.Embedding`` or the like).

Both formats go through :func:`torch.export.export`; ONNX is then
translated by ``torch.onnx.export(..., dynamo=True)``, which needs the
``onnx`` and ``onnxscript`` packages (``pip install "ampnet[onnx]"``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import os
import re
import sys
import warnings
from typing import Any, Iterator

import numpy as np
import torch
from skorch.classifier import NeuralNetBinaryClassifier

from ampnet.io.atomic import atomic_write_group
from ampnet.exceptions import AmpWarning, amp_warn
from ampnet.utils.tree import cast_floating
from ampnet.utils.dtypes import LOW_PRECISION_DTYPES
from ampnet.precision import Precision, module_root
from ampnet.precision import remove_state_hooks
from ampnet.precision import DTYPE_ALIASES, dtype_name
from ampnet.precision import remove_regions
from ampnet.precision import build_settings
from ampnet.config.params import constructor_defaults, parsed

__all__ = ["export_net", "EXPORT_FORMATS", "PredictProbaModule"]

#: Accepted values of ``format``.
EXPORT_FORMATS = ("onnx", "torch.export")

#: Names of the input and output of an exported ONNX model.
ONNX_INPUT_NAME, ONNX_OUTPUT_NAME = "input", "output"

_FLOATING = (*LOW_PRECISION_DTYPES, torch.float32, torch.float64)

_DTYPES_TEXT = "None (float32), 'float16' (or 'fp16', 'half'), 'bfloat16' (or 'bf16')"


class PredictProbaModule(torch.nn.Module):
    """Export-only wrapper: the module's output as ``predict_proba`` gives it.

    Parameters
    ----------
    module : torch.nn.Module
      The module to export (a copy; it is not changed otherwise).

    nonlinearity : callable
      skorch's prediction nonlinearity of the net
      (``net._get_predict_nonlinearity()``).

    flatten : bool (default=False)
      Reshape the output to one dimension before the nonlinearity, as
      skorch's binary classifier does in ``infer``.
    """

    def __init__(self, module: torch.nn.Module, nonlinearity: Any, flatten: bool = False) -> None:
        super().__init__()
        self.module = module
        self.nonlinearity = nonlinearity
        self.flatten = flatten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        if isinstance(out, (tuple, list)):
            out = out[0]
        out = cast_floating(out, torch.float32)
        if self.flatten:
            out = out.reshape(-1)
        return self.nonlinearity(out)


class _CastInputs:
    """Forward pre-hook (on the export copy only): cast floating inputs to
    the module's parameter dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        return (cast_floating(args, self.dtype, only=_FLOATING),
                cast_floating(kwargs, self.dtype, only=_FLOATING))


# ---- argument checks -------------------------------------------------------


def _check_format(format: Any) -> str:
    if not (isinstance(format, str) and format in EXPORT_FORMATS):
        raise ValueError(
            f"format must be one of {', '.join(map(repr, EXPORT_FORMATS))}; got {format!r} "
            f"({type(format).__name__}). Fix: format='onnx' for ONNX Runtime, TensorRT and "
            "other ONNX runtimes, or format='torch.export' for a .pt2 file that "
            "torch.export.load reads."
        )
    return format


def _parse_dtype(dtype: Any) -> torch.dtype | None:
    name = dtype.strip().lower() if isinstance(dtype, str) else None
    if dtype is None or dtype is torch.float32 or name in ("float32", "fp32"):
        return None
    if isinstance(dtype, torch.dtype) and dtype in LOW_PRECISION_DTYPES:
        return dtype
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    raise ValueError(
        f"dtype must be {_DTYPES_TEXT}, or torch.float16 / torch.bfloat16; got {dtype!r} "
        f"({type(dtype).__name__}). Fix: dtype=None for float32 weights, or "
        "dtype='float16' to store the weights in half precision."
    )


def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a file name (str or os.PathLike); got {type(path).__name__}. "
            "Fix: pass e.g. 'model.onnx' or 'model.pt2'."
        )
    path = os.fspath(path)
    if os.path.basename(path) in ("", ".", "..") or (os.path.isdir(path) and not os.path.islink(path)):
        raise ValueError(
            f"path must name a file; got {path!r}, "
            + ("a directory. " if path and os.path.isdir(path) else "which names no file. ")
            + "Nothing was written. Fix: pass e.g. 'model.onnx' or os.path.join(folder, 'model.onnx')."
        )
    return path


def _example_tensor(X_example: Any, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of at least 2 rows (torch.export specializes a batch of 1)."""
    if isinstance(X_example, torch.Tensor):
        x = X_example.detach().to("cpu")
    elif isinstance(X_example, (dict, list, tuple)) or not hasattr(X_example, "__array__"):
        raise TypeError(
            "X_example must be one array (numpy array, torch tensor or pandas DataFrame) "
            f"with the features of a few rows; got {type(X_example).__name__}. Exporting "
            "modules that take several inputs (dicts, tuples) is not supported. Fix: pass "
            "e.g. X[:8]."
        )
    else:
        x = torch.as_tensor(np.asarray(X_example))
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(
            f"X_example must hold at least one row; got shape {tuple(x.shape)}. Fix: pass e.g. X[:8]."
        )
    if x.is_floating_point():
        x = x.to(dtype)
    if x.shape[0] == 1:
        x = torch.cat([x, x])
    return x.contiguous()


# ---- the module copy -------------------------------------------------------


def _float32_copy(net: Any) -> torch.nn.Module:
    """A CPU, eval-mode copy of the net's module without ampnet's hooks, its
    low-precision parameters restored to float32 (from the masters)."""
    root = module_root(net.module_)
    layout = getattr(net, "amp_layout_", None)
    low = layout.low_precision_params if layout is not None else ()
    prec = net.__dict__.get("precision_")
    optimizers = [getattr(net, n + "_", None) for n in net._optimizers]
    optimizers = [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]
    compensated = low and prec is not None and prec.settings.compensated and optimizers
    if low and not getattr(net, "amp_master_params_", None) and not compensated:
        amp_warn(
            f"This net stores {len(low)} parameter(s) in "
            f"{dtype_name(layout.dtype)} without float32 master copies "
            "(amp_master_weights=False, or trim_for_prediction() after amp_level='pure' "
            "or 'compensated'): "
            "the export holds those low-precision values. Export before trimming to keep "
            "the float32 weights.")
    # float32 from the masters, or the weights plus their compensation
    state = prec.float32_weights(root, optimizers) if low else {}
    module = copy.deepcopy(root)
    if prec is not None:
        module = prec.to_plain(module)  # float8: plain linears
    remove_regions(module)
    remove_state_hooks(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    for name in low:
        params[name].data = state[name].detach().to(torch.float32, copy=True)
    module = module.to("cpu")
    for t in [*module.parameters(), *module.buffers()]:  # memory_format='channels_last'
        if t.dim() == 4:
            t.data = t.data.contiguous()
    return module.eval().requires_grad_(False)


def _narrow(module: torch.nn.Module, dtype: torch.dtype, net: Any) -> None:
    """Store in ``dtype`` what ``amp_level='pure'`` would, and make every
    module with floating parameters cast its inputs to their dtype."""
    settings = build_settings({
        **constructor_defaults(), "amp_enabled": True, "amp_dtype": dtype, "amp_level": "pure", "device": "cpu",
        "amp_fp32_modules": parsed(net, "amp_fp32_modules"), "amp_modules": parsed(net, "amp_modules"),
    })
    with warnings.catch_warnings():
        # selectors that match nothing were reported when the net was initialized
        warnings.simplefilter("ignore", AmpWarning)
        planner = Precision.build(settings, {})  # plans only: its scaler is never used
        layout = getattr(net, "amp_layout_", None)
        planner.auto_fp32 = layout.auto_fp32_modules if layout is not None else None
        plan = planner.plan(module)
    by_name = dict(module.named_parameters())
    low_ids = {id(by_name[n]) for n in plan.low_precision_params}
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if p.is_floating_point()]
        if not own:
            continue
        is_low = any(id(p) in low_ids for p in own)
        if is_low:
            for p in own:
                if id(p) in low_ids and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for name, buf in sub.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(sub, name, buf.to(dtype))
        target = dtype if is_low else own[0].dtype
        sub.register_forward_pre_hook(_CastInputs(target), with_kwargs=True)


def _first_floating_dtype(module: torch.nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


# ---- exporters -------------------------------------------------------------


class _DropTorchvisionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torchvision is not installed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hide the ONNX exporter's notices that concern torch, not the user."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    notice = _DropTorchvisionNotice()
    logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                    category=FutureWarning)
            yield
    finally:
        logger.removeFilter(notice)


class _HoldRecords(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def _held_torch_output() -> Iterator[None]:
    """Hold what torch logs and prints to stderr while it traces: passed on
    if the trace succeeds, dropped if it fails. A failed trace otherwise
    prints torch's partial FX graph twice, and a warning from its shape
    logger, before ampnet's error, which names the cause and chains torch's
    exception. (The redirection of ``sys.stderr`` is process-wide, as
    :func:`contextlib.redirect_stderr` is, for the duration of the trace.)"""
    hold = _HoldRecords()
    loggers = [logger for name, logger in list(logging.root.manager.loggerDict.items())
               if isinstance(logger, logging.Logger) and (name == "torch" or name.startswith("torch."))]
    for logger in loggers:
        logger.addFilter(hold)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
    # the trace succeeded: what torch said is passed on
    for record in hold.records:
        logging.getLogger(record.name).handle(record)
    if printed.getvalue():
        sys.stderr.write(printed.getvalue())


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost chained exception (it names the
    operator or the line that failed)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def _check_integer_example(wrapper: PredictProbaModule, x: torch.Tensor, module_name: str) -> None:
    """An integer (or boolean) ``x`` is kept only for a module that computes
    on it (e.g. an ``nn.Embedding`` first): a module that needs floating
    features would be traced with an integer input that the ONNX file
    cannot run. Runs the module once on ``x`` to find out.

    Raises
    ------
    ValueError
      For an integer ``x`` that the module cannot take.
    """
    if x.is_floating_point():
        return
    try:
        with torch.no_grad():
            wrapper(x)
    except Exception as exc:  # whatever the forward raises on integers
        dtype = str(x.dtype).replace("torch.", "")
        raise ValueError(
            f"X_example holds {dtype} values, but {module_name} fails on them "
            f"({_root_cause(exc)}): it takes floating features, and predict_proba "
            "would fail on this input too. The model takes the dtype of X_example. "
            "Fix: pass X_example.astype(numpy.float32); the exported model then takes "
            "float32 input."
        ) from exc


def _trace(wrapper: PredictProbaModule, x: torch.Tensor, module_name: str) -> Any:
    batch = torch.export.Dim("batch")
    try:
        with _quiet_exporter(), _held_torch_output():
            return torch.export.export(wrapper, (x,), dynamic_shapes={"x": {0: batch}})
    except Exception as exc:
        raise ValueError(
            f"torch.export could not trace {module_name} with X_example of shape "
            f"{tuple(x.shape)} and dtype {str(x.dtype).replace('torch.', '')} ({_root_cause(exc)}). "
            "Fix: check that predict_proba works on X_example; the forward must be traceable "
            "by torch.export with any batch size: no Python branching on tensor values, no "
            "numpy calls, no shapes fixed to one batch size (see the chained error above)."
        ) from exc


def _require_onnx() -> None:
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"format='onnx' needs the package(s) {', '.join(missing)}. Fix: "
            'pip install "ampnet[onnx]" (onnx, onnxscript and onnxruntime), or use '
            "format='torch.export'."
        )


def _to_onnx(program: Any, module_name: str) -> Any:
    try:
        with _quiet_exporter():
            onnx_program = torch.onnx.export(
                program, (), dynamo=True, verbose=False,
                input_names=[ONNX_INPUT_NAME], output_names=[ONNX_OUTPUT_NAME],
            )
    except Exception as exc:
        raise ValueError(
            f"torch.onnx could not translate {module_name} to ONNX ({_root_cause(exc)}). "
            "Fix: format='torch.export' keeps every torch operator; or replace the "
            "operator named in the chained error above by one that ONNX supports."
        ) from exc
    graph = onnx_program.model.graph
    rename = getattr(onnx_program, "rename_axes", None)
    if rename is not None:  # name the dynamic batch axis "batch" (cosmetic)
        rename({graph.inputs[0].shape[0]: "batch"})
    return onnx_program


# ---- public entry point ------------------------------------------------------


def export_net(
    net: Any,
    path: str | os.PathLike,
    X_example: Any,
    format: str = "onnx",
    dtype: str | torch.dtype | None = None,
) -> str:
    """Write the fitted ``net`` as a model that runs without ampnet or
    skorch and returns what ``net.predict_proba`` returns.

    See :meth:`ampnet.AmpNetMixin.export` for the parameters.

    Returns
    -------
    path : str
      The path written.
    """
    format = _check_format(format)
    low_dtype = _parse_dtype(dtype)
    path = _check_path(path)
    if format == "onnx":
        if low_dtype is torch.bfloat16:
            raise ValueError(
                "dtype='bfloat16' with format='onnx' is refused: ONNX Runtime's CPU provider "
                "has no bfloat16 kernels for Gemm/MatMul, so the file could not be run or "
                "checked here. Fix: dtype='float16' for ONNX, format='torch.export' for "
                "bfloat16, or dtype=None and let your runtime build in bfloat16 (TensorRT's "
                "BF16 builder flag)."
            )
        _require_onnx()
    net.check_is_fitted()
    if not isinstance(getattr(net, "module_", None), torch.nn.Module):
        raise ValueError(
            "export writes the net's 'module_', which this net does not have (its modules: "
            f"{', '.join(m + '_' for m in net._modules) or 'none'}). Fix: name the main "
            "module 'module_', or export it with torch.export / torch.onnx yourself."
        )
    module_name = type(getattr(net.module_, "_orig_mod", net.module_)).__name__
    nonlinearity = net._get_predict_nonlinearity()
    module = _float32_copy(net)
    x = _example_tensor(X_example, _first_floating_dtype(module))
    if low_dtype is not None:
        _narrow(module, low_dtype, net)
    wrapper = PredictProbaModule(
        module, nonlinearity, flatten=isinstance(net, NeuralNetBinaryClassifier)
    ).eval()
    _check_integer_example(wrapper, x, module_name)
    program = _trace(wrapper, x, module_name)
    if format == "torch.export":
        def write(target: str) -> None:
            with open(target, "wb") as f:
                torch.export.save(program, f)
    else:
        onnx_program = _to_onnx(program, module_name)

        def write(target: str) -> None:
            onnx_program.save(target, external_data=False)
    atomic_write_group({path: write})
    return path
