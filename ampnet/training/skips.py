"""Skipped steps, once their outcome is known on the host: a skipped
batch's ``step_skipped`` and ``skip_cause`` in its history row, the
epoch's applied optimizers and left-out rows, runs of skipped steps, their
warnings, and the divergence limit (``amp_max_consecutive_skips``)."""

from __future__ import annotations

from typing import Any

from ampnet.exceptions import AmpDivergenceError, amp_warn
from ampnet.training.records import PENDING, StepEntry
from ampnet.utils.tree import has_nonfinite

__all__ = ["finish_step", "finish_applied", "skip_cause", "bad_rows"]


def bad_rows(sources: list) -> bool:
    """Whether the rows ``sources`` name (``(arrays, rows)`` pairs) hold NaN or inf."""
    return any(has_nonfinite(arrays.gather(rows)) for arrays, rows in sources)


def finish_applied(net: Any, entries: list) -> None:
    """:func:`finish_step` for steps none of whose optimizers skipped: their
    rows' ``step_skipped`` is False, and no run of skipped steps goes on."""
    state = net.amp_step_state_
    for entry in entries:
        state.stepped_epoch.update(entry.optimizers)
        if entry.rows:
            row = entry.rows[-1][1]
            if row.get("step_skipped") is PENDING:
                row["step_skipped"] = False
    state.consecutive_skips = state.nonfinite_inputs = 0


def finish_step(net: Any, entry: StepEntry, skipped: tuple[bool, ...]) -> None:
    """What a step's outcome writes and counts once it is known on the host:
    ``step_skipped`` and a skipped step's ``skip_cause`` in its batch row,
    the epoch's applied optimizers and skipped rows, the runs of skipped
    steps (their warnings, and :class:`~ampnet.exceptions.AmpDivergenceError`
    after ``amp_max_consecutive_skips`` in a row)."""
    state = net.amp_step_state_
    row = entry.rows[-1][1] if entry.rows else None
    if not any(skipped):  # the common case, briefly
        state.stepped_epoch.update(entry.optimizers)
        if row is not None and row.get("step_skipped") is PENDING:
            row["step_skipped"] = False
        state.consecutive_skips = state.nonfinite_inputs = 0
        return
    stepped = [name for name, skip in zip(entry.optimizers, skipped) if not skip]
    state.stepped_epoch.update(stepped)
    bad_data, cause = entry.bad, entry.cause
    if cause is None:  # a deferred step: its cause, from what the arrays and the losses hold
        bad_data = bad_rows(entry.sources or [])
        cause = skip_cause(bad_data, entry.losses)
    if not stepped:  # no optimizer stepped: left out of the epoch's train_loss (TrainLoss)
        state.skipped_rows.update(index for index, _ in entry.rows)
    if row is not None:
        _insert_before(row, "skip_cause", cause, "step_skipped")
        row["step_skipped"] = True
    _count_run(net, state, True, bad_data, row)


def _insert_before(row: dict, key: str, value: Any, before: str) -> None:
    """``row[key] = value``, placed before ``before`` (where the step wrote its
    records in this order), keeping the other keys' order."""
    if before not in row:
        row[key] = value
        return
    items = list(row.items())
    row.clear()
    for k, v in items:
        if k == before:
            row[key] = value
        row[k] = v


def _insert_after(row: dict, key: str, value: Any, after: str) -> None:
    """``row[key] = value``, placed after ``after``, keeping the other keys' order."""
    items = list(row.items())
    if after not in row or items[-1][0] == after:
        row[key] = value
        return
    row.clear()
    for k, v in items:
        row[k] = v
        if k == after:
            row[key] = value


def skip_cause(bad_data: bool, losses: list) -> str:
    """Why a step was skipped: ``'nonfinite_input'`` (its batch held NaN or
    inf), ``'nonfinite_loss'`` (a loss of its micro-batches was NaN or inf:
    the forward pass already went non-finite) or ``'overflow'`` (finite data
    and loss, non-finite gradients: the backward pass overflowed). Reads the
    losses only here, on a skipped step."""
    if bad_data:
        return "nonfinite_input"
    return "nonfinite_loss" if has_nonfinite(losses) else "overflow"


def _count_run(net: Any, state: Any, skipped: bool, bad_data: bool, row: dict | None) -> None:
    """Count runs of skipped steps (a micro-batch inside an accumulation
    group is no step and neither ends nor extends a run); warn of each
    skipped step, and stop the fit after ``amp_max_consecutive_skips``."""
    if not skipped:
        state.consecutive_skips = 0
        state.nonfinite_inputs = 0
        return
    state.consecutive_skips += 1
    state.epoch_skips += 1
    if bad_data:
        state.nonfinite_inputs += 1
        if row is not None:  # where the step wrote it: after its own records
            _insert_after(row, "nonfinite_input", True, "loss_scale" if "loss_scale" in row else "step_skipped")
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


def _divergence_message(net: Any, state: Any) -> str:
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
