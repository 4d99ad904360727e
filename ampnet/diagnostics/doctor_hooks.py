"""skorch's ``SkorchDoctor`` on mixed-precision nets.

``skorch.helper.SkorchDoctor`` records activations with forward hooks and
gradients with tensor hooks, and turns them into numpy arrays with
``skorch.utils.to_numpy``. Under autocast, activations are float16 or
bfloat16 (numpy has no bfloat16: ``TypeError: Got unsupported ScalarType
BFloat16``), and under float16 loss scaling the gradients that reach a hook
are multiplied by the loss scale.

:func:`adapt_recording_hooks` finds the doctor's hooks on a net's modules
(the ``functools.partial`` objects of skorch's ``_add_activation_hook`` and
``_add_grad_hook``) and puts a wrapper in their place, under the same
handle, so that ``handle.remove()`` still removes them. The wrapper hands the
doctor a float32 copy of each low-precision activation, and float32
gradients divided by the loss scale of the step: what the doctor records is
what the net computed, in float32 and on the scale of the true gradients.
Nothing that flows through the model changes: the wrappers return None, as
the doctor's hooks do, so training is bitwise the same with or without the
doctor. The net calls :func:`adapt_recording_hooks` at the start of every
``partial_fit`` (and so of every ``fit``) with AMP on.

The doctor keeps each step's gradients in the order autograd delivered them
(``get_param_names`` lists them reversed). Autocast casts a layer's
parameters inside the layer's operator, and those casts change that order
(``lin0.bias, lin0.weight`` where skorch lists ``lin0.weight, lin0.bias``).
:class:`GradientOrder` reads the order float32 autograd would use from the
graph of the first training batch (a parameter's gradient is ready when the
node that consumes it, looking through the casts, has run: nodes run latest
created first), and the gradient hooks keep each step's records in that
order: the doctor lists parameters as skorch does without AMP.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterator

import torch

from ampnet.utils.dtypes import LOW_PRECISION_DTYPES

__all__ = ["adapt_recording_hooks", "ActivationHook", "GradientHook", "GradientOrder",
           "float32_gradient_order"]



def _doctor_functions() -> tuple[Callable | None, Callable | None]:
    try:
        # optional: skorch's private SkorchDoctor module, absent from some releases
        from skorch import _doctor
    except ImportError:  # a skorch without SkorchDoctor
        return None, None
    return getattr(_doctor, "_add_activation_hook", None), getattr(_doctor, "_add_grad_hook", None)


def _as_float32(obj: Any) -> Any:
    """Detached float32 copies of the low-precision tensors in ``obj``
    (walking tuples, lists and dicts as ``to_numpy`` does)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().float() if obj.dtype in LOW_PRECISION_DTYPES else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_as_float32(o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_as_float32(o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _as_float32(v)) for k, v in obj.items())
    return obj


class ActivationHook:
    """Forward hook that passes float32 activations to a recording hook.

    Parameters
    ----------
    hook : callable
      The recording hook, ``hook(module, input, output)``; its return value
      is ignored, so that it cannot change the module's output.
    """

    def __init__(self, hook: Callable) -> None:
        self.hook = hook

    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if module.training:  # the doctor records training batches only
            self.hook(module, inputs, _as_float32(output))


def _is_cast(node: Any) -> bool:
    return type(node).__name__ == "ToCopyBackward0" and len(node.next_functions) == 1


def float32_gradient_order(outputs: Any, params: dict[int, str]) -> list[str]:
    """The names in ``params`` (``id(parameter) -> name``) in the order
    float32 autograd delivers their gradients for the graph of ``outputs``.

    A parameter's gradient is delivered as soon as the last node that
    consumes it has run (its accumulation node has the highest priority);
    nodes run latest created first, and the parameters of one node in the
    order of its inputs. Autocast's casts (``ToCopyBackward0`` between a
    node and a parameter) are looked through: without autocast the node
    consumes the parameter itself.
    """
    roots = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    keys: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for index, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            target = child
            while _is_cast(target) and not _is_cast(node):
                target = target.next_functions[0][0]
                if target is None:
                    break
            name = params.get(id(getattr(target, "variable", None)))
            if name is not None and not _is_cast(node):
                key = (-node._sequence_nr(), index)
                # used twice: ready once its last (earliest created) consumer ran
                keys[name] = max(keys.get(name, key), key)
            stack.append(child)
    return sorted(keys, key=keys.__getitem__)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class GradientOrder:
    """One-shot forward hook on a top-level module: the order of
    :func:`float32_gradient_order` for the first training batch, shared by
    the module's :class:`GradientHook` objects (``rank``: name -> position).
    It removes itself after that batch."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = {id(p): n for n, p in module.named_parameters()}
        self.rank: dict[str, int] = {}
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.rank = {n: i for i, n in enumerate(float32_gradient_order(output, self.params))}
        self.handle.remove()


class GradientHook:
    """Tensor hook that passes float32, unscaled gradients to a recording hook.

    Parameters
    ----------
    hook : callable
      The recording hook, ``hook(grad)``; its return value is ignored, so
      that it cannot change the gradient.

    net : ampnet net
      Whose ``grad_scaler_`` scaled the loss (held by a weak reference).

    order : GradientOrder or None (default=None)
      The float32 order in which the doctor's records of a step are kept.
    """

    def __init__(self, hook: Callable, net: Any, order: GradientOrder | None = None) -> None:
        self.hook = hook
        self.net = weakref.ref(net)
        self.order = order

    def __call__(self, grad: torch.Tensor) -> None:
        grad = grad.detach().float()
        net = self.net()
        scaler = getattr(net, "grad_scaler_", None)
        if scaler is not None and scaler.is_enabled():
            grad = grad / scaler.get_scale()
        self.hook(grad)
        if self.order is not None and self.order.rank:
            self._reorder()

    def _reorder(self) -> None:
        """Keep the step's records (gradients, updates) in float32 order."""
        rank, last = self.order.rank, len(self.order.rank)
        for key in ("rec_grad", "rec_param_update"):
            recs = getattr(self.hook, "keywords", {}).get(key)
            if not recs:
                continue
            step = recs[-1]
            items = sorted(step.items(), key=lambda item: rank.get(item[0], last))
            if [k for k, _ in items] != list(step):
                step.clear()
                step.update(items)


def _is_partial_of(hook: Any, func: Callable | None) -> bool:
    return func is not None and isinstance(hook, functools.partial) and hook.func is func


def adapt_recording_hooks(net: Any) -> int:
    """Wrap the ``SkorchDoctor`` hooks found on ``net``'s modules and criteria.

    Parameters
    ----------
    net : ampnet net
      An initialized net.

    Returns
    -------
    int
      The number of hooks wrapped (hooks wrapped before are left alone).
    """
    activation_fn, grad_fn = _doctor_functions()
    if activation_fn is None and grad_fn is None:
        return 0
    count = 0
    for name in [*net._modules, *net._criteria]:
        top = getattr(net, name + "_", None)
        if not isinstance(top, torch.nn.Module):
            continue
        for module in top.modules():
            hooks = module._forward_hooks
            for key, hook in list(hooks.items()):
                if _is_partial_of(hook, activation_fn):
                    hooks[key] = ActivationHook(hook)
                    count += 1
        order = None
        for param in top.parameters():
            hooks = param._backward_hooks
            for key, hook in list((hooks or {}).items()):
                if _is_partial_of(hook, grad_fn):
                    order = order or GradientOrder(top)
                    hooks[key] = GradientHook(hook, net, order)
                    count += 1
    return count
