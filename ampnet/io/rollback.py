"""All-or-nothing application of a load: the steps of a load (each the
change of one file's contents) are applied in order inside one
:class:`ampnet.config.net_state.NetSnapshot` of the net that also records the
values of the tensors a load overwrites in place, and one snapshot of the
global random streams; when a step fails, both are put back, so the net is
exactly as before. The same snapshot serves ``set_params``, ``initialize``
and adopting a choice of ``'auto'`` (one undo mechanism).

Used by :meth:`ampnet.io.persistence.PersistenceMixin.load_params` after every
file has been read and checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ampnet.config.net_state import NetSnapshot
from ampnet.utils.random_state import capture_random_state

__all__ = ["Step", "apply_all"]


@dataclass
class Step:
    """One change of a load.

    Parameters
    ----------
    source : str
      The file the change comes from, for error messages.

    apply : callable
      Makes the change.

    message : str or None
      A warning to emit once every step has been applied.
    """

    source: str
    apply: Callable[[], None]
    message: str | None = None


def apply_all(net: Any, steps: list[Step]) -> None:
    """Apply ``steps`` to ``net`` in order, or none of them.

    Raises
    ------
    ValueError
      When a step raises an exception: it names the step's file, and the net
      and the random streams are as before the load.

    BaseException
      A ``KeyboardInterrupt`` (or similar) is re-raised after the undo.

    RuntimeError
      If undoing fails too (the net may then be partly loaded).
    """
    snapshot = NetSnapshot(net, values=True)
    restore_random = capture_random_state()
    for step in steps:
        try:
            step.apply()
        except BaseException as exc:
            try:
                snapshot.restore()
                restore_random()
            except Exception as undo_exc:
                raise RuntimeError(
                    f"Loading {step.source} failed ({type(exc).__name__}: {exc}), and undoing "
                    f"the load failed too ({type(undo_exc).__name__}: {undo_exc}); the "
                    "net may be partly loaded. Fix: load the checkpoint again into a new net."
                ) from exc
            if not isinstance(exc, Exception):
                raise
            raise ValueError(
                f"{step.source} passed every check but could not be loaded "
                f"({type(exc).__name__}: {exc}). Everything was rolled back: the net is "
                "exactly as before the load."
            ) from exc
