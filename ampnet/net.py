"""``AmpNet`` and its classifier/regressor variants: skorch nets with mixed
precision as a hyper-parameter.

One mixin, :class:`AmpNetMixin`, is put in front of skorch's classes. It
keeps the parameters, builds three components at ``initialize()`` and
overrides each skorch method it needs once, delegating to them:

- ``precision_`` (:class:`ampnet.precision.component.Precision`): every
  dtype decision, loss scaling and the module's precision layout;
- ``parallel_`` (:class:`ampnet.training.parallel.Parallel`): data-parallel training;
- ``amp_step_state_`` (:class:`ampnet.training.step.StepState`): the training step's
  bookkeeping; the step itself is :func:`ampnet.training.step.train_step`.

Building and changing the components (``initialize``, ``set_params``, all or
nothing): the net calls skorch's methods and, around them,
:mod:`ampnet.config.reconfigure` to check and plan, then to apply; the choices of ``'auto'``
:mod:`ampnet.auto`'s (one call at the start of a fit); saving and loading live
in :class:`ampnet.io.persistence.PersistenceMixin`. What each parameter is
(default, check, what a change rebuilds) is :mod:`ampnet.config.params`'s table.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from skorch import NeuralNet
from skorch.classifier import NeuralNetBinaryClassifier, NeuralNetClassifier
from skorch.dataset import unpack_data
from skorch.regressor import NeuralNetRegressor

from ampnet import auto

from ampnet.config import reconfigure
from ampnet.config.net_state import all_or_nothing
from ampnet.config.no_effect import warn_ineffective_settings
from ampnet.training import lean, step as steps
from ampnet.config.docstrings import amp_doc
from ampnet.callbacks.checkpoint import epochs_to_run
from ampnet.diagnostics.doctor_hooks import adapt_recording_hooks
from ampnet.exceptions import amp_warn
from ampnet.utils.warning_site import SITE_ATTRIBUTE, user_site
from ampnet.diagnostics.flight import nonfinite_loss_message
from ampnet.config.net_repr import add_amp_params
from ampnet.training.output_checks import check_loss_inputs, check_loss_value, probabilities_summing_to_one
from ampnet.training.user_inputs import prepare_fit_inputs, prepare_input
from ampnet.serving.conversion import ConversionMixin
from ampnet.diagnostics.reports import ReportsMixin
from ampnet.io.persistence import PersistenceMixin
from ampnet.training.parallel import Parallel
from ampnet.config.params import (
    BUILT_ATTRIBUTE, PARSED_ATTRIBUTE, constructor_defaults, is_auto, is_parsed_name, parsed,
)
from ampnet.training.batches import array_batches
from ampnet.training.records import DeferredHistory
from ampnet.utils.placement import is_on
from ampnet.training.step import all_training
from ampnet.precision import FLOAT8_FIX_INSTALL, NO_CONTEXT, GradScaler, PrecisionLayout, PrecisionPolicy, autocast_dtype_error, kernel_defaults

__all__ = ["AmpNetMixin", "AmpNet", "AmpNetClassifier", "AmpNetRegressor", "AmpNetBinaryClassifier"]


class AmpNetMixin(PersistenceMixin, ConversionMixin, ReportsMixin):
    """Mixed precision for any skorch net; mix it in before the skorch class.

    Adds the parameters described in :class:`AmpNet` and the fitted
    attributes ``precision_`` (with its read-only views
    ``precision_policy_``, ``grad_scaler_``, ``amp_layout_`` and
    ``amp_master_params_``), ``parallel_``, ``amp_step_state_`` and, with
    ``amp_enabled='auto'``, ``amp_autotune_``
    (:class:`ampnet.auto.AutotuneResult`).
    """

    prefixes_ = NeuralNet.prefixes_ + ["grad_scaler", "amp_autotune", "amp_float8"]

    def __init__(
        self,
        *args: Any,
        amp_enabled: bool | str = False,
        amp_dtype: str | torch.dtype = "auto",
        amp_level: str = "mixed",
        amp_master_weights: bool | str = True,
        amp_fp32_modules: Any = None,
        amp_modules: Any = None,
        memory_format: str = "preserve",
        grad_scaler: Any = GradScaler,
        gradient_accumulation_steps: int = 1,
        amp_max_consecutive_skips: int | None = 50,
        amp_skip_nonfinite: bool = True,
        batch_gather: bool = True,
        data_on_device: bool | str | int = "auto",
        distributed: Any = "auto",
        **kwargs: Any,
    ) -> None:
        self.amp_enabled = amp_enabled
        self.amp_dtype = amp_dtype
        self.amp_level = amp_level
        self.amp_master_weights = amp_master_weights
        self.amp_fp32_modules = amp_fp32_modules
        self.amp_modules = amp_modules
        self.memory_format = memory_format
        self.grad_scaler = grad_scaler
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.amp_max_consecutive_skips = amp_max_consecutive_skips
        self.amp_skip_nonfinite = amp_skip_nonfinite
        self.batch_gather = batch_gather
        self.data_on_device = data_on_device
        self.distributed = distributed
        super().__init__(*args, **kwargs)

    # ---- read-only views of the precision component ---------------------

    @property
    def precision_policy_(self) -> PrecisionPolicy:
        """The resolved precision policy (read-only)."""
        return self._component("precision_").policy

    @property
    def grad_scaler_(self) -> GradScaler:
        """The loss scaler (disabled when no loss scaling is used)."""
        return self._component("precision_").scaler

    @property
    def amp_layout_(self) -> PrecisionLayout | None:
        """The module's precision layout (None for nets without ``module_``)."""
        return self._component("precision_").layout

    @property
    def amp_master_params_(self) -> dict[str, torch.nn.Parameter] | None:
        """``'pure'`` with master weights: the float32 master parameters by name."""
        return self._component("precision_").masters

    @property
    def amp_autotune_(self) -> auto.AutotuneResult:
        """``amp_enabled='auto'``'s choice and its record (set by the first
        fit of a net with ``amp_enabled='auto'``)."""
        try:
            return self.__dict__["amp_autotune_"]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__} has no 'amp_autotune_': it is the record of amp_enabled='auto''s choice, "
                f"set by the first fit of a net with amp_enabled='auto' (this one has "
                f"amp_enabled={self.__dict__.get('amp_enabled')!r}).") from None

    @amp_autotune_.setter
    def amp_autotune_(self, result: auto.AutotuneResult) -> None:
        self.__dict__["amp_autotune_"] = result

    @amp_autotune_.deleter
    def amp_autotune_(self) -> None:
        try:
            del self.__dict__["amp_autotune_"]
        except KeyError:
            raise AttributeError("amp_autotune_") from None

    def __setattr__(self, name: str, value: Any) -> None:
        # a parameter set by plain assignment (net.amp_dtype = ...), as scikit-learn allows: the parse
        # that initialize() and set_params made no longer holds, and the next reader parses afresh; an
        # initialized net keeps the parse its components were built from, so that the next set_params
        # or partial_fit rebuilds what the assignment changes (reconfigure.assigned_changes)
        if is_parsed_name(name):
            held = self.__dict__.pop(PARSED_ATTRIBUTE, None)
            if held is not None and self.__dict__.get("initialized_", False):
                self.__dict__.setdefault(BUILT_ATTRIBUTE, held)
        super().__setattr__(name, value)

    def _component(self, name: str) -> Any:
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__} has no {name!r} yet: call initialize() or fit() first."
            ) from None

    # ---- initialization -------------------------------------------------

    def initialize(self) -> "AmpNetMixin":
        """Check every AMP setting, then initialize skorch's components and
        the precision, step and data-parallel components. All or nothing:
        if anything fails, the net is left exactly as it was (an
        initialized net keeps its module, optimizer and precision)."""
        plan = reconfigure.plan_initialize(self)  # every check: nothing has changed when one refuses
        if is_auto(plan.values["amp_enabled"]):
            auto.check_choosable(plan.values)  # what amp_enabled='auto' may choose
        with all_or_nothing(self):
            reconfigure.build_precision(self, plan)
            super().initialize()
            reconfigure.build_training(self)
        warn_ineffective_settings(self)
        return self

    def initialize_grad_scaler(self) -> "AmpNetMixin":
        """Build a new ``grad_scaler_`` from ``grad_scaler`` and the
        ``grad_scaler__*`` parameters (the scale restarts at ``init_scale``)."""
        reconfigure.initialize_grad_scaler(self)
        return self

    def _initialize_module(self, reason: str | None = None) -> "AmpNetMixin":
        reconfigure.detach_layout(self)  # an instance module is reused by skorch
        super()._initialize_module(reason=reason)
        reconfigure.attach_layout(self)
        return self

    def get_params_for_optimizer(self, prefix: str, named_parameters: Any) -> tuple[tuple, dict]:
        """skorch's optimizer arguments; with AMP on, the optimizer's fused
        kernel (else foreach) unless ``fused``/``foreach`` is set (see
        ``ampnet.precision.kernels``)."""
        args, kwargs = super().get_params_for_optimizer(prefix, named_parameters)
        prec = self.__dict__.get("precision_")
        if prec is not None and prec.enabled and args:
            groups = args[0]
            params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
            kwargs = {**kwargs, **kernel_defaults(getattr(self, prefix, None), kwargs, params)}
        return args, kwargs

    def _initialize_optimizer(self, reason: str | None = None) -> "AmpNetMixin":
        super()._initialize_optimizer(reason=reason)
        self.precision_.check_optimizers([(n, getattr(self, n + "_")) for n in self._optimizers])
        state = self.__dict__.get("amp_step_state_")
        if state is not None:
            state.closure = reconfigure.uses_closure(self)
        return self

    # ---- parameters -----------------------------------------------------
    def set_params(self, **kwargs: Any) -> "AmpNetMixin":
        """Set parameters, all or nothing.

        On a fitted net every AMP value is checked before anything changes;
        ``grad_scaler__growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``min_scale``, ``max_scale`` and
        ``hysteresis`` change the live scaler; other scaler settings and the
        precision parameters rebuild it (and the module's precision layout,
        keeping the trained weights) with skorch's re-init message.
        Optimizer settings (``lr``, ``optimizer__momentum``, ...) change the
        live optimizer after the optimizer accepts them, and show in
        ``get_params()``; ``iterator_*`` and ``dataset*`` settings apply
        at the next fit. If anything fails, for any parameter, the net is
        left exactly as it was (``ampnet.config.net_state``).
        """
        try:
            change = reconfigure.plan_change(self, kwargs)  # every check: nothing has changed when one refuses
            if change.values is not None and is_auto(change.values["amp_enabled"]):
                auto.check_choosable(change.values)  # what amp_enabled='auto' may choose
            with all_or_nothing(self):
                if "amp_autotune_" in self.__dict__:  # a choice the change may make stale
                    auto.drop_stale_choice(self, change)
                reconfigure.before_skorch(self, change)
                if change.skorch:
                    super().set_params(**change.skorch)
                reconfigure.apply_change(self, change)
        except ValueError as exc:  # an unknown name: the close valid one, where there is one
            raise reconfigure.with_name_hints(exc, self, kwargs) from exc.__cause__
        return self

    def _validate_params(self) -> None:
        try:
            super()._validate_params()
        except ValueError as exc:  # skorch's "unexpected argument(s)", with the close valid names
            raise reconfigure.with_name_hints(exc, self, self._params_to_validate) from None

    # ---- fitting --------------------------------------------------------

    def partial_fit(self, X, y=None, classes=None, **fit_params):
        X, y = prepare_fit_inputs(self, X, y)  # a pandas DataFrame X, pandas y (ampnet.training.user_inputs)
        if not self.initialized_:
            self.initialize()
        elif BUILT_ATTRIBUTE in self.__dict__:  # set by plain assignment since: built as set_params builds it
            self.set_params(**reconfigure.assigned_changes(self))
        auto.resolve(self, X, y, **fit_params)  # the autos' choices, at the first fit only
        if not is_auto(self.amp_enabled):  # 'auto' measured whether it pays off here
            for notice in self.precision_policy_.notices:
                amp_warn(notice)
        if self.precision_policy_.enabled:
            adapt_recording_hooks(self)  # skorch's SkorchDoctor records float32
        return super().partial_fit(X, y, classes, **fit_params)

    def fit_loop(self, X, y=None, epochs=None, **fit_params):
        if epochs is None:
            epochs = epochs_to_run(self)  # LoadInitState(resume="total")
        with self.parallel_.fitting():
            return super().fit_loop(X, y, epochs=epochs, **fit_params)

    def forward_iter(self, X, training=False, device="cpu"):
        """skorch's ``forward_iter``; a pandas DataFrame ``X`` is read as
        ``fit`` reads it (``ampnet.training.user_inputs``), so ``predict``,
        ``predict_proba`` and ``score`` take what ``fit`` took."""
        return super().forward_iter(prepare_input(self, X), training=training, device=device)

    def get_iterator(self, dataset, training=False):
        """skorch's iterator; for array data with skorch's ``Dataset`` and
        torch's ``DataLoader``, the same batches gathered with one index
        (``batch_gather``: ``ampnet.training.batches.array_batches``)."""
        parallel = self.__dict__.get("parallel_")
        iterator = parallel.iterator(self, dataset, training) if parallel is not None else None
        if iterator is None and parsed(self, "batch_gather"):
            state = self.__dict__.get("amp_step_state_")
            iterator = array_batches(self, dataset, training, state.sources if state is not None else None)
        return iterator if iterator is not None else super().get_iterator(dataset, training=training)

    def run_single_epoch(self, iterator, training, prefix, step_fn, **fit_params):
        """skorch's loop over an epoch's batches, with no host read per batch
        (``ampnet.training.step.epoch_run``): in the lean epoch where it
        applies (``ampnet.training.lean``), then, or else, through skorch's
        protocol (``ampnet.training.step.protocol_batches``)."""
        if iterator is None:
            return
        with steps.epoch_run(self, iterator, training, prefix) as run:
            plan = lean.plan(self, run, training, step_fn, fit_params)
            if plan is not None:  # until a callback changes what the plan rests on
                run.count = lean.run_batches(self, plan, run.batches, run.source, prefix)
            steps.protocol_batches(self, run, training, prefix, step_fn, **fit_params)

    def initialize_history(self):
        """skorch's history, as a ``ampnet.training.records.DeferredHistory``
        (the same rows; values still on the device are written before any read)."""
        if self.history_ is None:
            self.history_ = DeferredHistory()
        else:
            self.history_.clear()
        return self

    @property
    def _default_callbacks(self):
        # train_loss: the mean over the batches whose step was applied (ampnet.training.step.TrainLoss)
        return steps.default_callbacks(super()._default_callbacks)

    # ---- the training step ----------------------------------------------

    def train_step(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """One micro-batch: see :func:`ampnet.training.step.train_step` (in the
        candidate of its step while ``amp_enabled='auto'`` measures)."""
        if self.amp_step_state_.trial is None:
            return steps.train_step(self, batch, **fit_params)
        return auto.train_step(self, steps.train_step, batch, **fit_params)

    def train_step_single(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """Forward and loss in one precision context, then :meth:`backward`."""
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        # infer and get_loss find the context entered; a float32 step of auto's trial enters none
        with NO_CONTEXT if self.amp_step_state_.float32_step else self.precision_.forward_context():
            y_pred = self.infer(Xi, **fit_params)
            loss = self.get_loss(y_pred, yi, X=Xi, training=True)
        self.backward(loss)
        return {"loss": loss, "y_pred": y_pred}

    def _set_training(self, training: bool = True) -> None:
        """skorch's: training or evaluation mode on every module and
        criterion; a step whose modules (and all their submodules) are in
        training mode already calls no ``train()`` (skorch calls it every
        step: the same modes, where ``train()`` sets only the mode)."""
        if training and all_training(self):
            return
        super()._set_training(training)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``: scaled when loss scaling is active and
        divided by ``gradient_accumulation_steps``.

        Call this instead of ``loss.backward()`` in an override of
        ``train_step_single``; an unscaled ``loss.backward()`` while loss
        scaling is active is detected and raises :class:`.AmpStateError`.
        """
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        # under DDP, gradients stay on the module until the step boundary,
        # where DDP all-reduces them; then they move into the masters
        self.precision_.backward(loss, self.__dict__.get("module_"), gather=self.parallel_.ddp is None)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """Step one optimizer: the one place where ampnet steps optimizers.

        Gradients are unscaled and finite when this is called; a step whose
        gradients are not finite never reaches it. Fused optimizers receive
        the overflow flag on the device, as from torch's scaler. ``closure``
        is only passed for optimizers that need one (e.g. LBFGS), which
        ampnet allows only without loss scaling.
        """
        prec = self.precision_
        if closure is None:
            with prec.step_context(optimizer):
                return optimizer.step()
        if not prec.masters:
            return optimizer.step(closure)

        def synced_closure():
            # closure optimizers (LBFGS) evaluate the model between updates
            prec.after_step(self.module_)
            return closure()

        result = optimizer.step(synced_closure)
        prec.after_step(self.module_)
        return result

    def _step_optimizer(self, step_fn: Any) -> None:
        # skorch's closure path (closure optimizers without loss scaling)
        for name in self._optimizers:
            optimizer = getattr(self, name + "_")
            if step_fn is None:
                self.optimizer_step(optimizer)
            else:
                self.optimizer_step(optimizer, closure=step_fn)

    def _zero_grad_optimizer(self, set_to_none=None):
        super()._zero_grad_optimizer(set_to_none=set_to_none)
        self.precision_.zero_grad(self.__dict__.get("module_"))

    def get_all_learnable_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """skorch's learnable parameters; in ``'pure'`` with master weights
        the float32 masters stand in for the low-precision module parameters
        (same names), so the optimizer and ``on_grad_computed`` callbacks
        see float32 tensors."""
        named = super().get_all_learnable_params()
        prec = self.__dict__.get("precision_")
        return prec.learnable(named, self.__dict__.get("module_")) if prec is not None else named

    def validation_step(self, batch, **fit_params):
        return self.parallel_.validation(super().validation_step(batch, **fit_params), batch)

    # ---- forward, loss and outputs ---------------------------------------

    def infer(self, x, **fit_params):
        """Forward pass in the precision context.

        Floating low-precision outputs are returned as float32, so that the
        loss, skorch's caching scorers and ``to_numpy`` see float32. float64
        inputs are cast to float32 for a float32 module, AMP on or off (a
        float64 module keeps them with AMP off).
        """
        prec, parallel = self.precision_, self.parallel_
        x = prec.convert_input(x, self.__dict__.get("module_"), self.device)
        if not prec.enabled and parallel.ddp is None:
            return super().infer(x, **fit_params)
        context = prec.forward_context()
        if context is not NO_CONTEXT and self._float32_step():
            context = NO_CONTEXT
        try:
            if context is NO_CONTEXT and parallel.ddp is None:  # inside a training step's context
                return prec.convert_output(self._skorch_infer(x, fit_params))
            with context, parallel.forward_module(self):
                return prec.convert_output(super().infer(x, **fit_params))
        except RuntimeError as exc:
            error = autocast_dtype_error(exc, x, self.__dict__.get("module_"), prec.policy.name)
            if prec.enabled and error is not None:
                raise error from exc
            raise

    def _float32_step(self) -> bool:
        """Whether ``amp_enabled='auto'`` measures a float32 step now (the
        fit's own state, ``amp_step_state_``, holds it; no autocast then)."""
        state = self.__dict__.get("amp_step_state_")
        return state is not None and state.float32_step

    def _skorch_infer(self, x: Any, fit_params: dict) -> Any:
        """skorch's ``infer`` (the next in the MRO); during a fit where it is
        ``NeuralNet.infer`` and ``x`` a tensor on the device, what it does
        then: call the module."""
        state = self.__dict__.get("amp_step_state_")
        if state is not None and state.plain_infer and type(x) is torch.Tensor and is_on(x, self.device):
            return self.module_(x, **fit_params)
        return super().infer(x, **fit_params)

    def predict_proba(self, X):
        """skorch's ``predict_proba``; for a classifier whose softmax ran in
        bfloat16 or float16, rows renormalized to sum to 1 within float32's
        precision (``ampnet.training.output_checks.probabilities_summing_to_one``)."""
        return probabilities_summing_to_one(self, super().predict_proba(X))

    def get_loss(self, y_pred, y_true, X=None, training=False):
        """Loss in the precision context (from the float32 outputs of :meth:`infer`).

        On the first training batch of a fit, outputs and targets are
        checked for two natural mistakes (logits with ``NLLLoss``, float
        ``y`` for class indices; ``ampnet.training.output_checks``)."""
        state = self.__dict__.get("amp_step_state_")
        if training and state is not None and state.check_loss_inputs:
            state.check_loss_inputs = False
            state.not_probabilities = check_loss_inputs(self, y_pred, y_true)
        context = self.precision_.forward_context()
        if context is not NO_CONTEXT and state is not None and state.float32_step:
            context = NO_CONTEXT  # a float32 step of amp_enabled='auto''s trial
        if context is NO_CONTEXT:  # AMP off, or inside a training step's context
            if (state is not None and state.plain_loss and type(y_true) is torch.Tensor
                    and is_on(y_true, self.device) and not isinstance(self.criterion_, torch.nn.NLLLoss)):
                loss = self.criterion_(y_pred, y_true)  # all that skorch's get_loss does here
            else:
                loss = super().get_loss(y_pred, y_true, X=X, training=training)
        else:
            with context:
                loss = super().get_loss(y_pred, y_true, X=X, training=training)
        if not (type(loss) is torch.Tensor and loss.is_floating_point()):
            check_loss_value(self, loss)
        return loss

    # ---- epochs and callbacks -------------------------------------------

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        super().on_train_begin(net, X=X, y=y, **kwargs)
        steps.begin_fit(self)
        state = self.amp_step_state_
        # skorch's own infer and get_loss next in the MRO (not a subclass's, such as the binary
        # classifier's): on a tensor on the device they only call the module and the criterion
        state.plain_infer = _next_in_mro(type(self), "infer") is NeuralNet.infer
        state.plain_loss = _next_in_mro(type(self), "get_loss") in (NeuralNet.get_loss, NeuralNetClassifier.get_loss)
        # the step's methods ampnet's or skorch's own: the lean epoch may stand for them (ampnet.training.lean)
        state.plain_step = all(_is_own(type(self), name) for name in lean.STEP_METHODS)

    def on_epoch_begin(self, net, dataset_train=None, dataset_valid=None, **kwargs):
        super().on_epoch_begin(net, dataset_train=dataset_train, dataset_valid=dataset_valid, **kwargs)
        steps.begin_epoch(self)
        self.parallel_.begin_epoch(len(self.history))

    def on_epoch_end(self, net, dataset_train=None, dataset_valid=None, **kwargs):
        super().on_epoch_end(net, dataset_train=dataset_train, dataset_valid=dataset_valid, **kwargs)
        steps.record_epoch(self)
        auto.end_epoch(self)

    def on_train_end(self, net, X=None, y=None, **kwargs):
        super().on_train_end(net, X=X, y=y, **kwargs)
        steps.end_fit(self)
        auto.end_fit(self)
        message = nonfinite_loss_message(self)  # the last epoch's training loss is NaN/inf
        if message:
            amp_warn(message)

    def notify(self, method_name: str, **cb_kwargs: Any) -> None:
        getattr(self, method_name)(self, **cb_kwargs)
        state = self.__dict__.get("amp_step_state_")
        parallel = self.__dict__.get("parallel_")
        listeners = state.listeners.get(method_name) if state is not None and state.listeners else None
        if listeners is not None and not state.batch_schedulers and (parallel is None or parallel.ddp is None):
            for cb in listeners:  # a batch event with nothing held, in one process: only who acts on it
                getattr(cb, method_name)(self, **cb_kwargs)
            return
        held: list = []
        if state is not None:
            held = steps.held_callbacks(self, method_name, cb_kwargs)
        if parallel is not None and parallel.ddp is not None:
            held = held + parallel.held_callbacks(self)
            cb_kwargs = parallel.callback_kwargs(method_name, cb_kwargs)
        for cb in (listeners if listeners is not None else [cb for _, cb in self.callbacks_]):
            if held and any(cb is h for h in held):
                continue
            getattr(cb, method_name)(self, **cb_kwargs)
        if parallel is not None:
            parallel.after_notify(self, method_name)

    # ---- the autos' choices in saved files (io.persistence asks) --------------

    def _write_auto_choices(self, state: Any) -> None:
        auto.write_choices(self, state)

    def _plan_auto_choices(self, state: Any, source: str) -> list:
        return auto.plan_choices(self, state, source)

    # ---- pickling and trimming ---------------------------------------------

    def __getstate__(self):
        state = super().__getstate__()
        # where the user sent this net from: a warning in a search's worker
        # process, where no frame is the user's, points there
        site = user_site()
        state[SITE_ATTRIBUTE] = tuple(site) if site is not None else None
        return state

    def __setstate__(self, state):
        # a net pickled by an older ampnet lacks the parameters added since: their defaults
        for name, default in constructor_defaults().items():
            if name not in state:
                state[name] = default
        try:
            super().__setstate__(state)
        except ImportError as exc:  # a float8 net's module holds torchao's Float8Linear
            if not (getattr(exc, "name", None) or "").startswith("torchao"):
                raise
            raise ImportError(
                f"This net was pickled with amp_dtype='float8', whose layers are torchao's, and torchao is not "
                f"installed ({exc}). Fix: {FLOAT8_FIX_INSTALL}, then load it again.") from exc
        # a net pickled on a GPU and loaded where there is none runs on the
        # CPU: its scaler and regions follow
        prec = self.__dict__.get("precision_")
        if prec is not None:
            prec.to_device_type(self.__dict__.get("module_"), torch.device(self.device or "cpu").type)
        if "parallel_" in self.__dict__:
            self.parallel_ = Parallel()

    def __repr__(self) -> str:
        return add_amp_params(super().__repr__(), self)

    def trim_for_prediction(self):
        """skorch's trim; the float32 master weights are dropped as well.

        ``predict_proba``'s nonlinearity is kept: with
        ``predict_nonlinearity='auto'`` skorch infers it from the criterion,
        which the trim removes (softmax would silently become the identity,
        for ``predict_proba`` and for :meth:`export`), so it is resolved
        before the criterion goes.
        """
        if not getattr(self, "_trimmed_for_prediction", False):
            self.check_is_fitted()
            nonlinearity = self._get_predict_nonlinearity()
            super().trim_for_prediction()
            self._trimmed_nonlinearity = nonlinearity
        self.precision_.drop_masters(self.__dict__.get("module_"))

    def _get_predict_nonlinearity(self):
        kept = self.__dict__.get("_trimmed_nonlinearity")
        if kept is not None and isinstance(self.predict_nonlinearity, str) \
                and self.predict_nonlinearity == "auto":
            return kept
        return super()._get_predict_nonlinearity()


def _is_own(cls: type, name: str) -> bool:
    """Whether ``cls``'s method ``name`` is ampnet's or skorch's, not a subclass's."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass is AmpNetMixin or klass.__module__.split(".")[0] == "skorch"
    return False


def _next_in_mro(cls: type, name: str) -> Any:
    """The function ``name`` that ``super()`` in :class:`AmpNetMixin` calls for ``cls``."""
    mro = cls.__mro__
    for klass in mro[mro.index(AmpNetMixin) + 1:]:
        if name in vars(klass):
            return vars(klass)[name]
    return None


class AmpNet(AmpNetMixin, NeuralNet):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNet` with automatic mixed precision.\n\n"
        "    Everything skorch's net takes, plus the parameters below.\n\n    "
        + amp_doc(NeuralNet.__doc__)
    )


class AmpNetClassifier(AmpNetMixin, NeuralNetClassifier):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNetClassifier` with automatic mixed precision.\n\n"
        + amp_doc(NeuralNetClassifier.__doc__)
    )


class AmpNetBinaryClassifier(AmpNetMixin, NeuralNetBinaryClassifier):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNetBinaryClassifier` with automatic mixed precision.\n\n"
        + amp_doc(NeuralNetBinaryClassifier.__doc__)
    )


class AmpNetRegressor(AmpNetMixin, NeuralNetRegressor):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNetRegressor` with automatic mixed precision.\n\n"
        + amp_doc(NeuralNetRegressor.__doc__)
    )
