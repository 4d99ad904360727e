"""Which module went non-finite first: the replay of a skipped step.

A good step pays nothing for this. When a step was skipped (and an
:class:`ampnet.callbacks.AmpMonitor` watches), :func:`first_nonfinite`
replays its batch once on a deep copy of the module, with temporary hooks
on the copy only, under the same autocast and loss scale as the step. The
net's weights, gradients, buffers, optimizer, loss scaler, global random
streams and history are left exactly as they were. A replay costs about one
forward and backward pass plus a copy of the module;
:class:`ampnet.diagnostics.flight.FlightRecorder` replays at most ``max_replays`` skipped
steps per epoch (not counting the skips of the loss scale's settling at the
start of a fit, see there).

The random streams kept (:func:`ampnet.utils.random_state.kept_random_state`):
torch's CPU generator and, where CUDA is initialized, each CUDA device's;
numpy's global generator (``np.random.*``, whatever its bit generator); and
Python's ``random``. A module that draws dropout masks or noise from them
in ``forward`` trains bitwise the same with and without the replay.
Generators the module owns (a ``np.random.Generator`` it holds, a
``torch.Generator``) are deep-copied with the module, so the replay
advances the copy's, not the module's.

The answer is a name from ``module.named_modules()`` (``''``: the root
module's own code outside its submodules):

- in the forward pass, the first module whose output holds NaN or inf (the
  innermost, as forward hooks run innermost first);
- otherwise in the backward pass of the scaled loss, the first module whose
  parameters received a non-finite gradient, or, when the first non-finite
  gradient is that of a module's output, the module the backward pass was
  in when it went non-finite (the last one whose output gradient was still
  finite; the output's own module when there is none, e.g. when the loss
  scale times the loss gradient overflows the output layer's dtype).

None when the replay stays finite: the step went non-finite for a reason
the replay does not reproduce (a random dropout mask, another rank's batch
under data parallelism, a micro-batch earlier in an accumulation group than
the last, which is the one replayed), or only the loss itself was
non-finite.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from skorch.dataset import unpack_data

from ampnet.utils.tree import has_nonfinite, iter_tensors
from ampnet.exceptions import amp_warn
from ampnet.precision import module_root
from ampnet.utils.random_state import kept_random_state

__all__ = ["first_nonfinite"]


class _NonFinite(Exception):
    """Stops the replay at the first non-finite module."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Watch:
    """The replay's hooks: forward hooks on every module of the copy,
    gradient hooks on their outputs and on its parameters."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.current: str | None = None  # where the backward pass is
        # id of an output tensor -> (the tensor, kept alive so that its id is not
        # reused, and its innermost module)
        self.outputs: dict[int, tuple[torch.Tensor, str]] = {}
        self.handles = [
            m.register_forward_hook(self._forward_hook(name)) for name, m in root.named_modules()
        ]
        owners: dict[int, str] = {}
        for name, m in root.named_modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), name)
        for p in root.parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._param_hook(owners[id(p)])))

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            if has_nonfinite(output):
                raise _NonFinite(name)
            for t in iter_tensors(output):
                if t.requires_grad and id(t) not in self.outputs:
                    self.outputs[id(t)] = (t, name)  # forward hooks run innermost first
                    t.register_hook(self._output_hook(name))
        return hook

    def _output_hook(self, name: str):
        def hook(grad):
            if has_nonfinite(grad):
                raise _NonFinite(self.current if self.current is not None else name)
            self.current = name
        return hook

    def _param_hook(self, name: str):
        def hook(grad):
            if has_nonfinite(grad):
                raise _NonFinite(name)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.outputs.clear()


def first_nonfinite(net: Any, batch: Any, scale: float, **fit_params: Any) -> str | None:
    """The name of the first module of ``net.module_`` whose activations
    or gradients go non-finite when ``batch`` is replayed with loss scale
    ``scale`` on a copy of the module (see the module docstring); None when
    the replay stays finite or the net has no ``module_``."""
    module = net.__dict__.get("module_")
    if not isinstance(module, torch.nn.Module):
        return None
    prec = net.precision_
    root = module_root(module)
    # the float32 masters are the optimizer's: shared with the copy, never copied or changed
    memo = {id(m): m for m in (prec.masters or {}).values()}
    try:
        replica = copy.deepcopy(root, memo)
    except Exception as exc:  # a module holding something that cannot be copied
        amp_warn(
            f"first_nonfinite: the module could not be copied for the replay ({type(exc).__name__}: "
            f"{exc}); the step is recorded without it. Fix: make the module deep-copyable, or "
            "set AmpMonitor(max_replays=0).")
        return None
    for p in replica.parameters():
        p.grad = None
    watch = _Watch(replica)
    Xi, yi = unpack_data(batch)
    try:
        with kept_random_state(), torch.enable_grad():
            net.__dict__["module_"] = replica  # as in precision_report: an override of get_loss sees the copy
            loss = _forward_loss(net, replica, Xi, yi, fit_params)
            if has_nonfinite(loss):
                return None  # every module's output was finite: the loss itself
            if loss.requires_grad:
                (loss / net.gradient_accumulation_steps * (scale if prec.scaling else 1.0)).backward()
    except _NonFinite as found:
        return found.name
    finally:
        net.__dict__["module_"] = module
        watch.remove()
    return None


def _forward_loss(net: Any, replica: torch.nn.Module, Xi: Any, yi: Any, fit_params: dict) -> torch.Tensor:
    """The training forward pass and loss, as the step computes them, on ``replica``."""
    prec = net.precision_
    if getattr(net.parallel_, "ddp", None) is None:
        y_pred = net.infer(Xi, **fit_params)
    else:  # without DDP's wrapper, which would synchronize with the other ranks
        # skorch's NeuralNet: this module is imported by ampnet.net, itself a NeuralNet mixin
        from skorch import NeuralNet

        x = prec.convert_input(Xi, replica, net.device)
        with prec.forward_context():
            y_pred = prec.convert_output(NeuralNet.infer(net, x, **fit_params))
    return net.get_loss(y_pred, yi, X=Xi, training=True)
