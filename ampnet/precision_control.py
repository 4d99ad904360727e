"""Per-module precision control and pure low-precision training.

:class:`PrecisionControlMixin` implements the net parameters ``amp_level``
(``'pure'``), ``amp_master_weights``, ``amp_fp32_modules``, ``amp_modules``
and ``memory_format``, and the methods :meth:`~PrecisionControlMixin.
convert_for_inference` and :meth:`~PrecisionControlMixin.precision_report`.
It is mixed into :class:`ampnet.AmpNet` (after ``AmpNetMixin``'s own
methods, before the training step and skorch) and expects
``precision_policy_`` to be resolved before the module is initialized.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from skorch.utils import to_tensor

from ampnet.exceptions import amp_warn
from ampnet.layout import PrecisionLayout, plan_layout
from ampnet.master_weights import (
    find_state_hook,
    install_state_hooks,
    make_masters,
    move_grads,
    narrow,
    remove_state_hooks,
    sync_module,
)
from ampnet.precision import parse_amp_dtype
from ampnet.regions import AutocastRegion, install_region, regions_of, remove_regions
from ampnet.selectors import parse_selectors

__all__ = ["PrecisionControlMixin", "MEMORY_FORMATS", "CONTROL_PARAMS"]

#: Accepted values of ``memory_format``.
MEMORY_FORMATS = ("preserve", "channels_last")

#: Parameters whose change on an initialized net rebuilds the layout.
CONTROL_PARAMS = (
    "amp_enabled",
    "amp_dtype",
    "amp_level",
    "amp_master_weights",
    "amp_fp32_modules",
    "amp_modules",
    "memory_format",
)

_MASTERS = "amp_master_params_"


def _channels_last(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.dim() == 4 and x.is_floating_point():
            return x.contiguous(memory_format=torch.channels_last)
        return x
    if isinstance(x, dict):
        return type(x)((k, _channels_last(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_channels_last(v) for v in x)
    return x


class PrecisionControlMixin:
    """Precision control for :class:`ampnet.AmpNet`.

    Parameters
    ----------
    amp_level : str (default='mixed')
      ``'mixed'``: autocast over float32 weights. ``'pure'``: the module's
      float32 parameters are stored (and computed) in the low-precision
      dtype, except those of normalization layers (BatchNorm, LayerNorm,
      GroupNorm, InstanceNorm, RMSNorm) and of ``amp_fp32_modules``; the
      forward still runs under autocast, so ops in autocast's float32 list
      stay float32. float16 keeps loss scaling.

    amp_master_weights : bool (default=True)
      With ``'pure'``, the optimizer updates float32 master copies of the
      low-precision parameters (``amp_master_params_``); gradients are
      accumulated in float32 and the module's weights are refreshed from
      the masters after every step. False: the optimizer updates the
      low-precision weights directly (bfloat16 only; float16 loss scaling
      needs masters).

    amp_fp32_modules : selector or list of selectors (default=None)
      Modules that always compute in float32: their floating inputs are cast
      to float32, autocast is off inside, and their parameters stay float32
      in ``'pure'``. A selector is a ``torch.nn.Module`` subclass, a glob
      pattern on the qualified module name (``'head'``, ``'blocks.*.attn'``)
      or a compiled regex matched against the whole name.

    amp_modules : None, selector or list of selectors (default=None)
      None: the whole model runs in low precision. Otherwise only the
      selected modules do (autocast on inside them, their floating outputs
      cast back to float32); the rest of the model and the loss run in
      float32. ``amp_fp32_modules`` wins where both select a module.

    memory_format : str (default='preserve')
      ``'channels_last'``: the module's 4-D parameters and buffers and
      every 4-D floating input use ``torch.channels_last`` strides.

    Attributes
    ----------
    amp_layout_ : PrecisionLayout
      The resolved layout: float32 regions, low-precision regions and the
      parameters stored in low precision.

    amp_master_params_ : dict or None
      ``'pure'`` with master weights: float32 master parameters by name.

    Notes
    -----
    Precision control applies to ``module_`` (with ``compile=True``, to the
    module inside the compiled wrapper); other modules and the criterion
    keep float32 weights. Regions are forward hooks (the module's
    ``forward`` is never replaced), so the net stays picklable and
    clonable. Buffers are not cast.
    """

    # ---- validation -------------------------------------------------------

    def _check_precision_control_params(self) -> None:
        if not isinstance(self.amp_master_weights, bool):
            raise TypeError(
                f"amp_master_weights must be True or False; got {self.amp_master_weights!r} "
                f"({type(self.amp_master_weights).__name__}). Fix: amp_master_weights=True "
                "(float32 masters, the default) or False."
            )
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(
                f"memory_format must be one of {', '.join(map(repr, MEMORY_FORMATS))}; got "
                f"{self.memory_format!r} ({type(self.memory_format).__name__}). Fix: "
                "memory_format='channels_last' for convolutional models, else 'preserve'."
            )
        parse_selectors(self.amp_fp32_modules, "amp_fp32_modules")
        parse_selectors(self.amp_modules, "amp_modules")
        policy = self.precision_policy_
        forced = self.get_params_for("grad_scaler").get("enabled")
        scaling = policy.uses_scaler if forced is None else forced
        if policy.enabled and policy.level == "pure" and not self.amp_master_weights and scaling:
            raise ValueError(
                "amp_level='pure' with amp_master_weights=False and float16 loss scaling: "
                "the loss scaler cannot unscale float16 gradients in place. Fix: keep "
                "amp_master_weights=True, or use amp_dtype='bfloat16'."
            )

    # ---- layout -------------------------------------------------------------

    def _amp_root(self) -> torch.nn.Module:
        module = self.module_
        return getattr(module, "_orig_mod", module)

    def _amp_apply_layout(self) -> None:
        if not isinstance(getattr(self, "module_", None), torch.nn.Module):
            # skorch allows nets without a ``module_`` (custom module names):
            # autocast applies as usual; per-module control has no module to act on
            if (self.amp_level != "mixed" or self.amp_fp32_modules is not None
                    or self.amp_modules is not None or self.memory_format != "preserve"):
                raise ValueError(
                    "amp_level, amp_fp32_modules, amp_modules and memory_format act on "
                    "the net's 'module_', which this net does not have. Fix: keep their "
                    "defaults, or name the main module 'module_'."
                )
            self.amp_layout_ = None
            setattr(self, _MASTERS, None)
            return
        if getattr(self, "precision_policy_", None) is None:
            self.initialize_precision()  # _initialize_module() called on its own
        root = self._amp_root()
        remove_regions(root)
        remove_state_hooks(root)
        policy = self.precision_policy_
        layout = plan_layout(root, policy, self.amp_fp32_modules, self.amp_modules, self.memory_format)
        if layout.memory_format == "channels_last":
            for t in [*root.parameters(), *root.buffers()]:
                if t.dim() == 4:
                    t.data = t.data.contiguous(memory_format=torch.channels_last)
        for name in layout.fp32_modules:
            install_region(root.get_submodule(name), AutocastRegion(policy.device_type))
        if layout.scoped:
            for name in layout.amp_modules:
                region = AutocastRegion(policy.device_type, policy.compute_dtype)
                install_region(root.get_submodule(name), region)
        masters = None
        if layout.low_precision_params:
            trimmed = getattr(self, "_trimmed_for_prediction", False)
            if self.amp_master_weights and not trimmed:
                masters = make_masters(root, layout.low_precision_params)
            narrow(root, layout.low_precision_params, layout.dtype)
            install_state_hooks(root, layout.low_precision_params, masters)
        if _MASTERS not in self.cuda_dependent_attributes_:
            # pickled together with optimizer_, so both refer to the same tensors
            self.cuda_dependent_attributes_ = [*self.cuda_dependent_attributes_, _MASTERS]
        self.amp_layout_: PrecisionLayout = layout
        setattr(self, _MASTERS, masters)

    def _amp_restore_layout(self) -> None:
        """Undo :meth:`_amp_apply_layout`: no regions, float32 parameters."""
        layout = getattr(self, "amp_layout_", None)
        module = getattr(self, "module_", None)
        if layout is None or not isinstance(module, torch.nn.Module):
            return
        root = self._amp_root()
        remove_regions(root)
        remove_state_hooks(root)
        masters = getattr(self, _MASTERS, None)
        names = layout.low_precision_params
        params = dict(root.named_parameters(remove_duplicate=False))
        for name in names:
            source = masters[name].data if masters else params[name].data
            params[name].data = source.to(torch.float32, copy=True)
        if layout.memory_format == "channels_last":
            for t in [*root.parameters(), *root.buffers()]:
                if t.dim() == 4:
                    t.data = t.data.contiguous()
        self.amp_layout_ = None
        setattr(self, _MASTERS, None)

    def _amp_rebuild(self, changed: list[str]) -> None:
        """Re-plan the layout of the fitted module after a parameter change,
        keeping the weights. The optimizer is rebuilt (its state carried
        over where the parameters line up) only when low-precision
        parameters are involved before or after."""
        old = getattr(self, "amp_layout_", None) or PrecisionLayout()
        trimmed = getattr(self, "_trimmed_for_prediction", False)
        states = {}
        if not trimmed:
            states = {n: getattr(self, n + "_").state_dict() for n in self._optimizers}
        self._amp_restore_layout()
        self._amp_apply_layout()
        if trimmed or not (old.low_precision_params or self.amp_layout_.low_precision_params):
            return  # the same float32 Parameter objects: the optimizer is still right
        self._initialize_optimizer(
            reason=self._format_reinit_msg("optimizer", dict.fromkeys(changed))
        )
        for name, state in states.items():
            try:
                getattr(self, name + "_").load_state_dict(state)
            except ValueError as exc:
                amp_warn(
                    f"The state of {name} could not be carried over after changing "
                    f"{', '.join(changed)} ({exc}); it starts afresh.",
                )

    # ---- skorch overrides: initialization and parameters ------------------

    def initialize(self):
        self._check_precision_control_params()
        return super().initialize()

    def _initialize_module(self, reason=None):
        self._amp_restore_layout()  # an instance module is reused by skorch
        super()._initialize_module(reason=reason)
        self._amp_apply_layout()
        return self

    def set_params(self, **kwargs):
        super().set_params(**kwargs)
        changed = sorted(k for k in kwargs if k in CONTROL_PARAMS)
        if changed and self.initialized_ and getattr(self, "amp_layout_", None) is not None:
            self.initialize_precision()
            self._check_precision_control_params()
            self._amp_rebuild(changed)
        return self

    def get_all_learnable_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Yield skorch's learnable parameters; in ``'pure'`` with master
        weights the float32 masters stand in for the low-precision module
        parameters (same names), so the optimizer and ``on_grad_computed``
        callbacks see float32 tensors."""
        masters = getattr(self, _MASTERS, None)
        if not masters:
            yield from super().get_all_learnable_params()
            return
        params = dict(self._amp_root().named_parameters(remove_duplicate=False))
        by_id = {id(params[n]): m for n, m in masters.items()}
        for name, param in super().get_all_learnable_params():
            yield name, by_id.get(id(param), param)

    def trim_for_prediction(self):
        """skorch's trim; the float32 master weights are dropped as well."""
        super().trim_for_prediction()
        layout = getattr(self, "amp_layout_", None)
        if getattr(self, _MASTERS, None) and layout is not None:
            root = self._amp_root()
            remove_state_hooks(root)
            install_state_hooks(root, layout.low_precision_params, None)
        setattr(self, _MASTERS, None)

    def __setstate__(self, state):
        super().__setstate__(state)
        # a net pickled on a GPU and loaded where there is none runs on the
        # CPU: its regions must toggle the CPU's autocast
        module = self.__dict__.get("module_")
        if isinstance(module, torch.nn.Module):
            device_type = torch.device(self.device or "cpu").type
            for region in regions_of(getattr(module, "_orig_mod", module)).values():
                region.device_type = device_type

    # ---- forward and loss ---------------------------------------------------

    def _amp_scope(self) -> contextlib.AbstractContextManager:
        layout = getattr(self, "amp_layout_", None)
        if layout is not None and layout.scoped:
            # only the amp_modules regions turn autocast on
            return torch.autocast(self.precision_policy_.device_type, enabled=False)
        return contextlib.nullcontext()

    def infer(self, x, **fit_params):
        layout = getattr(self, "amp_layout_", None)
        if layout is None or not (layout.scoped or layout.memory_format == "channels_last"):
            return super().infer(x, **fit_params)
        if layout.memory_format == "channels_last":
            x = _channels_last(to_tensor(x, device=self.device))
        with self._amp_scope():
            return super().infer(x, **fit_params)

    def get_loss(self, y_pred, y_true, X=None, training=False):
        layout = getattr(self, "amp_layout_", None)
        if layout is None or not layout.scoped:
            return super().get_loss(y_pred, y_true, X=X, training=training)
        with self._amp_scope():
            return super().get_loss(y_pred, y_true, X=X, training=training)

    # ---- training step ------------------------------------------------------

    def _zero_grad_optimizer(self, set_to_none=None):
        super()._zero_grad_optimizer(set_to_none=set_to_none)
        masters = getattr(self, _MASTERS, None)
        if masters:
            params = dict(self._amp_root().named_parameters(remove_duplicate=False))
            for name in masters:
                params[name].grad = None

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        masters = getattr(self, _MASTERS, None)
        if masters:
            move_grads(self._amp_root(), masters)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        masters = getattr(self, _MASTERS, None)
        if closure is None or not masters:
            return super().optimizer_step(optimizer, closure)

        def synced_closure():
            # closure optimizers (LBFGS) evaluate the model between updates
            sync_module(self._amp_root(), masters)
            return closure()

        result = super().optimizer_step(optimizer, synced_closure)
        sync_module(self._amp_root(), masters)
        return result

    def _amp_grads_ready(self) -> None:
        """Called at a step boundary after backward, before unscaling."""
        masters = getattr(self, _MASTERS, None)
        if masters:
            move_grads(self._amp_root(), masters)

    def _amp_after_step(self) -> None:
        """Called after the optimizers stepped (or skipped) at a step boundary."""
        masters = getattr(self, _MASTERS, None)
        if masters:
            sync_module(self._amp_root(), masters)

    # ---- persistence ------------------------------------------------------

    @contextlib.contextmanager
    def _amp_params_as(self, params_dtype: Any = "float32") -> Iterator[None]:
        layout = getattr(self, "amp_layout_", None)
        low = layout.dtype if layout is not None else None
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
        module = getattr(self, "module_", None)
        hook = find_state_hook(self._amp_root()) if isinstance(module, torch.nn.Module) else None
        if hook is None or wide:
            yield
            return
        hook.low = True
        try:
            yield
        finally:
            hook.low = False

    def low_precision_state(self) -> contextlib.AbstractContextManager:
        """Context manager: inside it, ``module_.state_dict()`` -- and so
        ``save_params(f_params=...)`` and checkpoints -- hold the weights as
        the module stores them (low precision in ``'pure'``).

        Outside it, a ``'pure'`` net's module state dict holds float32
        weights (its master copies), and ``load_state_dict`` /
        ``load_params`` refresh the masters at full precision from either.

        Examples
        --------
        >>> with net.low_precision_state():
        ...     net.save_params(f_params="weights-bf16.pt")
        """
        return self._amp_params_as("low")

    # ---- conversion and diagnostics ----------------------------------------

    def convert_for_inference(self, dtype: str | torch.dtype = "auto"):
        """Return a copy of this fitted net that predicts with low-precision
        weights; this net is left unchanged.

        The copy is the same net with ``amp_enabled=True``, ``amp_level='pure'``
        and ``amp_dtype=dtype``: parameters are stored in ``dtype`` except
        those of normalization layers and ``amp_fp32_modules``; ``amp_modules``
        is respected. It pickles like any net. ``partial_fit`` continues
        training it as ``'pure'`` (float32 masters are made from this net's
        float32 weights); ``fit`` re-initializes and trains ``'pure'`` from
        scratch, as skorch's ``fit`` always does. Call
        ``trim_for_prediction()`` on the copy to drop the optimizer and the
        masters when it only predicts.

        Parameters
        ----------
        dtype : str or torch.dtype (default='auto')
          ``'auto'``: this net's low-precision dtype when AMP is on, else
          the device default of ``amp_dtype='auto'``; or any ``amp_dtype``
          value.

        Returns
        -------
        net
          The converted, fitted copy.
        """
        self.check_is_fitted()
        policy = self.precision_policy_
        if isinstance(dtype, str) and dtype.strip().lower() == "auto" and policy.enabled:
            dtype = policy.compute_dtype
        parse_amp_dtype(dtype)
        new = copy.deepcopy(self)
        new.amp_enabled, new.amp_dtype, new.amp_level = True, dtype, "pure"
        verbose, new.verbose = new.verbose, 0
        try:
            # what set_params(amp_enabled=..., amp_dtype=..., amp_level=...) does,
            # minus the optimizer check that a trimmed net cannot pass
            new.initialize_precision()
            new._check_precision_control_params()
            new._amp_rebuild(["amp_dtype", "amp_enabled", "amp_level"])
            new._initialize_grad_scaler(reinit=False)
            if not getattr(new, "_trimmed_for_prediction", False):
                new._check_optimizers()
        finally:
            new.verbose = verbose
        return new

    def precision_report(self, X: Any, y: Any = None, *, dtype: Any = None):
        """Run one forward and backward pass on the first batch of ``X`` and
        report, per module, the dtypes and ranges seen.

        The net is left unchanged (gradients, buffers such as BatchNorm
        statistics, the random state and train/eval modes are restored).

        Parameters
        ----------
        X : input data
          Anything ``fit`` accepts; only the first batch is used.

        y : target data or None (default=None)
          Without a target the backward pass uses the sum of the outputs.

        dtype : str, torch.dtype or None (default=None)
          The target low-precision dtype for the range and underflow
          analysis; None: the net's dtype, or the device default when AMP is
          off.

        Returns
        -------
        report : ampnet.report.PrecisionReport
          ``str(report)`` is a text table, ``report.to_dicts()`` a list of
          dicts, ``report.recommended_fp32_modules`` the modules it suggests
          for ``amp_fp32_modules``.
        """
        from ampnet.report import build_report

        if not self.initialized_:
            self.initialize()
        return build_report(self, X, y, dtype)


def _as_dtype(value: Any) -> torch.dtype | None:
    try:
        return parse_amp_dtype(value)
    except (TypeError, ValueError):
        return None
