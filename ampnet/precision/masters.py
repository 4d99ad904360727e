"""Float32 master weights for ``amp_level='pure'``.

The module stores the parameters named in the layout in the low-precision
dtype; the optimizer updates float32 copies ("masters") kept by the net in
``amp_master_params_`` (a dict from parameter name to
:class:`torch.nn.Parameter`). Masters are looked up by name, so they stay
tied to the module through pickle, ``deepcopy`` and ``torch.compile``.

Hooks on the root module make its ``state_dict()`` hold float32 weights
and its ``load_state_dict()`` refresh the masters, whoever calls them.
"""

from __future__ import annotations

import torch

__all__ = [
    "make_masters",
    "narrow",
    "move_grads",
    "sync_module",
    "Float32StateDict",
    "LoadIntoMasters",
    "install_state_hooks",
    "remove_state_hooks",
    "find_state_hook",
]


def _params(root: torch.nn.Module, names: tuple[str, ...] | list[str]) -> list[torch.nn.Parameter]:
    by_name = dict(root.named_parameters(remove_duplicate=False))
    return [by_name[n] for n in names]


def make_masters(root: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.nn.Parameter]:
    """Float32 copies of the named (still float32) parameters of ``root``."""
    return {
        n: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        for n, p in zip(names, _params(root, names))
    }


def narrow(root: torch.nn.Module, names: tuple[str, ...], dtype: torch.dtype) -> None:
    """Store the named parameters in ``dtype`` (same Parameter objects, so
    references held elsewhere stay valid; strides are preserved)."""
    for p in _params(root, names):
        p.data = p.data.to(dtype)
        if p.grad is not None:
            p.grad = None


def move_grads(root: torch.nn.Module, masters: dict[str, torch.nn.Parameter]) -> None:
    """Add the module's low-precision gradients, in float32, to the masters'
    ``.grad`` and clear them on the module (accumulation happens in float32)."""
    for (name, master), p in zip(masters.items(), _params(root, list(masters))):
        grad = p.grad
        if grad is None:
            continue
        grad = grad.to(master.dtype)
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)
        p.grad = None


@torch.no_grad()
def sync_module(root: torch.nn.Module, masters: dict[str, torch.nn.Parameter]) -> None:
    """Refresh the module's low-precision parameters from the masters."""
    if masters:
        torch._foreach_copy_(_params(root, list(masters)), list(masters.values()))


class Float32StateDict:
    """``state_dict`` post-hook of the root module in ``'pure'``: the entries
    of the low-precision parameters hold float32 values (the masters, or an
    upcast copy without masters), so every writer of ``module.state_dict()``
    (``save_params``, checkpoints, user code) saves float32 weights. With
    ``low=True`` the hook does nothing and the entries hold the weights as
    the module stores them.
    """

    def __init__(self, names: tuple[str, ...], masters: dict[str, torch.nn.Parameter] | None) -> None:
        self.names = names
        self.masters = masters
        self.low = False

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if self.low:
            return
        for name in self.names:
            key = prefix + name
            value = state_dict.get(key)
            if value is None:
                continue
            if self.masters:
                master = self.masters[name]
                state_dict[key] = master if isinstance(value, torch.nn.Parameter) else master.detach()
            else:
                state_dict[key] = value.to(torch.float32)


class LoadIntoMasters:
    """``load_state_dict`` pre-hook of the root module in ``'pure'`` with
    master weights: loaded values (float32 or low precision) are copied into
    the float32 masters at full precision before the module's own
    low-precision parameters receive them."""

    def __init__(self, masters: dict[str, torch.nn.Parameter]) -> None:
        self.masters = masters

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        with torch.no_grad():
            for name, master in self.masters.items():
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)


def install_state_hooks(
    root: torch.nn.Module, names: tuple[str, ...], masters: dict[str, torch.nn.Parameter] | None
) -> None:
    """Register :class:`Float32StateDict` (and, with masters,
    :class:`LoadIntoMasters`) on ``root``."""
    # the public registration methods are recent; the private ones are old
    post = getattr(root, "register_state_dict_post_hook", root._register_state_dict_hook)
    post(Float32StateDict(names, masters))
    if masters:
        root._register_load_state_dict_pre_hook(LoadIntoMasters(masters), with_module=True)


def _ours(hook: object) -> bool:
    return isinstance(getattr(hook, "hook", hook), (Float32StateDict, LoadIntoMasters))


def remove_state_hooks(root: torch.nn.Module) -> None:
    """Remove the hooks of :func:`install_state_hooks` from ``root``."""
    for hooks in (root._state_dict_hooks, root._load_state_dict_pre_hooks):
        for key in [k for k, h in hooks.items() if _ours(h)]:
            del hooks[key]


def find_state_hook(root: torch.nn.Module) -> Float32StateDict | None:
    """The :class:`Float32StateDict` hook of ``root``, if any."""
    for hook in root._state_dict_hooks.values():
        if isinstance(hook, Float32StateDict):
            return hook
    return None
