"""Building and changing a net's components, all or nothing: what
``AmpNetMixin.initialize``, ``_initialize_module``, ``initialize_grad_scaler``
and ``set_params`` do around skorch's own methods, with the helpers that
switching a net to the choices of the autos uses
(:mod:`ampnet.auto.switching`: :func:`trained_settings`,
:func:`carried_states`, :func:`rebuild_optimizers`, :func:`relayout`).
What ``amp_enabled='auto'`` stands for before it chooses is read here
(:func:`checked_params`); everything else of the autos is in ``ampnet/auto/``.

The net owns the sequence: it calls this module to check and plan (nothing
changes), then skorch's method, then this module to apply, inside one
:func:`ampnet.config.net_state.all_or_nothing`. Nothing here calls back
into skorch's methods that the net overrides.

The net's AMP parameters are parsed once, by ``initialize()`` and
``set_params`` (:func:`parse`), into the net's
:class:`ampnet.config.params.ParsedParams`; every later reader reads them
there. What a change rebuilds is the parameter table's to say
(:func:`ampnet.config.params.rebuilds`): a live scaler setting changes the
live scaler in place, checking that value only (no new ``Precision``); a
setting of the precision or its layout builds one new ``Precision`` from
the checked settings and moves the module to its layout once
(:func:`relayout`), rebuilding the optimizers only where their parameters
change or the kernel ampnet chose for them does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ampnet.training import step as steps
from ampnet.exceptions import amp_warn
from ampnet.training.parallel import build_parallel, rebuild_parallel
from ampnet.utils.hints import close_names
from ampnet.config.params import (
    BUILT_ATTRIBUTE, LAYOUT, LIVE_SCALER, MODULE_PARAMS, NOTHING, PARALLEL, PARAMS, PARSED_ATTRIBUTE, SCALER,
    ParsedParams,
    auto_inputs, check, check_all, check_names, constructor_defaults, is_auto, is_parsed_name, parsed, pending_params,
    rebuilds,
)
from ampnet.precision import (
    GradScaler, Precision, PrecisionSettings, build_scaler, build_settings, keep_kernels, kernels_differ,
    user_chose_kernel, validate_scaler_settings,
)

if TYPE_CHECKING:
    from ampnet.net import AmpNetMixin

__all__ = [
    "parse", "assigned_changes", "checked_params", "trained_settings", "uses_closure", "ampnet_kernels", "InitPlan",
    "plan_initialize", "build_precision", "build_training", "detach_layout", "attach_layout", "initialize_grad_scaler",
    "Change", "plan_change", "before_skorch", "apply_change", "relayout", "RebuildReason", "carried_states",
    "rebuild_optimizers", "with_name_hints",
]

#: The scaler bounds that a live change of one of them is checked against.
_BOUNDS = ("init_scale", "min_scale", "max_scale")

#: Parameters that a fitted net stores for the next fit (no component is rebuilt).
STORED_PREFIXES = ("iterator_train", "iterator_valid", "dataset")


# ---- parsing, once ---------------------------------------------------------------------------------


def _own_params(net: "AmpNetMixin") -> dict[str, Any]:
    """The net's AMP parameters as set (the table's constructor parameters,
    the device and the ``grad_scaler__*`` settings), raw."""
    params = {name: getattr(net, name) for name in [*constructor_defaults(), "device"]}
    params.update({"grad_scaler__" + k: v for k, v in net.get_params_for("grad_scaler").items()})
    float8 = net.get_params_for("amp_float8")
    check_names("amp_float8", float8)
    params.update({name: PARAMS[name].default for name in PARAMS if name.startswith("amp_float8__")})
    params.update({"amp_float8__" + k: v for k, v in float8.items()})
    return params


def parse(net: "AmpNetMixin", changes: Mapping[str, Any] | None = None, fresh: bool = False) -> ParsedParams:
    """The net's AMP parameters after ``changes``, each checked once: the
    parse the net holds (``fresh``: its raw values, parsed now) with the
    changed ones parsed.

    Raises
    ------
    ValueError, TypeError
      The first invalid value, naming the parameter (see :mod:`ampnet.config.params`).
    """
    held = None if fresh else net.__dict__.get(PARSED_ATTRIBUTE)
    values = dict(held) if held is not None else check_all(_own_params(net))
    values.update(check_all({k: v for k, v in (changes or {}).items() if is_parsed_name(k)}))
    return ParsedParams(values)


def _hold(net: "AmpNetMixin", values: ParsedParams) -> None:
    """Keep ``values`` as the net's parse, the one its components are built
    from (a parse kept from before a plain assignment is done with)."""
    net.__dict__[PARSED_ATTRIBUTE] = values
    net.__dict__.pop(BUILT_ATTRIBUTE, None)


def assigned_changes(net: "AmpNetMixin") -> dict[str, Any]:
    """The AMP parameters of an initialized net set by plain assignment
    (``net.amp_dtype = 'float16'``, as scikit-learn allows) since its
    components were built, with their values: those whose parse differs
    from the one the components were built from. ``set_params`` applies
    them together with its own changes, and ``partial_fit`` before it
    trains, so that the net gets the components a fresh build gives.

    Raises
    ------
    ValueError, TypeError
      An assigned value that is invalid, naming the parameter.
    """
    built = net.__dict__.get(BUILT_ATTRIBUTE)
    if built is None:
        return {}
    raw = _own_params(net)
    values = check_all(raw)
    return {name: raw[name] for name in values if name not in built or values[name] != built[name]}


def checked_params(net: "AmpNetMixin", changes: Mapping[str, Any] | None = None,
                   values: ParsedParams | None = None) -> dict[str, Any]:
    """The parameters the net trains with after ``changes`` (``values``:
    their parse, when the caller has it), with ``amp_enabled='auto'``
    standing for its choice (float32 before it, or when ``changes`` drop
    it). What ``'auto'`` may choose is checked by the net, after the plan
    (:func:`ampnet.auto.check_choosable`).

    Raises
    ------
    ValueError, TypeError
      The first invalid value, naming the parameter (see :mod:`ampnet.config.params`).
    """
    changes = dict(changes or {})
    params = dict(values if values is not None else parse(net, changes))
    if not is_auto(params["amp_enabled"]):
        return params
    choice = None if auto_inputs().intersection(changes) else net.__dict__.get("amp_autotune_")
    return {**params, **(choice.params if choice is not None else pending_params(params["memory_format"]))}


def trained_settings(net: "AmpNetMixin") -> PrecisionSettings:
    """The precision settings the net trains with, from its parse."""
    return build_settings(checked_params(net, values=parse(net)))


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


# ---- initialize(): the net calls plan_initialize, build_precision, skorch's initialize, build_training ----


@dataclass(frozen=True)
class InitPlan:
    """What ``initialize()`` builds, checked: the parse and the settings."""

    values: ParsedParams
    settings: PrecisionSettings


def plan_initialize(net: "AmpNetMixin") -> InitPlan:
    """Every check of ``initialize()``, before anything changes: the net's
    parameters parsed afresh (they may have been set since), the
    ``amp_autotune__*`` names and values, and the precision settings.

    Raises
    ------
    ValueError, TypeError
      The first invalid value, naming the parameter.
    """
    values = parse(net, fresh=True)
    tuned = net.get_params_for("amp_autotune")
    check_names("amp_autotune", tuned)  # for any amp_enabled: a typo is an error
    check_all({"amp_autotune__" + k: v for k, v in tuned.items()})
    return InitPlan(values, build_settings(checked_params(net, values=values)))


def build_precision(net: "AmpNetMixin", plan: InitPlan) -> None:
    """The precision component of ``plan`` (a new loss scaler, skorch's
    re-init message for it), before skorch initializes the rest; the
    parse kept on the net."""
    with net._current_init_context("grad_scaler"):
        kwargs = {"grad_scaler__" + k: v for k, v in net.get_params_for("grad_scaler").items()}
        if net.initialized_ and net.verbose and kwargs:
            print(net._format_reinit_msg("grad_scaler", kwargs))
        detach_layout(net)  # float32 again: skorch may reuse the module instance
        net.__dict__["precision_"] = Precision.build(plan.settings, net.get_params_for("grad_scaler"))
    _hold(net, plan.values)
    if "precision_" not in net.cuda_dependent_attributes_:
        # pickled together with optimizer_, so that the masters stay the optimizer's parameters
        net.cuda_dependent_attributes_ = [*net.cuda_dependent_attributes_, "precision_"]
    net.__dict__.pop("amp_step_state_", None)


def build_training(net: "AmpNetMixin") -> None:
    """The step state and the data-parallel component, after skorch's
    components are built."""
    net.amp_step_state_ = steps.StepState(closure=uses_closure(net))
    with net._current_init_context("parallel"):
        net.parallel_ = build_parallel(net, net.amp_step_state_.closure)


def detach_layout(net: "AmpNetMixin") -> None:
    """Take the precision layout off the module (before skorch reuses or
    replaces it)."""
    prec, module = net.__dict__.get("precision_"), net.__dict__.get("module_")
    if prec is not None and isinstance(module, torch.nn.Module):
        prec.detach(module)


def attach_layout(net: "AmpNetMixin") -> None:
    """Put the precision layout on the module skorch left (a precision
    component built first where skorch's ``_initialize_module`` ran on its
    own). A net without ``module_`` keeps the module parameters' defaults.

    Raises
    ------
    ValueError
      A module parameter set on a net without ``module_``.
    """
    prec = net.__dict__.get("precision_")
    if prec is None:
        prec = net.__dict__["precision_"] = Precision.build(trained_settings(net), net.get_params_for("grad_scaler"))
    module = net.__dict__.get("module_")
    if isinstance(module, torch.nn.Module):
        prec.attach(module, trimmed=getattr(net, "_trimmed_for_prediction", False))
    elif any(parsed(net, name) != PARAMS[name].default for name in MODULE_PARAMS):
        # skorch allows nets without a ``module_`` (custom module names):
        # autocast applies as usual; per-module control has no module to act on
        raise ValueError(
            f"{', '.join(MODULE_PARAMS[:-1])} and {MODULE_PARAMS[-1]} act on the net's 'module_', which this net "
            "does not have. Fix: keep their defaults, or name the main module 'module_'."
        )


def initialize_grad_scaler(net: "AmpNetMixin") -> None:
    """``net.initialize_grad_scaler()``: a new loss scaler from the net's
    ``grad_scaler`` and ``grad_scaler__*`` parameters (parsed afresh)."""
    values = parse(net, fresh=True)
    scaler = build_scaler(build_settings(checked_params(net, values=values)), net.get_params_for("grad_scaler"))
    net.precision_.scaler = scaler
    _hold(net, values)
    net.amp_step_state_.scale = None
    net.amp_step_state_.closure = uses_closure(net)


# ---- set_params(): the net calls plan_change, skorch's set_params with change.skorch, apply_change ----


@dataclass
class Change:
    """A checked ``set_params`` call, planned: nothing has changed yet.

    ``kind`` is ``'store'`` (a net not initialized: skorch's parameters
    and ampnet's stored), ``'live'`` (loss-scaler settings the live scaler
    takes, and settings that rebuild nothing) or ``'rebuild'`` (what the
    parameter table says the change rebuilds). ``skorch`` holds what
    skorch's ``set_params`` sets.
    """

    kind: str
    kwargs: dict[str, Any]
    own: dict[str, Any]
    skorch: dict[str, Any]
    stored: dict[str, Any] = field(default_factory=dict)
    values: ParsedParams | None = None
    new: Precision | None = None
    checked: bool = False


def _split(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    # grad_scaler and grad_scaler__* are ampnet's to handle: skorch would
    # treat the "grad_scaler" prefix as a module and refuse it
    own = {k: v for k, v in kwargs.items()
           if k == "grad_scaler" or k.startswith(("grad_scaler__", "amp_autotune__", "amp_float8__"))}
    return own, {k: v for k, v in kwargs.items() if k not in own}


def _tuned(own: Mapping[str, Any]) -> dict[str, Any]:
    return {k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("amp_autotune__")}


def _live(own: Mapping[str, Any]) -> dict[str, Any]:
    return {k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("grad_scaler__")}


def plan_change(net: "AmpNetMixin", kwargs: dict[str, Any]) -> Change:
    """Every check of ``net.set_params(**kwargs)``, before anything changes.

    Raises
    ------
    ValueError, TypeError
      An invalid value or name, naming the parameter.
    """
    if net.initialized_:  # what plain assignments changed since the components were built, rebuilt now too
        kwargs = {**assigned_changes(net), **kwargs}
    own, others = _split(kwargs)
    if not net.initialized_:
        return Change("store", kwargs, own, others)
    if not others and rebuilds(kwargs) <= {LIVE_SCALER, NOTHING} and _takes_live(net.precision_.scaler, _live(own)):
        _check_live(net, own)  # the one check of these values
        values = ParsedParams({**parse(net), **{k: v for k, v in own.items() if is_parsed_name(k)}})
        return Change("live", kwargs, own, {}, values=values)
    values = parse(net, kwargs)
    params = checked_params(net, kwargs, values)
    check_names("amp_autotune", {**net.get_params_for("amp_autotune"), **_tuned(own)})
    new_optimizer = any(k.split("__")[0] in net._optimizers for k in kwargs)
    # the one Precision of this call; apply_change gives it its scaler
    new = Precision(build_settings(params), net.precision_.scaler)
    checked = not (getattr(net, "_trimmed_for_prediction", False) or new_optimizer)
    if checked:  # a kernel ampnet chose is chosen again for the new layout
        new.check_optimizers([(n, getattr(net, n + "_")) for n in net._optimizers], ampnet_kernels(net))
    # read at the next fit: skorch re-initializes nothing for them (and refuses them on an initialized net)
    stored = {k: v for k, v in others.items() if k.startswith(STORED_PREFIXES)}
    skorch = {k: v for k, v in others.items() if k not in stored}
    return Change("rebuild", kwargs, own, skorch, stored, values, new, checked)


def before_skorch(net: "AmpNetMixin", change: Change) -> None:
    """What is set before skorch's ``set_params``: the settings stored for
    the next fit, and the optimizer settings, kept as parameters (skorch's
    virtual setter forgets them) so that a re-initialized optimizer has them."""
    if change.kind != "rebuild":
        return
    if change.stored:
        vars(net).update(change.stored)
        net._params_to_validate.update(change.stored)
        net._validate_params()
    vars(net).update(_optimizer_settings(net, change.skorch))


def apply_change(net: "AmpNetMixin", change: Change) -> None:
    """The change, after skorch's ``set_params``: ampnet's parameters set,
    and what the parameter table says the change rebuilds (``'auto'``'s
    choice is dropped where its inputs change by
    :func:`ampnet.auto.drop_stale_choice`, which the net calls first)."""
    if change.kind == "store":
        net.__dict__.update(change.own)
        return
    if change.kind == "rebuild":
        _check_optimizers_accept(net, change.skorch)
    net.__dict__.update(change.own)
    _hold(net, change.values)
    if change.kind == "live":
        _set_live_settings(net.precision_.scaler, _live(change.own))
        net.amp_step_state_.scale = None
        return
    _apply_precision(net, change.new, sorted(change.kwargs), change.checked)
    if PARALLEL in rebuilds(change.kwargs):  # refused as initialize() refuses it (True without a process group)
        net.parallel_ = rebuild_parallel(net, net.parallel_, net.amp_step_state_.closure)


def _takes_live(scaler: Any, live: Mapping[str, Any]) -> bool:
    """Whether ``scaler`` takes the settings ``live`` in place: ampnet's
    scaler always; torch's own while enabled and with a setter for each."""
    return not live or isinstance(scaler, GradScaler) or (
        scaler.is_enabled() and all(hasattr(scaler, f"set_{k}") for k in live))


def _set_live_settings(scaler: Any, live: Mapping[str, Any]) -> None:
    """Set checked ``live`` settings on ``scaler`` in place (see :func:`_takes_live`)."""
    if isinstance(scaler, GradScaler):
        scaler.apply_settings(**live)
    else:  # torch's own scaler: its setters
        for name, value in live.items():
            getattr(scaler, f"set_{name}")(value)


def _check_live(net: "AmpNetMixin", own: Mapping[str, Any]) -> None:
    """The checks of a live change: the ``amp_autotune__*`` names, each
    value, and the scaler settings together with the bounds they keep."""
    tuned, live = _tuned(own), _live(own)
    if tuned:
        check_names("amp_autotune", tuned)
    for name, value in own.items():
        if not name.startswith("grad_scaler__"):
            check(name, value)
    if live:
        scaler = net.precision_.scaler
        current = scaler.get_settings() if isinstance(scaler, GradScaler) else {}
        bounds = {k: current[k] for k in _BOUNDS if k in current and k not in live} if set(live) & set(_BOUNDS) else {}
        validate_scaler_settings(**{**bounds, **live})  # the one check of these values


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
    live = {k: scaler_params[k] for k in (name.split("__", 1)[1] for name in changed if name.startswith("grad_scaler__"))}
    rebuilt = rebuilds(changed)
    moves = LAYOUT in rebuilt
    scaler = prec.scaler
    if SCALER in rebuilt:
        reasons = sorted(k for k in changed if SCALER in rebuilds([k]))
        if net.verbose:
            print(net._format_reinit_msg("grad_scaler", dict.fromkeys(reasons)))
        scaler = build_scaler(settings, scaler_params)
    elif live and _takes_live(scaler, live):
        _set_live_settings(scaler, live)  # the values were checked with the settings
    elif live:  # torch's own scaler without a setter for one of them: a new one
        scaler = build_scaler(settings, scaler_params)
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
            rebuild_optimizers(net, carried_states(net), _changing(net, layout_changed))
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
        rebuild_optimizers(net, carried_states(net), _changing(net, changed))


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


@dataclass(frozen=True)
class RebuildReason:
    """Why the optimizers are rebuilt: skorch's re-init message (None: no
    message) and the words of the warning for a state that does not fit."""

    reinit: str | None
    words: str


def _changing(net: "AmpNetMixin", changed: list[str]) -> RebuildReason:
    return RebuildReason(net._format_reinit_msg("optimizer", dict.fromkeys(changed)),
                         f"after changing {', '.join(changed)}")


def carried_states(net: "AmpNetMixin", names: list[str] | None = None) -> dict[str, dict]:
    """The optimizers' states to carry over (``names``: those optimizers
    only; default: all, empty states included)."""
    if names is None:
        return {n: getattr(net, n + "_").state_dict() for n in net._optimizers}
    return {n: getattr(net, n + "_").state_dict() for n in names if getattr(net, n + "_").state}


def rebuild_optimizers(net: "AmpNetMixin", states: Mapping[str, dict], why: RebuildReason) -> None:
    """Build the optimizers afresh for the module's layout (with the kernel
    for it), with skorch's re-init message where ``why`` has one, and carry
    ``states`` over where the parameters line up (else a warning, and that
    optimizer starts afresh). It calls skorch's public ``initialize_optimizer``
    (which the net does not override), not the net's ``_initialize_optimizer``,
    which would climb back up into this module; the callers set the step's
    closure flag for the new precision."""
    with net._current_init_context("optimizer"):
        if why.reinit is not None and net.verbose:
            print(why.reinit)  # what skorch's _initialize_optimizer prints
        net.initialize_optimizer()
    net.precision_.check_optimizers([(n, getattr(net, n + "_")) for n in net._optimizers])
    for name, state in states.items():
        optimizer = getattr(net, name + "_")
        try:
            optimizer.load_state_dict(keep_kernels(optimizer, state))
        except ValueError as exc:
            amp_warn(f"The state of {name} could not be carried over {why.words} ({exc}); it starts afresh.")


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
