"""A load is all or nothing: a refused value, a failure or an interrupt while the states are applied
(schedulers included) leaves the net exactly as it was, and a rolled-back load leaves no saved
``amp_fp32_modules='auto'`` choice behind; a saved choice must name modules of the net."""

import copy
import re
import warnings

import numpy as np
import pytest
import torch

from ampnet.exceptions import AmpWarning
from ampnet.io.rng import PreparedRngState, get_rng_state
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    tiny_net,
    quietly,
    snapshot,
    data,
    fitted,
    saved,
    refused_unchanged,
    _scheduler_net,
    scheduler_checkpoint,
)
from resume_script import differences, make_data


# ---- a refused or failed load changes nothing ----------------------------------------------------


@pytest.mark.parametrize(
    "case", ["python.version=99", "python pos=100000", "cuda.x", "torch zero", "_overflow_streak"]
)
def test_values_that_fail_while_applied_are_refused_with_file_and_field(tmp_path, saved, case):
    """The five files that passed the checks and failed while being applied,
    after parameters, optimizer, history and scaler had changed."""
    files = dict(saved)
    if case == "_overflow_streak":
        state = torch.load(saved["f_grad_scaler"], weights_only=True)
        state["_overflow_streak"] = "x"
        key, field = "f_grad_scaler", r"'_overflow_streak' = 'x' \(str\) must be an int >= 0"
    else:
        state = get_rng_state()
        key = "f_rng_state"
        if case == "python.version=99":
            state["python.version"], field = torch.tensor(99), "python.version=99"
        elif case == "python pos=100000":
            state["python.internal"][624], field = 100000, r"python.internal\[624\]"
        elif case == "cuda.x":
            state["cuda.x"], field = torch.zeros(16, dtype=torch.uint8), "cuda.x"
        else:
            state["torch"], field = torch.zeros_like(state["torch"]), "torch refuses"
    files[key] = str(tmp_path / "bad.pt")
    torch.save(state, files[key])
    refused_unchanged(tiny_net().initialize(), files, field, re.escape(f"{key} file {files[key]!r}"))


class Boom(RuntimeError):
    pass


def _fail_partway(monkeypatch, net, where):
    """Make one apply step fail after it changed part of what it owns."""
    if where == "params":

        def load(state, *a, **k):
            with torch.no_grad():
                net.module_.hidden.weight.fill_(7.0)
            raise Boom("disk gone")

        monkeypatch.setattr(net.module_, "load_state_dict", load)
    elif where == "optimizer":

        def load(state):
            net.optimizer_.param_groups[0]["lr"] = 123.0
            raise Boom("disk gone")

        monkeypatch.setattr(net.optimizer_, "load_state_dict", load)
    elif where == "scaler":
        real = net.grad_scaler_.load_state_dict

        def load(state):
            real(state)
            raise Boom("disk gone")

        monkeypatch.setattr(net.grad_scaler_, "load_state_dict", load)
    else:  # the RNG, last of all: torch's generator already set
        real = PreparedRngState.apply

        def apply(self):
            torch.set_rng_state(self.torch_state)
            np.random.set_state(self.numpy_state)
            raise Boom("disk gone")

        monkeypatch.setattr(PreparedRngState, "apply", apply)
        return real


@pytest.mark.parametrize("where", ["params", "optimizer", "scaler", "rng"])
def test_failure_while_applying_rolls_everything_back(saved, monkeypatch, where):
    net = tiny_net().initialize()
    quietly(net.partial_fit, *make_data())  # a net with state of its own
    _fail_partway(monkeypatch, net, where)
    source = {
        "params": "f_params",
        "optimizer": "f_optimizer",
        "scaler": "f_grad_scaler",
        "rng": "f_rng_state",
    }[where]
    before = snapshot(net)
    with pytest.raises(
        ValueError,
        match="passed every check but could not be loaded .Boom: disk gone.. Everything was rolled back",
    ) as info:
        net.load_params(**saved)
    info.match(re.escape(f"{source} file {saved[source]!r}"))
    assert differences(snapshot(net), before) == []


def test_interrupt_while_applying_rolls_back_and_propagates(saved, monkeypatch):
    net = tiny_net().initialize()

    def interrupted(state):
        raise KeyboardInterrupt

    monkeypatch.setattr(net.grad_scaler_, "load_state_dict", interrupted)
    before = snapshot(net)
    with pytest.raises(KeyboardInterrupt):
        net.load_params(**saved)
    assert differences(snapshot(net), before) == []


def test_failure_while_restoring_schedulers_rolls_everything_back(scheduler_checkpoint, monkeypatch):
    net = _scheduler_net().initialize()
    cb = dict(net.callbacks_)["LRScheduler"]
    cb.on_train_begin(net)  # running, as during training
    scheduler = cb.lr_scheduler_
    real = scheduler.load_state_dict

    def load(state):
        real(state)
        raise Boom("disk gone")

    monkeypatch.setattr(scheduler, "load_state_dict", load)
    before = snapshot(net), copy.deepcopy(scheduler.state_dict()), cb.batch_idx_
    with pytest.raises(
        ValueError,
        match="f_lr_schedulers file .* could not be loaded .Boom: disk gone.. Everything was rolled back",
    ):
        net.load_params(checkpoint=scheduler_checkpoint)
    after = snapshot(net), scheduler.state_dict(), cb.batch_idx_
    assert differences(after, before) == []


# ---- the saved amp_fp32_modules='auto' choice ----------------------------------------------------


def test_rolled_back_load_undoes_the_saved_auto_choice(tmp_path, saved, monkeypatch, data):
    """A rolled-back load leaves no saved 'auto' choice behind (the parameters file's load hook
    once recorded it, and the net then trained with the saved layout instead of probing its
    own)."""
    from ampnet.auto.saved import FP32_KEY

    net = tiny_net(amp_fp32_modules="auto").initialize()
    assert net.amp_layout_.auto_fp32_modules is None  # the first fit probes
    state = net.module_.state_dict()
    state._metadata[""][FP32_KEY] = ["hidden"]
    params = str(tmp_path / "auto.pt")
    torch.save(state, params)

    def fail(state):
        raise Boom("disk gone")

    monkeypatch.setattr(net.grad_scaler_, "load_state_dict", fail)
    with pytest.raises(ValueError, match="Everything was rolled back"):
        net.load_params(f_params=params, f_grad_scaler=saved["f_grad_scaler"])
    assert net.amp_layout_.auto_fp32_modules is None and net.amp_layout_.fp32_modules == ()
    monkeypatch.undo()
    quietly(net.partial_fit, *data)
    assert net.amp_layout_.auto_fp32_modules == ()  # its own probe: Tiny never overflows
    # without the failure the saved choice is taken
    other = tiny_net(amp_fp32_modules="auto").initialize()
    other.load_params(f_params=params)
    quietly(other.partial_fit, *data)
    assert other.amp_layout_.auto_fp32_modules == ("hidden",)


@pytest.mark.parametrize(
    "choice, problem",
    [
        (["*"], r"\['\*'\] is not a module of Tiny"),
        (["../../etc"], r"\['../../etc'\] is not a module of Tiny"),
        (["hidden", "nothere"], r"\['nothere'\] is not a module of Tiny"),
        (["hidden", "hidden"], "it names a module twice"),
        ("hidden", "expected a list of module names, got str"),
        ([f"m{i}" for i in range(10**5)], r"\['m0', 'm1', .*'m7'\]\[:8\] \(of 100000\) are not modules"),
    ],
)
def test_saved_auto_choice_must_name_the_modules(tmp_path, saved, choice, problem):
    """A saved choice must name modules of the net, once each: ['*'], ['../../etc'] and unknown
    names are refused, and a list of 10**5 names is reported briefly, not echoed in full."""
    from ampnet.auto.saved import FP32_KEY

    net = tiny_net(amp_fp32_modules="auto").initialize()
    state = torch.load(saved["f_params"], weights_only=True)
    state._metadata[""][FP32_KEY] = choice
    bad = str(tmp_path / "p.pt")
    torch.save(state, bad)
    info = refused_unchanged(
        net, {"f_params": bad}, re.escape(f"f_params file {bad!r} holds an invalid amp_fp32_modules='auto' choice"),
        problem,
    )
    assert len(str(info.value)) < 1000
    # loaded directly into the module (not through load_params), the choice is
    # not read: the weights load as for any module, and the net keeps probing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.module_.load_state_dict(state)
    assert net.amp_layout_.auto_fp32_modules is None


def test_a_long_different_choice_is_reported_briefly(data, tmp_path):
    from ampnet.auto.saved import FP32_KEY

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
            self.out = torch.nn.Linear(4, 2)

        def forward(self, X):
            return torch.softmax(self.out(self.layers(X)), dim=-1)

    net = tiny_net(Deep, amp_fp32_modules="auto", max_epochs=1)
    quietly(net.fit, *data)
    state = net.module_.state_dict()
    state._metadata[""][FP32_KEY] = [f"layers.{i}" for i in range(30)]
    path = tmp_path / "deep.pt"
    torch.save(state, path)
    with pytest.warns(AmpWarning, match=r"keeping \['layers.0', .*'layers.7'\]\[:8\] \(of 30\) in float32") as record:
        net.load_params(f_params=path)
    assert "layers.8'" not in str(record[0].message)
    assert net.amp_layout_.auto_fp32_modules == ()  # the net keeps its own choice
