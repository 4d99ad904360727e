"""ampnet reads and writes no private state of torch's GradScaler:
``ampnet.GradScaler`` owns its state,
and a net given torch's own scaler uses its public API only."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback

import ampnet
from ampnet import AmpNetClassifier
from ampnet.precision.checks import unscale_flag

ROOT = os.path.dirname(os.path.abspath(ampnet.__file__))

#: torch's private names (fields and methods of torch.amp.GradScaler) that
#: no ampnet module may use, as attributes or as getattr/setattr names.
FORBIDDEN = (
    r"_per_optimizer_states", r"_found_inf_per_device", r"_unscale_grads_", r"_check_inf_per_device",
    r"_get_scale_async", r"_lazy_init_scale_growth_tracker", r"_check_scale_growth_tracker",
    r"_maybe_opt_step", r"_get_growth_tracker", r"\._init_growth_tracker\b",
    r"\._scale\b", r"\._growth_tracker\b", r"\._init_scale\b",
)

#: Modules of the loss scaler and the step: there, torch's settings fields
#: (which ampnet.GradScaler used to share) are refused too.
SCALER_MODULES = ("precision/scaler.py", "precision/component.py", "precision/checks.py", "step.py")
FORBIDDEN_IN_SCALER_MODULES = (
    r"\._device\b", r"\._enabled\b", r"\._growth_factor\b", r"\._backoff_factor\b", r"\._growth_interval\b",
    r"""(get|set|has|del)attr\([^)]*['"]_(device|enabled|scale|growth_tracker|init_scale|growth_factor|"""
    r"""backoff_factor|growth_interval)['"]""",
)


def _sources() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    out[os.path.relpath(path, ROOT).replace(os.sep, "/")] = f.read()
    return out


def _hits(source: str, patterns: tuple[str, ...]) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1)
            if any(re.search(p, line) for p in patterns)]


def test_the_patterns_catch_what_they_are_for():
    bad = ("scaler._per_optimizer_states.clear()", "x = scaler._scale.reshape(())",
           "found = scaler._found_inf_per_device(opt)", "super()._unscale_grads_(o, i, f, a)",
           "t = self._growth_tracker", "s = scaler._init_scale")
    for line in bad:
        assert _hits(line, FORBIDDEN), line
    assert _hits("getattr(scaler, '_device', None)", FORBIDDEN_IN_SCALER_MODULES)
    for line in ("self._loss_scale", "self._init_scale_setting", "grad_scaler__init_scale=2.0", "self._scale_tensor"):
        assert not _hits(line, FORBIDDEN), line


def test_no_ampnet_module_touches_torchs_scaler_internals():
    sources = _sources()
    assert "precision/scaler.py" in sources
    found = {path: _hits(text, FORBIDDEN) for path, text in sources.items()}
    assert not {k: v for k, v in found.items() if v}


def test_the_scaler_modules_use_no_torch_scaler_field():
    sources = _sources()
    found = {path: _hits(sources[path], FORBIDDEN_IN_SCALER_MODULES) for path in SCALER_MODULES}
    assert not {k: v for k, v in found.items() if v}


# ---- torch's own scaler on a net: the public API, the same training ---------------


def _data():
    rng = np.random.RandomState(0)
    X = (rng.randn(64, 20) * 4).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


def _net(**kw):
    torch.manual_seed(0)
    base = dict(criterion=torch.nn.CrossEntropyLoss, amp_enabled=True, amp_dtype="float16", max_epochs=2,
                batch_size=16, train_split=None, verbose=0, grad_scaler__init_scale=2.0**16,
                grad_scaler__growth_interval=2)
    return AmpNetClassifier(
        torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), **{**base, **kw})


@pytest.mark.filterwarnings("ignore")
def test_torchs_scaler_and_ampnets_train_alike():
    """Same scale policy (hysteresis 1, no bound reached): the same skips,
    scales and weights, although torch's flags are found by ampnet's own check."""
    ours, theirs = _net().fit(*_data()), _net(grad_scaler=torch.amp.GradScaler).fit(*_data())
    assert type(theirs.grad_scaler_) is torch.amp.GradScaler
    for key in ("step_skipped", "loss_scale"):
        assert [b[key] for r in ours.history for b in r["batches"]] == \
               [b[key] for r in theirs.history for b in r["batches"]]
    assert any(b["step_skipped"] for r in ours.history for b in r["batches"])
    for a, b in zip(ours.module_.parameters(), theirs.module_.parameters()):
        assert torch.equal(a, b)


def test_unscale_flag_is_torchs_flag():
    for values in ([1.0, 2.0], [1.0, float("inf")], [float("nan"), 0.0]):
        param = torch.nn.Parameter(torch.zeros(2))
        param.grad = torch.tensor(values)
        before = param.grad.clone()
        flag = unscale_flag([param], torch.device("cpu"))
        torch.testing.assert_close(param.grad, before, rtol=0, atol=0, equal_nan=True)  # unchanged
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))
        opt = torch.optim.SGD([param], lr=1.0)
        scaler.step(opt)  # torch skips the step on its own flag
        stepped = not torch.equal(param.detach(), torch.zeros(2))
        assert bool(flag > 0) == (not stepped)


class Interrupted(Exception):
    """Raised by :class:`Interrupt` (skorch catches a KeyboardInterrupt)."""


class Interrupt(Callback):
    """Raise once, between the unscale and the scaler's update."""

    def initialize(self):
        self.raised_ = False
        return self

    def on_grad_computed(self, net, named_parameters, batch=None, training=False, **kwargs):
        if not self.raised_ and len(net.history[-1, "batches"]) == 1:
            self.raised_ = True
            raise Interrupted


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("scaler", [ampnet.GradScaler, torch.amp.GradScaler])
def test_a_fit_after_an_interrupted_step_starts_afresh(scaler):
    net = _net(grad_scaler=scaler, callbacks=[Interrupt()], max_epochs=1)
    with pytest.raises(Interrupted):
        net.fit(*_data())
    scale = net.grad_scaler_.get_scale()
    assert net.grad_scaler_.get_scale() == scale
    net.partial_fit(*_data())  # unscale_ of the new step is not refused
    assert net.history[-1, "batches", 0, "loss_scale"] in (scale, scale * 2, scale / 2)
    assert all(bool(torch.isfinite(p).all()) for p in net.module_.parameters())
