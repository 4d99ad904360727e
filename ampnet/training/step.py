"""The training step, in one function that reads as the README's list
("What happens in a training step"), and its bookkeeping: gradient
accumulation, skipped steps and their history, divergence, and holding
LR schedulers past steps that did not happen.

:func:`train_step` calls two components of the net: ``precision_``
(:class:`ampnet.precision.component.Precision`: every dtype decision, loss
scaling, the one host read) and ``parallel_``
(:class:`ampnet.training.parallel.Parallel`: DDP's no_sync, loss averaging and the
any-rank decision).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from skorch import NeuralNet
from skorch.callbacks import LRScheduler, PassthroughScoring
from skorch.utils import TeeGenerator

from ampnet.utils.tree import has_nonfinite, nonfinite_flag
from ampnet.exceptions import AmpDivergenceError, AmpStateError, amp_warn

__all__ = [
    "StepState",
    "train_step",
    "uses_closure",
    "held_callbacks",
    "flag_last",
    "begin_fit",
    "begin_epoch",
    "record_epoch",
    "SKIP_CAUSES",
    "skip_cause",
    "TrainLoss",
    "default_callbacks",
]

#: Parameters of the training step.
#: The values of a skipped batch's ``skip_cause`` (see ``skip_cause``).
SKIP_CAUSES = ("overflow", "nonfinite_input", "nonfinite_loss")


@dataclass
class StepState:
    """Bookkeeping of the training step (fitted attribute ``amp_step_state_``).

    ``closure`` says whether optimizers are stepped through skorch's closure
    path (LBFGS, or custom optimizers with an optional closure).
    """

    closure: bool = False
    micro_batches: int = 0  # micro-batches accumulated since the last real step
    last_batch: bool = False  # the current batch is the last of the epoch
    consecutive_skips: int = 0
    epoch_skips: int = 0
    nonfinite_inputs: int = 0  # skips in the current run of skips caused by bad data
    scale: float | None = None  # the loss scale after the last step, as last read
    bad_input: Any = None  # on the device: an earlier micro-batch of this group held NaN/inf
    stepped_batch: frozenset = field(default_factory=frozenset)
    stepped_epoch: set = field(default_factory=set)
    losses: list = field(default_factory=list)  # the group's losses, read only when its step is skipped
    group_rows: list = field(default_factory=list)  # the epoch's batch rows of the current accumulation group
    skipped_rows: set = field(default_factory=set)  # the epoch's batch rows whose step was skipped (TrainLoss)
    recorder: Any = None  # ampnet.diagnostics.flight.FlightRecorder while an AmpMonitor watches the fit
    check_loss_inputs: bool = True  # the fit's first training batch is checked (output_checks)
    not_probabilities: bool = False  # that check warned: outputs are no probabilities under NLLLoss
    trial: Any = None  # ampnet.auto.trial.Trial while amp_enabled='auto' measures or watches its choice


def train_step(net: Any, batch: Any, **fit_params: Any) -> dict[str, Any]:
    """One training micro-batch of ``net``.

    1. zero the gradients at the start of a real step;
    2. forward pass and loss in the precision context, then
    3. backward of the scaled loss (``net.train_step_single``);
    4. at the step boundary: unscale once and check the gradients, on the device;
    5. ``on_grad_computed`` callbacks see the true gradients;
    6. one host read decides; ``optimizer_step`` for each optimizer whose
       gradients are finite;
    7. one scaler update; ``loss_scale`` and ``step_skipped`` into the
       history, and a skipped step's ``skip_cause`` (``skip_cause()``).
    """
    prec, par, state = net.precision_, net.parallel_, net.amp_step_state_
    if state.closure:
        step = NeuralNet.train_step(net, batch, **fit_params)  # skorch's closure path
        state.stepped_batch = frozenset(net._optimizers)
        state.stepped_epoch.update(net._optimizers)
        return step
    # 1. zero the gradients
    if state.micro_batches == 0:
        net._zero_grad_optimizer()
    boundary = state.micro_batches + 1 >= net.gradient_accumulation_steps or state.last_batch
    # 2.-3. forward, loss and scaled backward (no gradient all-reduce inside a group)
    with par.no_sync(boundary):
        step = net.train_step_single(batch, **fit_params)
    state.micro_batches += 1
    step = dict(step, loss=par.mean(step["loss"]))
    state.losses.append(step["loss"].detach())
    row = _batch_row(net)
    if row is not None:
        state.group_rows.append(row)
    if not boundary:
        if prec.scaling or prec.settings.skip_nonfinite:
            # bad data is told apart from an overflow when the step is skipped
            flag = nonfinite_flag(batch)
            if flag is not None:
                state.bad_input = flag if state.bad_input is None else state.bad_input | flag
        state.stepped_batch = frozenset()
        _record(net, skipped=False, boundary=False)
        return step

    # 4. unscale once and check, on the device
    if prec.scaling and not getattr(prec.scaler, "scaled_in_step", True):
        raise AmpStateError(
            "Loss scaling is active, but no loss was scaled in this step: an "
            "override of train_step_single probably called loss.backward() "
            "directly, which gives gradients that are wrong by the loss scale. "
            "Fix: call self.backward(loss) (or "
            "self.grad_scaler_.scale(loss).backward()) instead."
        )
    module = net.__dict__.get("module_")
    prec.gather_grads(module)
    active = _optimizers_with_grads(net)  # an optimizer without gradients is left alone
    flags = prec.check([(opt, params) for _, opt, params in active])
    if state.micro_batches < net.gradient_accumulation_steps:
        # a short remainder group at the end of the epoch: each micro-batch
        # was divided by the full count; restore the mean
        factor = net.gradient_accumulation_steps / state.micro_batches
        for _, _, params in active:
            torch._foreach_mul_([p.grad for p in params], factor)
    state.micro_batches = 0

    # 5. callbacks see the true gradients
    recorder = state.recorder  # ampnet.diagnostics.flight.FlightRecorder while an AmpMonitor watches
    if recorder is not None:
        recorder.grads_computed(active)
    net.notify(
        "on_grad_computed",
        named_parameters=TeeGenerator(net.get_all_learnable_params()),
        batch=batch,
        training=True,
    )

    # 6. the one host read, then step the optimizers with finite gradients
    decision = prec.decide(flags, len(active)) if active else None
    skipped = decision.skipped if decision else ()
    if recorder is not None:
        recorder.before_update(net, active, skipped)
    for (_, optimizer, _), skip in zip(active, skipped):
        if not skip:
            net.optimizer_step(optimizer)
    prec.after_step(module)
    if recorder is not None:
        recorder.after_update(net, active, skipped)

    # 7. one scaler update, then the history; every rank skips together
    # (gradients are synchronized), so par.any runs on all ranks or none
    earlier, state.bad_input = state.bad_input, None
    bad_data = any(skipped) and par.any(has_nonfinite(batch) or (earlier is not None and bool(earlier)))
    losses, state.losses = state.losses, []
    rows, state.group_rows = state.group_rows, []
    # a skipped step's cause (the losses are read only here); the scale moves only on
    # what it can fix, an overflow in the backward pass: bad data and a loss that the
    # forward pass already made non-finite keep it
    cause = skip_cause(bad_data, losses) if any(skipped) else None
    keep_scale = cause in ("nonfinite_input", "nonfinite_loss")
    if decision:
        prec.update(keep_scale=keep_scale, scale_before=decision.scale_before)
        state.scale = decision.scale_before if keep_scale else decision.scale
    stepped = [name for (name, _, _), skip in zip(active, skipped) if not skip]
    state.stepped_batch = frozenset(stepped)
    state.stepped_epoch.update(stepped)
    if cause is not None:
        if not stepped:  # no optimizer stepped: left out of the epoch's train_loss (TrainLoss)
            state.skipped_rows.update(rows)
        net.history.record_batch("skip_cause", cause)
        if recorder is not None:
            recorder.skipped(net, batch, fit_params, cause, decision.scale_before)
    _record(net, skipped=any(skipped), bad_data=bad_data)
    return step


def skip_cause(bad_data: bool, losses: list) -> str:
    """Why a step was skipped: ``'nonfinite_input'`` (its batch held NaN or
    inf), ``'nonfinite_loss'`` (a loss of its micro-batches was NaN or inf:
    the forward pass already went non-finite) or ``'overflow'`` (finite data
    and loss, non-finite gradients: the backward pass overflowed). Reads the
    losses only here, on a skipped step."""
    if bad_data:
        return "nonfinite_input"
    return "nonfinite_loss" if has_nonfinite(losses) else "overflow"


def _batch_row(net: Any) -> int | None:
    """The index of the current batch's row in the epoch's history (skorch
    adds it at ``on_batch_begin``); None outside a fit's epoch."""
    history = net.history
    if not len(history):
        return None
    batches = history[-1].get("batches")
    return len(batches) - 1 if batches else None


def _optimizers_with_grads(net: Any) -> list[tuple[str, torch.optim.Optimizer, list]]:
    """(name, optimizer, its parameters with a gradient) of every optimizer that has some."""
    active = []
    for name in net._optimizers:
        optimizer = getattr(net, name + "_")
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if params:
            active.append((name, optimizer, params))
    return active


def current_scale(net: Any) -> float:
    """The loss scale after the last step (read once per fit at most)."""
    state = net.amp_step_state_
    if state.scale is None:
        state.scale = float(net.precision_.scaler.get_scale())
    return state.scale


def _record(net: Any, skipped: bool, bad_data: bool = False, boundary: bool = True) -> None:
    """Record the step in the history; at a step boundary, count runs of
    skipped steps (a micro-batch inside an accumulation group is no step
    and neither ends nor extends a run)."""
    state = net.amp_step_state_
    history = net.history
    if net.precision_.records:
        history.record_batch("step_skipped", skipped)
        history.record_batch("loss_scale", current_scale(net))
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
            "data, not a float16 overflow). Clean or impute the data.")
    elif not net.precision_.enabled:
        amp_warn(
            "Non-finite gradients: the optimizer step was skipped so that the "
            "weights stay finite (amp_skip_nonfinite=True).")
    limit = net.amp_max_consecutive_skips
    if limit is not None and state.consecutive_skips >= limit:
        raise AmpDivergenceError(_divergence_message(net, state))


def _divergence_message(net: Any, state: StepState) -> str:
    scaler = net.precision_.scaler
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
        f"(amp_max_consecutive_skips={net.amp_max_consecutive_skips}). The weights "
        "are those of the last good step. Likely causes:\n- " + "\n- ".join(causes)
    )


def begin_fit(net: Any) -> None:
    """At the start of a fit: a fresh step state for it, and a loss scaler
    without the record of a step that an exception interrupted between
    ``unscale_()`` and ``update()`` (a callback, KeyboardInterrupt), which
    would block the next fit."""
    net.precision_.discard_step()
    state = net.amp_step_state_
    state.micro_batches = 0
    state.check_loss_inputs = True
    state.not_probabilities = False
    state.scale = None
    state.recorder = None  # an AmpMonitor among the callbacks attaches one
    current_scale(net)  # before the first scale(): no read


def begin_epoch(net: Any) -> None:
    """At the start of an epoch: its counts of micro-batches and skips."""
    state = net.amp_step_state_
    state.micro_batches, state.epoch_skips, state.stepped_epoch = 0, 0, set()
    state.bad_input, state.losses = None, []
    state.group_rows, state.skipped_rows = [], set()


def record_epoch(net: Any) -> None:
    """The epoch's ``loss_scale`` and ``skipped_steps``."""
    state = net.amp_step_state_
    if net.precision_.records:
        net.history.record("loss_scale", current_scale(net))
        net.history.record("skipped_steps", state.epoch_skips)
    elif state.epoch_skips:
        net.history.record("skipped_steps", state.epoch_skips)


class TrainLoss(PassthroughScoring):
    """skorch's ``train_loss`` callback (``PassthroughScoring``): the
    epoch's ``train_loss`` is the mean of the batches' ``train_loss``
    weighted by ``train_batch_size``, over the batches whose optimizer step
    was applied.

    A batch whose step was skipped (non-finite gradients: ``step_skipped``,
    with its ``skip_cause``; with gradient accumulation every micro-batch of
    the group; with several optimizers, where none of them stepped) keeps
    its own ``train_loss`` in its batch record and is left out of the mean,
    so that one non-finite batch does not make the epoch's loss NaN; the
    epoch's ``skipped_steps`` counts the skipped steps. An epoch without
    skipped steps, and one without an applied step, get skorch's
    computation (the mean over all its batches), to the bit.
    """

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        state = net.__dict__.get("amp_step_state_") if self.on_train else None
        left_out = frozenset(state.skipped_rows) if state is not None else frozenset()
        history = net.history
        rows = [row for i, row in enumerate(history[-1].get("batches") or [])
                if i not in left_out and self.name in row] if left_out else []
        if not rows:  # no step skipped, or none applied: skorch's own computation
            super().on_epoch_end(net, **kwargs)
            return
        score = np.average([row[self.name] for row in rows], weights=[row["train_batch_size"] for row in rows])
        is_best = self._is_best_score(score)
        if is_best:
            self.best_score_ = score
        history.record(self.name, score)
        if is_best is not None:
            history.record(self.name + "_best", bool(is_best))


def default_callbacks(callbacks: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """skorch's default callbacks, with :class:`TrainLoss` as ``train_loss``."""
    return [(name, TrainLoss(name="train_loss", on_train=True)
             if name == "train_loss" and type(cb) is PassthroughScoring else cb)
            for name, cb in callbacks]


# ---- checks -----------------------------------------------------------------------


def _closure_param(optimizer: torch.optim.Optimizer) -> inspect.Parameter | None:
    try:
        return inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return None


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (e.g. LBFGS)."""
    param = _closure_param(optimizer)
    return param is not None and param.default is inspect.Parameter.empty


def may_use_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes an optional closure that it may
    evaluate in its own way: true for optimizers outside ``torch.optim``
    (torch's own call an optional closure once, before updating)."""
    if _closure_param(optimizer) is None:
        return False
    return not type(optimizer).__module__.startswith("torch.optim")


def uses_closure(net: Any, scaling: bool, skip_nonfinite: bool, accumulation: int) -> bool:
    """Whether ``net``'s optimizers take skorch's closure path; refuse what
    cannot work.

    Optimizers that require a closure (LBFGS) take skorch's closure path,
    which loss scaling and gradient accumulation cannot share. Without
    loss scaling, custom optimizers (outside ``torch.optim``) whose step
    takes an optional closure keep skorch's path too, so that they get the
    closure as in skorch.

    Raises
    ------
    ValueError
      A closure optimizer with loss scaling or gradient accumulation.
    """
    optimizers = {
        n: getattr(net, n + "_", None) for n in net._optimizers if getattr(net, n + "_", None) is not None
    }
    closure = [n for n, opt in optimizers.items() if needs_closure(opt)]
    if not closure:
        optional = [n for n, opt in optimizers.items() if may_use_closure(opt)]
        on = bool(optional and not scaling and accumulation == 1)
        if on and skip_nonfinite:
            names = ", ".join(f"{n} ({type(optimizers[n]).__name__})" for n in optional)
            amp_warn(
                f"Optimizer {names} takes an optional closure, so ampnet steps it through "
                "skorch's closure path, as skorch does: the non-finite guard "
                "(amp_skip_nonfinite), step_skipped records and LR-scheduler holding do not "
                "apply to it. Set amp_skip_nonfinite=False to accept this, or use an "
                "optimizer from torch.optim.")
        return on
    names = ", ".join(f"{n} ({type(optimizers[n]).__name__})" for n in closure)
    if scaling:
        raise ValueError(
            f"Optimizer {names} needs a closure, which cannot be combined with float16 "
            "loss scaling: every closure evaluation would see scaled gradients and "
            "only the first would be checked for overflow. Fix: use "
            "amp_dtype='bfloat16' (no loss scaling), amp_enabled=False, or a "
            "first-order optimizer such as torch.optim.Adam."
        )
    if accumulation > 1:
        raise ValueError(
            f"Optimizer {names} needs a closure, which cannot be combined with "
            f"gradient_accumulation_steps={accumulation}. Fix: set gradient_accumulation_steps=1."
        )
    return True


# ---- epochs and callbacks ------------------------------------------------------------


def flag_last(iterator: Iterable[Any], state: StepState) -> Iterator[Any]:
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


def held_callbacks(net: Any, method_name: str, cb_kwargs: dict) -> list:
    """Callbacks that must not receive this event: an LRScheduler must not
    advance past an optimizer step that did not happen (skipped for
    overflow, or inside an accumulation group)."""
    state = net.amp_step_state_
    if method_name == "on_batch_end":
        if not cb_kwargs.get("training", False) or "optimizer" in state.stepped_batch:
            return []
        every = "batch"
    elif method_name == "on_epoch_end":
        if "optimizer" in state.stepped_epoch:
            return []
        every = "epoch"
    else:
        return []
    return [cb for _, cb in net.callbacks_ if isinstance(cb, LRScheduler) and cb.step_every == every]
