"""The lean epoch: the training loop of the common configuration, with
each batch's whole protocol in one function.

:func:`ampnet.training.step.protocol_batches` runs an epoch's batches
through skorch's protocol, a method per stage (``notify``, ``train_step``,
``train_step_single``, ``infer``, ``get_loss``, ``backward``,
``optimizer_step``), each asking again what this net needs. On a small
model that protocol is the step's cost: a 20-32-2 MLP's step on one CPU
thread spent about a sixth of its time in it. Where the answers are the
same for every batch of the epoch, :func:`plan` asks once, and
:func:`run_batches` runs each batch as those methods would, in the same
order, with the same tensors and the same history, callbacks and random
streams; only the Python around them is less. What it covers:

- the array data path (:mod:`ampnet.training.batches`) with the outcome of
  each step left on the device (:mod:`ampnet.training.records`): no loss
  scaling, no ``AmpMonitor``, no LR scheduler stepping every batch, no data
  parallelism, no gradient accumulation, no closure optimizer;
- ampnet's and skorch's own step methods (a subclass overriding one of
  :data:`STEP_METHODS` keeps the protocol), tensor features, no ``fit_params``;
- any kind of precision without float32 master weights whose step hooks
  (:data:`PRECISION_HOOKS`) are the base ``Precision``'s (compensated pure
  bf16 has its own, and keeps the protocol), with the non-finite check on
  or off (an optimizer that cannot skip on the device,
  not a fused one, has each step decided after one host read, as in the
  protocol, whose code takes that step);
- ``amp_enabled='auto'`` once it has chosen (its watch times each step).

A callback that acts on a batch event, other than skorch's and ampnet's own,
may change the net (``set_params``); after each of its calls the plan is
checked against the net and, where anything it rests on changed, the
epoch's remaining batches take the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from skorch.classifier import NeuralNetClassifier
from skorch.dataset import get_len
from skorch.utils import TeeGenerator

from ampnet.precision import Precision, autocast_dtype_error, fused_check_fits, fused_nonfinite, nonfinite_grads
from ampnet.training.batches import ArrayBatches
from ampnet.training.records import PENDING, StepEntry
from ampnet.training.step import _records, _step_on_host, current_scale
from ampnet.training.output_checks import check_loss_inputs, check_loss_value

__all__ = ["STEP_METHODS", "PRECISION_HOOKS", "LeanPlan", "plan", "run_batches"]

#: The net's methods of the step that the lean epoch stands for: a subclass
#: that overrides one of them gets skorch's protocol (see ``AmpNetMixin.on_train_begin``).
STEP_METHODS = (
    "train_step", "train_step_single", "backward", "optimizer_step", "_zero_grad_optimizer", "notify",
    "_set_training", "infer", "get_loss", "on_grad_computed", "get_all_learnable_params",
)


#: The precision's hooks of the step that the lean epoch leaves out (the base
#: ``Precision``'s do nothing there): a kind overriding one keeps the protocol.
PRECISION_HOOKS = ("backward", "gather_grads", "zero_grad", "check", "step_context", "after_step", "update")


@dataclass(slots=True)
class LeanPlan:
    """What every batch of the epoch needs, asked once (:func:`plan`)."""

    key: tuple  # what the plan rests on, by identity (:func:`_key`)
    module: torch.nn.Module
    criterion: Any
    log_probs: bool  # skorch's classifier with NLLLoss: the loss of the log of the probabilities
    optimizers: tuple  # (name, optimizer, its parameters)
    names: tuple  # the optimizers' names
    context: Any  # the forward pass's context (autocast), or NO_CONTEXT
    convert_output: Any  # the precision's output conversion, or None (AMP off)
    check: bool  # the non-finite check (amp_skip_nonfinite)
    fused: tuple  # per optimizer: its gradients, all present, take the fused check (checks.fused_check_fits)
    one: torch.Tensor | None  # the check's unit scale, on the device
    records: bool  # batch rows get step_skipped and loss_scale
    scale: float  # the loss scale they get (no loss scaling: it never moves)
    begin: tuple  # callbacks acting on on_batch_begin
    end: tuple  # callbacks acting on on_batch_end
    grad_listeners: bool  # on_grad_computed is called
    guarded: bool  # a batch callback not skorch's or ampnet's own: after it, the plan is checked against the net
    watch: Any  # amp_enabled='auto''s trial once it has chosen (its watch), else None
    host_step: Any  # the protocol's step after one host read (an optimizer that cannot skip on the device)


def _key(net: Any) -> tuple:
    """What a plan rests on: the components, modules, optimizers, callbacks
    and history of ``net``, and its precision's settings, by identity."""
    prec = net.precision_
    state = net.amp_step_state_
    return (
        prec, type(prec), prec.__dict__.get("_settings"), prec.__dict__.get("_layout"), prec.masters,
        net.__dict__.get("module_"), net.__dict__.get("criterion_"), net.callbacks_, net.history,
        net.gradient_accumulation_steps, state.trial, state.recorder, state.float32_step, state.guard,
        *(getattr(net, name + "_", None) for name in net._optimizers),
    )


def plan(net: Any, run: Any, training: bool, step_fn: Any, fit_params: dict) -> LeanPlan | None:
    """The plan of a lean epoch for ``run`` (``ampnet.training.step.EpochRun``),
    or None where the epoch takes skorch's protocol (see the module's docs
    for when)."""
    state = net.amp_step_state_
    iterator = run.source
    if not (training and run.deferring and not fit_params and isinstance(iterator, ArrayBatches)):
        return None
    if not (state.plain_step and state.plain_infer and state.plain_loss and state.defer):
        return None
    if getattr(step_fn, "__self__", None) is not net or getattr(step_fn, "__func__", None) is not type(net).train_step:
        return None
    if isinstance(iterator.source.X, dict) or state.closure or state.recorder is not None or state.float32_step:
        return None
    trial = state.trial
    if trial is not None and not trial.decided:
        return None
    prec = net.precision_
    if any(getattr(type(prec), hook) is not getattr(Precision, hook) for hook in PRECISION_HOOKS):
        return None  # a kind with its own step (compensated): the protocol calls its hooks
    if prec.masters or prec.scaling or net.gradient_accumulation_steps != 1 or net.parallel_.ddp is not None:
        return None
    criterion = net.criterion_
    check = bool(prec.settings.skip_nonfinite)
    optimizers = []
    host = False
    for name in net._optimizers:
        optimizer = getattr(net, name + "_")
        # an optimizer that cannot skip on the device: each step is decided after one host read
        host = host or (check and not getattr(optimizer, "_step_supports_amp_scaling", False))
        optimizers.append((name, optimizer, [p for group in optimizer.param_groups for p in group["params"]]))
    device = torch.device(net.device) if net.device is not None else None
    sparse = any(getattr(m, "sparse", False) is True for m in net.module_.modules())
    one = prec._one(device) if check and device is not None else None
    listeners = state.listeners
    begin, end = tuple(listeners["on_batch_begin"]), tuple(listeners["on_batch_end"])

    return LeanPlan(
        key=_key(net),
        module=net.module_,
        criterion=criterion,
        log_probs=isinstance(criterion, torch.nn.NLLLoss) and isinstance(net, NeuralNetClassifier),
        optimizers=tuple(optimizers),
        names=tuple(name for name, _, _ in optimizers),
        context=prec.forward_context(),
        convert_output=prec.convert_output if prec.enabled else None,
        check=check,
        fused=tuple(one is not None and fused_check_fits(params, sparse) for _, _, params in optimizers),
        one=one,
        records=_records(net),
        scale=current_scale(net),
        begin=begin,
        end=end,
        grad_listeners=bool(listeners["on_grad_computed"]),
        guarded=any(not _own(cb, "on_batch_begin") for cb in begin) or any(not _own(cb, "on_batch_end") for cb in end),
        watch=trial,
        host_step=_step_on_host if host else None,
    )


def run_batches(net: Any, lean: LeanPlan, batches: Iterator[Any], iterator: ArrayBatches, prefix: str) -> int:
    """Train on ``batches`` (the epoch's iterator) as the protocol would,
    until they are used up or a callback changed what ``lean`` rests on;
    return how many batches were trained on (the rest are the protocol's)."""
    state, history, prec = net.amp_step_state_, net.history, net.precision_
    records = state.records
    rows = list.__getitem__(history, -1)["batches"]
    module, criterion, optimizers, names = lean.module, lean.criterion, lean.optimizers, lean.names
    context, convert_output, one = lean.context, lean.convert_output, lean.one
    begin, end, watch = lean.begin, lean.end, lean.watch
    check, grad_listeners, log_probs, host_step = lean.check, lean.grad_listeners, lean.log_probs, lean.host_step
    guarded, fused = lean.guarded, lean.fused
    loss_key, size_key = prefix + "_loss", prefix + "_batch_size"
    device = net.device
    state.stepped_batch, last = frozenset(names), names
    count = 0
    for batch in batches:
        net.on_batch_begin(net, batch=batch, training=True)
        for cb in begin:
            cb.on_batch_begin(net, batch=batch, training=True)
        index = len(rows) - 1
        row = rows[index]
        mark = watch.clock.start() if watch is not None else None
        # train_step: zero the gradients; train_step_single: training mode, forward and loss, backward
        for _, optimizer, _ in optimizers:
            optimizer.zero_grad()
        net._set_training(True)
        Xi, yi = batch
        x = prec.convert_input(Xi, module, device)
        with context:
            try:
                y_pred = module(x)
            except RuntimeError as exc:
                _raise_dtype_error(net, exc, x)
                raise
            if convert_output is not None:
                y_pred = convert_output(y_pred)
            if state.check_loss_inputs:  # the fit's first training batch (get_loss)
                state.check_loss_inputs = False
                state.not_probabilities = check_loss_inputs(net, y_pred, yi)
            if log_probs:  # skorch's NeuralNetClassifier.get_loss
                loss = criterion(torch.log(y_pred + torch.finfo(y_pred.dtype).eps), yi)
            else:
                loss = criterion(y_pred, yi)
        if not (type(loss) is torch.Tensor and loss.is_floating_point()):
            check_loss_value(net, loss)
        loss.backward()
        loss_value = loss.detach()
        # the step: the optimizers with gradients (an optimizer without any is left alone), their
        # flags on the device, on_grad_computed, then each optimizer skips on its flag
        active, flags = _check(optimizers, fused, one) if check else (_with_grads(optimizers), [])
        stepped = names if active is optimizers else tuple(name for name, _, _ in active)
        if stepped is not last:
            state.stepped_batch, last = frozenset(stepped), stepped
        if grad_listeners:
            net.notify("on_grad_computed", named_parameters=_tee(net), batch=batch, training=True)
        sources = [(iterator.source, iterator.rows_of(batch))]
        if host_step is not None:  # the protocol's step: read, step, written at once
            state.row, state.losses, state.group_rows, state.group_sources = (index, row), [loss_value], [(index, row)], sources
            host_step(net, state, batch, {}, active, flags)
            state.row, last = None, None  # it wrote stepped_batch: the next step writes its own
        else:
            if flags and state.guard is not None:
                flags = state.guard.apply(flags)
            for i, (_, optimizer, _) in enumerate(active):
                _step(optimizer, flags[i] if flags else None)
            if lean.records:
                row["step_skipped"] = PENDING
                row["loss_scale"] = lean.scale
            records.add_step(StepEntry([(index, row)], flags, stepped, [loss_value], sources=sources))
        if watch is not None:
            watch.watch(watch.clock.stop(mark))
        # the batch's records (as protocol_batches writes them), then on_batch_end
        records.add_value(row, loss_key, loss_value)
        row[size_key] = Xi.shape[0] if Xi.dim() else get_len(Xi)
        net.on_batch_end(net, batch=batch, training=True, loss=loss, y_pred=y_pred)
        for cb in end:
            cb.on_batch_end(net, batch=batch, training=True, loss=loss, y_pred=y_pred)
        count += 1
        if guarded and _key(net) != lean.key:
            break  # a callback changed the net: the protocol from the next batch
    return count


def _check(optimizers: tuple, fused: tuple, one: torch.Tensor | None) -> tuple[Any, list]:
    """The step's check (``Precision.check`` without loss scaling): the
    optimizers with gradients (``optimizers`` itself where all have some;
    an optimizer without any is left alone, as the protocol leaves it) and
    one non-finite flag each, on the device."""
    if len(optimizers) == 1:  # the common case, briefly
        _, _, params = optimizers[0]
        grads = [p.grad for p in params]
        for g in grads:
            if g is None:
                break
        else:
            return optimizers, [fused_nonfinite(grads, one) if fused[0] else nonfinite_grads(params, None, one)]
    active = _with_grads(optimizers)
    return active, [nonfinite_grads(params, None, one) for _, _, params in active]


def _own(cb: Any, event: str) -> bool:
    """Whether ``cb``'s method for ``event`` is skorch's or ampnet's own,
    which changes nothing that a plan rests on."""
    for klass in type(cb).__mro__:
        if event in vars(klass):
            return klass.__module__.split(".")[0] in ("skorch", "ampnet") and event not in vars(cb)
    return event not in vars(cb)


def _with_grads(optimizers: tuple) -> Any:
    """The optimizers that have a parameter with a gradient, with all their
    parameters (``optimizers`` itself where all have some)."""
    active = [entry for entry in optimizers if any(p.grad is not None for p in entry[2])]
    return optimizers if len(active) == len(optimizers) else active


def _step(optimizer: torch.optim.Optimizer, found: torch.Tensor | None) -> None:
    """``optimizer.step()``; a fused optimizer skips on ``found`` on the
    device, as torch's scaler passes it (the gradients unscaled)."""
    if found is None:
        optimizer.step()
        return
    optimizer.grad_scale, optimizer.found_inf = None, found
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def _tee(net: Any) -> Any:
    return TeeGenerator(net.get_all_learnable_params())


def _raise_dtype_error(net: Any, exc: RuntimeError, x: Any) -> None:
    """``infer``'s explanation of a dtype error under autocast, raised from ``exc``."""

    prec = net.precision_
    error = autocast_dtype_error(exc, x, net.__dict__.get("module_"), prec.policy.name)
    if prec.enabled and error is not None:
        raise error from exc
