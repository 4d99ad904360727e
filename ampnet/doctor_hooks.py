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
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

__all__ = ["adapt_recording_hooks", "ActivationHook", "GradientHook"]

_LOW = (torch.float16, torch.bfloat16)


def _doctor_functions() -> tuple[Callable | None, Callable | None]:
    try:
        from skorch import _doctor
    except ImportError:  # a skorch without SkorchDoctor
        return None, None
    return getattr(_doctor, "_add_activation_hook", None), getattr(_doctor, "_add_grad_hook", None)


def _as_float32(obj: Any) -> Any:
    """Detached float32 copies of the low-precision tensors in ``obj``
    (walking tuples, lists and dicts as ``to_numpy`` does)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().float() if obj.dtype in _LOW else obj
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


class GradientHook:
    """Tensor hook that passes float32, unscaled gradients to a recording hook.

    Parameters
    ----------
    hook : callable
      The recording hook, ``hook(grad)``; its return value is ignored, so
      that it cannot change the gradient.

    net : ampnet net
      Whose ``grad_scaler_`` scaled the loss (held by a weak reference).
    """

    def __init__(self, hook: Callable, net: Any) -> None:
        self.hook = hook
        self.net = weakref.ref(net)

    def __call__(self, grad: torch.Tensor) -> None:
        grad = grad.detach().float()
        net = self.net()
        scaler = getattr(net, "grad_scaler_", None)
        if scaler is not None and scaler.is_enabled():
            grad = grad / scaler.get_scale()
        self.hook(grad)


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
        for param in top.parameters():
            hooks = param._backward_hooks
            for key, hook in list((hooks or {}).items()):
                if _is_partial_of(hook, grad_fn):
                    hooks[key] = GradientHook(hook, net)
                    count += 1
    return count
