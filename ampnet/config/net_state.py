"""All or nothing for ``set_params`` and ``initialize``: a snapshot of a
net that puts back everything these may change.

``set_params`` and ``initialize`` replace some of a net's parts (a new
``module_``, ``optimizer_``, ``precision_``) and change others in place:
skorch reuses a module instance and moves it to the device, the precision
component detaches the module (widens low-precision parameters, removes the
autocast regions' hooks), skorch re-initializes every callback and sets
virtual parameters (``lr``, ``optimizer__momentum``) in the optimizers'
parameter groups, and the live loss scaler takes new settings.
:func:`all_or_nothing` records, before any of that, the net's attributes
and the state of each such part, and restores them if the body raises:
the same objects (a reference held elsewhere stays valid) with the same
attributes, parameter data and dtypes, gradients, hooks, optimizer state
and loss scale.

Nothing is copied but containers and the loss scaler's scalar tensors:
parameter data is kept by reference (the parts that change it replace
``.data`` rather than write into it), so a snapshot costs no memory of the
model's size. A load, which writes into tensors in place, asks for their
values too (``values=True``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import torch

__all__ = ["NetSnapshot", "all_or_nothing"]

_Undo = Callable[[], None]


def _restore_container(container: Any, saved: Any) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(saved)
    elif isinstance(container, list):
        container[:] = saved
    elif isinstance(container, set):
        container.clear()
        container.update(saved)


def _containers(value: Any, depth: int, undo: list[_Undo]) -> None:
    """Record the contents of ``value`` (a dict, list or set) and of the
    containers directly inside it, ``depth`` levels deep."""
    if not isinstance(value, (dict, list, set)) or depth <= 0:
        return
    saved = copy.copy(value)
    undo.append(lambda: _restore_container(value, saved))
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        _containers(child, depth - 1, undo)


def _attributes(obj: Any, undo: list[_Undo], depth: int = 2) -> None:
    """Record ``vars(obj)``: each attribute, and the contents of container
    attributes (restored in place: hook handles keep pointing at them)."""
    attrs = vars(obj)
    saved = dict(attrs)

    def restore() -> None:
        attrs.clear()
        attrs.update(saved)

    undo.append(restore)
    for value in saved.values():
        _containers(value, depth, undo)


def _tensor_data(t: torch.Tensor, undo: list[_Undo], values: bool = False) -> None:
    data, grad, requires_grad = t.data, t.grad, t.requires_grad
    # a load writes into the tensors in place (load_state_dict copies): keep their values too
    saved = data.detach().clone() if values and not torch.nn.parameter.is_lazy(t) else None

    def restore() -> None:
        t.data = data
        if saved is not None:
            with torch.no_grad():
                data.copy_(saved)
        if t.requires_grad != requires_grad and t.is_leaf:
            t.requires_grad_(requires_grad)
        t.grad = grad

    undo.append(restore)


def _module(module: torch.nn.Module, undo: list[_Undo], seen: set[int], values: bool = False) -> None:
    for sub in module.modules():
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        _attributes(sub, undo, depth=1)  # parameters, buffers, submodules, every hook dict
        for t in [*sub._parameters.values(), *sub._buffers.values()]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                _tensor_data(t, undo, values)
        if values and type(sub).get_extra_state is not torch.nn.Module.get_extra_state:
            extra = copy.deepcopy(sub.get_extra_state())
            undo.append(lambda sub=sub, extra=extra: sub.set_extra_state(extra))


def _scaler(scaler: torch.amp.GradScaler, undo: list[_Undo]) -> None:
    # the live settings and the scale change in place (set_params(grad_scaler__max_scale=...)
    # clamps the scale tensor); these tensors hold a few scalars
    tensors = {k: v.clone() for k, v in vars(scaler).items() if isinstance(v, torch.Tensor)}
    _attributes(scaler, undo)

    def restore() -> None:
        for name, value in tensors.items():
            current = vars(scaler).get(name)
            if isinstance(current, torch.Tensor):
                current.copy_(value)

    undo.append(restore)


def _is_part(value: Any) -> bool:
    """Whether ``value`` is one of the objects a net's set_params or
    initialize may change in place."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler,
                          torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return True
    module = type(value).__module__ or ""
    return module.split(".")[0] in ("ampnet", "skorch") and hasattr(value, "__dict__") and not isinstance(
        value, type)


def _visit(value: Any, undo: list[_Undo], seen: set[int], depth: int = 3, values: bool = False) -> None:
    """Record ``value`` if it is a part, and the parts inside it (with
    ``values``, the values of their tensors too)."""
    if depth < 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), type)):
        return
    if isinstance(value, torch.nn.Module):
        _module(value, undo, seen, values)
        return
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple, set, dict)):
        seen.add(id(value))
        for child in (value.values() if isinstance(value, dict) else value):
            _visit(child, undo, seen, depth - 1, values)
        return
    if not _is_part(value):
        return
    seen.add(id(value))
    if isinstance(value, torch.amp.GradScaler):
        _scaler(value, undo)
        return
    _attributes(value, undo)
    if isinstance(value, torch.optim.Optimizer):
        for group in value.param_groups:
            for p in group["params"]:
                if id(p) not in seen:  # float32 masters, or parameters outside the module
                    seen.add(id(p))
                    _tensor_data(p, undo, values)
        return
    for child in list(vars(value).values()):
        _visit(child, undo, seen, depth - 1, values)


class NetSnapshot:
    """What a net is now, to be put back with :meth:`restore`.

    Records the net's attributes (parameters, fitted attributes and skorch's
    bookkeeping such as ``virtual_params_``) and every part reachable from
    them: modules (all submodules' parameters and buffers with their data,
    dtype, strides and gradients, and every hook dict), optimizers
    (parameter groups and state), the loss scaler (settings and scale),
    callbacks (and the LR schedulers they hold) and ampnet's components.

    This is ampnet's one undo mechanism: ``set_params``, ``initialize``,
    adopting a choice of ``'auto'`` (:func:`all_or_nothing`) and loads
    (:func:`ampnet.io.rollback.apply_all`, with ``values``) use it.

    Parameters
    ----------
    net : skorch.NeuralNet
      The net to record.

    values : bool (default=False)
      Also record the values of the tensors reached (parameters, buffers,
      master weights) and modules' extra state, for changes that write into
      tensors in place (``load_state_dict``); a copy of the model's size.
    """

    def __init__(self, net: Any, values: bool = False) -> None:
        self._net = net
        self._undo: list[_Undo] = []
        seen: set[int] = {id(net)}
        _attributes(net, self._undo)
        for value in list(vars(net).values()):
            _visit(value, self._undo, seen, 4, values)

    def restore(self) -> None:
        """Put the net and its parts back as they were when recorded."""
        # the net's attributes last: parts first, then the references to them
        for undo in reversed(self._undo):
            undo()


@contextlib.contextmanager
def all_or_nothing(net: Any) -> Iterator[NetSnapshot]:
    """Run the body; if it raises, put ``net`` back as it was before it."""
    snapshot = NetSnapshot(net)
    try:
        yield snapshot
    except BaseException:
        snapshot.restore()
        raise
