"""The state of a net's ``LRScheduler`` callbacks, saved as JSON so that a
resumed run continues the learning-rate schedule exactly.

skorch rebuilds a scheduler at the start of ``fit`` from the number of
epochs in the history; that is off by the steps ampnet holds back when
every optimizer step of an epoch was skipped, wrong for ``step_every=
'batch'``, and loses the state of schedulers such as ReduceLROnPlateau.
Saving the scheduler's own ``state_dict`` avoids all three.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from skorch.callbacks import LRScheduler

from ampnet.io.atomic import read_json

__all__ = ["lr_scheduler_states", "dumps_lr_scheduler_states", "read_lr_scheduler_states",
           "restore_lr_schedulers"]

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
    data = read_json(target, source, "a JSON file of scheduler states")
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
            and isinstance(entry.get("state"), dict)
        ):
            raise ValueError(
                f"{source} holds an invalid state for scheduler {name!r}: expected "
                "'policy' (str), 'batch_idx' (int) and 'state' (dict)."
            )
    return data


def restore_lr_schedulers(net: Any, data: dict[str, Any]) -> list[str]:
    """Load the saved states into the net's running schedulers.

    Returns
    -------
    notes : list of str
      What could not be restored: schedulers that are not running (the net
      is not training), missing from the file or from ``callbacks``, or of
      another policy.
    """
    notes = []
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
            scheduler.load_state_dict(copy.deepcopy(entry["state"]))
            cb.batch_idx_ = entry["batch_idx"]
    for name, cb in running.items():
        if name not in saved and getattr(cb, "lr_scheduler_", None) is not None:
            notes.append(
                f"LRScheduler {name!r} has no saved state; skorch rebuilt it from the history"
            )
    return notes
