"""``ampnet.GradScaler``: a loss scaler with bounds, hysteresis and a static
mode, validated settings, and state that survives checkpoints and pickling
at any point of a training step.

It is a subclass of :class:`torch.amp.GradScaler` (``isinstance`` checks
hold), but it owns its whole state: the scale and the growth tracker
tensors, the per-optimizer record of a step and the settings live in
attributes of its own, and every public method of torch's class that
touches them is overridden. The private state of torch's class is left as
its constructor set it, and never read or written: a torch release that
renames it changes nothing here. The one torch function that does the work
is the public op ``torch._amp_foreach_non_finite_check_and_unscale_``.
"""

from __future__ import annotations

import copy
import inspect
from collections import abc
from typing import Any

import torch

from ampnet.precision.scaler_state import ONLY_IN_0_3, as_float, cast_setting, own_state, state_of_0_3
from ampnet.precision.unscale import unscale_in_place
from ampnet.precision.scaler_checks import (  # noqa: F401  (re-exported)
    FLOAT32_MAX,
    FLOAT32_TINY,
    STATE_VERSION,
    validate_scaler_settings,
    validate_scaler_state,
)

__all__ = [
    "GradScaler", "DEFAULTS", "LIVE_SETTINGS", "validate_scaler_settings", "validate_scaler_state", "move_scaler",
    "copy_to_device",
]

#: Settings that a fitted net changes on its live scaler (no rebuild).
LIVE_SETTINGS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
)

#: The constructor's settings and their defaults (the parameter table's ``grad_scaler__*`` rows read them).
DEFAULTS = {
    "init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
    "min_scale": 1.0, "max_scale": 2.0**24, "hysteresis": 1, "enabled": True, "dynamic": True,
}

#: Stages of an optimizer in the current step (what torch calls OptState).
_UNSCALED, _STEPPED = "unscaled", "stepped"


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaler for float16 training, a subclass of
    :class:`torch.amp.GradScaler`.

    On top of torch's scaler it keeps the scale within ``[min_scale,
    max_scale]`` (it never collapses to 0 or grows to inf), can wait for
    ``hysteresis`` overflows in a row before backing off, has a static
    mode, validates its settings with clear errors, and can be pickled or
    deep-copied at any point of a training step. Its update runs on the
    device (:meth:`plan_update`), and :meth:`found_inf_tensor` gives an
    optimizer's overflow flag as a tensor, so a training step reads the
    device once.

    It keeps its state in attributes of its own (torch's private state is
    left as torch's constructor set it and never used), so it depends on
    torch's public API and the public op
    ``torch._amp_foreach_non_finite_check_and_unscale_`` only.

    Parameters
    ----------
    device : str or None (default=None)
      Device type of the tensors it scales. None: ``'cuda'`` where CUDA is
      available, else ``'cpu'``. An instance passed to a net as
      ``grad_scaler`` is copied onto the net's device type at
      ``initialize()``, whatever its own.

    init_scale : float (default=65536.0)
      Initial scale; the fixed scale when ``dynamic=False``.

    growth_factor : float (default=2.0)
      Factor applied after ``growth_interval`` good steps in a row.

    backoff_factor : float (default=0.5)
      Factor applied on overflow (after ``hysteresis`` overflows in a row).

    growth_interval : int (default=2000)
      Good steps in a row before the scale grows.

    enabled : bool (default=True)
      A disabled scaler is a no-op; ``scale()`` returns its input.

    min_scale : float (default=1.0)
      Lower bound of the scale.

    max_scale : float (default=2**24)
      Upper bound of the scale.

    hysteresis : int (default=1)
      Overflows in a row needed before backing off (Paddle's
      ``decr_every_n_nan_or_inf``). A step with an overflow is always
      skipped; only the backoff waits.

    dynamic : bool (default=True)
      If False, the scale stays at ``init_scale``; overflowing steps are
      still skipped.

    Attributes
    ----------
    scaled_in_step : bool
      Whether :meth:`scale` was called since the last :meth:`update`; a
      net uses it to detect an unscaled ``loss.backward()``.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        dynamic: bool = True,
    ) -> None:
        validate_scaler_settings(
            prefix="",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            dynamic=dynamic,
        )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if enabled and device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "GradScaler(device='cuda') was enabled, but CUDA is not available; torch "
                "would silently disable it. Fix: GradScaler(device='cpu'), or run on a GPU."
            )
        # torch's part, for isinstance and for code that reads torch's
        # settings through its constructor; ampnet never uses its state
        super().__init__(
            device,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            enabled=bool(enabled),
        )
        settings = dict(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, min_scale=min_scale, max_scale=max_scale,
            hysteresis=hysteresis, dynamic=dynamic, enabled=enabled,
        )
        self.__dict__.update(own_state(str(device), {k: cast_setting(k, v) for k, v in settings.items()}))

    def __repr__(self) -> str:
        """``GradScaler(device='cpu', init_scale=256.0)``: the device and the
        settings that differ from the defaults."""
        params = inspect.signature(GradScaler.__init__).parameters
        changed = [
            f"{k}={v!r}" for k, v in self.get_settings().items()
            if k not in params or v != params[k].default
        ]
        return f"{type(self).__name__}({', '.join([f'device={self.device!r}', *changed])})"

    # ---- settings -------------------------------------------------------

    @property
    def device(self) -> str:
        """The device type whose tensors it scales (``'cpu'``, ``'cuda'``...)."""
        return self._ampnet_device

    def is_enabled(self) -> bool:
        """Whether it scales (a disabled scaler is a no-op)."""
        return self._ampnet_settings["enabled"]

    def get_settings(self) -> dict[str, Any]:
        """The current settings as a dict of plain Python values."""
        return dict(self._ampnet_settings)

    def set_settings(self, **settings: Any) -> None:
        """Change live settings (see ``LIVE_SETTINGS``) after validating them."""
        unknown = sorted(set(settings) - set(LIVE_SETTINGS))
        if unknown:
            raise ValueError(
                f"{unknown} cannot be changed on a live scaler; live settings are "
                f"{list(LIVE_SETTINGS)}. Build a new scaler for the others."
            )
        merged = {k: v for k, v in self.get_settings().items() if k in LIVE_SETTINGS}
        merged.update(settings)
        validate_scaler_settings(prefix="", **merged)
        self.apply_settings(**settings)

    def apply_settings(self, **settings: Any) -> None:
        """:meth:`set_settings` for values already checked (a net's
        ``set_params`` checks them once, with the parameter table and
        ``ampnet.precision.build_settings``)."""
        own = self._ampnet_settings
        for name, value in settings.items():
            own[name] = cast_setting(name, value)
        if own["enabled"] and self._loss_scale is not None:
            self._loss_scale.clamp_(own["min_scale"], own["max_scale"])
        elif own["enabled"]:  # the scale tensor is made at the first scale()
            self._start_scale = min(max(self._start_scale, own["min_scale"]), own["max_scale"])

    def get_growth_factor(self) -> float:
        """The growth factor (as in torch)."""
        return self._ampnet_settings["growth_factor"]

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated, as :meth:`set_settings`)."""
        self.set_settings(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor (as in torch)."""
        return self._ampnet_settings["backoff_factor"]

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated, as :meth:`set_settings`)."""
        self.set_settings(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval (as in torch)."""
        return self._ampnet_settings["growth_interval"]

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated, as :meth:`set_settings`)."""
        self.set_settings(growth_interval=new_interval)

    # ---- the scale --------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (reads the device once the
        scale tensor exists); 1.0 for a disabled scaler, as in torch."""
        if not self.is_enabled():
            return 1.0
        scale = self._loss_scale
        return self._start_scale if scale is None else float(scale.item())

    def scale_tensor(self) -> torch.Tensor | None:
        """The scale as a float32 tensor on its device, without a host read;
        None before the first :meth:`scale` (and for a disabled scaler)."""
        return self._loss_scale

    def _growth_tracker_value(self) -> int:
        """Good steps in a row so far (reads the device)."""
        tracker = self._good_steps
        return self._start_good_steps if tracker is None else int(tracker.item())

    def _lazy_tensors(self, device: torch.device) -> torch.Tensor:
        """The scale tensor, made on ``device`` (with the growth tracker) at
        the first call, as torch makes its own at the first ``scale()``."""
        if self._loss_scale is None:
            self._loss_scale = torch.full((), self._start_scale, dtype=torch.float32, device=device)
            self._good_steps = torch.full((), self._start_good_steps, dtype=torch.int32, device=device)
        return self._loss_scale

    def _scale_and_tracker(self, caller: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale, tracker = self._loss_scale, self._good_steps
        if scale is None or tracker is None:
            raise RuntimeError(
                f"GradScaler.{caller}() before any scale(): scale the loss first "
                "(scaler.scale(loss).backward())."
            )
        return scale, tracker

    # ---- the step -------------------------------------------------------

    def scale(self, outputs):  # type: ignore[override]
        """Multiply by the scale, as in torch (a tensor, or an iterable of
        tensors on any devices); also records that a loss was scaled in this
        step, so that a net can detect an unscaled backward."""
        if not self.is_enabled():
            return outputs
        self.scaled_in_step = True
        if isinstance(outputs, torch.Tensor):
            scale = self._lazy_tensors(outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply_scale(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not per_device:
                    scale = self._lazy_tensors(value.device)
                    per_device[scale.device] = scale
                if value.device not in per_device:
                    master = next(iter(per_device.values()))
                    per_device[value.device] = master.to(device=value.device, non_blocking=True, copy=True)
                return value * per_device[value.device]
            if isinstance(value, abc.Iterable):
                scaled = map(apply_scale, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer, allow_fp16: bool = False) -> None:
        """Divide this optimizer's gradients by the scale, in place, and
        record whether any holds inf/NaN (on the device), as torch does;
        ``allow_fp16=True`` also unscales float16 gradients
        (``amp_master_weights='compensated'`` keeps float16 weights and
        gradients: values below float16's smallest subnormal, 6e-8, become
        zero once unscaled).

        Raises
        ------
        RuntimeError
          Called twice for an optimizer, or after :meth:`step`, before the
          next :meth:`update`; or before any :meth:`scale`.
        ValueError
          A float16 gradient without ``allow_fp16``.
        """
        if not self.is_enabled():
            return
        scale, _ = self._scale_and_tracker("unscale_")
        stage = self._step_records.get(id(optimizer), {}).get("stage")
        if stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # as torch: the reciprocal in float64 (float32 division can be imprecise)
        inv_scale = scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()
        found = unscale_in_place(optimizer, inv_scale, allow_fp16)
        self._step_records[id(optimizer)] = {"stage": _UNSCALED, "found_inf": found}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` did) and step ``optimizer`` if
        its gradients are finite, as torch's ``step``; an optimizer that
        handles the scale itself (``_step_supports_amp_scaling``, torch's
        fused ones) gets ``grad_scale`` and ``found_inf`` instead and steps
        without a host read. Returns what ``optimizer.step`` returns (None
        for a skipped step)."""
        if not self.is_enabled():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._scale_and_tracker("step")
        record = self._step_records.get(id(optimizer), {})
        if record.get("stage") == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            unscaled = record.get("stage") == _UNSCALED
            if unscaled:
                found = record["found_inf"]
            else:  # check only: the fused kernel unscales
                found = unscale_in_place(optimizer, torch.ones_like(scale), allow_fp16=True)
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                getattr(optimizer, "grad_scale", None) if unscaled
                else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                result = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
            self._step_records[id(optimizer)] = {"stage": _STEPPED, "found_inf": found}
            return result
        if record.get("stage") is None:
            self.unscale_(optimizer)
        found = self._step_records[id(optimizer)]["found_inf"]
        result = None if found.item() else optimizer.step(*args, **kwargs)
        self._step_records[id(optimizer)] = {"stage": _STEPPED, "found_inf": found}
        return result

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``unscale_`` found inf/NaN in this optimizer's gradients
        during the current step (False for a disabled scaler). Reads the
        device; a training step uses :meth:`found_inf_tensor` instead."""
        if not self.is_enabled():
            return False
        return bool(self.found_inf_tensor(optimizer).item())

    def found_inf_tensor(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """This optimizer's overflow flag of the current step as a float32
        tensor on the scale's device (> 0: inf/NaN found), without a host read."""
        record = self._step_records.get(id(optimizer))
        if record is None:
            raise RuntimeError(
                "GradScaler.found_inf_tensor(): unscale_(optimizer) was not called in this step."
            )
        return record["found_inf"]

    @property
    def step_pending(self) -> bool:
        """Whether an optimizer was unscaled or stepped since the last
        :meth:`update` (a step is under way)."""
        return bool(self._step_records)

    def discard_step(self) -> None:
        """Forget the step under way: what :meth:`unscale_` and :meth:`step`
        recorded, a planned update, and that a loss was scaled. The scale,
        the growth tracker and the overflow streak stay. A net calls it at
        the start of a fit, after a step that an exception interrupted."""
        self._step_records = {}
        self._planned = None
        self.scaled_in_step = False

    def plan_update(self) -> torch.Tensor:
        """Compute, on the device and without a host read, the scale that
        :meth:`update` will set for this step's overflow checks; return it.

        :meth:`update` commits the plan; ``update(new_scale=...)`` discards it.
        """
        found_infs = [record["found_inf"] for record in self._step_records.values()]
        if not found_infs:
            raise RuntimeError(
                "GradScaler.update(): no inf checks were recorded in this step; call "
                "unscale_(optimizer) or step(optimizer) before update()."
            )
        scale, tracker = self._scale_and_tracker("update")
        settings = self._ampnet_settings
        found = torch.stack([f.to(scale.device, non_blocking=True) for f in found_infs]).sum()
        overflow = found > 0
        streak = self._streak_tensor()
        dynamic = settings["dynamic"]
        # overflow: reset the tracker; back off once `hysteresis` overflows in a row
        new_streak = torch.where(overflow, streak + 1, torch.zeros_like(streak))
        backoff = overflow & (new_streak >= settings["hysteresis"]) & dynamic
        # no overflow: count good steps; grow after `growth_interval` of them
        good = torch.where(overflow, torch.zeros_like(tracker), tracker + 1)
        grow = ~overflow & (good >= settings["growth_interval"]) & dynamic
        new_scale = torch.where(
            backoff, scale * settings["backoff_factor"],
            torch.where(grow, scale * settings["growth_factor"], scale),
        )
        new_scale = torch.where(
            torch.isfinite(new_scale), new_scale, torch.full_like(new_scale, settings["max_scale"])
        ).clamp_(settings["min_scale"], settings["max_scale"])
        self._planned = (
            new_scale,
            torch.where(grow, torch.zeros_like(good), good),
            torch.where(backoff, torch.zeros_like(new_streak), new_streak),
        )
        return new_scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale at the end of a step, within ``[min_scale, max_scale]``,
        on the device (no host read).

        On a step with an overflow in any optimizer the growth tracker is
        reset and, once ``hysteresis`` overflows happened in a row, the
        scale is multiplied by ``backoff_factor``. After ``growth_interval``
        good steps in a row it is multiplied by ``growth_factor``. With
        ``dynamic=False`` the scale never changes. ``new_scale`` sets the
        scale by hand, as in torch (the growth tracker and the overflow
        streak are kept).
        """
        if not self.is_enabled():
            return
        self.scaled_in_step = False
        planned, self._planned = self._planned, None
        if new_scale is not None:
            scale, _ = self._scale_and_tracker("update")
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                if (new_scale.device.type != scale.device.type or new_scale.numel() != 1
                        or new_scale.requires_grad):
                    raise ValueError(
                        "new_scale should be a float or a 1-element tensor on the scale's "
                        "device with requires_grad=False."
                    )
                scale.copy_(new_scale)
            self._step_records = {}
            return
        if planned is None:
            self.plan_update()
            planned, self._planned = self._planned, None
        new, tracker, streak = planned
        self._loss_scale.copy_(new)
        self._good_steps.copy_(tracker)
        self._streak_tensor().copy_(streak)
        self._step_records = {}

    def _streak_tensor(self) -> torch.Tensor:
        """Overflows in a row, on the scale's device (created lazily, like
        the growth tracker)."""
        streak = self._streak
        scale = self._loss_scale
        device = scale.device if scale is not None else torch.device(self._ampnet_device)
        if streak is None or streak.device != device:
            start = streak.item() if isinstance(streak, torch.Tensor) else self._overflow_count
            streak = self._streak = torch.full((), int(start), dtype=torch.int32, device=device)
        return streak

    @property
    def _overflow_streak(self) -> int:
        """Overflows in a row so far (reads the device)."""
        streak = self._streak
        return int(streak.item()) if isinstance(streak, torch.Tensor) else self._overflow_count

    @_overflow_streak.setter
    def _overflow_streak(self, value: int) -> None:
        self._overflow_count = int(value)
        self._streak = None

    def to_device_type(self, device_type: str) -> None:
        """Re-target the scaler, e.g. after a CUDA net was loaded on a CPU."""
        self._ampnet_device = device_type
        for name in ("_loss_scale", "_good_steps", "_streak"):
            value = self.__dict__.get(name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device_type))
        self._step_records = {
            key: {**record, "found_inf": record["found_inf"].to(device_type)}
            for key, record in self._step_records.items()
        }
        self._planned = None

    # ---- state ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state (the same keys) plus the bounds, hysteresis and
        static mode.

        Empty for a disabled scaler, as in torch.
        """
        if not self.is_enabled():
            return {}
        settings = self._ampnet_settings
        return {
            "scale": self.get_scale(),
            "growth_factor": settings["growth_factor"],
            "backoff_factor": settings["backoff_factor"],
            "growth_interval": settings["growth_interval"],
            "_growth_tracker": self._growth_tracker_value(),
            "min_scale": settings["min_scale"],
            "max_scale": settings["max_scale"],
            "hysteresis": settings["hysteresis"],
            "dynamic": settings["dynamic"],
            "_overflow_streak": self._overflow_streak,
            "ampnet_scaler_version": STATE_VERSION,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate, then load. A state of plain torch's GradScaler loads
        too (the ampnet-only settings are then left as they are).

        Raises
        ------
        ValueError
          See ``validate_scaler_state``.
        """
        if not self.is_enabled():
            return
        validate_scaler_state(state_dict)
        scale = as_float(state_dict["scale"])
        tracker = int(state_dict["_growth_tracker"])
        self._start_scale, self._start_good_steps = scale, tracker
        if self._loss_scale is not None:
            self._loss_scale.fill_(scale)
            self._good_steps.fill_(tracker)
        settings = self._ampnet_settings
        for name in ("growth_factor", "backoff_factor", "growth_interval",
                     "min_scale", "max_scale", "hysteresis", "dynamic"):
            if name in state_dict:
                settings[name] = cast_setting(name, state_dict[name])
        if "_overflow_streak" in state_dict:
            self._overflow_streak = int(state_dict["_overflow_streak"])

    def __getstate__(self) -> dict[str, Any]:
        # the per-step record is keyed by id(optimizer) and means nothing in
        # a copy, so a copy starts the step afresh with the same scale; the
        # tensors travel as plain values (made again at the first scale())
        state = self.__dict__.copy()
        state.update(_ampnet_settings=dict(self._ampnet_settings), _step_records={}, _planned=None)
        if self.is_enabled():
            state.update(
                _start_scale=self.get_scale(), _start_good_steps=self._growth_tracker_value(),
                _loss_scale=None, _good_steps=None, _overflow_count=self._overflow_streak, _streak=None,
            )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_ampnet_settings" not in state:  # pickled by ampnet 0.3
            own = state_of_0_3(state)
            state = {k: v for k, v in state.items() if k not in ONLY_IN_0_3}
            state.update(own)
        self.__dict__.update(state)


def move_scaler(scaler: torch.amp.GradScaler, device_type: str) -> None:
    """Re-target a scaler in place, e.g. after a CUDA net was loaded on a CPU.

    ``ampnet.GradScaler`` moves its tensors. torch's own scaler is left as it
    is: a pickled one makes its tensors again, on the device of what it
    scales first, and ampnet touches no private state of it.
    """
    if isinstance(scaler, GradScaler):
        scaler.to_device_type(device_type)


def copy_to_device(scaler: GradScaler, device_type: str) -> GradScaler:
    """A deep copy of an ``ampnet.GradScaler`` whose tensors live on ``device_type``.

    A scaler instance is a hyper-parameter: a net trains a copy (``fit``
    must not change it, and clones must not share a training state), and
    the copy follows the net's device, so that ``GradScaler(init_scale=256.)``
    made on a CPU-only machine (or for another device) works on any net.
    (torch's own scalers are copied through their public API:
    ``ampnet.precision.scaler_build.build_scaler``.)
    """
    scaler = copy.deepcopy(scaler)
    scaler.to_device_type(device_type)
    return scaler
