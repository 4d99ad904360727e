"""``AmpNet`` and its classifier/regressor variants: skorch nets with mixed
precision as a hyper-parameter."""

from __future__ import annotations

import difflib
import inspect
from numbers import Integral
from typing import Any

import torch
from skorch import NeuralNet
from skorch.classifier import NeuralNetBinaryClassifier, NeuralNetClassifier
from skorch.regressor import NeuralNetRegressor
from skorch.utils import to_tensor

from ampnet.checkpoint import epochs_to_run
from ampnet.devices import check_device
from ampnet.distributed import DistributedMixin
from ampnet.doctor_hooks import adapt_recording_hooks
from ampnet.exceptions import amp_warn
from ampnet.input_dtype import match_module_dtype
from ampnet.net_repr import add_amp_params
from ampnet.no_effect import warn_ineffective_settings
from ampnet.persistence import PersistenceMixin
from ampnet.precision import PrecisionPolicy, _describe, resolve_precision
from ampnet.precision_control import PrecisionControlMixin
from ampnet.scaler import LIVE_SETTINGS, GradScaler, copy_to_device, validate_scaler_settings
from ampnet.training import StepState, TrainingStepMixin
from ampnet.utils import cast_floating, may_use_closure, needs_closure

__all__ = ["AmpNetMixin", "AmpNet", "AmpNetClassifier", "AmpNetRegressor", "AmpNetBinaryClassifier"]

#: Parameters of the training step, checked again when set on a fitted net.
STEP_PARAMS = frozenset({"gradient_accumulation_steps", "amp_max_consecutive_skips", "amp_skip_nonfinite"})

#: Parameters whose change re-resolves the precision policy and the scaler.
PRECISION_PARAMS = ("amp_enabled", "amp_dtype", "amp_level", "device", "grad_scaler")

_TORCH_LIVE_SETTERS = {
    "growth_factor": "set_growth_factor",
    "backoff_factor": "set_backoff_factor",
    "growth_interval": "set_growth_interval",
}

AMP_DOC = """
    amp_enabled : bool (default=False)
      Train and predict with automatic mixed precision. With False the net
      trains as the skorch net it replaces, bitwise, except that a step
      with non-finite gradients is skipped (see ``amp_skip_nonfinite``).

    amp_dtype : str or torch.dtype (default='auto')
      The low-precision dtype: ``'float16'`` (``'fp16'``, ``'half'``),
      ``'bfloat16'`` (``'bf16'``), ``torch.float16``, ``torch.bfloat16``, or
      ``'auto'``: bfloat16 on CPUs and on CUDA GPUs of compute capability
      8.0+, float16 on older GPUs and on MPS. float16 uses loss scaling;
      bfloat16 does not.

    amp_level : str (default='mixed')
      ``'mixed'``: autocast over float32 weights. ``'pure'``: float32
      parameters are stored and computed in the low-precision dtype, except
      those of normalization layers (BatchNorm, LayerNorm, GroupNorm,
      InstanceNorm, RMSNorm) and of ``amp_fp32_modules``; the forward still
      runs under autocast. float16 keeps loss scaling.

    amp_master_weights : bool (default=True)
      With ``'pure'``: the optimizer updates float32 master copies
      (``amp_master_params_``) and the low-precision weights are refreshed
      from them after each step; gradients are accumulated in float32.
      False (bfloat16 only): the optimizer updates the low-precision
      weights directly.

    amp_fp32_modules : selector or list of selectors (default=None)
      Modules that always compute in float32 (inputs cast up, autocast off
      inside, float32 weights in ``'pure'``). A selector is a module class,
      a glob pattern on the qualified module name (``'head'``,
      ``'blocks.*.attn'``) or a compiled regex matching the whole name.

    amp_modules : None, selector or list of selectors (default=None)
      None: the whole model runs in low precision. Otherwise only the
      selected modules do; the rest of the model and the loss run in
      float32. ``amp_fp32_modules`` wins where both select a module.

    memory_format : str (default='preserve')
      ``'channels_last'``: 4-D parameters, buffers and floating inputs use
      ``torch.channels_last`` strides.

    grad_scaler : class or instance (default=ampnet.GradScaler)
      The loss scaler; its settings are set with ``grad_scaler__*``
      parameters (``init_scale``, ``growth_factor``, ``backoff_factor``,
      ``growth_interval``, ``min_scale``, ``max_scale``, ``hysteresis``,
      ``dynamic``, ``enabled``). It is enabled for float16 only, unless
      ``grad_scaler__enabled`` says otherwise.

    gradient_accumulation_steps : int (default=1)
      Micro-batches whose gradients are summed before one optimizer step.
      Each micro-batch loss is divided by this number, so that the step
      matches one large batch.

    amp_max_consecutive_skips : int or None (default=50)
      Raise :class:`ampnet.exceptions.AmpDivergenceError` after this many
      skipped optimizer steps in a row, instead of skipping forever. None
      turns the check off.

    amp_skip_nonfinite : bool (default=True)
      Without loss scaling (bfloat16, or AMP off), skip and record an
      optimizer step whose gradients hold NaN or inf instead of writing
      them into the weights. Not applied on skorch's closure path: to
      optimizers that require a closure (LBFGS) and, without loss scaling,
      to optimizers outside ``torch.optim`` whose ``step`` takes an optional
      closure (an AmpWarning says so).

    distributed : 'auto' or bool (default='auto')
      Data-parallel training with ``torch.distributed``: with an
      initialized process group (``'auto'``) or ``True``, the training
      forward pass runs through ``DistributedDataParallel``, training and
      validation data are split with a ``DistributedSampler``, losses and
      validation predictions are reduced so that every rank has the same
      history, and only rank 0 prints and writes checkpoints.
"""


class AmpNetMixin(PersistenceMixin, PrecisionControlMixin, DistributedMixin, TrainingStepMixin):
    """Mixed precision for any skorch net; mix it in before the skorch class.

    Adds the parameters described in :class:`AmpNet` and the fitted
    attributes ``precision_policy_``, ``grad_scaler_`` and
    ``amp_step_state_``.
    """

    prefixes_ = NeuralNet.prefixes_ + ["grad_scaler"]

    def __init__(
        self,
        *args: Any,
        amp_enabled: bool = False,
        amp_dtype: str | torch.dtype = "auto",
        amp_level: str = "mixed",
        amp_master_weights: bool = True,
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

    # ---- initialization -------------------------------------------------

    def _check_amp_params(self) -> None:
        msgs = []
        steps = self.gradient_accumulation_steps
        if not (isinstance(steps, Integral) and not isinstance(steps, bool) and steps >= 1):
            msgs.append(
                f"gradient_accumulation_steps must be an int >= 1; got {_describe(steps)}."
            )
        limit = self.amp_max_consecutive_skips
        if limit is not None and not (
            isinstance(limit, Integral) and not isinstance(limit, bool) and limit >= 1
        ):
            msgs.append(
                f"amp_max_consecutive_skips must be None or an int >= 1; got {_describe(limit)}."
            )
        if not isinstance(self.amp_skip_nonfinite, bool):
            msgs.append(
                f"amp_skip_nonfinite must be True or False; got {_describe(self.amp_skip_nonfinite)}."
            )
        scaler = self.grad_scaler
        if not (
            isinstance(scaler, torch.amp.GradScaler)
            or (isinstance(scaler, type) and issubclass(scaler, torch.amp.GradScaler))
        ):
            msgs.append(
                "grad_scaler must be a torch.amp.GradScaler subclass or instance, such as "
                f"ampnet.GradScaler; got {_describe(scaler)}."
            )
        if msgs:
            raise ValueError("\n".join(msgs))

    def initialize_precision(self) -> "AmpNetMixin":
        """Resolve ``precision_policy_`` from ``amp_enabled``,
        ``amp_dtype`` and ``device``."""
        self._check_amp_params()
        check_device(self.device)
        self.precision_policy_: PrecisionPolicy = resolve_precision(
            self.amp_enabled, self.amp_dtype, self.device, self.amp_level
        )
        return self

    def _scaler_kwargs(self) -> dict[str, Any]:
        kwargs = self.get_params_for("grad_scaler")
        cls = self.grad_scaler if isinstance(self.grad_scaler, type) else type(self.grad_scaler)
        valid = _init_param_names(cls, exclude=("self", "device"))
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, valid, n=1)
                hints.append(f"grad_scaler__{key}" + (f" (did you mean grad_scaler__{close[0]}?)" if close else ""))
            raise ValueError(
                f"Unknown loss-scaler parameter(s): {', '.join(hints)}. Valid parameters of "
                f"{cls.__name__} are: {', '.join('grad_scaler__' + v for v in valid)}."
            )
        defaults = {
            name: p.default for name, p in inspect.signature(cls).parameters.items()
            if name in ("init_scale", "min_scale", "max_scale") and p.default is not p.empty
        }
        validate_scaler_settings(**{**defaults, **{k: v for k, v in kwargs.items() if k != "enabled"}})
        if "enabled" in kwargs:
            validate_scaler_settings(enabled=kwargs["enabled"])
        return kwargs

    def initialize_grad_scaler(self) -> "AmpNetMixin":
        """Build ``grad_scaler_``: enabled for float16 (unless
        ``grad_scaler__enabled`` says otherwise), disabled but present
        otherwise."""
        policy = self.precision_policy_
        kwargs = self._scaler_kwargs()
        forced = kwargs.pop("enabled", None)
        if forced and not policy.enabled:
            raise ValueError(
                "grad_scaler__enabled=True needs amp_enabled=True: loss scaling protects "
                "low-precision gradients and does nothing for float32 training. Fix: set "
                "amp_enabled=True, or drop grad_scaler__enabled."
            )
        enabled = policy.uses_scaler if forced is None else forced
        scaler = self.grad_scaler
        if isinstance(scaler, torch.amp.GradScaler):
            if scaler.is_enabled() and not policy.uses_scaler and forced is None:
                raise ValueError(
                    f"An enabled grad_scaler instance was passed, but {policy.name} "
                    "training uses no loss scaling (bfloat16 has the range of float32). "
                    "Fix: pass grad_scaler=ampnet.GradScaler (the class), or force scaling "
                    "with grad_scaler__enabled=True."
                )
            if kwargs or forced is not None:
                scaler = type(scaler)(device=policy.device_type, enabled=enabled, **kwargs)
            else:
                scaler = copy_to_device(scaler, policy.device_type)
        else:
            scaler = scaler(device=policy.device_type, enabled=enabled, **kwargs)
        if policy.uses_scaler and not scaler.is_enabled():
            amp_warn(
                "float16 training without loss scaling (grad_scaler__enabled=False): "
                "small gradients underflow to zero in float16.",
            )
        self.grad_scaler_ = scaler
        return self

    def _initialize_grad_scaler(
        self, reason: str | None = None, reinit: bool | None = None
    ) -> "AmpNetMixin":
        with self._current_init_context("grad_scaler"):
            kwargs = {"grad_scaler__" + k: v for k, v in self.get_params_for("grad_scaler").items()}
            reinit = self.initialized_ if reinit is None else reinit
            if reinit and self.verbose and (reason or kwargs):
                print(reason or self._format_reinit_msg("grad_scaler", kwargs))
            self.initialize_grad_scaler()
            return self

    def _check_optimizers(self) -> None:
        """Choose skorch's closure path or ampnet's step, or refuse.

        Optimizers that require a closure (LBFGS) take skorch's closure path,
        which loss scaling and gradient accumulation cannot share. Without
        loss scaling, custom optimizers (outside ``torch.optim``) whose step
        takes an optional closure keep skorch's path too, so that they get
        the closure as in skorch.
        """
        optimizers = {
            n: getattr(self, n + "_", None) for n in self._optimizers
            if getattr(self, n + "_", None) is not None
        }
        closure = [n for n, opt in optimizers.items() if needs_closure(opt)]
        if not closure:
            optional = [n for n, opt in optimizers.items() if may_use_closure(opt)]
            self.amp_closure_mode_ = bool(
                optional and not self.grad_scaler_.is_enabled() and self.gradient_accumulation_steps == 1
            )
            if self.amp_closure_mode_ and self.amp_skip_nonfinite:
                names = ", ".join(f"{n} ({type(optimizers[n]).__name__})" for n in optional)
                amp_warn(
                    f"Optimizer {names} takes an optional closure, so ampnet steps it through "
                    "skorch's closure path, as skorch does: the non-finite guard "
                    "(amp_skip_nonfinite), step_skipped records and LR-scheduler holding do not "
                    "apply to it. Set amp_skip_nonfinite=False to accept this, or use an "
                    "optimizer from torch.optim.",
                )
            return
        self.amp_closure_mode_ = True
        names = ", ".join(f"{n} ({type(optimizers[n]).__name__})" for n in closure)
        if self.grad_scaler_.is_enabled():
            raise ValueError(
                f"Optimizer {names} needs a closure, which cannot be combined with float16 "
                "loss scaling: every closure evaluation would see scaled gradients and "
                "only the first would be checked for overflow. Fix: use "
                "amp_dtype='bfloat16' (no loss scaling), amp_enabled=False, or a "
                "first-order optimizer such as torch.optim.Adam."
            )
        if self.gradient_accumulation_steps > 1:
            raise ValueError(
                f"Optimizer {names} needs a closure, which cannot be combined with "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}. Fix: "
                "set gradient_accumulation_steps=1."
            )

    def initialize(self) -> "AmpNetMixin":
        """Initialize all components, the precision policy and the scaler."""
        was_initialized = self.initialized_
        with self._current_init_context("precision"):
            self.initialize_precision()
        super().initialize()
        self._initialize_grad_scaler(reinit=was_initialized)
        self._check_optimizers()
        self.amp_step_state_ = StepState()
        with self._current_init_context("distributed"):
            self.initialize_distributed()
        warn_ineffective_settings(self)
        return self

    def _initialize_optimizer(self, reason: str | None = None) -> "AmpNetMixin":
        super()._initialize_optimizer(reason=reason)
        if getattr(self, "grad_scaler_", None) is not None:
            self._check_optimizers()
        return self

    # ---- parameters -----------------------------------------------------

    def set_params(self, **kwargs: Any) -> "AmpNetMixin":
        """Set parameters; ``grad_scaler__growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``min_scale``, ``max_scale``
        and ``hysteresis`` change the live scaler; other scaler settings and
        the precision parameters rebuild it with a message."""
        # grad_scaler and grad_scaler__* are ampnet's to handle: skorch would
        # treat the "grad_scaler" prefix as a module and refuse it
        own = {k: v for k, v in kwargs.items() if k == "grad_scaler" or k.startswith("grad_scaler__")}
        others = {k: v for k, v in kwargs.items() if k not in own}
        if others:
            super().set_params(**others)
        for key, val in own.items():
            setattr(self, key, val)
        if not self.initialized_:
            return self
        scaler_kw = {k: v for k, v in own.items() if k != "grad_scaler"}
        changed = sorted(k for k in {**others, **own} if k in PRECISION_PARAMS)
        if changed:
            self._check_amp_params()
            self.initialize_precision()
            reason = self._format_reinit_msg("grad_scaler", dict.fromkeys(changed + sorted(scaler_kw)))
            self._initialize_grad_scaler(reason=reason)
            self._check_optimizers()
        elif scaler_kw:
            self._set_scaler_params(scaler_kw)
        if STEP_PARAMS & set(others):
            self._check_amp_params()
            self._check_optimizers()
        return self

    def _set_scaler_params(self, scaler_kw: dict[str, Any]) -> None:
        names = {k.split("__", 1)[1]: v for k, v in scaler_kw.items()}
        scaler = self.grad_scaler_
        if isinstance(scaler, GradScaler) and set(names) <= set(LIVE_SETTINGS):
            self._scaler_kwargs()  # validates the merged settings with their names
            scaler.set_settings(**names)
        elif set(names) <= set(_TORCH_LIVE_SETTERS) and scaler.is_enabled():
            self._scaler_kwargs()
            for name, value in names.items():
                getattr(scaler, _TORCH_LIVE_SETTERS[name])(value)
        else:
            self._initialize_grad_scaler(
                reason=self._format_reinit_msg("grad_scaler", scaler_kw)
            )
            self._check_optimizers()

    # ---- fitting --------------------------------------------------------

    def partial_fit(self, X, y=None, classes=None, **fit_params):
        if not self.initialized_:
            self.initialize()
        for notice in self.precision_policy_.notices:
            amp_warn(notice)
        if self.precision_policy_.enabled:
            adapt_recording_hooks(self)  # skorch's SkorchDoctor records float32
        return super().partial_fit(X, y, classes, **fit_params)

    def fit_loop(self, X, y=None, epochs=None, **fit_params):
        if epochs is None:
            epochs = epochs_to_run(self)  # LoadInitState(resume="total")
        return super().fit_loop(X, y, epochs=epochs, **fit_params)

    # ---- forward, loss and outputs -------------------------------------

    def infer(self, x, **fit_params):
        """Forward pass under the precision policy's autocast.

        Floating low-precision outputs are returned as float32, so that the
        loss, skorch's caching scorers and ``to_numpy`` see float32. float64
        inputs are cast to float32 for a float32 module, AMP on or off (a
        float64 module keeps them with AMP off).
        """
        policy = self.precision_policy_
        if not policy.enabled:
            x = match_module_dtype(x, getattr(self, "module_", None), self.device)
            return super().infer(x, **fit_params)
        x = cast_floating(to_tensor(x, device=self.device), torch.float32, only=(torch.float64,))
        with policy.autocast():
            try:
                return policy.convert_output(super().infer(x, **fit_params))
            except RuntimeError as exc:
                text = str(exc)
                if "dtype" in text or "scalar type" in text or "type (" in text:
                    raise TypeError(
                        f"The module failed under {policy.name} autocast with an input of "
                        f"dtype {_dtypes_of(x)}: {text}. Fix: pass float32 features "
                        "(e.g. X.astype(numpy.float32)); integer inputs only suit layers "
                        "such as nn.Embedding."
                    ) from exc
                raise

    def get_loss(self, y_pred, y_true, X=None, training=False):
        """Loss under autocast (from the float32 outputs of :meth:`infer`)."""
        policy = self.precision_policy_
        if not policy.enabled:
            return super().get_loss(y_pred, y_true, X=X, training=training)
        with policy.autocast():
            return super().get_loss(y_pred, y_true, X=X, training=training)

    def __repr__(self) -> str:
        return add_amp_params(super().__repr__(), self)

    # ---- pickling -------------------------------------------------------

    def __setstate__(self, state):
        super().__setstate__(state)
        policy = self.__dict__.get("precision_policy_")
        if policy is not None and policy.enabled:
            device_type = torch.device(self.device or "cpu").type
            if device_type != policy.device_type:
                self.precision_policy_ = resolve_precision(
                    self.amp_enabled, self.amp_dtype, self.device, self.amp_level
                )


def _init_param_names(cls: type, exclude: tuple[str, ...] = ()) -> list[str]:
    """Keyword parameters of ``cls(...)``, following ``**kwargs`` up the MRO."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names + list(exclude):
                names.append(p.name)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _dtypes_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.dtype)
    if isinstance(x, dict):
        return str({k: _dtypes_of(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return str([_dtypes_of(v) for v in x])
    return type(x).__name__


def _amp_doc(cls_doc: str | None) -> str:
    doc = cls_doc or ""
    marker = "    Attributes\n    ----------"
    if marker in doc:
        head, tail = doc.split(marker, 1)
        return head.rstrip() + "\n" + AMP_DOC + "\n" + marker + tail
    return doc + AMP_DOC


class AmpNet(AmpNetMixin, NeuralNet):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNet` with automatic mixed precision.\n\n"
        "    Everything skorch's net takes, plus the parameters below.\n"
        + _amp_doc(NeuralNet.__doc__)
    )


class AmpNetClassifier(AmpNetMixin, NeuralNetClassifier):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNetClassifier` with automatic mixed precision.\n\n"
        + _amp_doc(NeuralNetClassifier.__doc__)
    )


class AmpNetBinaryClassifier(AmpNetMixin, NeuralNetBinaryClassifier):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNetBinaryClassifier` with automatic mixed precision.\n\n"
        + _amp_doc(NeuralNetBinaryClassifier.__doc__)
    )


class AmpNetRegressor(AmpNetMixin, NeuralNetRegressor):
    __doc__ = (
        "skorch's :class:`skorch.NeuralNetRegressor` with automatic mixed precision.\n\n"
        + _amp_doc(NeuralNetRegressor.__doc__)
    )
