"""Switching a net to the choices of the autos: ``amp_enabled='auto'``'s
before a fit's first step (:func:`apply_choice`: a stored, loaded or
resumed choice, or the start of the measurement) and in the fit, at the
step it decides float32 (:func:`switch_in_fit`); ``amp_fp32_modules='auto'``'s
(:func:`apply_fp32_choice`); and whether a net can take a choice at all
(:func:`choice_problem`).

Each builds the net's components as :mod:`ampnet.config.reconfigure` builds
them for a ``set_params`` of the chosen settings (its
:func:`~ampnet.config.reconfigure.trained_settings`,
:func:`~ampnet.config.reconfigure.relayout` and
:func:`~ampnet.config.reconfigure.rebuild_optimizers`), so that a net
switched to a choice trains as a net constructed with it; the callers wrap
each in :func:`ampnet.config.net_state.all_or_nothing`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ampnet.auto.enabled import AutotuneResult
from ampnet.config import reconfigure
from ampnet.precision import COMPENSATION_KEY, Precision, build_settings, compensation_of, set_kernels
from ampnet.training.step import StepState

__all__ = ["apply_choice", "switch_in_fit", "apply_fp32_choice", "choice_problem"]


def apply_choice(net: Any, result: AutotuneResult, carry: bool = True) -> None:
    """Switch the net to ``amp_enabled='auto'``'s choice ``result``: a new
    precision component for it, the module moved to its layout, new
    optimizers (their state carried over with ``carry``) and a new step
    state, as a net constructed with the chosen settings has them."""
    before = net.__dict__.get("amp_autotune_")
    pending = reconfigure.checked_params(net) if before is None else None
    net.__dict__["amp_autotune_"] = result
    if pending is not None and all(pending[k] == v for k, v in result.params.items()):
        return  # the choice is what the net trains with before choosing (float32): nothing changes
    settings = reconfigure.trained_settings(net)
    old, new = net.precision_, Precision.build(settings, net.get_params_for("grad_scaler"))
    trimmed = getattr(net, "_trimmed_for_prediction", False)
    names = [n for n in net._optimizers if isinstance(net.__dict__.get(n + "_"), torch.optim.Optimizer)]
    module = net.__dict__.get("module_")
    # compensation buffers loaded into a float32 net's optimizer (load_params) stay the weights'
    kept = compensation_of([getattr(net, n + "_") for n in names]) if carry and settings.compensated else {}
    if isinstance(module, torch.nn.Module):
        new.take_over(old, module, trimmed, [getattr(net, n + "_") for n in names])
    states = reconfigure.carried_states(net, names) if carry else {}
    net.__dict__["precision_"] = new
    if not trimmed:
        why = reconfigure.RebuildReason(None, "to the settings of amp_enabled='auto'")
        reconfigure.rebuild_optimizers(net, states, why)
        for name in net._optimizers if kept else ():
            optimizer = getattr(net, name + "_")
            for p in (p for group in optimizer.param_groups for p in group["params"]):
                if id(p) in kept and p in optimizer.state:
                    optimizer.state[p][COMPENSATION_KEY] = kept[id(p)].to(p.dtype)
    # a new step state, as initialize() builds; DDP re-wraps the module by itself
    net.amp_step_state_ = StepState(closure=reconfigure.uses_closure(net))


def switch_in_fit(net: Any, result: AutotuneResult) -> None:
    """Switch an ``'auto'`` net that measured in its fit's first steps to
    the float32 choice ``result`` in place: a new precision component, and
    the optimizers' kernels set in their parameter groups as a float32 net
    builds them, the optimizer objects (which callbacks such as skorch's
    ``LRScheduler`` hold) kept with their state. Mixed precision and float32
    share the module's layout (float32 weights, the same memory format)."""
    net.__dict__["amp_autotune_"] = result
    old, new = net.precision_, Precision.build(reconfigure.trained_settings(net), net.get_params_for("grad_scaler"))
    module = net.__dict__.get("module_")
    if isinstance(module, torch.nn.Module):
        new.take_over(old, module, getattr(net, "_trimmed_for_prediction", False))
    net.__dict__["precision_"] = new
    for name in reconfigure.ampnet_kernels(net):
        optimizer = net.__dict__.get(name + "_")
        if isinstance(optimizer, torch.optim.Optimizer) and callable(getattr(net, name, None)):
            _, kwargs = net.get_params_for_optimizer(name, net.get_all_learnable_params())
            set_kernels(optimizer, kwargs)
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = reconfigure.uses_closure(net)


def apply_fp32_choice(net: Any, names: tuple[str, ...]) -> None:
    """Switch the net to ``amp_fp32_modules='auto'``'s choice: ``names``
    join the float32 regions, as if listed in ``amp_fp32_modules``."""
    prec = net.precision_
    new = Precision(prec.settings, prec.scaler)
    new.auto_fp32 = tuple(names)
    reconfigure.relayout(net, prec, new, ["amp_fp32_modules"])
    net.__dict__["precision_"] = new


def choice_problem(net: Any, params: Mapping[str, Any]) -> str | None:
    """Why ``net`` cannot train with ``amp_enabled='auto'``'s choice
    ``params`` (checked values of the table's choice parameters): the
    settings are refused together with the net's others, or its optimizers
    cannot serve them; None when it can."""
    try:
        settings = build_settings({**reconfigure.checked_params(net), **params})
        Precision(settings, net.precision_.scaler).check_optimizers(
            [(n, o) for n in net._optimizers if isinstance(o := net.__dict__.get(n + "_"), torch.optim.Optimizer)],
            reconfigure.ampnet_kernels(net))  # applying the choice rebuilds them with the kernel for it
    except (ValueError, TypeError) as exc:
        return str(exc).splitlines()[0]
    return None
