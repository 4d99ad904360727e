"""The flight recorder of a fit: what :class:`ampnet.callbacks.AmpMonitor`
adds to the training step.

While an ``AmpMonitor`` watches a fit, the step (:mod:`ampnet.training.step`) holds
a :class:`FlightRecorder` in ``amp_step_state_.recorder`` and calls it at
three points: when the unscaled gradients are complete (before
``on_grad_computed`` callbacks such as ``GradientNormClipping`` see them),
around the optimizer updates, and when a step was skipped. Everything a
good step records stays on the device; :meth:`FlightRecorder.end_epoch`
reads it back once per epoch. Without an ``AmpMonitor`` the recorder is
None and the step does none of this.

Per epoch it measures

- ``grad_norm``: the mean, over the epoch's applied steps, of the global L2
  norm of the unscaled gradients of the optimizers' parameters (what
  ``GradientNormClipping`` computes, before it clips);
- ``lost_updates`` (``amp_level='pure'`` only): the share of parameter
  elements with a non-zero gradient whose stored value did not change in
  an applied optimizer step, i.e. whose update was lost to rounding. The
  value is the one the optimizer steps: the float32 master with master
  weights, the weight plus its compensation with ``'compensated'`` (so both
  give close to 0: only updates below float32's resolution, or the
  compensation buffer's, are lost), the low-precision weight without either. It is
  estimated on a strided sample of at most :data:`SAMPLE_PER_TENSOR`
  elements of each parameter.

and on each skipped step whose cause is not bad data, it names the first
module that went non-finite (:func:`ampnet.diagnostics.diagnosis.first_nonfinite`), at
most ``max_replays`` times per epoch; the skips of the loss scale's settling
at the start of a fit (``"overflow"`` skips from the initial scale down,
before the first applied step) are replayed without counting.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import torch

from ampnet.diagnostics.diagnosis import first_nonfinite
from ampnet.precision import compensation_of, grads_by_device_dtype

__all__ = [
    "FlightRecorder", "REPEATED_OVERFLOWS", "REPEATED_OVERFLOW_SHARE", "SAMPLE_PER_TENSOR", "global_grad_norm",
    "nonfinite_loss_message",
]

#: At most this many elements of each parameter are compared before and
#: after an update to estimate ``lost_updates`` (a strided sample).
SAMPLE_PER_TENSOR = 4096


def global_grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of all gradients of ``params`` together, as a float32
    tensor on the first gradient's device (no host read); None without
    gradients. Low-precision gradients are summed in float32.

    float32 and float64 gradients: one dot product per tensor (a BLAS
    reduction, about twice as fast as ``torch._foreach_norm`` on a CPU),
    then the square root of the sum."""
    groups = grads_by_device_dtype(params)
    if not groups:
        return None
    device = next(iter(groups))[0]
    squares = []
    for (_, dtype), grads in groups.items():
        if dtype in (torch.float32, torch.float64):
            for g in grads:
                flat = g.reshape(-1)
                squares.append(torch.dot(flat, flat).to(device, torch.float32))
        else:
            squares.extend(torch.linalg.vector_norm(g, dtype=torch.float32).square().to(device) for g in grads)
    return torch.stack(squares).sum().sqrt()


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat[:: max(1, math.ceil(flat.numel() / SAMPLE_PER_TENSOR))]


class FlightRecorder:
    """What an :class:`ampnet.callbacks.AmpMonitor` records during one fit
    (``amp_step_state_.recorder``).

    Parameters
    ----------
    lost_updates : bool
      Whether to measure ``lost_updates`` (``amp_level='pure'``).

    max_replays : int
      At most this many skipped steps per epoch are replayed to find the
      first non-finite module.
    """

    def __init__(self, lost_updates: bool, max_replays: int) -> None:
        self.lost_updates = lost_updates
        self.max_replays = max_replays
        # the loss scale's settling at the start of a fit (see `skipped`): None until the
        # fit's first skip or applied step decides it, then True until the first applied step
        self.settling: bool | None = None
        self.begin_epoch()

    def begin_epoch(self) -> None:
        self.applied = 0
        self.replays = 0
        self._norm: torch.Tensor | None = None  # this step's
        self._norm_sum: torch.Tensor | None = None
        self._lost: torch.Tensor | None = None  # [lost, counted], summed over the epoch
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- called by the step ------------------------------------------------------

    def grads_computed(self, active: Sequence[tuple[str, torch.optim.Optimizer, list]]) -> None:
        """The step's gradients are unscaled and complete (no clipping yet)."""
        self._norm = global_grad_norm([p for _, _, params in active for p in params])

    def before_update(self, net: Any, active: Sequence[tuple], skipped: Sequence[bool]) -> None:
        """Before the optimizers step: sample the values they will update."""
        self._before = []
        if not self.lost_updates:
            return
        for (_, optimizer, params), skip in zip(active, skipped):
            if skip:
                continue
            comps = compensation_of([optimizer])
            for p in params:
                nonzero = _sample(p.grad) != 0
                self._before.append((p, nonzero, self._value(p, comps).clone()))

    def after_update(self, net: Any, active: Sequence[tuple], skipped: Sequence[bool]) -> None:
        """After the optimizers stepped: count the step and its lost updates."""
        if active and not all(skipped):
            self.settling = False  # a step was applied: the loss scale has settled
        if active and not any(skipped) and self._norm is not None:
            self.applied += 1
            norm = self._norm
            self._norm_sum = norm if self._norm_sum is None else self._norm_sum + norm.to(self._norm_sum.device)
        self._norm = None
        if not self._before:
            return
        comps = compensation_of([opt for (_, opt, _), skip in zip(active, skipped) if not skip])
        counts = []
        for p, nonzero, before in self._before:
            lost = (self._value(p, comps) == before) & nonzero
            counts.append(torch.stack([lost.sum(), nonzero.sum()]).to(torch.float32))
        self._before = []
        total = torch.stack([c.to(counts[0].device) for c in counts]).sum(0)
        self._lost = total if self._lost is None else self._lost + total.to(self._lost.device)

    @staticmethod
    def _value(p: torch.Tensor, comps: dict[int, torch.Tensor]) -> torch.Tensor:
        value = _sample(p).to(torch.float32)
        extra = comps.get(id(p))
        return value + _sample(extra).to(torch.float32) if extra is not None else value

    def skipped(self, net: Any, batch: Any, fit_params: dict, cause: str, scale: float) -> None:
        """A skipped step: name its first non-finite module in the batch's
        history row (``first_nonfinite``), replaying the batch, unless the
        data was bad or this epoch's replays are spent.

        The skips of the loss scale's settling do not spend the epoch's
        replays (:meth:`is_settling`): they are replayed too, so that an
        overflow of the data among them is named, but ``max_replays`` is
        left for the skips after it (with float16 and the default initial
        scale 2**16, a fit's first steps often skip while the scale falls to
        what the gradients allow)."""
        if cause == "nonfinite_input" or self.max_replays == 0:
            return
        settling = self.is_settling(net, cause, scale)
        if not settling:
            if self.replays >= self.max_replays:
                return
            self.replays += 1
        net.history.record_batch("first_nonfinite", first_nonfinite(net, batch, scale, **fit_params))

    def is_settling(self, net: Any, cause: str, scale: float) -> bool:
        """Whether a skipped step is one of the loss scale's settling: an
        ``"overflow"`` skip of a dynamic scaler, above its floor
        (``min_scale``), before the fit's first applied step, in a fit whose
        first skip came at the scaler's initial scale (``init_scale``: a
        fresh scaler, not one that settled in an earlier fit and that
        ``partial_fit`` or a checkpoint carries on)."""
        scaler = getattr(net.precision_, "scaler", None)
        settings = getattr(scaler, "get_settings", dict)()
        if self.settling is None:  # the fit's first skip, before any applied step
            # where the scale starts (within the bounds, for ampnet's scaler); torch's scaler too
            init = getattr(scaler, "_init_scale", settings.get("init_scale"))
            self.settling = init is not None and cause == "overflow" and float(scale) == float(init)
        if not self.settling or cause != "overflow":
            return False
        return bool(settings.get("dynamic", True)) and float(scale) > float(settings.get("min_scale", 0.0))

    # ---- read once per epoch ------------------------------------------------------

    def end_epoch(self) -> dict[str, float]:
        """The epoch's ``grad_norm`` (and ``lost_updates``), read from the
        device in one read."""
        parts = [t for t in (self._norm_sum, self._lost) if t is not None]
        values = torch.cat([t.reshape(-1).to(parts[0].device) for t in parts]).tolist() if parts else []
        out = {"grad_norm": math.nan}
        if self._norm_sum is not None:
            out["grad_norm"] = values.pop(0) / self.applied
        if self.lost_updates:
            out["lost_updates"] = values[0] / values[1] if self._lost is not None and values[1] else math.nan
        return out


# ---- the end of a fit -------------------------------------------------------------


#: Overflow skips count as "repeated" (float16 overflow that loss scaling
#: could not absorb) when at least this many of the last epoch's steps...
REPEATED_OVERFLOWS = 2
#: ... and at least this share of its steps were skipped as ``"overflow"``.
REPEATED_OVERFLOW_SHARE = 0.5


def _overflow_evidence(prec: Any, rows: list[dict]) -> str | None:
    """Why the record points to a float16 overflow that loss scaling could
    not absorb: steps skipped as ``"overflow"`` with the loss scale at its
    floor (``min_scale``), or in at least :data:`REPEATED_OVERFLOWS` steps and
    :data:`REPEATED_OVERFLOW_SHARE` of the epoch's; None otherwise."""
    overflows = [r for r in rows if r.get("step_skipped") and r.get("skip_cause") == "overflow"]
    if not overflows:
        return None
    settings = getattr(prec.scaler, "get_settings", dict)()
    floor = float(settings.get("min_scale", 1.0))
    steps = sum(1 for r in rows if "loss_scale" in r or r.get("step_skipped")) or len(rows)
    at_floor = [r for r in overflows if r.get("loss_scale") is not None and r["loss_scale"] <= floor]
    n = len(overflows)
    if at_floor:
        return f"{n} step{'s' if n > 1 else ''} skipped as overflow, the loss scale at its floor ({floor:g})"
    if n >= REPEATED_OVERFLOWS and n >= REPEATED_OVERFLOW_SHARE * steps:
        return f"{n} of {steps} steps skipped as overflow"
    return None


def _nonfinite_before_any_update(history: Any) -> bool:
    """Whether the fit's first step skipped as ``"nonfinite_loss"`` came
    before any applied step: the loss went non-finite with the initial
    weights, which a learning rate cannot have caused."""
    for epoch in history:
        for row in epoch.get("batches") or []:
            if row.get("skip_cause") == "nonfinite_loss":
                return True
            if row.get("step_skipped") is not True:
                return False
    return False


def nonfinite_loss_message(net: Any) -> str | None:
    """What :meth:`on_train_end` warns about when the last epoch's training
    loss is NaN or inf, or the training loss of one of its batches is (a
    skipped batch, left out of the epoch's mean); None when all are finite.

    The likely cause is read from the record, the evidence considered in
    this order:

    1. bad data: steps skipped as ``"nonfinite_input"``;
    2. a classifier with ``NLLLoss`` whose module does not return
       probabilities (the warning of :mod:`ampnet.training.output_checks` at the
       first batch of the fit): the log of a negative output is NaN;
    3. a float16 overflow, in float16: steps skipped as ``"overflow"`` with
       the loss scale at its floor or repeatedly (:func:`_overflow_evidence`);
       a module named as ``first_nonfinite`` by an ``AmpMonitor``'s replay
       (its activations or gradients overflow at the step's loss scale); or,
       without a replay, a loss that was non-finite before any step was
       applied (the initial weights: no learning rate can have caused it);
    4. otherwise a diverging loss: the learning rate, or an operation that
       gives NaN/inf.
    """
    if not len(net.history):
        return None
    loss = net.history[-1].get("train_loss")
    rows = net.history[-1].get("batches") or []
    # the epoch's train_loss is the mean over the batches whose step was applied
    # (ampnet.training.step.TrainLoss): a skipped batch's own loss tells of a non-finite one
    batch_losses = [r["train_loss"] for r in rows if "train_loss" in r]
    nonfinite = sum(1 for x in batch_losses if not math.isfinite(x))
    if loss is None or (math.isfinite(loss) and not nonfinite):
        return None
    skipped = [r for r in rows if r.get("step_skipped")]
    causes = Counter(r.get("skip_cause") for r in skipped)
    modules = Counter(r["first_nonfinite"] for r in skipped if r.get("first_nonfinite") is not None)
    replayed = any("first_nonfinite" in r for r in skipped)  # an AmpMonitor watched
    prec = net.precision_
    guarded = prec.scaling or prec.settings.skip_nonfinite
    fp16 = prec.enabled and prec.policy.compute_dtype == torch.float16
    state = net.__dict__.get("amp_step_state_")
    if math.isfinite(loss):
        text = (f"Training ended with a non-finite training loss in {nonfinite} of the last epoch's "
                f"{len(batch_losses)} training batches (train_loss={loss:g} is the mean over the batches "
                "whose step was applied")
    else:
        text = f"Training ended with a non-finite training loss (train_loss={loss:g} in the last epoch"
    if guarded:
        listed = ", ".join(f"{n} {c}" for c, n in causes.most_common() if c)
        text += f"; {len(skipped)} of its {len(rows)} batches skipped their step{': ' + listed if listed else ''}"
    text += "). "
    name = modules.most_common(1)[0][0] if modules else None
    where = f" in module {name!r}" if name else " in the module's own forward" if name == "" else ""
    name = name or None  # '' (the root) is no amp_fp32_modules selector
    overflow = _overflow_evidence(prec, rows) if fp16 else None
    if fp16 and not overflow and not replayed and causes["nonfinite_loss"] and _nonfinite_before_any_update(
            net.history):
        overflow = "the loss was non-finite before any step was applied"
    if causes["nonfinite_input"]:
        bad = causes["nonfinite_input"]
        text += (f"Likely cause: bad data ({bad} batch{'es hold' if bad > 1 else ' holds'} NaN or inf "
                 "in the input or target). Fix: clean or impute the data.")
    elif getattr(state, "not_probabilities", False):
        text += (f"Likely cause: the loss set-up, not the precision: {type(net).__name__} trains with "
                 "criterion=NLLLoss, which takes the log of the module's output as class probabilities, "
                 "but the module does not return probabilities (see the warning at the start of the "
                 "fit): the log of a negative output is NaN. Fix: criterion=torch.nn.CrossEntropyLoss "
                 "for a module that returns logits, or end the module's forward with "
                 "torch.softmax(..., dim=-1).")
    elif fp16 and (overflow or modules):
        fp32 = f"amp_fp32_modules=[{name!r}]" if name is not None else (
            "amp_fp32_modules (net.precision_report(X, y) names the overflowing modules; "
            "ampnet.callbacks.AmpMonitor records them as first_nonfinite)")
        evidence = f" ({overflow})" if overflow else ""
        text += (f"Likely cause: a float16 overflow{where}{evidence}, which loss scaling "
                 "could not absorb. Fix: amp_dtype='bfloat16' (the range of float32), or keep the "
                 f"module in float32 with {fp32}; inputs of a large scale (standardize them) "
                 "cause it too.")
    else:
        text += (f"Likely cause: the loss diverged{where}. Fix: lower the learning rate (lr), or "
                 "look for operations in the module or criterion that produce NaN/inf (log of 0, "
                 "division by 0).")
        if fp16 and not replayed:
            text += (" A float16 overflow in the forward pass leaves the same record: "
                     "ampnet.callbacks.AmpMonitor (first_nonfinite) or net.precision_report(X, y) "
                     "names a module that overflows.")
    if guarded:
        text += " Every step whose gradients were not finite was skipped: none reached the weights."
    else:
        text += " The non-finite guard is off (amp_skip_nonfinite=False): the weights may be NaN."
    return text
