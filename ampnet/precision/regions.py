"""Per-module autocast regions, installed as forward hooks.

An :class:`AutocastRegion` turns autocast off (float32 region) or on in the
low-precision dtype (low-precision region) for the duration of one module's
forward, without touching the module's ``forward``. It is registered as a
forward pre-hook and an ``always_call`` forward hook, so the autocast state
is restored even when the forward raises. The hooks are plain picklable
objects; they travel with the module through pickle, ``deepcopy`` and
``torch.compile`` (dynamo traces them without graph breaks).
"""

from __future__ import annotations

from typing import Any

import torch

from ampnet.utils.tree import cast_floating
from ampnet.precision.policy import dtype_name

__all__ = ["AutocastRegion", "install_region", "remove_regions", "regions_of"]


class AutocastRegion:
    """Autocast state for one module's forward.

    Parameters
    ----------
    device_type : str
      The autocast device type (``'cpu'``, ``'cuda'``, ...).

    dtype : torch.dtype or None
      None: a float32 region (autocast off inside, low-precision floating
      inputs cast to float32). A low-precision dtype: autocast on in that
      dtype inside, low-precision floating outputs cast to float32 (used
      with ``amp_modules``, where the rest of the model runs in float32).

    Notes
    -----
    The state saved on entry is kept on a per-instance stack, so a region
    module must not run its forward concurrently from several threads.
    """

    def __init__(self, device_type: str, dtype: torch.dtype | None = None) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._saved: list[tuple[bool, torch.dtype]] = []

    def pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        dev = self.device_type
        self._saved.append((torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        if self.dtype is None:
            torch.set_autocast_enabled(dev, False)
            args = cast_floating(args, torch.float32)
            kwargs = cast_floating(kwargs, torch.float32)
        else:
            torch.set_autocast_enabled(dev, True)
            torch.set_autocast_dtype(dev, self.dtype)
        torch.autocast_increment_nesting()
        return args, kwargs

    def post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._saved:  # an earlier pre-hook raised before ours ran
            return None
        enabled, dtype = self._saved.pop()
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(self.device_type, enabled)
        torch.set_autocast_dtype(self.device_type, dtype)
        if self.dtype is not None and output is not None:
            return cast_floating(output, torch.float32)
        return None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_saved"] = []
        return state

    def __repr__(self) -> str:
        kind = "float32" if self.dtype is None else dtype_name(self.dtype)
        return f"AutocastRegion({self.device_type!r}, {kind})"


def install_region(module: torch.nn.Module, region: AutocastRegion) -> None:
    """Register ``region``'s hooks on ``module``."""
    module.register_forward_pre_hook(region.pre_hook, with_kwargs=True)
    module.register_forward_hook(region.post_hook, with_kwargs=True, always_call=True)


def _is_region_hook(hook: Any) -> bool:
    return isinstance(getattr(hook, "__self__", None), AutocastRegion)


def remove_regions(root: torch.nn.Module) -> None:
    """Remove every :class:`AutocastRegion` hook from ``root`` and its submodules."""
    for module in root.modules():
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if _is_region_hook(hook):
                del module._forward_pre_hooks[hook_id]
                module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
        for hook_id, hook in list(module._forward_hooks.items()):
            if _is_region_hook(hook):
                del module._forward_hooks[hook_id]
                module._forward_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)


def regions_of(root: torch.nn.Module) -> dict[str, AutocastRegion]:
    """The regions installed on ``root``'s modules, by qualified name."""
    found = {}
    for name, module in root.named_modules():
        for hook in module._forward_pre_hooks.values():
            if _is_region_hook(hook):
                found[name] = hook.__self__
    return found
