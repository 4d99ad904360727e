"""What nets pickled by ampnet 0.3 may carry, kept so that they unpickle.

0.3 kept ``amp_fp32_modules='auto'``'s choice in state-dict hooks on the root
module (``ampnet.precision.auto.AutoChoiceHooks``); the choice now travels
through ``save_params`` (:mod:`ampnet.auto.saved`) and the layout
(``amp_layout_.auto_fp32_modules``). An unpickled 0.3 net's hooks are inert,
and :func:`remove_legacy_hooks` takes them off when the precision component
detaches from the module.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AutoChoiceHooks", "remove_legacy_hooks"]


class AutoChoiceHooks:
    """0.3's state-dict hooks of ``amp_fp32_modules='auto'``: inert."""

    choice: Any = None
    loaded: Any = None

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        return None

    def load(self, *args: Any, **kwargs: Any) -> None:
        return None


def _is_legacy(hook: Any) -> bool:
    hook = getattr(hook, "hook", hook)
    return isinstance(hook, AutoChoiceHooks) or isinstance(getattr(hook, "__self__", None), AutoChoiceHooks)


def remove_legacy_hooks(root: torch.nn.Module) -> None:
    """Remove 0.3's hooks (:class:`AutoChoiceHooks`) from ``root``."""
    for hooks in (root._state_dict_hooks, root._load_state_dict_pre_hooks):
        for key in [k for k, h in hooks.items() if _is_legacy(h)]:
            del hooks[key]
