"""Building and changing a net's components, all or nothing: the work behind
``AmpNetMixin.initialize`` (with ``initialize_grad_scaler`` and
``_initialize_module``) and ``set_params``, and switching a net to the
choices of the autos (:func:`apply_choice`, :func:`apply_fp32_choice`).

What a change rebuilds is the parameter table's to say
(:func:`ampnet.config.params.rebuilds`): a live scaler setting changes the live
scaler in place, checking that value only (no new ``Precision``); a setting
of the precision or its layout builds one new ``Precision`` from the checked
settings and moves the module to its layout once (:func:`relayout`),
rebuilding the optimizers only where their parameters change or the kernel
ampnet chose for them does. Every value is checked before anything changes,
and the changes run inside :func:`ampnet.config.net_state.all_or_nothing`, which
puts the net back if anything raises.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ampnet.training import step as steps
from ampnet.exceptions import amp_warn
from ampnet.config.net_state import all_or_nothing
from ampnet.config.no_effect import warn_ineffective_settings
from ampnet.training.parallel import build_parallel, rebuild_parallel
from ampnet.utils.validation import close_names
from ampnet.config.params import (
    LAYOUT, LIVE_SCALER, NOTHING, PARALLEL, PARAMS, SCALER, auto_inputs, check, check_all, check_names,
    constructor_defaults, is_auto, pending_params, rebuilds,
)
from ampnet.precision import (
    COMPENSATION_KEY, GradScaler, Precision, PrecisionSettings, build_scaler, build_settings, compensation_of,
    keep_kernels, kernels_differ, set_kernels, user_chose_kernel, validate_scaler_settings,
)

if TYPE_CHECKING:
    from ampnet.auto.enabled import AutotuneResult
    from ampnet.net import AmpNetMixin

__all__ = [
    "checked_params", "read_settings", "uses_closure", "ampnet_kernels", "initialize", "initialize_grad_scaler",
    "initialize_module", "set_params", "relayout", "apply_choice", "switch_in_fit", "apply_fp32_choice",
    "choice_problem", "refuse_unswitchable",
    "with_name_hints",
]

#: The scaler bounds that a live change of one of them is checked against.
_BOUNDS = ("init_scale", "min_scale", "max_scale")


def _own_params(net: "AmpNetMixin") -> dict[str, Any]:
    """The net's AMP parameters as set (the table's constructor parameters,
    the device and the ``grad_scaler__*`` settings)."""
    params = {name: getattr(net, name) for name in [*constructor_defaults(), "device"]}
    params.update({"grad_scaler__" + k: v for k, v in net.get_params_for("grad_scaler").items()})
    return params


def checked_params(net: "AmpNetMixin", changes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The net's AMP parameters after ``changes``, each checked by the
    parameter table (string choices in their canonical spelling), with
    ``amp_enabled='auto'`` standing for its choice (float32 before it, or
    when ``changes`` drop it).

    Raises
    ------
    ValueError, TypeError
      The first invalid value, naming the parameter (see :mod:`ampnet.config.params`).
    """
    changes = dict(changes or {})
    params = check_all({**_own_params(net), **changes})
    if not is_auto(params["amp_enabled"]):
        return params
    # what 'auto' may choose must be valid (a master-weights setting narrows it to 'pure')
    device = torch.device(params.get("device") or "cpu") if _is_device(params.get("device")) else None
    if device is not None and torch.amp.is_autocast_available(device.type) and (
            device.type != "cuda" or torch.cuda.is_available()):
        refuse_unswitchable(params)
        read_settings({**params, "amp_enabled": True})
    choice = None if auto_inputs().intersection(changes) else net.__dict__.get("amp_autotune_")
    return {**params, **(choice.params if choice is not None else pending_params(params["memory_format"]))}


def refuse_unswitchable(params: Mapping[str, Any]) -> None:
    """Refuse ``'auto'`` with settings that cannot be switched to and from
    float32 between two steps (``params``: checked constructor values).

    Raises
    ------
    ValueError
      Naming the parameter, its value and the fix.
    """
    for name, default in (("amp_level", "mixed"), ("amp_master_weights", True), ("amp_modules", None)):
        value = params.get(name, default)
        if value != default and not (value is default):
            raise ValueError(
                f"amp_enabled='auto' chooses between float32 and mixed precision, measured in the fit's own "
                f"steps, and cannot switch to {name}={value!r} between two steps (the weights or their "
                f"precision regions would be rebuilt). Fix: pin it, with amp_enabled=True and {name}={value!r}, "
                f"or keep {name}={default!r} with amp_enabled='auto'.")


def _is_device(value: Any) -> bool:
    try:
        torch.device(value or "cpu")
    except (RuntimeError, TypeError):
        return False
    return True


def read_settings(params: Mapping[str, Any]) -> PrecisionSettings:
    """The precision settings of checked parameters (:func:`checked_params`),
    with the checks that involve several of them."""
    return build_settings(params)


def uses_closure(net: "AmpNetMixin") -> bool:
    """Whether the net's optimizers step through skorch's closure path
    (:func:`ampnet.training.step.uses_closure`)."""
    prec = net.precision_
    return steps.uses_closure(net, prec.scaling, prec.settings.skip_nonfinite, net.gradient_accumulation_steps)


def ampnet_kernels(net: "AmpNetMixin") -> frozenset[str]:
    """The names of ``net``'s optimizers (``'optimizer'``, ...) whose kernel
    ampnet chooses: those the user set neither ``fused`` nor ``foreach`` for.
    A precision change rebuilds them with the kernel for the new layout, so
    their current kernel is not checked against the new settings."""
    return frozenset(n for n in net._optimizers if not user_chose_kernel(net.get_params_for(n)))


def _scaler_params(net: "AmpNetMixin") -> dict[str, Any]:
    return net.get_params_for("grad_scaler")


def initialize(net: "AmpNetMixin", skorch_initialize: Callable[[], Any]) -> None:
    """``net.initialize()``: check every AMP setting, then build the
    precision component, skorch's components (``skorch_initialize``), the
    step state and the data-parallel component, all or nothing."""
    params = checked_params(net)
    probe = net.get_params_for("amp_autotune")
    check_names("amp_autotune", probe)  # for any amp_enabled: a typo is an error
    check_all({"amp_autotune__" + k: v for k, v in probe.items()})
    settings = read_settings(params)
    with all_or_nothing(net):
        was_initialized = net.initialized_
        with net._current_init_context("grad_scaler"):
            kwargs = {"grad_scaler__" + k: v for k, v in net.get_params_for("grad_scaler").items()}
            if was_initialized and net.verbose and kwargs:
                print(net._format_reinit_msg("grad_scaler", kwargs))
            old, module = net.__dict__.get("precision_"), net.__dict__.get("module_")
            if old is not None and isinstance(module, torch.nn.Module):
                old.detach(module)  # float32 again: skorch may reuse the instance
            net.__dict__["precision_"] = Precision.build(settings, _scaler_params(net))
        if "precision_" not in net.cuda_dependent_attributes_:
            # pickled together with optimizer_, so that the masters stay
            # the optimizer's parameters
            net.cuda_dependent_attributes_ = [*net.cuda_dependent_attributes_, "precision_"]
        net.__dict__.pop("amp_step_state_", None)
        skorch_initialize()
        net.amp_step_state_ = steps.StepState(closure=uses_closure(net))
        with net._current_init_context("parallel"):
            net.parallel_ = build_parallel(net, net.amp_step_state_.closure)
    warn_ineffective_settings(net)


def initialize_grad_scaler(net: "AmpNetMixin") -> None:
    """``net.initialize_grad_scaler()``: a new loss scaler from the net's
    ``grad_scaler`` and ``grad_scaler__*`` parameters."""
    net.precision_.scaler = build_scaler(read_settings(checked_params(net)), _scaler_params(net))
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = uses_closure(net)


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
        prec = net.__dict__["precision_"] = Precision.build(read_settings(checked_params(net)), _scaler_params(net))
    module = net.__dict__.get("module_")
    if isinstance(module, torch.nn.Module):
        prec.attach(module, trimmed=getattr(net, "_trimmed_for_prediction", False))
    elif any(check(name, getattr(net, name)) != PARAMS[name].default
             for name in ("amp_level", "amp_fp32_modules", "amp_modules", "memory_format")):
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
    value is checked before anything changes, and only what the parameter
    table says the change rebuilds is rebuilt."""
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
    if not others and rebuilds(kwargs) <= {LIVE_SCALER, NOTHING} and _set_live(net, own):
        return
    # every check first: nothing has changed when one refuses
    params = checked_params(net, kwargs)
    check_names("amp_autotune", {**net.get_params_for("amp_autotune"),
                                 **{k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("amp_autotune__")}})
    settings = read_settings(params)
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
        _drop_choice_on_new_probe_settings(
            net, {k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("amp_autotune__")})
        net.__dict__.update(own)
        if auto_inputs().intersection(kwargs):
            net.__dict__.pop("amp_autotune_", None)  # the next fit probes again
        _apply_precision(net, new, sorted(kwargs), checked)
        if PARALLEL in rebuilds(kwargs):  # refused as initialize() refuses it (True without a process group)
            net.parallel_ = rebuild_parallel(net, net.parallel_, net.amp_step_state_.closure)


#: Parameters that a fitted net stores for the next fit (no component is rebuilt).
STORED_PREFIXES = ("iterator_train", "iterator_valid", "dataset")


def _set_live(net: "AmpNetMixin", own: dict[str, Any]) -> bool:
    """Set loss-scaler settings that the live scaler takes in place, and
    settings that rebuild nothing, checking those values only; False (and
    nothing changed) where the live scaler cannot take them (torch's scaler
    without the setter, or disabled)."""
    scaler = net.precision_.scaler
    live = {k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("grad_scaler__")}
    if live and not isinstance(scaler, GradScaler) and not (
            scaler.is_enabled() and all(hasattr(scaler, f"set_{k}") for k in live)):
        return False
    tuned = {k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("amp_autotune__")}
    if tuned:
        check_names("amp_autotune", tuned)
    for name, value in own.items():
        if not name.startswith("grad_scaler__"):
            check(name, value)
    if live:
        current = scaler.get_settings() if isinstance(scaler, GradScaler) else {}
        bounds = {k: current[k] for k in _BOUNDS if k in current and k not in live} if set(live) & set(_BOUNDS) else {}
        validate_scaler_settings(**{**bounds, **live})  # the one check of these values
    # every value is checked (also as the plain number the scaler keeps); should anything
    # below raise all the same, the net is put back
    with all_or_nothing(net):
        _drop_choice_on_new_probe_settings(net, tuned)
        net.__dict__.update(own)
        if isinstance(scaler, GradScaler):
            scaler.apply_settings(**live)
        else:  # torch's own scaler: its setters
            for name, value in live.items():
                getattr(scaler, f"set_{name}")(value)
        net.amp_step_state_.scale = None
    return True


def _drop_choice_on_new_probe_settings(net: "AmpNetMixin", tuned: Mapping[str, Any]) -> None:
    """A change of ``amp_enabled='auto'``'s settings (``amp_autotune__*``)
    asks for a new choice: it is dropped, and the next fit of an ``'auto'``
    net reads the cache or measures again. Setting a value it already has
    changes nothing."""
    current = net.get_params_for("amp_autotune")
    if any(current.get(name, PARAMS[f"amp_autotune__{name}"].default) != value for name, value in tuned.items()):
        net.__dict__.pop("amp_autotune_", None)


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
    scaler_params = _scaler_params(net)  # the settings' one stored copy (set by now)
    scaler_kw = {k.split("__", 1)[1] for k in changed if k.startswith("grad_scaler__")}
    rebuilt = rebuilds(changed)
    rebuild_scaler = SCALER in rebuilt
    moves = LAYOUT in rebuilt
    scaler = prec.scaler
    if rebuild_scaler:
        reasons = sorted(k for k in changed if SCALER in rebuilds([k]))
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
    layout_changed = [k for k in changed if LAYOUT in rebuilds([k])]
    if moves and isinstance(net.__dict__.get("module_"), torch.nn.Module):
        relayout(net, prec, new, layout_changed)
    else:
        new.layout, new.masters = prec.layout, prec.masters
        net.__dict__["precision_"] = new
        if moves and not getattr(net, "_trimmed_for_prediction", False) and _kernels_changed(net):
            _rebuild_optimizers(net, layout_changed)
    net.__dict__["precision_"] = new
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = uses_closure(net)


def relayout(net: "AmpNetMixin", old: Precision, new: Precision, changed: list[str]) -> None:
    """Move the fitted module
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


def apply_choice(net: "AmpNetMixin", result: "AutotuneResult", carry: bool = True) -> None:
    """Switch the net to ``amp_enabled='auto'``'s choice ``result``: a new
    precision component for it, the module moved to its layout, new
    optimizers (their state carried over with ``carry``) and a new step
    state, as a net constructed with the chosen settings has them."""
    before = net.__dict__.get("amp_autotune_")
    pending = checked_params(net) if before is None else None
    net.__dict__["amp_autotune_"] = result
    if pending is not None and all(pending[k] == v for k, v in result.params.items()):
        return  # the choice is what the net trains with before choosing (float32): nothing changes
    settings = read_settings(checked_params(net))
    old, new = net.precision_, Precision.build(settings, _scaler_params(net))
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
    net.amp_step_state_ = steps.StepState(closure=uses_closure(net))


def switch_in_fit(net: "AmpNetMixin", result: "AutotuneResult") -> None:
    """Switch an ``'auto'`` net that measured in its fit's first steps to
    the float32 choice ``result`` in place: a new precision component, and
    the optimizers' kernels set in their parameter groups as a float32 net
    builds them, the optimizer objects (which callbacks such as skorch's
    ``LRScheduler`` hold) kept with their state. Mixed precision and float32
    share the module's layout (float32 weights, the same memory format)."""
    net.__dict__["amp_autotune_"] = result
    old, new = net.precision_, Precision.build(read_settings(checked_params(net)), _scaler_params(net))
    module = net.__dict__.get("module_")
    if isinstance(module, torch.nn.Module):
        new.take_over(old, module, getattr(net, "_trimmed_for_prediction", False))
    net.__dict__["precision_"] = new
    for name in ampnet_kernels(net):
        optimizer = net.__dict__.get(name + "_")
        if isinstance(optimizer, torch.optim.Optimizer) and callable(getattr(net, name, None)):
            _, kwargs = net.get_params_for_optimizer(name, net.get_all_learnable_params())
            set_kernels(optimizer, kwargs)
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = uses_closure(net)


def apply_fp32_choice(net: "AmpNetMixin", names: tuple[str, ...]) -> None:
    """Switch the net to ``amp_fp32_modules='auto'``'s choice: ``names``
    join the float32 regions, as if listed in ``amp_fp32_modules``."""
    prec = net.precision_
    new = Precision(prec.settings, prec.scaler)
    new.auto_fp32 = tuple(names)
    relayout(net, prec, new, ["amp_fp32_modules"])
    net.__dict__["precision_"] = new


def choice_problem(net: "AmpNetMixin", params: Mapping[str, Any]) -> str | None:
    """Why ``net`` cannot train with ``amp_enabled='auto'``'s choice
    ``params`` (checked values of the table's choice parameters): the
    settings are refused together with the net's others, or its optimizers
    cannot serve them; None when it can."""
    try:
        settings = read_settings({**checked_params(net), **params})
        Precision(settings, net.precision_.scaler).check_optimizers(
            [(n, o) for n in net._optimizers if isinstance(o := net.__dict__.get(n + "_"), torch.optim.Optimizer)],
            ampnet_kernels(net))  # applying the choice rebuilds them with the kernel for it
    except (ValueError, TypeError) as exc:
        return str(exc).splitlines()[0]
    return None


# ---- unknown names --------------------------------------------------------------------------------


def with_name_hints(exc: ValueError, net: Any, names: Any) -> ValueError:
    """``exc`` (skorch's "unexpected argument(s)" or scikit-learn's "Invalid
    parameter" refusal of a name) with the close valid name of each unknown
    one of ``names`` added: ``amp_enable`` gets "Did you mean amp_enabled
    (for amp_enable)?", ``grad_scalar__growth_factor`` gets
    ``grad_scaler__growth_factor``. Any other error, or no close name:
    ``exc`` itself."""
    text = str(exc)
    if not (text.startswith("Invalid parameter") or "unexpected argument(s)" in text) or "Did you mean" in text:
        return exc
    known = set(PARAMS)
    for cls in type(net).__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None and cls is not object:
            known.update(name for name, p in inspect.signature(init).parameters.items()
                         if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    # a name that starts with a prefix (iterator_train_shuffle, grad_scaler__growth_factr) has its
    # own hint: skorch's "did you mean iterator_train__shuffle?", ampnet's scaler and probe checks
    prefixes = tuple(getattr(net, "prefixes_", ()))
    unknown = [name for name in names
               if name not in known and not name.endswith("_") and name in text and not name.startswith(prefixes)]
    hint = close_names(unknown, sorted(known))
    return ValueError(text + hint) if hint else exc
