"""The float32 step of ``amp_enabled='auto'``'s trial is the fit's own state
(``amp_step_state_.float32_step``), not the precision component's: a copy
or a pickle taken during that step predicts in the net's precision
(issue 38, item 10)."""

from __future__ import annotations

import copy
import pickle

import torch
from skorch.callbacks import Callback

from ampnet import AmpNetClassifier


class Recorder(torch.nn.Module):
    """A linear model that records, per forward call, whether autocast was on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(20, 2)
        self.autocast: list[bool] = []

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return self.lin(X)


class CopyInFloat32Step(Callback):
    """At ``on_grad_computed`` of the trial's first float32 step (its
    forward ran without autocast): a pickle and a deep copy of the net."""

    def __init__(self) -> None:
        self.copies: list = []
        self.float32_steps: list[bool] = []

    def on_grad_computed(self, net, named_parameters, **kwargs) -> None:
        float32_step = not net.module_.autocast[-1]
        self.float32_steps.append(float32_step)
        if float32_step and not self.copies:
            self.copies = [pickle.loads(pickle.dumps(net)), copy.deepcopy(net)]


def mixed_faster(params: dict, seconds: float) -> float:
    """``amp_autotune__timer``: mixed steps count half of float32's (a module-level function: it pickles)."""
    return 0.5 if params["amp_enabled"] else 1.0


def test_a_copy_taken_in_a_float32_trial_step_predicts_with_autocast(classifier_data):
    X, y = classifier_data  # 16 steps at batch 8: enough for the trial to measure
    grab = CopyInFloat32Step()
    torch.manual_seed(0)
    net = AmpNetClassifier(
        Recorder, criterion=torch.nn.CrossEntropyLoss, amp_enabled="auto", amp_autotune__min_steps=0,
        amp_autotune__cache=False,
        amp_autotune__timer=mixed_faster,
        max_epochs=1, batch_size=8, train_split=None, verbose=0, callbacks=[grab],
    ).fit(X, y)
    assert grab.float32_steps[:2] == [True, False]  # the trial alternates, float32 first
    assert len(grab.copies) == 2
    for clone in grab.copies:
        clone.module_.autocast.clear()
        proba = clone.predict_proba(X[:8])
        assert clone.module_.autocast == [True]  # the net's mixed precision, autocast on
        assert proba.dtype.name == "float32"
    net.module_.autocast.clear()
    net.predict_proba(X[:8])
    assert net.module_.autocast == [True]  # the fitted net too
