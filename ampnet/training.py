"""The training step under loss scaling: backward, gradient accumulation,
unscaling, skipped-step detection, the optimizer step and its bookkeeping.

:class:`TrainingStepMixin` overrides skorch's ``train_step`` family; it is
mixed into :class:`ampnet.AmpNet` and expects the attributes that
:class:`ampnet.net.AmpNetMixin` initializes (``grad_scaler_``,
``precision_policy_``, ``amp_step_state_``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from skorch.callbacks import LRScheduler
from skorch.utils import TeeGenerator

from ampnet.exceptions import AmpDivergenceError, AmpStateError, amp_warn
from ampnet.utils import grads_are_finite, has_nonfinite, optimizer_params_with_grad

__all__ = ["TrainingStepMixin", "StepState"]


@dataclass
class StepState:
    """Per-fit bookkeeping of the training step (fitted attribute
    ``amp_step_state_``)."""

    micro_batches: int = 0  # micro-batches accumulated since the last real step
    last_batch: bool = False  # the current batch is the last of the epoch
    consecutive_skips: int = 0
    epoch_skips: int = 0
    nonfinite_inputs: int = 0  # skips in the current run of skips caused by bad data
    stepped_batch: frozenset = field(default_factory=frozenset)
    stepped_epoch: set = field(default_factory=set)


def _flag_last(iterator: Iterable[Any], state: StepState) -> Iterator[Any]:
    """Yield from ``iterator``, setting ``state.last_batch`` before the last item."""
    it = iter(iterator)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        state.last_batch = False
        yield current
        current = nxt
    state.last_batch = True
    yield current
    state.last_batch = False


class TrainingStepMixin:
    """The AMP-aware training step (see the class docs of :class:`ampnet.AmpNet`)."""

    # ---- hooks users may override --------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``: scaled when loss scaling is active and
        divided by ``gradient_accumulation_steps``.

        Call this instead of ``loss.backward()`` in an override of
        ``train_step_single``; an unscaled ``loss.backward()`` while loss
        scaling is active is detected and raises :class:`.AmpStateError`.
        """
        steps = self.gradient_accumulation_steps
        if steps > 1:
            loss = loss / steps
        scaler = self.grad_scaler_
        if scaler.is_enabled():
            loss = scaler.scale(loss)
        loss.backward()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Any = None
    ) -> Any:
        """Step one optimizer: the one place where ampnet steps optimizers.

        With loss scaling this goes through ``grad_scaler_.step``; a step
        whose gradients overflowed never reaches this method. ``closure``
        is only passed for optimizers that need one (e.g. LBFGS), which
        ampnet allows only without loss scaling.
        """
        if closure is not None:
            return optimizer.step(closure)
        if self.grad_scaler_.is_enabled():
            return self.grad_scaler_.step(optimizer)
        return optimizer.step()

    # ---- skorch overrides ----------------------------------------------

    def train_step_single(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """Forward and loss under autocast, then :meth:`backward` outside it."""
        from skorch.dataset import unpack_data

        self._set_training(True)
        Xi, yi = unpack_data(batch)
        y_pred = self.infer(Xi, **fit_params)
        loss = self.get_loss(y_pred, yi, X=Xi, training=True)
        self.backward(loss)
        return {"loss": loss, "y_pred": y_pred}

    def _step_optimizer(self, step_fn: Any) -> None:
        # skorch's closure path (used only for closure optimizers such as
        # LBFGS, and only without loss scaling): route through optimizer_step.
        for name in self._optimizers:
            optimizer = getattr(self, name + "_")
            if step_fn is None:
                self.optimizer_step(optimizer)
            else:
                self.optimizer_step(optimizer, closure=step_fn)

    def train_step(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """One micro-batch: zero grads at the start of a real step, forward
        and loss under autocast, scaled backward; at the step boundary
        (every ``gradient_accumulation_steps`` micro-batches and at the end
        of the epoch) unscale once, notify ``on_grad_computed``, step the
        optimizers whose gradients are finite and update the scale once.
        """
        if self.amp_closure_mode_:
            step = super().train_step(batch, **fit_params)
            self.amp_step_state_.stepped_batch = frozenset(self._optimizers)
            self.amp_step_state_.stepped_epoch.update(self._optimizers)
            return step
        state = self.amp_step_state_
        if state.micro_batches == 0:
            self._zero_grad_optimizer()
        boundary = state.micro_batches + 1 >= self.gradient_accumulation_steps or state.last_batch
        with self._micro_batch_context(boundary):
            step = self.train_step_single(batch, **fit_params)
        state.micro_batches += 1
        if boundary:
            self._finish_step(batch)
        else:
            state.stepped_batch = frozenset()
            self._record_step(skipped=False, boundary=False)
        return step

    def run_single_epoch(self, iterator, training, prefix, step_fn, **fit_params):
        if training and iterator is not None and self.gradient_accumulation_steps > 1:
            iterator = _flag_last(iterator, self.amp_step_state_)
        return super().run_single_epoch(iterator, training, prefix, step_fn, **fit_params)

    # ---- the step boundary ---------------------------------------------

    def _finish_step(self, batch: Any) -> None:
        state = self.amp_step_state_
        scaler = self.grad_scaler_
        scaling = scaler.is_enabled()
        if scaling and not getattr(scaler, "scaled_in_step", True):
            raise AmpStateError(
                "Loss scaling is active, but no loss was scaled in this step: an "
                "override of train_step_single probably called loss.backward() "
                "directly, which gives gradients that are wrong by the loss scale. "
                "Fix: call self.backward(loss) (or "
                "self.grad_scaler_.scale(loss).backward()) instead."
            )
        self._amp_grads_ready()
        # (name, optimizer, its parameters with a gradient): an optimizer
        # whose parameters got no gradient in this step is left alone
        active = []
        for name in self._optimizers:
            optimizer = getattr(self, name + "_")
            params = optimizer_params_with_grad(optimizer)
            if params:
                active.append((name, optimizer, params))
        if scaling:
            for _, optimizer, _ in active:
                scaler.unscale_(optimizer)
        if state.micro_batches < self.gradient_accumulation_steps:
            # a short remainder group at the end of the epoch: each
            # micro-batch was divided by the full count; restore the mean
            factor = self.gradient_accumulation_steps / state.micro_batches
            for _, _, params in active:
                torch._foreach_mul_([p.grad for p in params], factor)
        state.micro_batches = 0

        self.notify(
            "on_grad_computed",
            named_parameters=TeeGenerator(self.get_all_learnable_params()),
            batch=batch,
            training=True,
        )

        guard = not scaling and self.amp_skip_nonfinite
        stepped, skipped = [], []
        for name, optimizer, params in active:
            if scaling:
                bad = scaler.found_inf(optimizer)
            elif guard:
                bad = not grads_are_finite(params)
            else:
                bad = False
            if bad:
                skipped.append(name)
            else:
                self.optimizer_step(optimizer)
                stepped.append(name)

        self._amp_after_step()
        # every rank skips together (gradients are synchronized), so the
        # collective inside _any_rank runs on all ranks or on none
        bad_data = bool(skipped) and self._any_rank(has_nonfinite(batch))
        if scaling and active:
            if bad_data:
                # not an fp16 overflow: keep the scale as it was
                scaler.update(new_scale=scaler.get_scale())
            else:
                scaler.update()
        state.stepped_batch = frozenset(stepped)
        state.stepped_epoch.update(stepped)
        self._record_step(skipped=bool(skipped), bad_data=bad_data)

    def _record_step(self, skipped: bool, bad_data: bool = False, boundary: bool = True) -> None:
        """Record the step in the history; at a step boundary, count runs of
        skipped steps (a micro-batch inside an accumulation group is no step
        and neither ends nor extends a run)."""
        state = self.amp_step_state_
        history = self.history
        if self.precision_policy_.enabled or self.grad_scaler_.is_enabled():
            history.record_batch("step_skipped", skipped)
            history.record_batch("loss_scale", self.grad_scaler_.get_scale())
        elif skipped:
            history.record_batch("step_skipped", True)
        if not boundary:
            return
        if not skipped:
            state.consecutive_skips = 0
            state.nonfinite_inputs = 0
            return
        state.consecutive_skips += 1
        state.epoch_skips += 1
        if bad_data:
            state.nonfinite_inputs += 1
            history.record_batch("nonfinite_input", True)
            amp_warn(
                "A training batch holds NaN or inf in its input or target; its "
                "optimizer step was skipped and the loss scale kept (this is bad "
                "data, not a float16 overflow). Clean or impute the data.",
            )
        elif not self.precision_policy_.enabled:
            amp_warn(
                "Non-finite gradients: the optimizer step was skipped so that the "
                "weights stay finite (amp_skip_nonfinite=True).",
            )
        limit = self.amp_max_consecutive_skips
        if limit is not None and state.consecutive_skips >= limit:
            raise AmpDivergenceError(self._divergence_message(state))

    def _divergence_message(self, state: StepState) -> str:
        scaler = self.grad_scaler_
        causes = []
        if state.nonfinite_inputs:
            causes.append(
                f"{state.nonfinite_inputs} of these batches hold NaN or inf in the input "
                "or target data: clean the data"
            )
        causes.append("the learning rate is too high (the loss diverged): lower lr")
        if scaler.is_enabled():
            causes.append(
                f"float16 overflow that backing off cannot fix (scale now "
                f"{scaler.get_scale():g}): try amp_dtype='bfloat16', which has the "
                "range of float32"
            )
        causes.append("a bug in the module or criterion that produces NaN/inf")
        return (
            f"Training stopped: {state.consecutive_skips} optimizer steps in a row were "
            f"skipped because the gradients were not finite "
            f"(amp_max_consecutive_skips={self.amp_max_consecutive_skips}). The weights "
            "are those of the last good step. Likely causes:\n- " + "\n- ".join(causes)
        )

    # ---- bookkeeping around epochs and LR schedulers --------------------

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        super().on_train_begin(net, X=X, y=y, **kwargs)
        # a step interrupted between unscale_() and update() (an exception
        # in a callback, KeyboardInterrupt) must not block the next fit
        scaler = self.grad_scaler_
        if scaler.is_enabled() and scaler._per_optimizer_states:
            scaler._per_optimizer_states.clear()
        if hasattr(scaler, "scaled_in_step"):
            scaler.scaled_in_step = False
        self.amp_step_state_.micro_batches = 0

    def on_epoch_begin(self, net, dataset_train=None, dataset_valid=None, **kwargs):
        super().on_epoch_begin(net, dataset_train=dataset_train, dataset_valid=dataset_valid, **kwargs)
        state = self.amp_step_state_
        state.micro_batches = 0
        state.epoch_skips = 0
        state.stepped_epoch = set()

    def on_epoch_end(self, net, dataset_train=None, dataset_valid=None, **kwargs):
        super().on_epoch_end(net, dataset_train=dataset_train, dataset_valid=dataset_valid, **kwargs)
        state = self.amp_step_state_
        if self.precision_policy_.enabled or self.grad_scaler_.is_enabled():
            self.history.record("loss_scale", self.grad_scaler_.get_scale())
            self.history.record("skipped_steps", state.epoch_skips)
        elif state.epoch_skips:
            self.history.record("skipped_steps", state.epoch_skips)

    def _micro_batch_context(self, boundary: bool) -> Any:
        """Context for one micro-batch's forward and backward; ``boundary``
        says whether an optimizer step follows (the distributed mixin skips
        the gradient all-reduce on the others)."""
        return contextlib.nullcontext()

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any process (one process: the flag)."""
        return flag

    def _held_callbacks(self, method_name: str, cb_kwargs: dict) -> list:
        """Callbacks that must not receive this event: an LRScheduler must
        not advance past an optimizer step that did not happen (skipped for
        overflow, or inside an accumulation group)."""
        if method_name == "on_batch_end":
            if not cb_kwargs.get("training", False) or "optimizer" in self.amp_step_state_.stepped_batch:
                return []
            every = "batch"
        elif method_name == "on_epoch_end":
            if "optimizer" in self.amp_step_state_.stepped_epoch:
                return []
            every = "epoch"
        else:
            return []
        return [
            cb for _, cb in self.callbacks_
            if isinstance(cb, LRScheduler) and cb.step_every == every
        ]

    def notify(self, method_name: str, **cb_kwargs: Any) -> None:
        getattr(self, method_name)(self, **cb_kwargs)
        held = (
            self._held_callbacks(method_name, cb_kwargs)
            if "amp_step_state_" in self.__dict__ else ()
        )
        for _, cb in self.callbacks_:
            if held and any(cb is h for h in held):
                continue
            getattr(cb, method_name)(self, **cb_kwargs)
