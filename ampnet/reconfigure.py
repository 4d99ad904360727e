"""Building and changing a net's components, all or nothing: the work behind
``AmpNetMixin.initialize`` (and its ``initialize_grad_scaler`` and
``_initialize_module``), ``set_params``, ``precision_params``,
``relayout_precision`` and ``adopt_autotune``, which delegate here.

Each function checks every value first (:func:`~ampnet.precision.read_settings`,
:func:`ampnet.step.check_step_params`), then changes the net inside
:func:`ampnet.net_state.all_or_nothing`, which puts it back if anything
raises. On a fitted net, :func:`set_params` builds one new ``Precision``
from the checked settings, gives it the live loss scaler (changed in place)
or a new one, and moves the module to its layout (:func:`relayout_precision`),
rebuilding the optimizers only where their parameters change or the kernel
ampnet chose for them does (``ampnet.precision.kernels``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ampnet import step as steps
from ampnet.exceptions import amp_warn
from ampnet.net_state import all_or_nothing
from ampnet.parallel import build_parallel
from ampnet.precision import (
    COMPENSATION_KEY, LIVE_SETTINGS, PRECISION_PARAMS, AutotuneResult, GradScaler, Precision, autotune_settings,
    ampnet_kernels, build_scaler, check_device, compensation_of, effective_params, is_auto, keep_kernels,
    kernels_differ, read_settings, warn_ineffective_settings,
)

if TYPE_CHECKING:
    from ampnet.net import AmpNetMixin

__all__ = [
    "LAYOUT_PARAMS", "STORED_PREFIXES", "SCALER_PARAMS", "AUTOTUNE_INPUTS",
    "precision_params", "initialize", "initialize_grad_scaler", "initialize_module", "set_params",
    "relayout_precision", "adopt_autotune",
]

#: Parameters whose change rebuilds the module's precision layout.
LAYOUT_PARAMS = frozenset({
    "amp_enabled", "amp_dtype", "amp_level", "amp_master_weights", "amp_fp32_modules", "amp_modules",
    "memory_format",
})

#: Parameters that a fitted net stores for the next fit (no component is rebuilt).
STORED_PREFIXES = ("iterator_train", "iterator_valid", "dataset")

#: Parameters whose change rebuilds the loss scaler (besides non-live ``grad_scaler__*``).
SCALER_PARAMS = frozenset({"amp_enabled", "amp_dtype", "device", "grad_scaler"})

#: Parameters whose change drops the choice of ``amp_enabled='auto'`` (the next fit probes again).
AUTOTUNE_INPUTS = frozenset({
    "amp_enabled", "amp_dtype", "amp_level", "amp_master_weights", "memory_format", "device",
})


def precision_params(net: "AmpNetMixin", changes: dict[str, Any]) -> dict[str, Any]:
    """``net.precision_params(**changes)``: the net's precision and step
    parameters with ``changes``, ``amp_enabled='auto'`` standing for its
    choice unless ``changes`` drop it."""
    params = {name: getattr(net, name) for name in PRECISION_PARAMS + steps.STEP_PARAMS}
    params.update({"grad_scaler__" + k: v for k, v in net.get_params_for("grad_scaler").items()})
    params.update(changes)
    choice = None if AUTOTUNE_INPUTS.intersection(changes) else net.__dict__.get("amp_autotune_")
    return effective_params(params, choice)


def initialize(net: "AmpNetMixin", skorch_initialize: Callable[[], Any]) -> None:
    """``net.initialize()``: check every AMP setting, then build the
    precision component, skorch's components (``skorch_initialize``), the
    step state and the data-parallel component, all or nothing."""
    check_device(net.device)
    params = net.precision_params()
    settings = read_settings(params)
    steps.check_step_params(params)
    if is_auto(net.amp_enabled):
        autotune_settings(net.get_params_for("amp_autotune"))
    with all_or_nothing(net):
        was_initialized = net.initialized_
        with net._current_init_context("grad_scaler"):
            kwargs = {"grad_scaler__" + k: v for k, v in net.get_params_for("grad_scaler").items()}
            if was_initialized and net.verbose and kwargs:
                print(net._format_reinit_msg("grad_scaler", kwargs))
            old, module = net.__dict__.get("precision_"), net.__dict__.get("module_")
            if old is not None and isinstance(module, torch.nn.Module):
                old.detach(module)  # float32 again: skorch may reuse the instance
            net.__dict__["precision_"] = Precision.build(settings, net.get_params_for("grad_scaler"))
        if "precision_" not in net.cuda_dependent_attributes_:
            # pickled together with optimizer_, so that the masters stay
            # the optimizer's parameters
            net.cuda_dependent_attributes_ = [*net.cuda_dependent_attributes_, "precision_"]
        net.__dict__.pop("amp_step_state_", None)
        skorch_initialize()
        net.amp_step_state_ = steps.StepState(closure=net._uses_closure())
        with net._current_init_context("parallel"):
            net.parallel_ = build_parallel(net, net.amp_step_state_.closure)
    warn_ineffective_settings(net)


def initialize_grad_scaler(net: "AmpNetMixin") -> None:
    """``net.initialize_grad_scaler()``: a new loss scaler from the net's
    ``grad_scaler`` and ``grad_scaler__*`` parameters."""
    settings = read_settings(net.precision_params())
    net.precision_.scaler = build_scaler(settings, net.get_params_for("grad_scaler"))
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = net._uses_closure()


def initialize_module(net: "AmpNetMixin", skorch_initialize_module: Callable[..., Any], reason: str | None) -> None:
    """``net._initialize_module(reason)``: skorch's (``skorch_initialize_module``),
    between detaching the precision layout from the module skorch may reuse
    and attaching it to the module it leaves."""
    prec = net.__dict__.get("precision_")
    module = net.__dict__.get("module_")
    if prec is not None and isinstance(module, torch.nn.Module):
        prec.detach(module)  # an instance module is reused by skorch
    skorch_initialize_module(reason=reason)
    if prec is None:
        # skorch's _initialize_module() called on its own
        prec = net.__dict__["precision_"] = Precision.build(
            read_settings(net.precision_params()), net.get_params_for("grad_scaler"))
    module = net.__dict__.get("module_")
    if isinstance(module, torch.nn.Module):
        prec.attach(module, trimmed=getattr(net, "_trimmed_for_prediction", False))
    elif (net.amp_level != "mixed" or net.amp_fp32_modules is not None
          or net.amp_modules is not None or net.memory_format != "preserve"):
        # skorch allows nets without a ``module_`` (custom module names):
        # autocast applies as usual; per-module control has no module to act on
        raise ValueError(
            "amp_level, amp_fp32_modules, amp_modules and memory_format act on "
            "the net's 'module_', which this net does not have. Fix: keep their "
            "defaults, or name the main module 'module_'."
        )


def set_params(net: "AmpNetMixin", kwargs: dict[str, Any], skorch_set_params: Callable[..., Any]) -> None:
    """``net.set_params(**kwargs)``, all or nothing (``skorch_set_params``:
    skorch's own, for the parameters it handles). On a fitted net every
    value is checked before anything changes."""
    # grad_scaler and grad_scaler__* are ampnet's to handle: skorch would
    # treat the "grad_scaler" prefix as a module and refuse it
    own = {k: v for k, v in kwargs.items()
           if k == "grad_scaler" or k.startswith(("grad_scaler__", "amp_autotune__"))}
    others = {k: v for k, v in kwargs.items() if k not in own}
    if not net.initialized_:
        with all_or_nothing(net):
            skorch_set_params(**others)
            net.__dict__.update(own)
        return
    # every check first: nothing has changed when one refuses
    if "device" in kwargs:
        check_device(kwargs["device"])
    params = net.precision_params(**kwargs)
    settings = read_settings(params)
    steps.check_step_params(params)
    if is_auto(kwargs.get("amp_enabled", net.amp_enabled)):
        autotune_settings({**net.get_params_for("amp_autotune"),
                           **{k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("amp_autotune__")}})
    new_optimizer = any(k.split("__")[0] in net._optimizers for k in kwargs)
    # the one Precision of this call; _apply_precision gives it its scaler
    new = Precision(settings, net.precision_.scaler)
    checked = not (getattr(net, "_trimmed_for_prediction", False) or new_optimizer)
    if checked:  # a kernel ampnet chose is chosen again for the new layout
        new.check_optimizers([(n, getattr(net, n + "_")) for n in net._optimizers], ampnet_kernels(net))
    # read at the next fit: skorch re-initializes nothing for them (and
    # refuses them on an initialized net)
    stored = {k: v for k, v in others.items() if k.startswith(STORED_PREFIXES)}
    others = {k: v for k, v in others.items() if k not in stored}
    with all_or_nothing(net):
        if stored:
            vars(net).update(stored)
            net._params_to_validate.update(stored)
            net._validate_params()
        # kept as parameters (skorch's virtual setter forgets them), and
        # before skorch's set_params, so that a re-initialized optimizer has them
        vars(net).update(_optimizer_settings(net, others))
        if others:
            skorch_set_params(**others)
        _check_optimizers_accept(net, others)
        net.__dict__.update(own)
        if AUTOTUNE_INPUTS.intersection(kwargs):
            net.__dict__.pop("amp_autotune_", None)  # the next fit probes again
        _apply_precision(net, new, sorted(kwargs), checked)


def _optimizer_settings(net: "AmpNetMixin", changed: dict[str, Any]) -> dict[str, Any]:
    """The ``<optimizer>__<name>`` settings among ``changed`` (not
    ``lr``, which skorch keeps, nor ``param_groups__*``, which are
    no constructor arguments)."""
    return {k: v for k, v in changed.items()
            if any(k.startswith(n + "__") and not k.startswith(n + "__param_groups__")
                   for n in net._optimizers)}


def _check_optimizers_accept(net: "AmpNetMixin", changed: dict[str, Any]) -> None:
    """skorch sets optimizer settings (``lr``, ``optimizer__momentum``)
    in the live optimizer's parameter groups without a check: build each
    changed optimizer afresh, as ``initialize()`` would, so that an
    invalid value raises."""
    if getattr(net, "_trimmed_for_prediction", False):
        return
    for name in net._optimizers:
        if not any(k.startswith(name + "__") or (k == "lr" and name == "optimizer") for k in changed):
            continue
        factory = getattr(net, name, None)
        # a distributed optimizer (ZeroRedundancyOptimizer) talks to its peers when built
        if callable(factory) and not getattr(factory, "__module__", "").startswith("torch.distributed"):
            args, kwargs = net.get_params_for_optimizer(name, net.get_all_learnable_params())
            factory(*args, **kwargs)


def _apply_precision(net: "AmpNetMixin", new: Precision, changed: list[str], checked: bool = False) -> None:
    """Make ``new`` (built by ``set_params`` from the checked settings)
    the net's ``precision_`` after ``changed`` parameters were set on an
    initialized net: give it its scaler (the live one, changed in place,
    or a new one) and the module's layout. Values are not checked again;
    the optimizers are, unless ``checked``."""
    prec, settings = net.precision_, new.settings
    scaler_params = net.get_params_for("grad_scaler")  # the settings' one stored copy (set by now)
    scaler_kw = {k.split("__", 1)[1] for k in changed if k.startswith("grad_scaler__")}
    rebuild_scaler = bool(SCALER_PARAMS.intersection(changed)) or not scaler_kw <= set(LIVE_SETTINGS)
    relayout = bool(LAYOUT_PARAMS.intersection(changed))
    scaler = prec.scaler
    if rebuild_scaler:
        reasons = sorted(k for k in changed if k in SCALER_PARAMS or k.startswith("grad_scaler"))
        if net.verbose:
            print(net._format_reinit_msg("grad_scaler", dict.fromkeys(reasons)))
        scaler = build_scaler(settings, scaler_params)
    elif scaler_kw:
        live = {k: scaler_params[k] for k in scaler_kw}
        if isinstance(scaler, GradScaler):
            scaler.apply_settings(**live)  # read_settings has checked the values
        else:  # torch's own scaler: its setters, or a new one
            for name, value in live.items():
                setter = getattr(scaler, f"set_{name}", None)
                if setter is None or not scaler.is_enabled():
                    scaler = build_scaler(settings, scaler_params)
                    break
                setter(value)
    new.scaler = scaler
    if not (checked or getattr(net, "_trimmed_for_prediction", False)):  # refuse before the module changes
        new.check_optimizers([(n, getattr(net, n + "_")) for n in net._optimizers], ampnet_kernels(net))
    layout_changed = [k for k in changed if k in LAYOUT_PARAMS]
    if relayout and isinstance(net.__dict__.get("module_"), torch.nn.Module):
        net.relayout_precision(prec, new, layout_changed)
    else:
        new.layout, new.masters = prec.layout, prec.masters
        net.__dict__["precision_"] = new
        if relayout and not getattr(net, "_trimmed_for_prediction", False) and _kernels_changed(net):
            _rebuild_optimizers(net, layout_changed)
    net.__dict__["precision_"] = new
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = net._uses_closure()


def relayout_precision(net: "AmpNetMixin", old: Precision, new: Precision, changed: list[str]) -> None:
    """``net.relayout_precision(old, new, changed)``: move the fitted module
    from ``old``'s layout to ``new``'s, keeping the weights; rebuild the
    optimizers (their state carried over) only where low-precision
    parameters are involved, or where the kernel ampnet chose for them is
    not the one it chooses for the new layout."""
    trimmed = getattr(net, "_trimmed_for_prediction", False)
    optimizers = [] if trimmed else [getattr(net, n + "_") for n in net._optimizers]
    moved = new.take_over(old, net.module_, trimmed, optimizers)
    if trimmed:
        return
    net.__dict__["precision_"] = new
    # float32 parameters throughout and the kernel ampnet would choose: the optimizer is still right
    if moved or _kernels_changed(net):
        _rebuild_optimizers(net, changed)


def _kernels_changed(net: "AmpNetMixin") -> bool:
    """Whether an optimizer whose kernel ampnet chose would get another one
    if built now (``net.precision_`` is the new one): AMP turned on or off,
    or parameters of a dtype the fused kernel does not serve."""
    for name in ampnet_kernels(net):
        optimizer = net.__dict__.get(name + "_")
        if not isinstance(optimizer, torch.optim.Optimizer) or not callable(getattr(net, name, None)):
            continue
        _, kwargs = net.get_params_for_optimizer(name, net.get_all_learnable_params())
        if kernels_differ(optimizer, kwargs):
            return True
    return False


def _rebuild_optimizers(net: "AmpNetMixin", changed: list[str]) -> None:
    """Build the optimizers afresh for the module's new layout (with the
    kernel for it), carrying their state over where the parameters line up."""
    states = {n: getattr(net, n + "_").state_dict() for n in net._optimizers}
    net._initialize_optimizer(reason=net._format_reinit_msg("optimizer", dict.fromkeys(changed)))
    for name, state in states.items():
        try:
            optimizer = getattr(net, name + "_")
            optimizer.load_state_dict(keep_kernels(optimizer, state))
        except ValueError as exc:
            amp_warn(
                f"The state of {name} could not be carried over after changing "
                f"{', '.join(changed)} ({exc}); it starts afresh.")


def adopt_autotune(net: "AmpNetMixin", result: AutotuneResult, carry: bool = True) -> None:
    """``net.adopt_autotune(result, carry)``: a new precision component for
    ``result``'s choice, the module moved to its layout, new optimizers
    (their state carried over with ``carry``) and a new step state."""
    net.__dict__["amp_autotune_"] = result
    settings = read_settings(net.precision_params())
    old, new = net.precision_, Precision.build(settings, net.get_params_for("grad_scaler"))
    trimmed = getattr(net, "_trimmed_for_prediction", False)
    names = [n for n in net._optimizers if isinstance(net.__dict__.get(n + "_"), torch.optim.Optimizer)]
    module = net.__dict__.get("module_")
    # compensation buffers loaded into a float32 net's optimizer (load_params) stay the weights'
    kept = compensation_of([getattr(net, n + "_") for n in names]) if carry and settings.compensated else {}
    if isinstance(module, torch.nn.Module):
        new.take_over(old, module, trimmed, [getattr(net, n + "_") for n in names])
    states = {n: getattr(net, n + "_").state_dict() for n in names if carry and getattr(net, n + "_").state}
    net.__dict__["precision_"] = new
    if not trimmed:
        with net._current_init_context("optimizer"):
            net.initialize_optimizer()
        new.check_optimizers([(n, getattr(net, n + "_")) for n in net._optimizers])
        for name, state in states.items():
            optimizer = getattr(net, name + "_")
            try:
                optimizer.load_state_dict(keep_kernels(optimizer, state))
            except ValueError as exc:
                amp_warn(f"The state of {name} could not be carried over to the settings of "
                         f"amp_enabled='auto' ({exc}); it starts afresh.")
        for name in net._optimizers if kept else ():
            optimizer = getattr(net, name + "_")
            for p in (p for group in optimizer.param_groups for p in group["params"]):
                if id(p) in kept and p in optimizer.state:
                    optimizer.state[p][COMPENSATION_KEY] = kept[id(p)].to(p.dtype)
    # a new step state, as initialize() builds; DDP re-wraps the module by itself
    net.amp_step_state_ = steps.StepState(closure=net._uses_closure())
