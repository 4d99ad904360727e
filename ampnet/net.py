"""``AmpNet`` and its classifier/regressor variants: skorch nets with mixed
precision as a hyper-parameter.

One mixin, :class:`AmpNetMixin`, is put in front of skorch's classes. It
keeps the parameters, builds three components at ``initialize()`` and
overrides each skorch method it needs once, delegating to them:

- ``precision_`` (:class:`ampnet.precision.component.Precision`): every
  dtype decision, loss scaling and the module's precision layout;
- ``parallel_`` (:class:`ampnet.parallel.Parallel`): data-parallel training;
- ``amp_step_state_`` (:class:`ampnet.step.StepState`): the training step's
  bookkeeping; the step itself is :func:`ampnet.step.train_step`.

Saving and loading live in :class:`ampnet.io.persistence.PersistenceMixin`.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from skorch import NeuralNet
from skorch.classifier import NeuralNetBinaryClassifier, NeuralNetClassifier
from skorch.dataset import unpack_data
from skorch.regressor import NeuralNetRegressor

from ampnet import step as steps
from ampnet._docs import amp_doc
from ampnet.callbacks.checkpoint import epochs_to_run
from ampnet.doctor_hooks import adapt_recording_hooks
from ampnet.exceptions import amp_warn
from ampnet.warning_site import SITE_ATTRIBUTE, user_site
from ampnet.flight import nonfinite_loss_message
from ampnet.net_repr import add_amp_params
from ampnet.net_state import all_or_nothing
from ampnet.output_checks import check_loss_inputs
from ampnet.conversion import ConversionMixin
from ampnet.io.persistence import PersistenceMixin
from ampnet.parallel import Parallel, build_parallel
from ampnet.precision import resolve_auto_fp32
from ampnet.precision import (
    AutotuneResult, autotune_settings, effective_params, is_auto, read_saved_choice, run_probe,
)
from ampnet.precision import Precision, build_scaler
from ampnet.precision import COMPENSATION_KEY, compensation_of
from ampnet.precision import check_device
from ampnet.precision import autocast_dtype_error
from ampnet.precision import kernel_defaults, keep_kernels
from ampnet.precision import warn_ineffective_settings
from ampnet.precision import PrecisionLayout
from ampnet.precision import PrecisionPolicy
from ampnet.precision import LIVE_SETTINGS, GradScaler
from ampnet.precision import PRECISION_PARAMS, read_settings

__all__ = ["AmpNetMixin", "AmpNet", "AmpNetClassifier", "AmpNetRegressor", "AmpNetBinaryClassifier"]

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


class AmpNetMixin(PersistenceMixin, ConversionMixin):
    """Mixed precision for any skorch net; mix it in before the skorch class.

    Adds the parameters described in :class:`AmpNet` and the fitted
    attributes ``precision_`` (with its read-only views
    ``precision_policy_``, ``grad_scaler_``, ``amp_layout_`` and
    ``amp_master_params_``), ``parallel_``, ``amp_step_state_`` and, with
    ``amp_enabled='auto'``, ``amp_autotune_``
    (:class:`ampnet.precision.autotune.AutotuneResult`).
    """

    prefixes_ = NeuralNet.prefixes_ + ["grad_scaler", "amp_autotune"]

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

    def _component(self, name: str) -> Any:
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__} has no {name!r} yet: call initialize() or fit() first."
            ) from None

    # ---- initialization -------------------------------------------------

    def precision_params(self, **changes: Any) -> dict[str, Any]:
        """The precision parameters the net trains with, after ``changes``:
        ``amp_enabled='auto'`` stands for its choice (float32 before it, or
        when ``changes`` drop it; see ``ampnet.precision.autotune``).

        Part of the protocol that ``ampnet.precision`` calls on the net
        (it calls no private method of the net); not a user API.
        """
        params = {name: getattr(self, name) for name in PRECISION_PARAMS + steps.STEP_PARAMS}
        params.update({"grad_scaler__" + k: v for k, v in self.get_params_for("grad_scaler").items()})
        params.update(changes)
        choice = None if AUTOTUNE_INPUTS.intersection(changes) else self.__dict__.get("amp_autotune_")
        return effective_params(params, choice)

    def initialize(self) -> "AmpNetMixin":
        """Check every AMP setting, then initialize skorch's components and
        the precision, step and data-parallel components. All or nothing:
        if anything fails, the net is left exactly as it was (an
        initialized net keeps its module, optimizer and precision)."""
        check_device(self.device)
        params = self.precision_params()
        settings = read_settings(params)
        steps.check_step_params(params)
        if is_auto(self.amp_enabled):
            autotune_settings(self.get_params_for("amp_autotune"))
        with all_or_nothing(self):
            was_initialized = self.initialized_
            with self._current_init_context("grad_scaler"):
                kwargs = {"grad_scaler__" + k: v for k, v in self.get_params_for("grad_scaler").items()}
                if was_initialized and self.verbose and kwargs:
                    print(self._format_reinit_msg("grad_scaler", kwargs))
                old, module = self.__dict__.get("precision_"), self.__dict__.get("module_")
                if old is not None and isinstance(module, torch.nn.Module):
                    old.detach(module)  # float32 again: skorch may reuse the instance
                self.__dict__["precision_"] = Precision.build(settings, self.get_params_for("grad_scaler"))
            if "precision_" not in self.cuda_dependent_attributes_:
                # pickled together with optimizer_, so that the masters stay
                # the optimizer's parameters
                self.cuda_dependent_attributes_ = [*self.cuda_dependent_attributes_, "precision_"]
            self.__dict__.pop("amp_step_state_", None)
            super().initialize()
            self.amp_step_state_ = steps.StepState(closure=self._uses_closure())
            with self._current_init_context("parallel"):
                self.parallel_ = build_parallel(self, self.amp_step_state_.closure)
        warn_ineffective_settings(self)
        return self

    def initialize_grad_scaler(self) -> "AmpNetMixin":
        """Build a new ``grad_scaler_`` from ``grad_scaler`` and the
        ``grad_scaler__*`` parameters (the scale restarts at ``init_scale``)."""
        settings = read_settings(self.precision_params())
        self.precision_.scaler = build_scaler(settings, self.get_params_for("grad_scaler"))
        self.amp_step_state_.scale = None
        self.amp_step_state_.closure = self._uses_closure()
        return self

    def _uses_closure(self) -> bool:
        prec = self.precision_
        return steps.uses_closure(
            self, prec.scaling, prec.settings.skip_nonfinite, self.gradient_accumulation_steps
        )

    def _initialize_module(self, reason: str | None = None) -> "AmpNetMixin":
        prec = self.__dict__.get("precision_")
        module = self.__dict__.get("module_")
        if prec is not None and isinstance(module, torch.nn.Module):
            prec.detach(module)  # an instance module is reused by skorch
        super()._initialize_module(reason=reason)
        if prec is None:
            # skorch's _initialize_module() called on its own
            prec = self.__dict__["precision_"] = Precision.build(
                read_settings(self.precision_params()), self.get_params_for("grad_scaler"))
        module = self.__dict__.get("module_")
        if isinstance(module, torch.nn.Module):
            prec.attach(module, trimmed=getattr(self, "_trimmed_for_prediction", False))
        elif (self.amp_level != "mixed" or self.amp_fp32_modules is not None
              or self.amp_modules is not None or self.memory_format != "preserve"):
            # skorch allows nets without a ``module_`` (custom module names):
            # autocast applies as usual; per-module control has no module to act on
            raise ValueError(
                "amp_level, amp_fp32_modules, amp_modules and memory_format act on "
                "the net's 'module_', which this net does not have. Fix: keep their "
                "defaults, or name the main module 'module_'."
            )
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
            state.closure = self._uses_closure()
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
        left exactly as it was (``ampnet.net_state``).
        """
        # grad_scaler and grad_scaler__* are ampnet's to handle: skorch would
        # treat the "grad_scaler" prefix as a module and refuse it
        own = {k: v for k, v in kwargs.items()
               if k == "grad_scaler" or k.startswith(("grad_scaler__", "amp_autotune__"))}
        others = {k: v for k, v in kwargs.items() if k not in own}
        if not self.initialized_:
            with all_or_nothing(self):
                super().set_params(**others)
                self.__dict__.update(own)
            return self
        # every check first: nothing has changed when one refuses
        if "device" in kwargs:
            check_device(kwargs["device"])
        params = self.precision_params(**kwargs)
        settings = read_settings(params)
        steps.check_step_params(params)
        if is_auto(kwargs.get("amp_enabled", self.amp_enabled)):
            autotune_settings({**self.get_params_for("amp_autotune"),
                               **{k.split("__", 1)[1]: v for k, v in own.items() if k.startswith("amp_autotune__")}})
        new_optimizer = any(k.split("__")[0] in self._optimizers for k in kwargs)
        # the one Precision of this call; _apply_precision gives it its scaler
        new = Precision(settings, self.precision_.scaler)
        checked = not (getattr(self, "_trimmed_for_prediction", False) or new_optimizer)
        if checked:
            new.check_optimizers([(n, getattr(self, n + "_")) for n in self._optimizers])
        # read at the next fit: skorch re-initializes nothing for them (and
        # refuses them on an initialized net)
        stored = {k: v for k, v in others.items() if k.startswith(STORED_PREFIXES)}
        others = {k: v for k, v in others.items() if k not in stored}
        with all_or_nothing(self):
            if stored:
                vars(self).update(stored)
                self._params_to_validate.update(stored)
                self._validate_params()
            # kept as parameters (skorch's virtual setter forgets them), and
            # before skorch's set_params, so that a re-initialized optimizer has them
            vars(self).update(self._optimizer_settings(others))
            if others:
                super().set_params(**others)
            self._check_optimizers_accept(others)
            self.__dict__.update(own)
            if AUTOTUNE_INPUTS.intersection(kwargs):
                self.__dict__.pop("amp_autotune_", None)  # the next fit probes again
            self._apply_precision(new, sorted(kwargs), checked)
        return self

    def _optimizer_settings(self, changed: dict[str, Any]) -> dict[str, Any]:
        """The ``<optimizer>__<name>`` settings among ``changed`` (not
        ``lr``, which skorch keeps, nor ``param_groups__*``, which are
        no constructor arguments)."""
        return {k: v for k, v in changed.items()
                if any(k.startswith(n + "__") and not k.startswith(n + "__param_groups__")
                       for n in self._optimizers)}

    def _check_optimizers_accept(self, changed: dict[str, Any]) -> None:
        """skorch sets optimizer settings (``lr``, ``optimizer__momentum``)
        in the live optimizer's parameter groups without a check: build each
        changed optimizer afresh, as ``initialize()`` would, so that an
        invalid value raises."""
        if getattr(self, "_trimmed_for_prediction", False):
            return
        for name in self._optimizers:
            if not any(k.startswith(name + "__") or (k == "lr" and name == "optimizer") for k in changed):
                continue
            factory = getattr(self, name, None)
            # a distributed optimizer (ZeroRedundancyOptimizer) talks to its peers when built
            if callable(factory) and not getattr(factory, "__module__", "").startswith("torch.distributed"):
                args, kwargs = self.get_params_for_optimizer(name, self.get_all_learnable_params())
                factory(*args, **kwargs)

    def _apply_precision(self, new: Precision, changed: list[str], checked: bool = False) -> None:
        """Make ``new`` (built by ``set_params`` from the checked settings)
        the net's ``precision_`` after ``changed`` parameters were set on an
        initialized net: give it its scaler (the live one, changed in place,
        or a new one) and the module's layout. Values are not checked again;
        the optimizers are, unless ``checked``."""
        prec, settings = self.precision_, new.settings
        scaler_params = self.get_params_for("grad_scaler")  # the settings' one stored copy (set by now)
        scaler_kw = {k.split("__", 1)[1] for k in changed if k.startswith("grad_scaler__")}
        rebuild_scaler = bool(SCALER_PARAMS.intersection(changed)) or not scaler_kw <= set(LIVE_SETTINGS)
        relayout = bool(LAYOUT_PARAMS.intersection(changed))
        scaler = prec.scaler
        if rebuild_scaler:
            reasons = sorted(k for k in changed if k in SCALER_PARAMS or k.startswith("grad_scaler"))
            if self.verbose:
                print(self._format_reinit_msg("grad_scaler", dict.fromkeys(reasons)))
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
        if not (checked or getattr(self, "_trimmed_for_prediction", False)):  # refuse before the module changes
            new.check_optimizers([(n, getattr(self, n + "_")) for n in self._optimizers])
        if relayout and isinstance(self.__dict__.get("module_"), torch.nn.Module):
            self.relayout_precision(prec, new, [k for k in changed if k in LAYOUT_PARAMS])
        else:
            new.layout, new.masters = prec.layout, prec.masters
        self.__dict__["precision_"] = new
        self.amp_step_state_.scale = None
        self.amp_step_state_.closure = self._uses_closure()

    def relayout_precision(self, old: Precision, new: Precision, changed: list[str]) -> None:
        """Move the fitted module to the new layout, keeping the weights; the
        optimizer is rebuilt (its state carried over where the parameters
        line up) only when low-precision parameters are involved.

        Part of the protocol that ``ampnet.precision`` calls on the net
        (it calls no private method of the net); not a user API.
        """
        trimmed = getattr(self, "_trimmed_for_prediction", False)
        optimizers = [] if trimmed else [getattr(self, n + "_") for n in self._optimizers]
        if not new.take_over(old, self.module_, trimmed, optimizers) or trimmed:
            return  # the same float32 Parameter objects: the optimizer is still right
        states = {n: opt.state_dict() for n, opt in zip(self._optimizers, optimizers)}
        self.__dict__["precision_"] = new
        self._initialize_optimizer(reason=self._format_reinit_msg("optimizer", dict.fromkeys(changed)))
        for name, state in states.items():
            try:
                optimizer = getattr(self, name + "_")
                optimizer.load_state_dict(keep_kernels(optimizer, state))
            except ValueError as exc:
                amp_warn(
                    f"The state of {name} could not be carried over after changing "
                    f"{', '.join(changed)} ({exc}); it starts afresh.")

    # ---- fitting --------------------------------------------------------

    def partial_fit(self, X, y=None, classes=None, **fit_params):
        if not self.initialized_:
            self.initialize()
        # amp_enabled='auto', first fit only (skorch's fit() threads a routing flag through)
        self._autotune(X, y, **{k: v for k, v in fit_params.items() if k != "_routing_method"})
        if not is_auto(self.amp_enabled):  # 'auto' measured whether it pays off here
            for notice in self.precision_policy_.notices:
                amp_warn(notice)
        resolve_auto_fp32(self, X, y, **fit_params)  # amp_fp32_modules='auto', first fit only
        if self.precision_policy_.enabled:
            adapt_recording_hooks(self)  # skorch's SkorchDoctor records float32
        return super().partial_fit(X, y, classes, **fit_params)

    def fit_loop(self, X, y=None, epochs=None, **fit_params):
        if epochs is None:
            epochs = epochs_to_run(self)  # LoadInitState(resume="total")
        with self.parallel_.fitting():
            return super().fit_loop(X, y, epochs=epochs, **fit_params)

    def get_iterator(self, dataset, training=False):
        parallel = self.__dict__.get("parallel_")
        iterator = parallel.iterator(self, dataset, training) if parallel is not None else None
        return iterator if iterator is not None else super().get_iterator(dataset, training=training)

    def run_single_epoch(self, iterator, training, prefix, step_fn, **fit_params):
        if training and iterator is not None and self.gradient_accumulation_steps > 1:
            iterator = steps.flag_last(iterator, self.amp_step_state_)
        return super().run_single_epoch(iterator, training, prefix, step_fn, **fit_params)

    # ---- amp_enabled='auto' -------------------------------------------------

    def _autotune(self, X: Any, y: Any = None, **fit_params: Any) -> None:
        """Choose for ``amp_enabled='auto'`` once: a saved choice of the
        checkpoint that ``LoadInitState`` resumes from, else the probe of
        ``ampnet.precision.autotune``; then train with it."""
        if not is_auto(self.amp_enabled) or "amp_autotune_" in self.__dict__:
            return
        saved = self._resume_choice()
        if saved is not None:
            result = AutotuneResult(params=saved, device=str(self.device), source="loaded")
        else:
            result = run_probe(self, X, y, **fit_params)
            if self.parallel_.world_size > 1:  # every rank trains with rank 0's choice
                shared = [result]
                torch.distributed.broadcast_object_list(shared, src=0)
                result = shared[0]
        self.adopt_autotune(result)
        if self.verbose and result.source == "probe":
            print(result, flush=True)

    def _resume_choice(self) -> dict[str, Any] | None:
        """The choice saved in the parameters of the checkpoint that a
        ``LoadInitState`` callback will load, if any."""
        from skorch.callbacks import LoadInitState as SkorchLoadInitState

        from ampnet.io.files import checkpoint_files

        for _, cb in self.callbacks_:
            if not isinstance(cb, SkorchLoadInitState) or getattr(cb, "use_safetensors", False):
                continue
            try:
                path = checkpoint_files(cb.checkpoint, self).get("f_params")
                if path is None or not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
                    continue
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception:  # no checkpoint yet, or one LoadInitState will refuse
                continue
            choice = read_saved_choice(state)
            if choice is not None:
                return choice
        return None

    def adopt_autotune(self, result: AutotuneResult, carry: bool = True) -> None:
        """Train with ``result``'s choice from now on: the precision component,
        the module's layout and the optimizers become those of a net built
        with these settings (the optimizers' state carried over, with
        ``carry``).

        Part of the protocol that ``ampnet.precision`` calls on the net
        (it calls no private method of the net); not a user API.
        """
        self.__dict__["amp_autotune_"] = result
        settings = read_settings(self.precision_params())
        old, new = self.precision_, Precision.build(settings, self.get_params_for("grad_scaler"))
        trimmed = getattr(self, "_trimmed_for_prediction", False)
        names = [n for n in self._optimizers if isinstance(self.__dict__.get(n + "_"), torch.optim.Optimizer)]
        module = self.__dict__.get("module_")
        # compensation buffers loaded into a float32 net's optimizer (load_params) stay the weights'
        kept = compensation_of([getattr(self, n + "_") for n in names]) if carry and settings.compensated else {}
        if isinstance(module, torch.nn.Module):
            new.take_over(old, module, trimmed, [getattr(self, n + "_") for n in names])
        states = {n: getattr(self, n + "_").state_dict() for n in names if carry and getattr(self, n + "_").state}
        self.__dict__["precision_"] = new
        if not trimmed:
            with self._current_init_context("optimizer"):
                self.initialize_optimizer()
            new.check_optimizers([(n, getattr(self, n + "_")) for n in self._optimizers])
            for name, state in states.items():
                optimizer = getattr(self, name + "_")
                try:
                    optimizer.load_state_dict(keep_kernels(optimizer, state))
                except ValueError as exc:
                    amp_warn(f"The state of {name} could not be carried over to the settings of "
                             f"amp_enabled='auto' ({exc}); it starts afresh.")
            for name in self._optimizers if kept else ():
                optimizer = getattr(self, name + "_")
                for p in (p for group in optimizer.param_groups for p in group["params"]):
                    if id(p) in kept and p in optimizer.state:
                        optimizer.state[p][COMPENSATION_KEY] = kept[id(p)].to(p.dtype)
        # a new step state, as initialize() builds; DDP re-wraps the module by itself
        self.amp_step_state_ = steps.StepState(closure=self._uses_closure())

    def autotune_copy(self, params: dict[str, Any]) -> "AmpNetMixin":
        """A net that trains copies of this net's modules with ``params``
        (for the probe): its own precision, optimizers, history and step
        state, no callbacks, no data parallelism; this net is unchanged.

        Part of the protocol that ``ampnet.precision`` calls on the net
        (it calls no private method of the net); not a user API.
        """
        from skorch.history import History

        from ampnet.precision import module_root

        probe = object.__new__(type(self))
        probe.__dict__.update(self.__dict__)
        d = probe.__dict__
        for name in [*self._modules, *self._criteria]:
            obj = self.__dict__.get(name + "_")
            if isinstance(obj, torch.nn.Module):
                d[name + "_"] = copy.deepcopy(module_root(obj) if name == "module" else obj)
        for name in self._optimizers:
            d[name + "_"] = None
        d.pop("amp_autotune_", None)
        d.update(
            precision_=copy.copy(self.precision_), virtual_params_=dict(self.virtual_params_),
            history_=History(), callbacks_=[], verbose=0, parallel_=Parallel(), _trimmed_for_prediction=False,
            gradient_accumulation_steps=1,  # every probe step is an optimizer step
        )
        probe.adopt_autotune(AutotuneResult(params=dict(params)), carry=False)
        return probe

    # ---- the training step ----------------------------------------------

    def train_step(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """One micro-batch: see :func:`ampnet.step.train_step`."""
        return steps.train_step(self, batch, **fit_params)

    def train_step_single(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """Forward and loss in the precision context, then :meth:`backward`."""
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        y_pred = self.infer(Xi, **fit_params)
        loss = self.get_loss(y_pred, yi, X=Xi, training=True)
        self.backward(loss)
        return {"loss": loss, "y_pred": y_pred}

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
        with prec.forward_context(), parallel.forward_module(self):
            try:
                return prec.convert_output(super().infer(x, **fit_params))
            except RuntimeError as exc:
                error = autocast_dtype_error(exc, x, self.__dict__.get("module_"), prec.policy.name)
                if prec.enabled and error is not None:
                    raise error from exc
                raise

    def get_loss(self, y_pred, y_true, X=None, training=False):
        """Loss in the precision context (from the float32 outputs of :meth:`infer`).

        On the first training batch of a fit, outputs and targets are
        checked for two natural mistakes (logits with ``NLLLoss``, float
        ``y`` for class indices; ``ampnet.output_checks``)."""
        state = self.__dict__.get("amp_step_state_")
        if training and state is not None and state.check_loss_inputs:
            state.check_loss_inputs = False
            check_loss_inputs(self, y_pred, y_true)
        with self.precision_.forward_context():
            loss = super().get_loss(y_pred, y_true, X=X, training=training)
        if not (isinstance(loss, torch.Tensor) and loss.is_floating_point()):
            _refuse_loss(self, loss)
        return loss

    # ---- epochs and callbacks -------------------------------------------

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        super().on_train_begin(net, X=X, y=y, **kwargs)
        # a step interrupted between unscale_() and update() (an exception
        # in a callback, KeyboardInterrupt) must not block the next fit
        scaler = self.grad_scaler_
        if scaler.is_enabled() and scaler._per_optimizer_states:
            scaler._per_optimizer_states.clear()
        if isinstance(scaler, GradScaler):
            scaler.scaled_in_step = False
        state = self.amp_step_state_
        state.micro_batches = 0
        state.check_loss_inputs = True
        state.scale = None
        state.recorder = None  # an AmpMonitor among the callbacks attaches one
        steps.current_scale(self)  # before the first scale(): no read

    def on_epoch_begin(self, net, dataset_train=None, dataset_valid=None, **kwargs):
        super().on_epoch_begin(net, dataset_train=dataset_train, dataset_valid=dataset_valid, **kwargs)
        state = self.amp_step_state_
        state.micro_batches, state.epoch_skips, state.stepped_epoch = 0, 0, set()
        state.bad_input, state.losses = None, []
        self.parallel_.begin_epoch(len(self.history))

    def on_epoch_end(self, net, dataset_train=None, dataset_valid=None, **kwargs):
        super().on_epoch_end(net, dataset_train=dataset_train, dataset_valid=dataset_valid, **kwargs)
        steps.record_epoch(self)

    def on_train_end(self, net, X=None, y=None, **kwargs):
        super().on_train_end(net, X=X, y=y, **kwargs)
        message = nonfinite_loss_message(self)  # the last epoch's training loss is NaN/inf
        if message:
            amp_warn(message)

    def notify(self, method_name: str, **cb_kwargs: Any) -> None:
        getattr(self, method_name)(self, **cb_kwargs)
        parallel = self.__dict__.get("parallel_")
        held: list = []
        if "amp_step_state_" in self.__dict__:
            held = steps.held_callbacks(self, method_name, cb_kwargs)
        if parallel is not None:
            held = held + parallel.held_callbacks(self)
            cb_kwargs = parallel.callback_kwargs(method_name, cb_kwargs)
        for _, cb in self.callbacks_:
            if held and any(cb is h for h in held):
                continue
            getattr(cb, method_name)(self, **cb_kwargs)
        if parallel is not None:
            parallel.after_notify(self, method_name)

    # ---- pickling and trimming ---------------------------------------------

    def __getstate__(self):
        state = super().__getstate__()
        # where the user sent this net from: a warning in a search's worker
        # process, where no frame is the user's, points there
        site = user_site()
        state[SITE_ATTRIBUTE] = tuple(site) if site is not None else None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
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


def _refuse_loss(net: Any, loss: Any) -> None:
    """Raise the TypeError for a criterion that returned no floating tensor."""
    criterion = net.__dict__.get("criterion_")
    if criterion is not None:
        name = type(criterion).__name__
    else:
        name = getattr(getattr(net, "criterion", None), "__name__", "the criterion")
    what = (f"a {type(loss).__name__} of {len(loss)}" if isinstance(loss, (tuple, list))
            else f"a {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
    raise TypeError(
        f"The criterion {name} returned {what} ({str(loss)[:80]}), but get_loss must return "
        "the loss as a floating tensor, which backward() differentiates. Fix: make the "
        "criterion's forward return the loss tensor (e.g. 'return loss', not 'return loss, "
        "parts'; torch operations, not Python numbers), or override get_loss to pick it."
    )


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
