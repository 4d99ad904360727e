"""All-or-nothing application of a load: every change is a :class:`Step`
that first takes a snapshot of what it changes; when a step fails, the
steps applied so far are undone in reverse order, so the net is exactly as
before.

Used by :meth:`ampnet.io.persistence.PersistenceMixin.load_params` after every
file has been read and checked.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

__all__ = [
    "Step", "apply_all", "snapshot_module", "snapshot_optimizer", "snapshot_attributes",
    "snapshot_attribute",
]

Restore = Callable[[], None]


@dataclass
class Step:
    """One change of a load.

    Parameters
    ----------
    source : str
      The file the change comes from, for error messages.

    apply : callable
      Makes the change.

    snapshot : callable
      Takes a snapshot of what ``apply`` changes and returns the function
      that restores it.

    message : str or None
      A warning to emit once every step has been applied.
    """

    source: str
    apply: Callable[[], None]
    snapshot: Callable[[], Restore]
    message: str | None = None


def apply_all(steps: list[Step]) -> None:
    """Apply ``steps`` in order, or none of them.

    Raises
    ------
    ValueError
      When a step raises an exception: it names the step's file, and every
      step applied so far (the failing one included) has been undone.

    BaseException
      A ``KeyboardInterrupt`` (or similar) is re-raised after the undo.

    RuntimeError
      If undoing fails too (the net may then be partly loaded).
    """
    restores = [step.snapshot() for step in steps]
    for index, step in enumerate(steps):
        try:
            step.apply()
        except BaseException as exc:
            failures = []
            for restore in reversed(restores[: index + 1]):
                try:
                    restore()
                except Exception as undo_exc:  # keep undoing the others
                    failures.append(undo_exc)
            if failures:
                raise RuntimeError(
                    f"Loading {step.source} failed ({type(exc).__name__}: {exc}), and undoing "
                    f"the load failed too ({type(failures[0]).__name__}: {failures[0]}); the "
                    "net may be partly loaded. Fix: load the checkpoint again into a new net."
                ) from exc
            if not isinstance(exc, Exception):
                raise
            raise ValueError(
                f"{step.source} passed every check but could not be loaded "
                f"({type(exc).__name__}: {exc}). Everything was rolled back: the net is "
                "exactly as before the load."
            ) from exc


def snapshot_module(module: torch.nn.Module, extra: Iterable[torch.Tensor] = ()) -> Restore:
    """Snapshot the values of a module's parameters and buffers (and of
    ``extra`` tensors, e.g. float32 master weights), copied to the CPU."""
    tensors = [
        (t, t.detach().to("cpu", copy=True))
        for t in itertools.chain(module.parameters(), module.buffers(), extra)
        if not torch.nn.parameter.is_lazy(t)
    ]
    extra_states = [
        (m, copy.deepcopy(m.get_extra_state()))
        for m in module.modules()
        if type(m).get_extra_state is not torch.nn.Module.get_extra_state
    ]

    def restore() -> None:
        with torch.no_grad():
            for tensor, saved in tensors:
                tensor.copy_(saved)
        for m, state in extra_states:
            m.set_extra_state(state)

    return restore


def snapshot_optimizer(optimizer: torch.optim.Optimizer) -> Restore:
    """Snapshot an optimizer's state and parameter groups (``load_state_dict``
    replaces both with new objects, so references suffice)."""
    state, groups = optimizer.state, optimizer.param_groups
    contents = [dict(group) for group in groups]

    def restore() -> None:
        for group, saved in zip(groups, contents):
            group.clear()
            group.update(saved)
        optimizer.state = state
        optimizer.param_groups = groups

    return restore


def snapshot_attributes(obj: Any, names: Iterable[str] | None = None) -> Restore:
    """Snapshot the attributes of ``obj`` (all, or ``names``), with the
    values of the tensors among them."""
    names = None if names is None else list(names)
    if names is None:
        saved = dict(vars(obj))
    else:
        saved = {name: vars(obj)[name] for name in names if name in vars(obj)}
    absent = [name for name in names or () if name not in saved]
    tensors = [(t, t.detach().clone()) for t in saved.values() if isinstance(t, torch.Tensor)]

    def restore() -> None:
        if names is None:
            vars(obj).clear()
        for name in absent:
            vars(obj).pop(name, None)
        vars(obj).update(saved)
        with torch.no_grad():
            for tensor, value in tensors:
                tensor.copy_(value)

    return restore


def snapshot_attribute(obj: Any, name: str) -> Restore:
    """Snapshot one attribute (also a property, such as skorch's
    ``history``) that a step replaces by a new object."""
    value = getattr(obj, name)

    def restore() -> None:
        setattr(obj, name, value)

    return restore
