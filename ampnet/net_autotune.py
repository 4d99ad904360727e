"""The net's side of ``amp_enabled='auto'``: the choice at the first fit
(:func:`choose`), and the copy of the net that the probe trains
(``AmpNetMixin.autotune_copy`` delegates to :func:`autotune_copy`).

The probe itself, its candidates and the saved choice are
``ampnet.precision.autotune``'s; switching the net to the choice is
:func:`ampnet.reconfigure.adopt_autotune`.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from skorch.history import History

from ampnet.parallel import Parallel
from ampnet.precision import AutotuneResult, is_auto, module_root, read_saved_choice, run_probe

if TYPE_CHECKING:
    from ampnet.net import AmpNetMixin

__all__ = ["choose", "autotune_copy"]


def choose(net: "AmpNetMixin", X: Any, y: Any = None, **fit_params: Any) -> None:
    """Choose for ``amp_enabled='auto'`` once: a saved choice of the
    checkpoint that ``LoadInitState`` resumes from, else the probe of
    ``ampnet.precision.autotune``; then train with it."""
    if not is_auto(net.amp_enabled) or "amp_autotune_" in net.__dict__:
        return
    saved = _resume_choice(net)
    if saved is not None:
        result = AutotuneResult(params=saved, device=str(net.device), source="loaded")
    else:
        result = run_probe(net, X, y, **fit_params)
        if net.parallel_.world_size > 1:  # every rank trains with rank 0's choice
            shared = [result]
            torch.distributed.broadcast_object_list(shared, src=0)
            result = shared[0]
    net.adopt_autotune(result)
    if net.verbose and result.source == "probe":
        print(result, flush=True)


def _resume_choice(net: "AmpNetMixin") -> dict[str, Any] | None:
    """The choice saved in the parameters of the checkpoint that a
    ``LoadInitState`` callback will load, if any."""
    from skorch.callbacks import LoadInitState as SkorchLoadInitState

    from ampnet.io.files import checkpoint_files

    for _, cb in net.callbacks_:
        if not isinstance(cb, SkorchLoadInitState) or getattr(cb, "use_safetensors", False):
            continue
        try:
            path = checkpoint_files(cb.checkpoint, net).get("f_params")
            if path is None or not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
                continue
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # no checkpoint yet, or one LoadInitState will refuse
            continue
        choice = read_saved_choice(state)
        if choice is not None:
            return choice
    return None


def autotune_copy(net: "AmpNetMixin", params: dict[str, Any]) -> "AmpNetMixin":
    """``net.autotune_copy(params)``: a net of ``net``'s class sharing its
    attributes, with copies of its modules and criteria, no optimizers
    until :meth:`adopt_autotune` builds them for ``params``, a fresh
    history, no callbacks and no data parallelism."""
    probe = object.__new__(type(net))
    probe.__dict__.update(net.__dict__)
    d = probe.__dict__
    for name in [*net._modules, *net._criteria]:
        obj = net.__dict__.get(name + "_")
        if isinstance(obj, torch.nn.Module):
            d[name + "_"] = copy.deepcopy(module_root(obj) if name == "module" else obj)
    for name in net._optimizers:
        d[name + "_"] = None
    d.pop("amp_autotune_", None)
    d.update(
        precision_=copy.copy(net.precision_), virtual_params_=dict(net.virtual_params_),
        history_=History(), callbacks_=[], verbose=0, parallel_=Parallel(), _trimmed_for_prediction=False,
        gradient_accumulation_steps=1,  # every probe step is an optimizer step
    )
    probe.adopt_autotune(AutotuneResult(params=dict(params)), carry=False)
    return probe
