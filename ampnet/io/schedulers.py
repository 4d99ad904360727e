"""The state of a net's ``LRScheduler`` callbacks, saved as JSON so that a
resumed run continues the learning-rate schedule exactly.

skorch rebuilds a scheduler at the start of ``fit`` from the number of
epochs in the history; that is off by the steps ampnet holds back when
every optimizer step of an epoch was skipped, wrong for ``step_every=
'batch'``, and loses the state of schedulers such as ReduceLROnPlateau.
Saving the scheduler's own ``state_dict`` avoids all three.
"""

from __future__ import annotations

import collections
import copy
import json
import warnings
from typing import Any, Callable

import torch
from skorch.callbacks import LRScheduler

from ampnet.io.untrusted import max_bytes, read_json
from ampnet.io.scheduler_fields import decode_state, field_problems, is_stock, trial_problem
from ampnet.utils.values import is_bool
from ampnet.utils.file_values import type_mismatch

__all__ = ["lr_scheduler_states", "dumps_lr_scheduler_states", "read_lr_scheduler_states",
           "check_lr_scheduler_states", "plan_lr_schedulers", "restore_lr_schedulers"]

_VERSION = 1
_VERSION_KEY = "ampnet_lr_schedulers_version"


def _schedulers(net: Any) -> dict[str, Any]:
    return {name: cb for name, cb in net.callbacks_ if isinstance(cb, LRScheduler)}


def lr_scheduler_states(net: Any) -> dict[str, Any]:
    """The state of every running ``LRScheduler`` callback of ``net``."""
    states = {}
    for name, cb in _schedulers(net).items():
        scheduler = getattr(cb, "lr_scheduler_", None)
        if scheduler is not None:
            states[name] = {
                "policy": type(scheduler).__name__,
                "batch_idx": int(getattr(cb, "batch_idx_", 0)),
                "state": scheduler.state_dict(),
            }
    return {_VERSION_KEY: _VERSION, "schedulers": states}


def dumps_lr_scheduler_states(net: Any, source: str) -> str:
    """:func:`lr_scheduler_states` as JSON text.

    Raises
    ------
    ValueError
      If a scheduler state holds values that JSON cannot store.
    """
    data = lr_scheduler_states(net)
    try:
        return json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"Cannot save {source}: a learning-rate scheduler state holds a value that "
            f"JSON cannot store ({exc}). Fix: pass f_lr_schedulers=None."
        ) from exc


def read_lr_scheduler_states(target: Any, source: str) -> dict[str, Any]:
    """Read and check a file written from :func:`dumps_lr_scheduler_states`.

    Raises
    ------
    ValueError
      Naming ``source``: not JSON, not a scheduler-state file, or a newer
      format.
    """
    data = read_json(target, source, "a JSON file of scheduler states", max_bytes("f_lr_schedulers"))
    if not (isinstance(data, dict) and isinstance(data.get("schedulers"), dict)):
        raise ValueError(
            f"{source} is not an ampnet file of learning-rate scheduler states (expected "
            f"the keys {_VERSION_KEY!r} and 'schedulers'). Was another file passed?"
        )
    version = data.get(_VERSION_KEY)
    if not isinstance(version, int) or version > _VERSION:
        raise ValueError(
            f"{source} has format version {version!r}; this ampnet reads versions up to "
            f"{_VERSION}. Fix: upgrade ampnet."
        )
    for name, entry in data["schedulers"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("policy"), str)
            and isinstance(entry.get("batch_idx"), int)
            and not is_bool(entry["batch_idx"])
            and entry["batch_idx"] >= 0
            and isinstance(entry.get("state"), dict)
        ):
            raise ValueError(
                f"{source} holds an invalid state for scheduler {name!r}: expected "
                "'policy' (str), 'batch_idx' (int >= 0) and 'state' (dict)."
            )
        # a scheduler's load_state_dict sets attributes: none may replace its
        # optimizer or a method
        bad = sorted(k for k in entry["state"] if k == "optimizer" or k.startswith("__"))
        if bad:
            raise ValueError(
                f"{source} holds an invalid state for scheduler {name!r}: the keys {bad} "
                "are not scheduler state. Nothing was loaded."
            )
    return data


def _state_problem(reference: dict[str, Any], state: dict[str, Any], path: str) -> str | None:
    """Why ``state`` cannot be loaded into a scheduler whose own state is
    ``reference``: unknown keys, or values of another type."""
    unknown = sorted(k for k in state if k not in reference)
    if unknown:
        return f"{path} holds keys {unknown[:6]} that the scheduler does not have"
    for key, value in state.items():
        if key == "milestones" and isinstance(reference[key], collections.Counter):
            continue  # data, not field names: checked by scheduler_fields
        problem = type_mismatch(reference[key], value, f"{path}[{key!r}]")
        if problem:
            return problem
    return None


def _entry_problem(net: Any, cb: LRScheduler, scheduler: Any, entry: dict[str, Any],
                   path: str) -> tuple[str | None, dict[str, Any]]:
    """Check one saved scheduler state against ``scheduler`` (the running
    one, or a scratch one built like it); return the problem, if any, and
    the state decoded for ``load_state_dict``.

    For torch's stock classes every field is range-checked and a scratch
    copy steps with the state (:mod:`ampnet.io.scheduler_fields`).
    """
    state = decode_state(entry["policy"], entry["state"])
    problem = _state_problem(scheduler.state_dict(), state, path)
    if problem or not is_stock(type(scheduler)):
        return problem, state
    problems = field_problems(entry["policy"], state, path)
    if problems:
        return "; ".join(problems[:4]), state
    scratch = _scratch_scheduler(net, cb)
    if scratch is not None:
        problem = trial_problem(scratch, copy.deepcopy(state), path)
    return problem, state


def _scratch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer with the same hyper-parameters over one scalar per group,
    to build a scratch scheduler on: of the same class for ``torch.optim``
    optimizers, an SGD otherwise (a user's class is not run for a check)."""
    groups = [
        {
            **{k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names")},
            "params": [torch.zeros(1, requires_grad=True)],
        }
        for group in optimizer.param_groups
    ]
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim"):
        cls = torch.optim.SGD
        groups = [
            {k: v for k, v in group.items() if k in ("params", "lr", "initial_lr", "momentum")}
            for group in groups
        ]
    return cls(groups)


def _scratch_scheduler(net: Any, cb: LRScheduler) -> Any:
    """A scheduler of ``cb``'s policy and arguments on a scratch optimizer
    (see :func:`_scratch_optimizer`); None where none can be built."""
    try:
        policy = cb._get_policy_cls()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return policy(_scratch_optimizer(net.optimizer_), **cb.kwargs)
    except Exception:  # an exotic scheduler or optimizer: checked when restored
        return None


def check_lr_scheduler_states(net: Any, data: dict[str, Any], source: str) -> None:
    """Check the saved states against the net's ``LRScheduler`` callbacks
    before anything is loaded (their schedulers may not be running yet:
    a scratch scheduler of the same policy and arguments stands in).

    Raises
    ------
    ValueError
      Naming ``source`` and the field: a key the scheduler does not have,
      a value of another type than the scheduler's own, or (torch's stock
      schedulers) a value out of range or one that makes a step fail or the
      learning rate NaN, infinite or negative.
    """
    callbacks = _schedulers(net)
    for name, entry in data["schedulers"].items():
        cb = callbacks.get(name)
        if cb is None:
            continue  # not restored (restore_lr_schedulers says why)
        scheduler = getattr(cb, "lr_scheduler_", None) or _scratch_scheduler(net, cb)
        if scheduler is None or type(scheduler).__name__ != entry["policy"]:
            continue
        problem, _ = _entry_problem(net, cb, scheduler, entry, f"schedulers[{name!r}]['state']")
        if problem:
            raise ValueError(
                f"{source} holds an invalid state for scheduler {name!r}: {problem}. "
                "Nothing was loaded."
            )


def plan_lr_schedulers(
    net: Any, data: dict[str, Any], source: str
) -> tuple[Callable[[], None], list[str], list[tuple[Any, Any]]]:
    """Check the saved states against the running schedulers; return what
    loads them, the notes on what cannot be restored, and the (callback,
    scheduler) pairs that loading changes.

    Raises
    ------
    ValueError
      See :func:`check_lr_scheduler_states`; nothing is changed then.
    """
    notes = []
    planned = []
    saved = data["schedulers"]
    running = _schedulers(net)
    for name, entry in saved.items():
        cb = running.get(name)
        scheduler = getattr(cb, "lr_scheduler_", None)
        if cb is None:
            notes.append(f"the net has no LRScheduler callback {name!r}")
        elif scheduler is None:
            notes.append(
                f"LRScheduler {name!r} is not running (the net is not training); "
                "ampnet.callbacks.checkpoint.LoadInitState restores it when training starts"
            )
        elif type(scheduler).__name__ != entry["policy"]:
            notes.append(
                f"LRScheduler {name!r} is a {type(scheduler).__name__}, the file holds a "
                f"{entry['policy']}"
            )
        else:
            problem, state = _entry_problem(
                net, cb, scheduler, entry, f"schedulers[{name!r}]['state']"
            )
            if problem:
                raise ValueError(
                    f"{source} holds an invalid state for scheduler {name!r}: {problem}. "
                    "Nothing was loaded."
                )
            planned.append((cb, scheduler, {**entry, "state": state}))
    for name, cb in running.items():
        if name not in saved and getattr(cb, "lr_scheduler_", None) is not None:
            notes.append(
                f"LRScheduler {name!r} has no saved state; skorch rebuilt it from the history"
            )

    def apply() -> None:
        for cb, scheduler, entry in planned:
            scheduler.load_state_dict(copy.deepcopy(entry["state"]))
            cb.batch_idx_ = entry["batch_idx"]

    return apply, notes, [(cb, scheduler) for cb, scheduler, _ in planned]


def restore_lr_schedulers(net: Any, data: dict[str, Any], source: str = "the file") -> list[str]:
    """Load the saved states into the net's running schedulers.

    Returns
    -------
    notes : list of str
      What could not be restored: schedulers that are not running (the net
      is not training), missing from the file or from ``callbacks``, or of
      another policy.

    Raises
    ------
    ValueError
      See :func:`plan_lr_schedulers`; nothing is changed then.
    """
    apply, notes, _ = plan_lr_schedulers(net, data, source)
    apply()
    return notes
