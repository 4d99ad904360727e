"""The training step, in one function that reads as the README's list
("What happens in a training step"), and its bookkeeping: gradient
accumulation, skipped steps and their history, divergence, and holding
LR schedulers past steps that did not happen.

:func:`train_step` calls two components of the net: ``precision_``
(:class:`ampnet.precision.component.Precision`: every dtype decision, loss
scaling, the one host read) and ``parallel_``
(:class:`ampnet.training.parallel.Parallel`: DDP's no_sync, loss averaging and the
any-rank decision).

Beside it: the epoch's loop (:func:`epoch_run`, :func:`protocol_batches`;
the lean epoch of the common configuration is ``ampnet.training.lean``),
the closure path's checks (``ampnet.training.closure``), skipped steps' history,
counts and divergence limit (``ampnet.training.skips``) and skorch's default
callbacks as the history needs them (``ampnet.training.default_callbacks``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from skorch import NeuralNet
from skorch.callbacks import Callback, LRScheduler
from skorch.history import History
from skorch.dataset import get_len
from skorch.utils import TeeGenerator

from ampnet.utils.tree import has_nonfinite, nonfinite_flag
from ampnet.training.batches import ArrayBatches
from ampnet.training.closure import uses_closure
from ampnet.training.skips import bad_rows, finish_applied, finish_step, skip_cause
from ampnet.training.default_callbacks import QuietPrintLog, TrainLoss, default_callbacks
from ampnet.training.records import PENDING, BatchRecords, DeferredHistory, SkipGuard, StepEntry, current_row
from ampnet.exceptions import AmpStateError
from ampnet.config.params import is_auto, parsed

__all__ = [
    "StepState",
    "train_step",
    "uses_closure",
    "held_callbacks",
    "flag_last",
    "begin_fit",
    "end_fit",
    "begin_epoch",
    "EpochRun",
    "epoch_run",
    "protocol_batches",
    "finish_step",
    "finish_applied",
    "MAX_PENDING",
    "listeners",
    "all_training",
    "record_epoch",
    "SKIP_CAUSES",
    "skip_cause",
    "TrainLoss",
    "QuietPrintLog",
    "default_callbacks",
]

#: Steps whose outcome may wait on the device before it is read (see ``ampnet.training.records``).
MAX_PENDING = 1024

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
    group_rows: list = field(default_factory=list)  # (index, row) of the current accumulation group's batches
    group_sources: list = field(default_factory=list)  # (arrays, rows) of the group's batches (array path)
    skipped_rows: set = field(default_factory=set)  # the epoch's batch rows whose step was skipped (TrainLoss)
    recorder: Any = None  # ampnet.diagnostics.flight.FlightRecorder while an AmpMonitor watches the fit
    check_loss_inputs: bool = True  # the fit's first training batch is checked (output_checks)
    not_probabilities: bool = False  # that check warned: outputs are no probabilities under NLLLoss
    trial: Any = None  # ampnet.auto.trial.Trial while amp_enabled='auto' measures or watches its choice
    records: Any = None  # ampnet.training.records.BatchRecords of the fit's current epoch loop
    batch_schedulers: tuple = ()  # LRScheduler callbacks that step every batch (held on skipped steps)
    defer: bool = False  # steps may leave their outcome on the device (ampnet.training.records)
    sources: dict | None = None  # while fitting: the fit's arrays, by dataset (ampnet.training.batches)
    batch_source: Any = None  # the ArrayBatches that yields the current epoch's batches, if any
    listeners: dict | None = None  # while fitting: per batch event, the callbacks that act on it
    modules: list | None = None  # during an epoch: the net's modules and all their submodules
    row: Any = None  # during a batch of an epoch's loop: (index, row) of its history row
    guard: Any = None  # during a fit on a GPU: ampnet.training.records.SkipGuard
    plain_infer: bool = False  # during a fit: skorch's own infer and get_loss come next (ampnet.net)
    plain_loss: bool = False
    plain_step: bool = False  # during a fit: the step's methods are ampnet's and skorch's (ampnet.training.lean)
    float32_step: bool = False  # while amp_enabled='auto' measures a float32 step: no autocast (ampnet.net)

    def __getstate__(self) -> dict[str, Any]:
        # a fit's transient parts: pending device values, the arrays (on the device), the iterator,
        # the float32 step of auto's trial (a copy predicts in the net's own precision)
        state = dict(self.__dict__)
        state.update(records=None, sources=None, batch_source=None, group_sources=[], listeners=None,
                     modules=None, row=None, guard=None, float32_step=False)
        return state


def train_step(net: Any, batch: Any, **fit_params: Any) -> dict[str, Any]:
    """One training micro-batch of ``net``.

    1. zero the gradients at the start of a real step;
    2. forward pass and loss in the precision context, then
    3. backward of the scaled loss (``net.train_step_single``);
    4. at the step boundary: unscale once and check the gradients, on the device;
    5. ``on_grad_computed`` callbacks see the true gradients;
    6. step each optimizer whose gradients are finite: on the device
       (fused optimizers take the flag), or after one host read;
    7. one scaler update; the step's outcome into the records
       (``ampnet.training.records``): ``loss_scale``, ``step_skipped``
       and a skipped step's ``skip_cause`` in the history, read from the
       device when something reads the history, or at the epoch's end.
    """
    state = net.amp_step_state_
    if state.closure:
        return _closure_step(net, state, batch, **fit_params)
    # 1. zero the gradients
    if state.micro_batches == 0:
        net._zero_grad_optimizer()
    boundary = state.micro_batches + 1 >= net.gradient_accumulation_steps or state.last_batch
    # 2.-3. forward, loss and scaled backward (no gradient all-reduce inside a group)
    step = _forward_backward(net, state, batch, boundary, fit_params)
    if not boundary:
        _inside_group(net, state, batch)
        return step
    # 4.-5.
    active, flags = _check(net, state, batch)
    # 6.-7.
    if _deferred(net, state, active, flags):
        _step_on_device(net, state, active, flags)
    else:
        _step_on_host(net, state, batch, fit_params, active, flags)
    return step


def _closure_step(net: Any, state: StepState, batch: Any, **fit_params: Any) -> dict[str, Any]:
    """skorch's closure path (LBFGS): skorch's own step."""
    step = NeuralNet.train_step(net, batch, **fit_params)
    state.stepped_batch = frozenset(net._optimizers)
    state.stepped_epoch.update(net._optimizers)
    return step


def _forward_backward(net: Any, state: StepState, batch: Any, boundary: bool, fit_params: dict) -> dict[str, Any]:
    """Steps 2 and 3; the micro-batch joins its accumulation group: its
    loss, its history row and, on the array path, its rows of the arrays."""
    par = net.parallel_
    if par.ddp is None:
        step = net.train_step_single(batch, **fit_params)
        loss = step["loss"]
    else:
        with par.no_sync(boundary):
            step = net.train_step_single(batch, **fit_params)
        loss = par.mean(step["loss"])
        step = dict(step, loss=loss)
    state.micro_batches += 1
    state.losses.append(loss.detach())
    row = state.row if state.row is not None else current_row(net.history)
    if row is not None:
        state.group_rows.append(row)
        source = state.batch_source
        rows = source.rows_of(batch) if source is not None else None
        if rows is not None:
            state.group_sources.append((source.source, rows))
    return step


def _inside_group(net: Any, state: StepState, batch: Any) -> None:
    """A micro-batch inside an accumulation group: no step; bad data is
    told apart from an overflow when the group's step is skipped (from the
    arrays then, on the array path)."""
    prec = net.precision_
    if (prec.scaling or prec.settings.skip_nonfinite) and not state.group_sources:
        flag = nonfinite_flag(batch)
        if flag is not None:
            state.bad_input = flag if state.bad_input is None else state.bad_input | flag
    state.stepped_batch = frozenset()
    _record_rows(net, state, boundary=False)


def _check(net: Any, state: StepState, batch: Any) -> tuple[list, list | None]:
    """Step 4 and 5: the optimizers with gradients, and their flags (on the
    device: one per optimizer, or None where nothing is checked); the
    gradients are unscaled and, for a short last group, restored to the
    group's mean; then ``on_grad_computed``."""
    prec = net.precision_
    if prec.scaling and not getattr(prec.scaler, "scaled_in_step", True):
        raise AmpStateError(
            "Loss scaling is active, but no loss was scaled in this step: an "
            "override of train_step_single probably called loss.backward() "
            "directly, which gives gradients that are wrong by the loss scale. "
            "Fix: call self.backward(loss) (or "
            "self.grad_scaler_.scale(loss).backward()) instead."
        )
    if prec.masters:
        prec.gather_grads(net.__dict__.get("module_"))
    active = _optimizers_with_grads(net)  # an optimizer without gradients is left alone
    flags = prec.check([(opt, params) for _, opt, params in active])
    if state.micro_batches < net.gradient_accumulation_steps:
        # a short remainder group at the end of the epoch: each micro-batch
        # was divided by the full count; restore the mean
        factor = net.gradient_accumulation_steps / state.micro_batches
        for _, _, params in active:
            torch._foreach_mul_([p.grad for p in params], factor)
    state.micro_batches = 0
    recorder = state.recorder  # ampnet.diagnostics.flight.FlightRecorder while an AmpMonitor watches
    if recorder is not None:
        recorder.grads_computed(active)
    listeners = state.listeners
    if listeners is None or listeners["on_grad_computed"] or (
            type(net).on_grad_computed is not NeuralNet.on_grad_computed):
        net.notify(
            "on_grad_computed",
            named_parameters=TeeGenerator(net.get_all_learnable_params()),
            batch=batch,
            training=True,
        )
    return active, flags


def _deferred(net: Any, state: StepState, active: list, flags: list | None) -> bool:
    """Whether this step leaves its outcome on the device: nothing on the
    host needs it now (``state.defer``: see :func:`begin_fit`; no
    ``AmpMonitor``, no loss scaling), its batch can be read again from the
    arrays (the array path), and each optimizer skips on the device (a fused
    one, which takes the flag)."""
    if not state.defer or state.recorder is not None or not state.group_sources or net.precision_.scaling:
        return False
    if flags is None:
        return True
    for _, optimizer, _ in active:
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
    return True


def _step_on_device(net: Any, state: StepState, active: list, flags: list | None) -> None:
    """Steps 6 and 7 without a host read: each optimizer skips on its flag,
    on the device; the outcome goes into the records, read later."""
    prec = net.precision_
    names = [name for name, _, _ in active]
    if state.guard is not None and flags:  # the divergence limit, on the device (see begin_fit)
        flags = state.guard.apply(flags)
        for (_, optimizer, _), flag in zip(active, flags):
            prec.skip_on(optimizer, flag)
    for _, optimizer, _ in active:
        net.optimizer_step(optimizer)
    if prec.masters:
        prec.after_step(net.__dict__.get("module_"))
    prec.update(keep_scale=False, scale_before=None)
    state.stepped_batch = frozenset(names)  # no scheduler is held in a deferred fit
    losses, state.losses = state.losses, []
    rows, state.group_rows = state.group_rows, []
    sources, state.group_sources = state.group_sources, []
    state.bad_input = None
    _record_rows(net, state, boundary=True)
    state.records.add_step(StepEntry(rows, flags if flags is not None else [], names, losses, sources=sources))


def _step_on_host(
    net: Any, state: StepState, batch: Any, fit_params: dict, active: list, flags: list | None,
) -> None:
    """Steps 6 and 7 after one host read of the flags (and the scale):
    the optimizers with finite gradients step; the scale's update keeps it
    where the cause is no overflow; the outcome is written at once."""
    prec, par = net.precision_, net.parallel_
    module = net.__dict__.get("module_")
    decision = prec.decide(flags, len(active)) if active else None
    skipped = decision.skipped if decision else ()
    recorder = state.recorder
    if recorder is not None:
        recorder.before_update(net, active, skipped)
    for (_, optimizer, _), skip in zip(active, skipped):
        if not skip:
            net.optimizer_step(optimizer)
    prec.after_step(module)
    if recorder is not None:
        recorder.after_update(net, active, skipped)
    names = tuple(name for name, _, _ in active)
    losses, state.losses = state.losses, []
    rows, state.group_rows = state.group_rows, []
    sources, state.group_sources = state.group_sources, []
    earlier, state.bad_input = state.bad_input, None
    # every rank skips together (gradients are synchronized), so par.any runs on all ranks or none
    bad_data = any(skipped) and par.any(
        (bad_rows(sources) if sources else has_nonfinite(batch)) or (earlier is not None and bool(earlier)))
    # a skipped step's cause (the losses are read only here); the scale moves only on
    # what it can fix, an overflow in the backward pass: bad data and a loss that the
    # forward pass already made non-finite keep it
    cause = skip_cause(bad_data, losses) if any(skipped) else None
    keep_scale = cause in ("nonfinite_input", "nonfinite_loss")
    if decision:
        prec.update(keep_scale=keep_scale, scale_before=decision.scale_before)
        state.scale = decision.scale_before if keep_scale else decision.scale
    state.stepped_batch = frozenset(n for n, skip in zip(names, skipped) if not skip)
    if cause is not None and recorder is not None:
        recorder.skipped(net, batch, fit_params, cause, decision.scale_before)
    _record_rows(net, state, boundary=True)
    entry = StepEntry(rows, list(skipped), names, losses, bad=bad_data, cause=cause)
    records = state.records
    if records is None:
        finish_step(net, entry, tuple(skipped))
    else:
        records.finish_now(entry)
    if state.guard is not None:  # counted on the host now: the device's count follows
        state.guard.reset(state.consecutive_skips)


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


def _record_rows(net: Any, state: StepState, boundary: bool) -> None:
    """The current batch row's ``step_skipped`` and ``loss_scale`` (AMP on,
    or loss scaling), in skorch's order: ``step_skipped`` False inside an
    accumulation group, :data:`~ampnet.training.records.PENDING` at a
    boundary until the step's outcome is known (``finish_step`` writes it)."""
    if not _records(net):
        return
    found = state.row if state.row is not None else current_row(net.history)
    if found is None:
        return
    row = found[1]
    row["step_skipped"] = PENDING if boundary else False
    row["loss_scale"] = state.scale if state.scale is not None else current_scale(net)


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
    state.sources = {}
    state.batch_schedulers = tuple(
        cb for _, cb in net.callbacks_ if isinstance(cb, LRScheduler) and cb.step_every == "batch")
    # a step's outcome may stay on the device unless something on the host needs it at once: an LR
    # scheduler held on a skipped batch, data parallelism (every rank decides together), skorch's closure
    state.defer = not state.batch_schedulers and net.parallel_.ddp is None and not state.closure
    limit = net.amp_max_consecutive_skips
    # read at least every `limit` steps, so that a run of skipped steps stops the fit in time; on a GPU,
    # where such a read would stall it, the limit is kept on the device instead (SkipGuard)
    on_gpu = torch.device(net.device or "cpu").type == "cuda"
    state.guard = SkipGuard(limit, state.consecutive_skips, torch.device(net.device)) if on_gpu and limit else None
    state.records = BatchRecords(functools.partial(finish_step, net), functools.partial(finish_applied, net),
                                 max_pending=min(limit, MAX_PENDING) if limit and not on_gpu else MAX_PENDING)
    state.listeners = listeners(net)


def end_fit(net: Any) -> None:
    """At the end of a fit: what is still pending is written, and the fit's
    arrays (on the device) are let go."""
    state = net.amp_step_state_
    if state.records is not None:
        state.records.flush()
    state.records, state.sources, state.batch_source, state.listeners = None, None, None, None
    state.modules = state.row = state.guard = None
    state.plain_infer = state.plain_loss = state.plain_step = False


#: The callback events of every batch, which :func:`listeners` dispatches.
BATCH_EVENTS = ("on_batch_begin", "on_batch_end", "on_grad_computed")


def listeners(net: Any) -> dict[str, list]:
    """Per batch event (:data:`BATCH_EVENTS`), the callbacks whose method
    for it is not skorch's ``Callback``'s own, which does nothing: only they
    are called, every batch."""
    return {event: [cb for _, cb in net.callbacks_ if _acts_on(cb, event)] for event in BATCH_EVENTS}


def _acts_on(cb: Any, event: str) -> bool:
    method = getattr(type(cb), event, None)
    return method is not getattr(Callback, event) or event in vars(cb)


def all_training(net: Any) -> bool:
    """Whether every module and criterion of ``net``, and all their
    submodules, are in training mode (the modules as the epoch began, or
    as now outside an epoch)."""
    state = net.__dict__.get("amp_step_state_")
    modules = state.modules if state is not None and state.modules is not None else _all_modules(net)
    for m in modules:
        if not m.training:
            return False
    return True


def _all_modules(net: Any) -> list[torch.nn.Module]:
    """Every module and criterion of ``net`` with all their submodules."""
    out: list[torch.nn.Module] = []
    for name in net._modules + net._criteria:
        module = net.__dict__.get(name + "_")
        if isinstance(module, torch.nn.Module):
            out.extend(module.modules())
    return out


def begin_epoch(net: Any) -> None:
    """At the start of an epoch: its counts of micro-batches and skips."""
    state = net.amp_step_state_
    state.micro_batches, state.epoch_skips, state.stepped_epoch = 0, 0, set()
    state.bad_input, state.losses = None, []
    state.group_rows, state.group_sources, state.skipped_rows = [], [], set()
    state.modules = _all_modules(net)


def _records(net: Any) -> bool:
    """Whether every batch and epoch of ``net`` records ``loss_scale`` and
    ``step_skipped``/``skipped_steps``: AMP on, loss scaling, or
    ``amp_enabled='auto'`` whatever it chose (so that a float32 choice made
    mid-fit keeps the history's columns: a float32 step records a scale of
    1.0 and its skip)."""
    return net.precision_.records or is_auto(parsed(net, "amp_enabled"))


def record_epoch(net: Any) -> None:
    """The epoch's ``loss_scale`` and ``skipped_steps``."""
    state = net.amp_step_state_
    if _records(net):
        net.history.record("loss_scale", current_scale(net))
        net.history.record("skipped_steps", state.epoch_skips)
    elif state.epoch_skips:
        net.history.record("skipped_steps", state.epoch_skips)


# ---- epochs and callbacks ------------------------------------------------------------


@dataclass
class EpochRun:
    """One epoch's loop (:func:`epoch_run`): its history and records, its
    batches (an iterator the lean epoch and the protocol share) and how many
    batches ran.

    ``deferring``: its steps may leave their outcome on the device (the
    array path, the history ``DeferredHistory``); ``source``: the
    :class:`~ampnet.training.batches.ArrayBatches` then, else None.
    """

    history: Any
    records: Any
    batches: Iterator[Any]
    deferring: bool
    source: Any
    count: int = 0


@contextlib.contextmanager
def epoch_run(net: Any, iterator: Any, training: bool, prefix: str) -> Iterator[EpochRun]:
    """skorch's ``run_single_epoch`` around its batches, without a host read
    per batch: each batch's loss goes into the history through the fit's
    records (``ampnet.training.records``), read when the loop ends (here)
    or when something reads the history; the same rows, keys and values as
    skorch writes. With gradient accumulation, the last batch is flagged.
    The batches run in the block: the lean epoch's (``ampnet.training.lean``)
    then :func:`protocol_batches`."""
    state = net.amp_step_state_
    history = net.history
    if type(history) is History:  # loaded (LoadInitState, load_params): the same rows, read lazily
        net.history_ = history = DeferredHistory(history)
    records = state.records if isinstance(history, DeferredHistory) else None
    if records is not None:
        history.attach(records)
    deferring = records is not None and training and isinstance(iterator, ArrayBatches)
    state.batch_source = iterator if deferring else None
    batches = flag_last(iterator, state) if training and net.gradient_accumulation_steps > 1 else iterator
    run = EpochRun(history, records, iter(batches), deferring, iterator if deferring else None)
    try:
        yield run
    except BaseException:
        if records is not None:  # what was measured is written; the exception is what matters
            with contextlib.suppress(Exception):
                records.flush()
        raise
    finally:
        state.batch_source = state.row = None
    if records is not None:
        records.flush()
    history.record(prefix + "_batch_count", run.count)


def protocol_batches(net: Any, run: EpochRun, training: bool, prefix: str, step_fn: Any, **fit_params: Any) -> None:
    """The epoch's (remaining) batches through skorch's protocol: ``notify``,
    ``step_fn`` (``train_step`` or ``validation_step``), the batch's records."""
    state, history, records = net.amp_step_state_, run.history, run.records
    loss_key, size_key = prefix + "_loss", prefix + "_batch_size"
    for batch in run.batches:
        net.notify("on_batch_begin", batch=batch, training=training)
        state.row = row = current_row(history)
        step = step_fn(batch, **fit_params)
        state.row = None
        if records is None or row is None:
            history.record_batch(loss_key, step["loss"].item())
        else:
            records.add_value(row[1], loss_key, step["loss"].detach())
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        history.record_batch(size_key, first.shape[0] if type(first) is torch.Tensor and first.dim()
                             else get_len(first))
        net.notify("on_batch_end", batch=batch, training=training, **step)
        run.count += 1


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
        if not state.batch_schedulers or not cb_kwargs.get("training", False) or "optimizer" in state.stepped_batch:
            return []
        every = "batch"
    elif method_name == "on_epoch_end":
        if "optimizer" in state.stepped_epoch:
            return []
        every = "epoch"
    else:
        return []
    return [cb for _, cb in net.callbacks_ if isinstance(cb, LRScheduler) and cb.step_every == every]
