"""``amp_enabled='auto'``'s choice dropped where a ``set_params`` changes
what decided it: one of the choice's inputs (the parameter table's "drops
auto's choice" column, :func:`ampnet.config.params.auto_inputs`), or one of
its own settings (``amp_autotune__*``) set to another value. The next fit of
an ``'auto'`` net then reads the cache or measures again. The net calls
:func:`drop_stale_choice` inside the change's
:func:`ampnet.config.net_state.all_or_nothing`, before the change is applied.
"""

from __future__ import annotations

from typing import Any

from ampnet.config.params import PARAMS, auto_inputs
from ampnet.config.reconfigure import Change

__all__ = ["drop_stale_choice"]


def drop_stale_choice(net: Any, change: Change) -> None:
    """Drop ``net``'s ``amp_enabled='auto'`` choice where the planned
    ``change`` (:func:`ampnet.config.reconfigure.plan_change`) changes what
    decided it; a net not initialized (``change.kind == 'store'``) keeps
    what it holds. Setting a value it already has changes nothing."""
    if change.kind == "store":
        return
    current = net.get_params_for("amp_autotune")
    tuned = {k.split("__", 1)[1]: v for k, v in change.own.items() if k.startswith("amp_autotune__")}
    if any(current.get(name, PARAMS[f"amp_autotune__{name}"].default) != value for name, value in tuned.items()):
        net.__dict__.pop("amp_autotune_", None)
    elif change.kind == "rebuild" and auto_inputs().intersection(change.kwargs):
        net.__dict__.pop("amp_autotune_", None)  # the next fit measures again
