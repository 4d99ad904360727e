"""The auto wing: ``amp_enabled='auto'`` and ``amp_fp32_modules='auto'``.

This package's one door. The net calls :func:`resolve` once at the start of
each fit (it does nothing once both choices are made); persistence calls
:func:`write_choices` and :func:`plan_choices` to save and load the choices.
Nothing else in ampnet imports the wing's modules:

- :mod:`ampnet.auto.enabled`: the candidates of ``amp_enabled='auto'``, the
  choice among them, :class:`AutotuneResult`;
- :mod:`ampnet.auto.screen`: one forward pass per low-precision dtype
  against float32's, before any candidate is timed;
- :mod:`ampnet.auto.budget`: how much the probe may measure, a share
  of the fit's float32 training time (``amp_autotune__budget``);
- :mod:`ampnet.auto.probe`: the probe's copies of the net and their
  interleaved timed rounds;
- :mod:`ampnet.auto.fp32_modules`: the overflow probe of
  ``amp_fp32_modules='auto'``;
- :mod:`ampnet.auto.saved`: both saved choices, one mechanism.

Switching a net to a choice is :func:`ampnet.reconfigure.apply_choice` and
:func:`ampnet.reconfigure.apply_fp32_choice`, as for any other change of
its components.
"""

from __future__ import annotations

from typing import Any

import torch
from skorch.callbacks import LoadInitState as SkorchLoadInitState

from ampnet import reconfigure
from ampnet.auto.enabled import AutotuneResult, label
from ampnet.auto.fp32_modules import resolve_fp32_modules
from ampnet.auto.probe import CopyFailed, run_probe
from ampnet.auto.saved import enabled_choice, fp32_choice, plan_choices, write_choices
from ampnet.exceptions import amp_warn
from ampnet.io.files import checkpoint_files, read_params_file
from ampnet.net_state import all_or_nothing
from ampnet.params import is_auto, pending_params

__all__ = ["resolve", "AutotuneResult", "write_choices", "plan_choices"]


def resolve(net: Any, X: Any, y: Any = None, **fit_params: Any) -> None:
    """Make the choices that the first fit of ``net`` is waiting for:
    ``amp_enabled='auto'``'s, then ``amp_fp32_modules='auto'``'s (which
    exists only once AMP is on). Each is taken from the checkpoint that a
    ``LoadInitState`` callback resumes from, where it holds one this net can
    use, else measured; then the net switches to it, all or nothing."""
    enabled = is_auto(net.amp_enabled) and "amp_autotune_" not in net.__dict__
    if not (enabled or _fp32_pending(net)):
        return
    saved, source = _resume_state(net)
    epochs = fit_params.pop("epochs", None)  # fit(X, y, epochs=n): fit_loop's, not the data's
    if enabled:
        _resolve_enabled(net, X, y, saved, source, epochs,
                         **{k: v for k, v in fit_params.items() if k != "_routing_method"})
    if _fp32_pending(net):
        names = None
        if saved is not None:
            names, problem = fp32_choice(saved, net.module_)
            if problem:
                amp_warn(f"{source} holds an amp_fp32_modules='auto' choice that this module cannot take "
                         f"({problem}); it was ignored, and the net probes its own.")
        with all_or_nothing(net):
            resolve_fp32_modules(net, X, y, saved=names, **fit_params)


def _fp32_pending(net: Any) -> bool:
    prec = net.__dict__.get("precision_")
    return prec is not None and prec.auto_pending and isinstance(net.__dict__.get("module_"), torch.nn.Module)


def _resolve_enabled(net: Any, X: Any, y: Any, saved: Any, source: str | None, epochs: int | None,
                     **fit_params: Any) -> None:
    result = None
    if saved is not None:
        params, problem = enabled_choice(saved)
        problem = problem or (reconfigure.choice_problem(net, params) if params is not None else None)
        if problem:
            amp_warn(f"{source} holds an amp_enabled='auto' choice that this net cannot use ({problem}); "
                     "it was ignored, and the net measures its own.")
        elif params is not None:
            result = AutotuneResult(params=params, device=str(net.device), source="loaded")
    if result is None:
        try:
            result = run_probe(net, X, y, epochs, **fit_params)
        except CopyFailed as exc:
            params = pending_params(reconfigure.checked_params(net)["memory_format"])
            result = AutotuneResult(params=params, device=str(net.device), source="fallback", note=str(exc))
            amp_warn(
                f"amp_enabled='auto' could not copy the net to measure the candidates ({exc}), so it "
                f"trains in {label(params)}. Fix: pin the precision (amp_enabled=True or False), or pass "
                "a module that can be deep-copied (copy.deepcopy), e.g. its class instead of an instance.")
        if net.parallel_.world_size > 1:  # every rank trains with rank 0's choice
            shared = [result]
            torch.distributed.broadcast_object_list(shared, src=0)
            result = shared[0]
    with all_or_nothing(net):
        reconfigure.apply_choice(net, result)
    if result.source == "probe" and result.disturbed:
        amp_warn(f"amp_enabled='auto' measured on a busy machine: {result.disturbed}, so its timings may not "
                 f"hold for the fit. It chose {result.chosen}, once, for the whole fit. Fix: re-run the fit "
                 "on a quiet machine, or pin a choice (amp_enabled=True or False); print(net.amp_autotune_) "
                 "shows what it measured.")
    if net.verbose and result.source == "probe":
        print(result, flush=True)


def _resume_state(net: Any) -> tuple[Any, str | None]:
    """The module state (and the file's description) of the checkpoint that
    a ``LoadInitState`` callback will load, read through the checked reader
    of every load (:func:`ampnet.io.files.read_params_file`); ``(None, None)``
    where there is none, or one that ``LoadInitState`` will refuse with its
    own error."""
    for _, cb in net.callbacks_:
        if not isinstance(cb, SkorchLoadInitState) or getattr(cb, "use_safetensors", False):
            continue
        try:
            path = checkpoint_files(cb.checkpoint, net).get("f_params")
            if path is None or not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
                continue
            source = f"f_params={str(path)!r}"
            state = read_params_file(path, source)
        except (OSError, ValueError):  # no checkpoint yet, or one LoadInitState will refuse
            continue
        return state, source
    return None, None
