"""``ampnet.GradScaler``: torch's loss scaler with bounds, hysteresis and
a static mode, validated settings, and state that survives checkpoints and
pickling at any point of a training step."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from ampnet.precision.scaler_checks import (  # noqa: F401  (re-exported)
    FLOAT32_MAX,
    FLOAT32_TINY,
    STATE_VERSION,
    validate_scaler_settings,
    validate_scaler_state,
)

__all__ = [
    "GradScaler", "validate_scaler_settings", "validate_scaler_state", "move_scaler",
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


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaler for float16 training, a subclass of
    :class:`torch.amp.GradScaler`.

    On top of torch's scaler it keeps the scale within ``[min_scale,
    max_scale]`` (it never collapses to 0 or grows to inf), can wait for
    ``hysteresis`` overflows in a row before backing off, has a static
    mode, validates its settings with clear errors, and can be pickled or
    deep-copied at any point of a training step.

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
        super().__init__(
            device,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            enabled=bool(enabled),
        )
        # torch stores these only when enabled; keep them always so that a
        # disabled scaler still reports its settings.
        self._init_scale_setting = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._min_scale = float(min_scale)
        self._max_scale = float(max_scale)
        self._hysteresis = int(hysteresis)
        self._dynamic = bool(dynamic)
        self._overflow_streak = 0
        self.scaled_in_step = False

    def __repr__(self) -> str:
        """``GradScaler(device='cpu', init_scale=256.0)``: the device and the
        settings that differ from the defaults."""
        params = inspect.signature(GradScaler.__init__).parameters
        changed = [
            f"{k}={v!r}" for k, v in self.get_settings().items()
            if k not in params or v != params[k].default
        ]
        return f"{type(self).__name__}({', '.join([f'device={self._device!r}', *changed])})"

    # ---- settings -------------------------------------------------------

    def get_settings(self) -> dict[str, Any]:
        """The current settings as a dict of plain Python values."""
        return {
            "init_scale": self._init_scale_setting,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "hysteresis": self._hysteresis,
            "dynamic": self._dynamic,
            "enabled": self._enabled,
        }

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
        ``set_params`` checks them once, in
        ``ampnet.precision.settings.read_settings``)."""
        for name, value in settings.items():
            cast = int if name in ("growth_interval", "hysteresis") else float
            setattr(self, "_" + name, cast(value))
        if self._enabled and self._scale is not None:
            self._scale.clamp_(self._min_scale, self._max_scale)
        elif self._enabled:  # the scale tensor is made at the first scale()
            self._init_scale = min(max(self._init_scale, self._min_scale), self._max_scale)

    # ---- the step -------------------------------------------------------

    def scale(self, outputs):  # type: ignore[override]
        """Multiply by the scale, as in torch; also records that a loss was
        scaled in this step, so that a net can detect an unscaled backward."""
        self.scaled_in_step = True
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer, allow_fp16: bool = False) -> None:
        """torch's ``unscale_``; ``allow_fp16=True`` also unscales float16
        gradients in place (``amp_master_weights='compensated'`` keeps
        float16 weights and gradients: values below float16's smallest
        subnormal, 6e-8, become zero once unscaled)."""
        self._allow_fp16 = allow_fp16
        try:
            super().unscale_(optimizer)
        finally:
            self._allow_fp16 = False

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[override]
        allow = allow_fp16 or getattr(self, "_allow_fp16", False)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``unscale_`` found inf/NaN in this optimizer's gradients
        during the current step (False for a disabled scaler). Reads the
        device; a training step uses :meth:`found_inf_tensor` instead."""
        if not self._enabled:
            return False
        return bool(self.found_inf_tensor(optimizer).item())

    def found_inf_tensor(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """This optimizer's overflow flag of the current step as a float32
        tensor on the scale's device (> 0: inf/NaN found), without a host read."""
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:
            raise RuntimeError(
                "GradScaler.found_inf_tensor(): unscale_(optimizer) was not called in this step."
            )
        values = [v.to(self._scale.device, non_blocking=True) for v in found.values()]
        return torch.stack(values).sum() if len(values) > 1 else values[0]

    def plan_update(self) -> torch.Tensor:
        """Compute, on the device and without a host read, the scale that
        :meth:`update` will set for this step's overflow checks; return it.

        :meth:`update` commits the plan; ``update(new_scale=...)`` discards it.
        """
        states = self._per_optimizer_states.values()
        found_infs = [v for state in states for v in state["found_inf_per_device"].values()]
        if not found_infs:
            raise RuntimeError(
                "GradScaler.update(): no inf checks were recorded in this step; call "
                "unscale_(optimizer) or step(optimizer) before update()."
            )
        scale, tracker = self._check_scale_growth_tracker("update")
        found = torch.stack([f.to(scale.device, non_blocking=True) for f in found_infs]).sum()
        overflow = found > 0
        streak = self._streak_tensor()
        dynamic = self._dynamic
        # overflow: reset the tracker; back off once `hysteresis` overflows in a row
        new_streak = torch.where(overflow, streak + 1, torch.zeros_like(streak))
        backoff = overflow & (new_streak >= self._hysteresis) & dynamic
        # no overflow: count good steps; grow after `growth_interval` of them
        good = torch.where(overflow, torch.zeros_like(tracker), tracker + 1)
        grow = ~overflow & (good >= self._growth_interval) & dynamic
        new_scale = torch.where(
            backoff, scale * self._backoff_factor, torch.where(grow, scale * self._growth_factor, scale)
        )
        new_scale = torch.where(
            torch.isfinite(new_scale), new_scale, torch.full_like(new_scale, self._max_scale)
        ).clamp_(self._min_scale, self._max_scale)
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
        if not self._enabled:
            return
        self.scaled_in_step = False
        planned, self._planned = getattr(self, "_planned", None), None
        if new_scale is not None:
            super().update(new_scale)
            return
        if planned is None:
            self.plan_update()
            planned, self._planned = self._planned, None
        scale, tracker, streak = planned
        self._scale.copy_(scale)
        self._growth_tracker.copy_(tracker)
        self._streak_tensor().copy_(streak)
        self._per_optimizer_states = type(self._per_optimizer_states)(
            self._per_optimizer_states.default_factory
        )

    def _streak_tensor(self) -> torch.Tensor:
        """Overflows in a row, on the scale's device (created lazily, like
        torch's growth tracker)."""
        streak = getattr(self, "_streak", None)
        device = self._scale.device if self._scale is not None else torch.device(self._device)
        if streak is None or streak.device != device:
            start = streak.item() if isinstance(streak, torch.Tensor) else self._overflow_count
            streak = self._streak = torch.full((), int(start), dtype=torch.int32, device=device)
        return streak

    @property
    def _overflow_streak(self) -> int:
        """Overflows in a row so far (reads the device)."""
        streak = getattr(self, "_streak", None)
        return int(streak.item()) if isinstance(streak, torch.Tensor) else self._overflow_count

    @_overflow_streak.setter
    def _overflow_streak(self, value: int) -> None:
        self._overflow_count = int(value)
        self._streak = None

    def to_device_type(self, device_type: str) -> None:
        """Re-target the scaler, e.g. after a CUDA net was loaded on a CPU."""
        self._device = device_type
        for name in ("_scale", "_growth_tracker", "_streak"):
            value = getattr(self, name, None)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device_type))

    # ---- state ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state plus the bounds, hysteresis and static mode.

        Empty for a disabled scaler, as in torch.
        """
        state = super().state_dict()
        if not state:
            return state
        state.update(
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            hysteresis=self._hysteresis,
            dynamic=self._dynamic,
            _overflow_streak=self._overflow_streak,
            ampnet_scaler_version=STATE_VERSION,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate, then load. A state of plain torch's GradScaler loads
        too (the ampnet-only settings are then left as they are).

        Raises
        ------
        ValueError
          See ``validate_scaler_state``.
        """
        if not self._enabled:
            return
        validate_scaler_state(state_dict)
        super().load_state_dict(state_dict)
        for name in ("min_scale", "max_scale", "hysteresis", "dynamic", "overflow_streak"):
            key = "_overflow_streak" if name == "overflow_streak" else name
            if key in state_dict:
                cast = {"hysteresis": int, "dynamic": bool, "overflow_streak": int}.get(name, float)
                setattr(self, "_" + name, cast(state_dict[key]))

    def __getstate__(self) -> dict[str, Any]:
        # torch refuses to pickle between unscale_() and update(); the
        # per-step record is keyed by id(optimizer) and means nothing in a
        # copy, so a copy starts the step afresh with the same scale.
        pending = self._per_optimizer_states if self._enabled else None
        if pending:
            self._per_optimizer_states = type(pending)(pending.default_factory)
        try:
            state = super().__getstate__()
        finally:
            if pending:
                self._per_optimizer_states = pending
        # like torch's scale and tracker, the streak travels as a plain value
        state.update(_overflow_count=self._overflow_streak, _streak=None, _planned=None)
        return state


def move_scaler(scaler: torch.amp.GradScaler, device_type: str) -> None:
    """Re-target any torch scaler in place, e.g. after a CUDA net was loaded on a CPU."""
    if getattr(scaler, "_device", device_type) == device_type:
        return
    if isinstance(scaler, GradScaler):
        scaler.to_device_type(device_type)
        return
    scaler._device = device_type
    for name in ("_scale", "_growth_tracker"):
        value = getattr(scaler, name, None)
        if isinstance(value, torch.Tensor):
            setattr(scaler, name, value.to(device_type))


def copy_to_device(scaler: torch.amp.GradScaler, device_type: str) -> torch.amp.GradScaler:
    """A deep copy of ``scaler`` whose tensors live on ``device_type``.

    A scaler instance is a hyper-parameter: a net trains a copy (``fit``
    must not change it, and clones must not share a training state), and
    the copy follows the net's device, so that ``GradScaler(init_scale=256.)``
    made on a CPU-only machine (or for another device) works on any net.
    """
    scaler = copy.deepcopy(scaler)
    move_scaler(scaler, device_type)
    return scaler
