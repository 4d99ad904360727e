"""Per-batch values kept on the device until something reads them.

skorch writes each batch's loss into the history as a Python float
(``loss.item()``), and ampnet read each step's non-finite flag on the host
to decide whether to skip it: two host syncs a step, which on a GPU stall
the CPU until the device has caught up. Here the per-batch values (the loss,
the step's skipped flag, and what follows from it: ``skip_cause``, the
epoch's skip counts, ``train_loss``'s skipped rows) stay on the device in a
:class:`BatchRecords` buffer, and are read in one transfer, and written into
the history, when

- the epoch's training (or validation) loop ends, before ``on_epoch_end``;
- anything reads the history: :class:`DeferredHistory` writes them before
  any read (``net.history[-1, 'batches', -1, 'train_loss']`` in a
  callback's ``on_batch_end``, ``ProgressBar``, pickling, ``to_file``), so
  a reader sees exactly the history skorch's loop would have written;
- ``max_pending`` steps are waiting (at most ``amp_max_consecutive_skips``,
  so that a run of skipped steps stops the fit at most that many steps late).

Until then a row holds :data:`PENDING` where a value will go (so that the
keys keep skorch's order); only code that kept a row from an earlier read
and reads it again without the history can see it.

A step whose outcome must be known on the host at once (loss scaling, an
optimizer without an on-device skip, an ``AmpMonitor``, an LR scheduler
that steps every batch, data parallelism, skorch's closure path) is
written at once (:meth:`BatchRecords.flush` right after it): the same code
path, read at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from skorch.history import History

__all__ = ["DeferredHistory", "BatchRecords", "StepEntry", "SkipGuard", "PENDING", "current_row"]


class _Pending:
    """The placeholder of a value still on the device."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<pending: read net.history to get it>"

    def __reduce__(self) -> str:
        return "PENDING"


#: The placeholder a batch row holds until its value is read from the device.
PENDING = _Pending()


class DeferredHistory(History):
    """skorch's :class:`~skorch.history.History`, whose current epoch may
    hold values still on the device (:class:`BatchRecords`): every read
    writes them first, so readers see the history as skorch writes it.
    skorch's writers (``new_epoch``, ``new_batch``, ``record``,
    ``record_batch``) read nothing and write nothing pending."""

    _records: "BatchRecords | None" = None

    def _resolve(self) -> None:
        records = self.__dict__.get("_records")
        if records is not None and records.entries:
            records.flush()

    def attach(self, records: "BatchRecords | None") -> None:
        """Let ``records`` write their pending values before any read."""
        self.__dict__["_records"] = records

    # ---- readers: the pending values first ----------------------------------------

    def __getitem__(self, i: Any) -> Any:
        self._resolve()
        return super().__getitem__(i)

    def __iter__(self) -> Any:
        self._resolve()
        return list.__iter__(self)

    def __reversed__(self) -> Any:
        self._resolve()
        return list.__reversed__(self)

    def __contains__(self, value: Any) -> bool:
        self._resolve()
        return list.__contains__(self, value)

    def __eq__(self, other: Any) -> bool:
        self._resolve()
        return list.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  # a list's

    def __repr__(self) -> str:
        self._resolve()
        return list.__repr__(self)

    def to_list(self) -> list:
        self._resolve()
        return list(list.__iter__(self))

    def copy(self) -> list:
        self._resolve()
        return list.copy(self)

    def __getstate__(self) -> dict[str, Any]:
        self._resolve()
        state = dict(self.__dict__)
        state.pop("_records", None)
        return state

    def clear(self) -> None:
        records = self.__dict__.get("_records")
        if records is not None:
            records.discard()
        list.clear(self)

    # ---- writers: no read --------------------------------------------------------

    def new_batch(self) -> None:
        list.__getitem__(self, -1)["batches"].append({})

    def record(self, attr: str, value: Any) -> None:
        if not list.__len__(self):
            raise ValueError("Call new_epoch before recording for the first time.")
        list.__getitem__(self, -1)[attr] = value

    def record_batch(self, attr: str, value: Any) -> None:
        list.__getitem__(self, -1)["batches"][-1][attr] = value


def current_row(history: Any) -> tuple[int, dict] | None:
    """``(index, row)`` of the current epoch's last batch, read without
    writing pending values (None outside an epoch's batches); ``history``
    is skorch's ``History`` or another of its kinds (``DistributedHistory``)."""
    if not len(history):
        return None
    last = list.__getitem__(history, -1) if isinstance(history, list) else history[-1]
    batches = last.get("batches")
    if not batches:
        return None
    return len(batches) - 1, batches[-1]


@dataclass(slots=True)
class StepEntry:
    """A training step (a real one: an accumulation group's boundary)
    whose outcome may still be on the device.

    Attributes
    ----------
    rows : list of (int, dict)
      The epoch's batch rows of its micro-batches, by index.
    skipped : list
      One flag per optimizer in ``optimizers``: a bool, or a tensor on the
      device, > 0 where that optimizer skipped (on the device, for a
      deferred step).
    optimizers : tuple of str
      The optimizers that had gradients.
    losses : list of tensors
      The micro-batches' losses (the cause of a skip).
    sources : list
      A deferred step: ``(arrays, rows)`` of its micro-batches, from which
      its input is read again where it was skipped (was it bad data?).
    bad : bool
      An eager step: its input held NaN or inf.
    cause : str or None
      An eager step: why it was skipped (None: not skipped).
    """

    rows: list
    skipped: list
    optimizers: tuple
    losses: list
    sources: list | None = None
    bad: bool = False
    cause: str | None = None


@dataclass
class BatchRecords:
    """The current epoch's per-batch values still on the device, and the
    writer of their history (see the module's docs).

    Parameters
    ----------
    finish_step : callable
      ``finish_step(entry, skipped)`` (``skipped``: a bool per optimizer):
      what a step's outcome writes and counts once it is read
      (:func:`ampnet.training.step.finish_step`); may raise
      :class:`~ampnet.exceptions.AmpDivergenceError`.
    finish_applied : callable
      ``finish_applied(entries)``: the same for steps none of whose
      optimizers skipped (:func:`ampnet.training.step.finish_applied`).
    max_pending : int
      Steps that may wait before they are read.
    """

    finish_step: Callable[..., None]
    finish_applied: Callable[..., None]
    max_pending: int = 1024
    values: list = field(default_factory=list)  # (row, key, tensor)
    steps: list = field(default_factory=list)  # StepEntry, each flag a tensor

    @property
    def entries(self) -> bool:
        """Whether anything is pending."""
        return bool(self.values or self.steps)

    def add_value(self, row: dict, key: str, value: torch.Tensor) -> None:
        """Write ``value`` (a one-element tensor) into ``row[key]`` when read."""
        row[key] = PENDING
        self.values.append((row, key, value))

    def add_step(self, entry: StepEntry) -> None:
        """A step whose outcome stays on the device (its flags: tensors), read
        when the records are."""
        self.steps.append(entry)
        if len(self.steps) >= self.max_pending:
            self.flush()

    def finish_now(self, entry: StepEntry) -> None:
        """A step whose outcome was read on the host at once: the steps
        before it first, in order."""
        if self.steps:
            self.flush()
        self.finish_step(entry, tuple(bool(s) for s in entry.skipped))

    def discard(self) -> None:
        """Forget what is pending (the history was cleared)."""
        self.values, self.steps = [], []

    def flush(self) -> None:
        """Read every pending value in one transfer (one per device, where
        they are on several), and write the history."""
        values, steps = self.values, self.steps
        self.values, self.steps = [], []
        if not values and not steps:
            return
        tensors = [t for _, _, t in values]
        for entry in steps:
            tensors += entry.skipped
        out = _read(tensors)
        for (row, key, _), value in zip(values, out):  # every value first: a step below may stop the fit
            row[key] = value
        flags = out[len(values):]
        if not steps:
            return
        if not any(flags):
            self.finish_applied(steps)
            return
        outcomes = []
        flags = iter(flags)
        for entry in steps:
            outcomes.append((entry, tuple(next(flags) > 0 for _ in entry.skipped)))
        for i, (entry, skipped) in enumerate(outcomes):
            try:
                self.finish_step(entry, skipped)
            except BaseException:  # the fit stops here: the later steps' rows say what happened to them
                for later, later_skipped in outcomes[i + 1:]:
                    if later.rows and later.rows[-1][1].get("step_skipped") is PENDING:
                        later.rows[-1][1]["step_skipped"] = any(later_skipped)
                raise


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of one-element ``tensors`` as floats, in order: one read
    (a stack, which widens mixed floating dtypes exactly), or one per device
    and dtype where they cannot be stacked together."""
    if not tensors:
        return []
    try:
        return torch.stack(tensors).tolist() if tensors[0].dim() == 0 else _by_group(tensors)
    except RuntimeError:  # on several devices, or of several shapes
        return _by_group(tensors)


def _by_group(tensors: list[torch.Tensor]) -> list[float]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[float] = [0.0] * len(tensors)
    for positions in groups.values():
        stacked = torch.stack([tensors[i].reshape(()) for i in positions])
        for i, value in zip(positions, stacked.tolist()):
            out[i] = float(value)
    return out


class SkipGuard:
    """``amp_max_consecutive_skips`` kept on the device, for steps whose
    outcome is read later (on a GPU, where a read every few steps would
    stall it): once that many steps in a row were skipped, every later step
    skips too, on the device, so that no step after the limit reaches the
    weights; the records then stop the fit at their next read, at the step
    that reached the limit, as a fit that reads every step stops.

    Parameters
    ----------
    limit : int
      ``amp_max_consecutive_skips``.
    run : int
      Steps skipped in a row before this fit (a run goes on across fits).
    device : torch.device
      Where the flags are.
    """

    def __init__(self, limit: int, run: int, device: torch.device) -> None:
        self.limit = limit
        self.run = torch.full((), float(run), device=device)

    def reset(self, run: int) -> None:
        """The run as counted on the host (after a step read at once)."""
        self.run = torch.full((), float(run), device=self.run.device)

    def apply(self, flags: list[torch.Tensor]) -> list[torch.Tensor]:
        """The flags the optimizers skip on (> 0: skip): theirs, or all
        set once the limit is reached; the run moves on (no host read)."""
        blocked = (self.run >= self.limit).to(flags[0].dtype)
        flags = [torch.maximum(flag, blocked) for flag in flags]
        skipped = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
        self.run = (self.run + 1) * skipped
        return flags
