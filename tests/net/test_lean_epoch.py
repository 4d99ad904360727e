"""The lean epoch (ampnet.training.lean): where it applies, it trains and
records bitwise as skorch's step protocol does on the same batches (the
array path, with the lean epoch turned off); where it does not, the
protocol runs; a callback that changes the net mid-epoch hands the rest
of the epoch to the protocol."""

import collections
import warnings

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback, EpochScoring, LRScheduler
from skorch.dataset import ValidSplit
from torch.optim.lr_scheduler import StepLR

from ampnet import AmpNetClassifier, AmpNetRegressor
from ampnet.callbacks import AmpMonitor
from ampnet.training import lean

from conftest import MLP, Logits, net_kw
from test_deferred_records import _data, _rows  # the same data and history rows as the array-path tests


class Spy:
    """Counts the batches the lean epoch trains on (and lets it run)."""

    def __init__(self, monkeypatch, off=False):
        self.batches, self.plans = 0, 0
        real_plan, real_run = lean.plan, lean.run_batches

        def plan(*args, **kwargs):
            found = None if off else real_plan(*args, **kwargs)
            self.plans += found is not None
            return found

        def run_batches(*args, **kwargs):
            count = real_run(*args, **kwargs)
            self.batches += count
            return count

        monkeypatch.setattr(lean, "plan", plan)
        monkeypatch.setattr(lean, "run_batches", run_batches)


def _fit(monkeypatch, off, X, y, cls=AmpNetClassifier, **kw):
    with monkeypatch.context() as m:
        spy = Spy(m, off=off)
        torch.manual_seed(0)
        params = net_kw(batch_size=16, max_epochs=2, iterator_train__shuffle=True)
        params.update(kw)
        net = cls(**params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net.fit(X, y)
    return net, [(w.category.__name__, str(w.message)) for w in caught], spy


def _assert_same_fit(a, b):
    (net_a, warned_a, _), (net_b, warned_b, _) = a, b
    assert _rows(net_a) == _rows(net_b)
    for (name, p), (_, q) in zip(net_a.module_.named_parameters(), net_b.module_.named_parameters()):
        assert torch.equal(p, q), name
    for opt_a, opt_b in zip(net_a.optimizer_.state.values(), net_b.optimizer_.state.values()):
        for key in opt_a:
            assert torch.equal(torch.as_tensor(opt_a[key]), torch.as_tensor(opt_b[key])), key
    assert warned_a == warned_b


class Unused(torch.nn.Module):
    """A parameter without a gradient (never used) beside the used ones."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(20, 8)
        self.out = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, X):
        return self.out(torch.relu(self.hidden(X)))


SETTINGS = {
    "bf16": dict(amp_enabled=True),
    "amp-off": dict(amp_enabled=False),
    "bf16-no-guard": dict(amp_enabled=True, amp_skip_nonfinite=False),
    "bf16-adam": dict(amp_enabled=True, optimizer=torch.optim.Adam, lr=0.01),
    "bf16-split": dict(amp_enabled=True, train_split=ValidSplit(5)),
    "bf16-pure-no-masters": dict(amp_enabled=True, amp_level="pure", amp_master_weights=False),
    "nll-probabilities": dict(amp_enabled=True, module=MLP, criterion=torch.nn.NLLLoss),
    "unused-parameter": dict(amp_enabled=True, module=Unused),
    "epoch-scoring": dict(amp_enabled=True, callbacks=[EpochScoring("accuracy", on_train=True, name="train_acc")]),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_lean_epoch_trains_and_records_as_the_protocol(monkeypatch, setting):
    X, y = _data(100)  # 7 batches of 16, the last one short
    ours = _fit(monkeypatch, False, X, y, **SETTINGS[setting])
    theirs = _fit(monkeypatch, True, X, y, **SETTINGS[setting])
    steps = sum(ours[0].history[:, "train_batch_count"])
    assert ours[2].batches == steps > 0 and theirs[2].batches == 0  # every batch lean, or none
    _assert_same_fit(ours, theirs)


def test_the_lean_epoch_trains_a_regressor_as_the_protocol(monkeypatch):
    rng = np.random.RandomState(1)
    X = rng.randn(64, 20).astype(np.float32)
    y = X[:, :3].sum(1, keepdims=True).astype(np.float32)
    kw = dict(module=Logits, module__n_in=20, criterion=torch.nn.MSELoss, cls=AmpNetRegressor)
    ours, theirs = _fit(monkeypatch, False, X, y[:, [0, 0]], **kw), _fit(monkeypatch, True, X, y[:, [0, 0]], **kw)
    assert ours[2].batches == 8
    _assert_same_fit(ours, theirs)


def test_skipped_steps_their_causes_and_warnings_as_the_protocol(monkeypatch):
    # a bad row in the fourth batch, and a backward overflow on the second training call
    X, y = _data(96, nan_rows=(50,))
    kw = dict(amp_enabled=True, iterator_train__shuffle=False, module__bad_grad_calls=(2,))
    ours, theirs = _fit(monkeypatch, False, X, y, **kw), _fit(monkeypatch, True, X, y, **kw)
    assert ours[2].batches == 12
    _assert_same_fit(ours, theirs)
    batches = [b for epoch in ours[0].history[:, "batches"] for b in epoch]
    causes = [b.get("skip_cause") for b in batches if b.get("step_skipped")]
    assert causes.count("nonfinite_input") == 2 and causes.count("overflow") == 1
    assert any("holds NaN or inf in its input" in text for _, text in ours[1])
    assert ours[0].history[:, "skipped_steps"] == [2, 1]


def _plan_for(monkeypatch, cls=AmpNetClassifier, X=None, **kw):
    """Whether the first epoch of a fit with ``kw`` is lean."""
    X_, y = _data(64)
    net, _, spy = _fit(monkeypatch, False, X if X is not None else X_, y, cls=cls, **{"max_epochs": 1, **kw})
    return spy.plans == 1, net


class OwnStep(AmpNetClassifier):
    calls = 0

    def train_step_single(self, batch, **fit_params):
        type(self).calls += 1
        return super().train_step_single(batch, **fit_params)


PROTOCOL = {
    "gradient accumulation": dict(gradient_accumulation_steps=2),
    "loss scaling": dict(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0),
    "an AmpMonitor": dict(callbacks=[AmpMonitor()]),
    "a scheduler every batch": dict(callbacks=[LRScheduler(StepLR, step_size=2, step_every="batch")]),
    "skorch's DataLoader": dict(batch_gather=False),
    "master weights": dict(amp_level="pure"),
}


@pytest.mark.parametrize("case", list(PROTOCOL))
def test_the_protocol_runs_where_the_lean_epoch_does_not_apply(monkeypatch, case):
    lean_epoch, net = _plan_for(monkeypatch, **{"amp_enabled": True, **PROTOCOL[case]})
    assert not lean_epoch
    assert len(net.history[-1, "batches"]) == 4


def test_an_optimizer_that_skips_on_the_host_trains_as_the_protocol(monkeypatch):
    X, y = _data(96, nan_rows=(50,))
    # not fused: no on-device skip, so each step is decided after a host read
    kw = dict(amp_enabled=True, optimizer__foreach=True, iterator_train__shuffle=False, module__bad_grad_calls=(2,))
    ours, theirs = _fit(monkeypatch, False, X, y, **kw), _fit(monkeypatch, True, X, y, **kw)
    assert ours[2].batches == 12 and not ours[0].optimizer_.defaults.get("fused")
    _assert_same_fit(ours, theirs)
    assert ours[0].history[:, "skipped_steps"] == [2, 1]


def test_a_default_net_trains_in_the_lean_epoch(monkeypatch):
    assert _plan_for(monkeypatch, amp_enabled=True)[0]
    assert _plan_for(monkeypatch, amp_enabled=False)[0]


def test_a_subclass_s_own_step_method_runs_in_the_protocol(monkeypatch):
    OwnStep.calls = 0
    lean_epoch, _ = _plan_for(monkeypatch, cls=OwnStep, amp_enabled=True)
    assert not lean_epoch and OwnStep.calls == 4


def test_dict_features_run_in_the_protocol(monkeypatch):
    from test_deferred_records import DictModule

    X, _ = _data(64)
    lean_epoch, _ = _plan_for(monkeypatch, X={"a": X[:, :12], "b": X[:, 12:]}, module=DictModule)
    assert not lean_epoch


class SwitchesAmpOff(Callback):
    """Turns AMP off after the third batch of the first epoch (``set_params`` mid-epoch)."""

    def initialize(self):
        self.seen = 0
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.seen += 1
            if self.seen == 3:
                net.set_params(amp_enabled=False)


def test_a_callback_that_changes_the_net_hands_the_rest_of_the_epoch_to_the_protocol(monkeypatch):
    X, y = _data(100)
    ours = _fit(monkeypatch, False, X, y, amp_enabled=True, max_epochs=1, callbacks=[SwitchesAmpOff()])
    theirs = _fit(monkeypatch, True, X, y, amp_enabled=True, max_epochs=1, callbacks=[SwitchesAmpOff()])
    assert ours[2].batches == 3  # lean until the callback turned AMP off
    assert ours[0].precision_.enabled is False
    _assert_same_fit(ours, theirs)


def test_an_auto_net_watches_its_choice_in_the_lean_epoch(monkeypatch):
    from ampnet.auto.trial import Trial

    readings = []
    real_watch = Trial.watch
    monkeypatch.setattr(Trial, "watch", lambda self, reading: (readings.append(reading), real_watch(self, reading)))
    X, y = _data(640)  # 40 steps an epoch: the trial decides in the first
    net, _, spy = _fit(monkeypatch, False, X, y, amp_enabled="auto", amp_autotune__cache=False, max_epochs=3)
    assert net.amp_autotune_ is not None and net.amp_autotune_.source == "measured"
    assert spy.batches == 2 * 40  # the epochs after the measurement
    assert len(readings) >= 2 * 40 and all(isinstance(r, float) and r > 0 for r in readings[-80:])


class _Ops(Callback):
    """Records the tensor operations of each training epoch's batches (torch's dispatch mode)."""

    def initialize(self):
        self.epochs = []
        return self

    def on_epoch_begin(self, net, **kwargs):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = []

        class Log(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Log()
        self.mode.__enter__()
        self.epochs.append(ops)

    def on_epoch_end(self, net, **kwargs):
        self.mode.__exit__(None, None, None)


@pytest.mark.parametrize("amp", [True, False])
def test_the_lean_epoch_runs_the_protocol_s_tensor_operations_and_no_more(monkeypatch, amp):
    X, y = _data(64)
    ours = _fit(monkeypatch, False, X, y, amp_enabled=amp, max_epochs=1, callbacks=[_Ops()])
    theirs = _fit(monkeypatch, True, X, y, amp_enabled=amp, max_epochs=1, callbacks=[_Ops()])
    lean_ops = dict(ours[0].callbacks_)["_Ops"].epochs[0]
    protocol_ops = dict(theirs[0].callbacks_)["_Ops"].epochs[0]
    assert ours[2].batches == 4 and len(lean_ops) > 4 * 10
    # the same operations, as many of each, but the protocol's second detach of each batch's loss
    # (the check's unit scale is made when the plan is, not at the first step: the order differs there)
    lean_count, protocol_count = collections.Counter(lean_ops), collections.Counter(protocol_ops)
    assert protocol_count.pop("aten.detach.default") - lean_count.pop("aten.detach.default") == 4
    assert lean_count == protocol_count


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_default_fit_on_cuda_makes_no_host_sync_per_step():
    def syncs(n_rows):
        X, y = _data(n_rows)
        torch.manual_seed(0)
        net = AmpNetClassifier(**net_kw(batch_size=16, max_epochs=1, device="cuda", amp_enabled=True))
        net.initialize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                net.partial_fit(X, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message).lower() for w in caught)

    syncs(64)  # warm-up
    assert syncs(16 * 12) == syncs(16 * 4)  # 8 more steps, not one more sync
