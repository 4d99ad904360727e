"""The precision component of a net: every dtype decision, in one object.

:class:`Precision` is built at ``initialize()`` from the net's checked
parameters (:class:`~ampnet.precision.settings.PrecisionSettings`) and kept
as the fitted attribute ``precision_``. The net and its training step never
ask which precision is active: they call the component's hooks, in the order
of a training step (see :mod:`ampnet.training.step`):

``attach``/``detach`` (the module's layout: low-precision storage, float32
master copies, float32 and low-precision regions, memory format),
``forward_context``, ``convert_input``, ``convert_output``, ``backward``,
``gather_grads``, ``check`` (unscale once, on the device), ``decide`` (the
one host read of a step), ``step_context`` (fused optimizers),
``after_step`` and ``update``.

Each kind of precision is a subclass, in :mod:`ampnet.precision.kinds` (one
module per kind), chosen from the settings by :func:`precision_class`: ``Precision(settings,
scaler)`` builds the kind that ``settings`` ask for, and a new ``settings``
(a move to another device type) re-chooses it. A kind says what it does at
every hook; no hook branches on the settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Collection, Iterator, Mapping, NamedTuple, Sequence

import torch
from ampnet.precision import compensated as comp
from ampnet.precision.legacy import remove_legacy_hooks
from ampnet.precision.memory import MemoryReport, measure_memory
from ampnet.precision.checks import nonfinite_grads, unscale_flag
from ampnet.precision.masters import (
    find_state_hook,
    install_state_hooks,
    make_masters,
    move_grads,
    narrow,
    remove_state_hooks,
    sync_module,
)
from ampnet.precision.plan import PrecisionLayout, plan_layout
from ampnet.precision.policy import PrecisionPolicy, parse_amp_dtype, resolve_precision
from ampnet.precision.regions import AutocastRegion, install_region, regions_of, remove_regions
from ampnet.precision.scaler import GradScaler, move_scaler
from ampnet.precision.scaler_build import build_scaler
from ampnet.precision.selectors import AUTO, parse_selectors
from ampnet.precision.settings import PrecisionSettings


__all__ = ["Precision", "StepDecision", "module_root", "NO_CONTEXT", "precision_class", "restore_precision"]


class StepDecision(NamedTuple):
    """What the one host read of a step says: which optimizers skip, and
    the loss scale after the step (1.0 without loss scaling)."""

    skipped: tuple[bool, ...]
    scale: float | None  # None: not read (torch's own scaler)
    scale_before: float | None  # None: not read (torch's own scaler, no step skipped)


#: A context that does nothing (reusable: ``contextlib.nullcontext`` keeps no state).
NO_CONTEXT = contextlib.nullcontext()

def module_root(module: torch.nn.Module) -> torch.nn.Module:
    """The module that precision acts on (inside a ``torch.compile`` wrapper)."""
    return getattr(module, "_orig_mod", module)


class Precision:
    """The precision of one net (fitted attribute ``precision_``).

    Parameters
    ----------
    settings : PrecisionSettings
      The net's checked precision parameters.

    scaler : ampnet.GradScaler
      The loss scaler (``grad_scaler_``), disabled when no loss scaling is used.

    Attributes
    ----------
    policy : PrecisionPolicy
      The resolved policy (``precision_policy_``).

    layout : PrecisionLayout or None
      The module's layout once attached (``amp_layout_``).

    masters : dict or None
      Float32 master parameters by name in ``'pure'`` (``amp_master_params_``).

    auto_fp32 : tuple of str or None
      The modules that ``'auto'`` in ``amp_fp32_modules`` stands for in the
      next :meth:`plan` (None: those of the current layout, if any).

    Notes
    -----
    ``Precision(settings, scaler)`` returns an instance of the kind that
    ``settings`` ask for (:func:`precision_class`).
    What a hook needs from the settings and the layout is read once, when
    either is set (:meth:`_configure`), never inside a hook.
    """

    auto_fp32: tuple[str, ...] | None = None  # also for components pickled before it existed
    #: ``scaler.unscale_`` keywords of ampnet's scaler for this kind.
    _unscale_kwargs: Mapping[str, Any] = {}

    def __new__(cls, settings: PrecisionSettings | None = None, scaler: GradScaler | None = None) -> "Precision":
        if cls is Precision and settings is not None:
            cls = precision_class(settings)
        return object.__new__(cls)

    def __init__(self, settings: PrecisionSettings, scaler: GradScaler) -> None:
        self.__dict__["_layout"] = None
        self.settings = settings
        self.scaler = scaler
        self.masters: dict[str, torch.nn.Parameter] | None = None
        self.auto_fp32: tuple[str, ...] | None = None
        self._found: dict[int, torch.Tensor] = {}

    @property
    def settings(self) -> PrecisionSettings:
        """The checked precision settings; setting new ones re-chooses the
        kind (:func:`precision_class`)."""
        return self.__dict__["_settings"]

    @settings.setter
    def settings(self, settings: PrecisionSettings) -> None:
        kind = precision_class(settings)
        self.__dict__["_settings"] = settings
        if type(self) is not kind:
            self.__class__ = kind
        self._configure()

    @property
    def layout(self) -> PrecisionLayout | None:
        """The module's layout once attached (``amp_layout_``)."""
        return self.__dict__["_layout"]

    @layout.setter
    def layout(self, layout: PrecisionLayout | None) -> None:
        self.__dict__["_layout"] = layout
        self._configure()

    def _configure(self) -> None:
        """Read what the hooks need from the settings and the layout."""
        d = self.__dict__
        settings, layout = d.get("_settings"), d.get("_layout")
        if settings is None:
            return
        policy = settings.policy
        d["_device_type"], d["_dtype"] = policy.device_type, policy.compute_dtype
        # without loss scaling the check is the non-finite one, or none (amp_skip_nonfinite=False): chosen here
        d["_unscaled_check"] = self._check_nonfinite if settings.skip_nonfinite else _no_check
        d["_scoped"] = layout is not None and layout.scoped
        d["_channels_last"] = layout is not None and layout.memory_format == "channels_last"

    @classmethod
    def build(cls, settings: PrecisionSettings, scaler_params: Mapping[str, Any]) -> "Precision":
        """A new component with a new scaler (:func:`~ampnet.precision.scaler_build.build_scaler`;
        ``scaler_params``: the net's ``grad_scaler__*`` settings)."""
        return cls(settings, build_scaler(settings, scaler_params))

    @property
    def policy(self) -> PrecisionPolicy:
        return self.settings.policy

    @property
    def enabled(self) -> bool:
        """Whether AMP is on."""
        return self.settings.policy.enabled

    @property
    def scaling(self) -> bool:
        """Whether loss scaling is active."""
        return self.scaler.is_enabled()

    @property
    def auto_pending(self) -> bool:
        """Whether ``amp_fp32_modules`` holds ``'auto'`` that the first fit
        has yet to resolve (AMP on, a module attached and not yet probed)."""
        return (
            self.enabled and self.layout is not None and self.layout.auto_fp32_modules is None
            and AUTO in parse_selectors(self.settings.fp32_modules, "amp_fp32_modules")
        )

    @property
    def records(self) -> bool:
        """Whether the history gets ``loss_scale`` and ``step_skipped`` every step."""
        return self.enabled or self.scaling

    # ---- the module --------------------------------------------------------

    def plan(self, module: torch.nn.Module, current: PrecisionLayout | None = None) -> PrecisionLayout:
        """The layout of ``module`` under these settings, without changing it
        (``current``: the layout the module carries now, if any)."""
        settings = self.settings
        auto = self.auto_fp32
        if auto is None and current is not None and current.dtype == settings.policy.compute_dtype:
            # a probed choice holds for the dtype it was probed in
            auto = current.auto_fp32_modules
        return plan_layout(
            module_root(module), settings.policy, settings.fp32_modules, settings.amp_modules,
            settings.memory_format, current.low_precision_params if current is not None else (),
            auto,
        )

    def attach(self, module: torch.nn.Module, trimmed: bool = False, layout: PrecisionLayout | None = None) -> None:
        """Apply the layout (planned now unless given) on ``module``, which
        must be float32 without regions: memory format, float32 and
        low-precision regions, low-precision storage and, unless
        ``trimmed``, float32 master copies."""
        root = module_root(module)
        policy = self.settings.policy
        settings = self.settings
        layout = layout if layout is not None else self.plan(module)
        if layout.memory_format == "channels_last":
            for t in [*root.parameters(), *root.buffers()]:
                if t.dim() == 4:
                    t.data = t.data.contiguous(memory_format=torch.channels_last)
        for name in layout.fp32_modules:
            install_region(root.get_submodule(name), AutocastRegion(policy.device_type))
        if layout.scoped:
            for name in layout.amp_modules:
                install_region(root.get_submodule(name), AutocastRegion(policy.device_type, policy.compute_dtype))
        masters = None
        if layout.low_precision_params:
            if settings.master_weights and not trimmed:
                masters = make_masters(root, layout.low_precision_params)
            narrow(root, layout.low_precision_params, layout.dtype)
            install_state_hooks(root, layout.low_precision_params, masters)
        self.layout, self.masters = layout, masters

    def take_over(
        self, old: "Precision", module: torch.nn.Module, trimmed: bool = False,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> bool:
        """Move ``module`` from ``old``'s layout to this one, keeping the
        weights (float32 from the masters, or the weights plus their
        compensation in ``optimizers``' state, which is removed from it).
        The new layout is planned first, so a refusal changes nothing.
        Returns whether low-precision parameters are involved before or
        after (the optimizer's parameters changed)."""
        layout = self.plan(module, old.layout)
        before = old.layout.low_precision_params if old.layout is not None else ()
        old.detach(module, optimizers)
        self.attach(module, trimmed=trimmed, layout=layout)
        return bool(before or layout.low_precision_params)

    def detach(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Undo :meth:`attach`: no regions, float32 parameters (from the
        masters where there are some, with the compensation in
        ``optimizers``' state added, which is removed from it), default
        strides."""
        root = module_root(module)
        remove_regions(root)
        remove_state_hooks(root)
        remove_legacy_hooks(root)
        layout = self.layout
        if layout is not None:
            params = dict(root.named_parameters(remove_duplicate=False))
            wide = self.float32_weights(module, optimizers)
            comp.pop_compensation(optimizers)
            for name in layout.low_precision_params:
                params[name].data = wide[name]
            if layout.memory_format == "channels_last":
                for t in [*root.parameters(), *root.buffers()]:
                    if t.dim() == 4:
                        t.data = t.data.contiguous()
        self.layout, self.masters = None, None

    def float32_weights(
        self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()
    ) -> dict[str, torch.Tensor]:
        """New float32 tensors of the low-precision parameters, by name: the
        masters, else the weights plus their compensation (found in
        ``optimizers``' state), else the weights as stored."""
        if self.layout is None:
            return {}
        params = dict(module_root(module).named_parameters(remove_duplicate=False))
        comps = comp.compensation_of(optimizers) if self.settings.compensated else {}
        out = {}
        with torch.no_grad():
            for name in self.layout.low_precision_params:
                if self.masters:
                    out[name] = self.masters[name].detach().to(torch.float32, copy=True)
                    continue
                param = params[name]
                wide = param.detach().to(torch.float32, copy=True)
                extra = comps.get(id(param))
                if extra is not None:
                    wide.add_(extra.to(torch.float32))
                out[name] = wide
        return out

    def memory(self, module: Any, optimizers: Sequence[torch.optim.Optimizer]) -> "MemoryReport":
        """The bytes of the training state, by role (:func:`ampnet.precision.memory.measure_memory`)."""
        name = self.policy.name
        if self.enabled and self.policy.level == "pure":
            mode = "compensated" if self.settings.compensated else (
                "float32 masters" if self.settings.master_weights else "no masters")
            name = name[:-1] + f", {mode})"
        return measure_memory(module_root(module) if module is not None else None, self.masters, optimizers, name)

    def check_optimizers(
        self, optimizers: Sequence[tuple[str, torch.optim.Optimizer]], rederived: Collection[str] = ()
    ) -> None:
        """Refuse ``(name, optimizer)`` pairs that these settings cannot
        step (``'compensated'``: see :func:`ampnet.precision.compensated.check_optimizer`;
        a fused SGD that skips low-precision updates:
        :func:`ampnet.precision.compensated.check_fused_sgd`). The kernel of
        the optimizers named in ``rederived`` is not checked: ampnet chose it,
        and chooses it again for the new layout when it rebuilds them
        (``ampnet.config.reconfigure.ampnet_kernels``)."""
        low = self.enabled and self.policy.level == "pure" and not self.settings.master_weights
        for name, optimizer in optimizers:
            if self.settings.compensated:
                comp.check_optimizer(optimizer, name, self.policy.compute_dtype)
            if low and name not in rederived:  # the optimizer steps low-precision parameters
                comp.check_fused_sgd(optimizer, name, self.policy.compute_dtype)

    def drop_masters(self, module: torch.nn.Module) -> None:
        """Forget the float32 masters (prediction only, after a trim)."""
        if self.masters and self.layout is not None:
            root = module_root(module)
            remove_state_hooks(root)
            install_state_hooks(root, self.layout.low_precision_params, None)
        self.masters = None

    def learnable(self, named_params: Iterator[tuple[str, torch.nn.Parameter]], module: Any) -> Iterator:
        """``named_params`` with the float32 masters standing in for the
        low-precision parameters they update (same names)."""
        if not self.masters:
            yield from named_params
            return
        params = dict(module_root(module).named_parameters(remove_duplicate=False))
        by_id = {id(params[n]): m for n, m in self.masters.items()}
        for name, param in named_params:
            yield name, by_id.get(id(param), param)

    def to_device_type(self, module: Any, device_type: str) -> None:
        """Re-target the scaler and the regions after the net moved device
        type (a CUDA net loaded on a CPU)."""
        if self.policy.enabled and self.policy.device_type != device_type:
            self.settings = dataclasses.replace(  # its fields only (a pickle may hold more)
                self.settings,
                policy=resolve_precision(True, self.policy.compute_dtype, device_type, self.policy.level),
            )
        move_scaler(self.scaler, device_type)
        if isinstance(module, torch.nn.Module):
            for region in regions_of(module_root(module)).values():
                region.device_type = device_type

    @contextlib.contextmanager
    def params_as(self, module: Any, params_dtype: Any = "float32") -> Iterator[None]:
        """Inside, ``module.state_dict()`` holds float32 weights
        (``'float32'``) or the weights as stored (``'low'``)."""
        low = self.layout.dtype if self.layout is not None else None
        if params_dtype in ("float32", torch.float32):
            wide = True
        elif params_dtype == "low" or (low is not None and _as_dtype(params_dtype) == low):
            wide = False
        else:
            raise ValueError(
                "params_dtype must be 'float32' (float32 weights, from the master copies "
                "in amp_level='pure') or 'low' (the weights as the module stores them"
                f"{', ' + str(low).replace('torch.', '') if low else ''}); got "
                f"{params_dtype!r} ({type(params_dtype).__name__})."
            )
        hook = find_state_hook(module_root(module)) if isinstance(module, torch.nn.Module) else None
        if hook is None or wide:
            yield
            return
        hook.low = True
        try:
            yield
        finally:
            hook.low = False

    @property
    def name(self) -> str:
        """How the net computes, for reports (``'bfloat16 (mixed)'``)."""
        return self.policy.name

    def layer_notes(self, module: torch.nn.Module) -> dict[str, str]:
        """What this kind does to single layers, by name, for the precision
        report (none but float8's)."""
        return {}

    def to_plain(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` (an export's copy) with what this kind put in its
        structure undone (none but float8's: its ``Float8Linear`` layers)."""
        return module

    def report_dtype(self, requested: Any = None) -> torch.dtype:
        """The low-precision dtype a precision report analyses: ``requested``,
        else the net's, else the device's ``'auto'`` choice."""
        if requested is not None:
            parsed = parse_amp_dtype(requested)
            if parsed is not None:
                return parsed
        if self.enabled:
            return self.policy.compute_dtype
        return resolve_precision(True, "auto", self.policy.device_type).compute_dtype

    # ---- forward and loss: each kind's (ampnet.precision.kinds) ----------

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The context of the forward pass and the loss; nothing where that
        context is entered already (a step's forward and loss)."""
        raise NotImplementedError

    def convert_input(self, x: Any, module: Any, device: Any) -> Any:
        """The batch's features as the module takes them, on ``device``."""
        raise NotImplementedError

    def convert_output(self, y: Any) -> Any:
        """The module's outputs as the loss and the user see them."""
        raise NotImplementedError

    # ---- backward and the step ---------------------------------------------

    def backward(self, loss: torch.Tensor, module: Any, gather: bool = True) -> None:
        """Backward of the (scaled) loss; gradients land where the optimizer
        reads them (the float32 masters in ``'pure'``; with ``gather=False``
        they stay on the module until :meth:`gather_grads`)."""
        if self.scaler.is_enabled():
            loss = self.scaler.scale(loss)
        loss.backward()
        if gather:
            self.gather_grads(module)

    def gather_grads(self, module: Any) -> None:
        """Move low-precision gradients into the float32 masters (accumulating)."""
        if self.masters:
            move_grads(module_root(module), self.masters)

    def zero_grad(self, module: Any) -> None:
        """Clear the gradients of the low-precision parameters that masters stand in for."""
        if self.masters:
            params = dict(module_root(module).named_parameters(remove_duplicate=False))
            for name in self.masters:
                params[name].grad = None

    def check(self, optimizers: Sequence[tuple[torch.optim.Optimizer, list]]) -> list[torch.Tensor] | None:
        """Unscale each optimizer's gradients once and flag non-finite ones,
        on the device. Returns one flag tensor per optimizer, or None when
        nothing is checked (no loss scaling and ``amp_skip_nonfinite=False``)."""
        self._found = {}
        scaler = self.scaler
        if scaler.is_enabled():
            flags = []
            ours = isinstance(scaler, GradScaler)
            device = next((p.grad.device for _, params in optimizers for p in params), None)
            for optimizer, params in optimizers:
                if ours:
                    scaler.unscale_(optimizer, **self._unscale_kwargs)
                    flag = scaler.found_inf_tensor(optimizer)
                else:
                    # torch's own scaler keeps its flag private: the same check, just before
                    flag = unscale_flag(params, device)
                self._found[id(optimizer)] = flag  # also: a step is under way (discard_step)
                if not ours:
                    scaler.unscale_(optimizer)
                flags.append(flag)
            return flags
        return self._unscaled_check(optimizers)

    def _check_nonfinite(self, optimizers: Sequence[tuple[torch.optim.Optimizer, list]]) -> list[torch.Tensor]:
        """Without loss scaling: one non-finite flag per optimizer, on the device."""
        device = optimizers[0][1][0].grad.device if optimizers and optimizers[0][1] else None
        one = self.__dict__.get("_ones", {}).get(device)
        if one is None and device is not None:
            one = self._one(device)
        flags = [nonfinite_grads(params, device, one) for _, params in optimizers]
        for (optimizer, _), flag in zip(optimizers, flags):
            self._found[id(optimizer)] = flag  # a fused optimizer skips on it, on the device
        return flags

    def _one(self, device: torch.device) -> torch.Tensor:
        """A float32 one on ``device``, made once (the non-finite check's unit scale)."""
        ones = self.__dict__.setdefault("_ones", {})
        one = ones.get(device)
        if one is None:
            one = ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return one

    def skip_on(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        """Let ``optimizer``'s step (a fused one) skip on ``flag`` instead of
        the flag :meth:`check` found (the training step's limit on runs of
        skipped steps, on the device)."""
        self._found[id(optimizer)] = flag

    def decide(self, flags: list[torch.Tensor] | None, count: int) -> StepDecision:
        """The one host read of a step: the flags of ``count`` optimizers and,
        with loss scaling, the scale before and after this step's update
        (planned on the device). No read when nothing was checked."""
        scaler = self.scaler
        if not scaler.is_enabled():
            if flags is None or not flags:
                return StepDecision((False,) * count, 1.0, 1.0)
            values = torch.stack([f.reshape(()) for f in flags]).tolist()
            return StepDecision(tuple(v > 0 for v in values), 1.0, 1.0)
        if not isinstance(scaler, GradScaler):
            # torch's own scaler updates on the device too, but the new scale
            # is only known after update(): the history reads it then. Its
            # scale as a tensor, through its public API: scale(1.0), exact
            one = torch.ones((), dtype=torch.float32, device=flags[0].device)
            values = torch.stack([*(f.reshape(()) for f in flags), scaler.scale(one)]).tolist()
            return StepDecision(tuple(v > 0 for v in values[:-1]), None, values[-1])
        before = scaler.scale_tensor().reshape(())
        after = scaler.plan_update()
        values = torch.stack([*(f.reshape(()) for f in flags), before, after.reshape(())]).tolist()
        return StepDecision(tuple(v > 0 for v in values[:-2]), values[-1], values[-2])

    def step_context(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """Around ``optimizer.step()``: fused optimizers receive the overflow
        flag on the device (``found_inf``), as torch's own scaler passes it;
        with ``'compensated'`` the optimizer steps the compensation buffers,
        which are then folded into the weights."""
        found = self._found.get(id(optimizer))
        if found is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            return _fused_flags(optimizer, found)
        return NO_CONTEXT

    def _fused_found(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The flag :meth:`check` found for ``optimizer`` where it is a fused
        one that takes it on the device, else None."""
        found = self._found.get(id(optimizer))
        return found if found is not None and getattr(optimizer, "_step_supports_amp_scaling", False) else None

    def after_step(self, module: Any) -> None:
        """Refresh the low-precision weights from the masters."""
        if self.masters:
            sync_module(module_root(module), self.masters)

    def update(self, keep_scale: bool, scale_before: float | None) -> None:
        """The one scaler update of a step (on the device); ``keep_scale``
        (bad data, not an overflow) keeps the scale as it was."""
        if self.scaler.is_enabled():
            if keep_scale:
                self.scaler.update(new_scale=scale_before)
            else:
                self.scaler.update()
        self._found = {}

    def discard_step(self) -> None:
        """Forget a step that an exception interrupted between the unscale
        (:meth:`check`) and :meth:`update` (a callback, KeyboardInterrupt),
        which would block the next fit; the scale stays as it was. ampnet's
        scaler drops its record (:meth:`GradScaler.discard_step`); torch's
        own ends the step through its public ``update(new_scale=...)``."""
        scaler = self.scaler
        if isinstance(scaler, GradScaler):
            scaler.discard_step()
        elif scaler.is_enabled() and self._found:
            scaler.update(new_scale=float(scaler.get_scale()))
        self._found = {}

    # ---- state -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The component's training state: the loss scaler's."""
        return {"grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["grad_scaler"])

    def __getstate__(self) -> dict[str, Any]:
        # the names of ampnet 0.4's pickles: settings, scaler, layout, masters, auto_fp32, _found
        state = {k: v for k, v in self.__dict__.items() if k not in _DERIVED}
        state["settings"] = state.pop("_settings")
        state["layout"] = state.pop("_layout")
        state["_found"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled component, also one of ampnet 0.4 (one class
        for every precision): its kind is chosen from its settings."""
        restore_precision(self, state)

    def __repr__(self) -> str:
        return f"<Precision: {self.policy.name}, loss scaling {'on' if self.scaling else 'off'}>"


def precision_class(settings: PrecisionSettings) -> type[Precision]:
    """The kind of :class:`Precision` that ``settings`` ask for.

    The kinds are the subclasses of :class:`Precision` that define a static
    ``serves(settings)`` (:mod:`ampnet.precision.kinds`, one module each;
    importing :mod:`ampnet.precision` imports them). From :class:`Precision`
    down, the one subclass that serves ``settings`` is taken, then the one
    of its subclasses that does, until none does: the most specific kind.

    Parameters
    ----------
    settings : PrecisionSettings
      A net's checked precision settings.

    Returns
    -------
    type
      A subclass of :class:`Precision`.

    Raises
    ------
    TypeError
      Two kinds at one level serve ``settings`` (each kind must own its settings).
    ValueError
      No kind serves them.
    """
    kind: type[Precision] = Precision
    while True:
        serving = [k for k in kind.__subclasses__() if "serves" in k.__dict__ and k.serves(settings)]
        if len(serving) > 1:
            raise TypeError(
                f"kinds of precision {', '.join(k.__qualname__ for k in serving)} all serve {settings!r}; "
                "a kind must own its settings. Fix: make their serves(settings) exclusive.")
        if not serving:
            break
        kind = serving[0]
    if kind is Precision:
        raise ValueError(
            f"no kind of precision serves {settings!r}. Fix: import ampnet.precision, which imports "
            "the kinds of ampnet.precision.kinds.")
    return kind


def _no_check(optimizers: Sequence[tuple[torch.optim.Optimizer, list]]) -> None:
    """``amp_skip_nonfinite=False`` without loss scaling: nothing is checked."""
    return None


#: What :meth:`Precision._configure` derives, and per-run caches: never pickled.
_DERIVED = frozenset({"_device_type", "_dtype", "_unscaled_check", "_skip_nonfinite", "_scoped", "_channels_last",
                      "_cache", "_ones", "float32_step"})


def restore_precision(prec: Precision, state: Mapping[str, Any]) -> None:
    """Fill ``prec`` from a pickled ``state`` (this version's or 0.4's, whose
    class was ``Precision`` itself, with ``float32_step`` in it): the kind
    follows the settings."""
    state = {k: v for k, v in state.items() if k not in _DERIVED}
    settings, layout = state.pop("settings"), state.pop("layout", None)
    state.setdefault("_found", {})
    prec.__dict__.update(state)
    prec.__dict__["_layout"] = layout
    prec.settings = settings


class _fused_flags:
    """Around a fused optimizer's step: the overflow flag on the device, as
    torch's own scaler passes it (the gradients already unscaled)."""

    __slots__ = ("optimizer", "found")

    def __init__(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        self.optimizer, self.found = optimizer, found

    def __enter__(self) -> None:
        self.optimizer.grad_scale = None  # already unscaled
        self.optimizer.found_inf = self.found

    def __exit__(self, *exc: Any) -> None:
        del self.optimizer.grad_scale, self.optimizer.found_inf


def _as_dtype(value: Any) -> torch.dtype | None:
    try:
        return parse_amp_dtype(value)
    except (TypeError, ValueError):
        return None
