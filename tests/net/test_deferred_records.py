"""Per-batch values kept on the device until read (ampnet.training.records):
the history, the callbacks and the weights are those of skorch's loop, read
at once (the DataLoader path, ``batch_gather=False``, reads every step)."""

import copy
import json
import pickle
import warnings

import numpy as np
import pytest
import torch
from skorch.callbacks import (BatchScoring, Callback, Checkpoint, EpochScoring, GradientNormClipping,
                              LRScheduler, ProgressBar)
from skorch.dataset import ValidSplit
from torch.optim.lr_scheduler import StepLR

from ampnet import AmpDivergenceError, AmpNetClassifier, AmpWarning
from ampnet.callbacks import AmpMonitor
from ampnet.training.records import PENDING, DeferredHistory

from conftest import Logits, net_kw
from host_reads import HostReadCounter


def _data(n=100, nan_rows=()):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 20).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(np.int64)
    for row in nan_rows:
        X[row, 3] = np.nan
    return X, y


def _fit(gather, X, y, **kw):
    torch.manual_seed(0)
    params = net_kw(batch_size=16, max_epochs=2, batch_gather=gather, iterator_train__shuffle=True)
    params.update(kw)
    net = AmpNetClassifier(**params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.fit(X, y)
    return net, [(w.category.__name__, str(w.message)) for w in caught if "float16 autocast on CPU" not in str(w.message)]


def _same(value):
    return "nan" if isinstance(value, float) and np.isnan(value) else value  # NaN equals NaN here


def _rows(net):
    """The history as skorch writes it: every row's keys in order and values, without durations."""
    out = []
    for epoch in net.history:
        epoch = {k: _same(v) for k, v in epoch.items() if k != "dur"}
        epoch["batches"] = [[(k, _same(v)) for k, v in b.items()] for b in epoch["batches"]]
        out.append(list(epoch.items()))
    return out


def _assert_same_fit(a, b):
    net_a, warned_a = a
    net_b, warned_b = b
    assert _rows(net_a) == _rows(net_b)
    for (name, p), (_, q) in zip(net_a.module_.named_parameters(), net_b.module_.named_parameters()):
        assert torch.equal(p, q), name
    assert warned_a == warned_b


SETTINGS = {
    "amp-off": dict(amp_enabled=False),
    "bf16": dict(amp_enabled=True, amp_dtype="bfloat16"),
    "bf16-adam": dict(amp_enabled=True, amp_dtype="bfloat16", optimizer=torch.optim.Adam, lr=0.01),
    "bf16-accumulate": dict(amp_enabled=True, amp_dtype="bfloat16", gradient_accumulation_steps=3),
    "bf16-split": dict(amp_enabled=True, amp_dtype="bfloat16", train_split=ValidSplit(5)),
    "bf16-pure": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure"),
    "fp16": dict(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0),
    "bf16-no-guard": dict(amp_enabled=True, amp_dtype="bfloat16", amp_skip_nonfinite=False),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_array_path_trains_and_records_as_skorch_s_loop(setting):
    X, y = _data(100)  # 7 batches of 16, the last one short
    _assert_same_fit(_fit(True, X, y, **SETTINGS[setting]), _fit(False, X, y, **SETTINGS[setting]))


class DictModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 8)
        self.b = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, a, b):
        return self.out(torch.tanh(self.a(a) + self.b(b)))


@pytest.mark.parametrize("amp", [False, True])
def test_dict_inputs(amp):
    X, y = _data(100)
    X = {"a": X[:, :12], "b": X[:, 12:]}
    kw = dict(module=DictModule, amp_enabled=amp, train_split=ValidSplit(4))
    _assert_same_fit(_fit(True, X, y, **kw), _fit(False, X, y, **kw))


@pytest.mark.parametrize("setting", ["bf16", "bf16-accumulate", "amp-off"])
def test_skipped_steps_and_their_causes_as_read_at_once(setting):
    # a bad row in the fourth batch, and a backward overflow on the second training call
    X, y = _data(96, nan_rows=(50,))
    kw = dict(SETTINGS[setting], iterator_train__shuffle=False, module__bad_grad_calls=(2,))
    ours, theirs = _fit(True, X, y, **kw), _fit(False, X, y, **kw)
    _assert_same_fit(ours, theirs)
    batches = [b for epoch in ours[0].history[:, "batches"] for b in epoch]
    causes = [b.get("skip_cause") for b in batches if b.get("step_skipped")]
    assert "nonfinite_input" in causes and "overflow" in causes
    assert any("holds NaN or inf in its input" in text for _, text in ours[1])


def test_a_run_of_skipped_steps_stops_the_fit_as_when_read_at_once():
    X, y = _data(160)
    X[:] = np.nan  # every step is skipped
    kw = dict(amp_enabled=True, amp_dtype="bfloat16", amp_max_consecutive_skips=3, iterator_train__shuffle=False)
    nets = []
    for gather in (True, False):
        torch.manual_seed(0)
        net = AmpNetClassifier(**net_kw(batch_size=16, max_epochs=2, batch_gather=gather, **kw))
        net.initialize()
        before = copy.deepcopy(net.module_.state_dict())
        with pytest.warns(AmpWarning), pytest.raises(AmpDivergenceError, match="3 optimizer steps in a row"):
            net.partial_fit(X, y)
        for name, value in net.module_.state_dict().items():  # no step reached the weights
            assert torch.equal(value, before[name]), name
        nets.append(net)
    ours, theirs = nets
    # read in one go, the fit stops at the read (within amp_max_consecutive_skips steps of the third skip)
    assert len(ours.history[-1, "batches"]) >= len(theirs.history[-1, "batches"]) == 3


class ReadsTheBatch(Callback):
    def initialize(self):
        self.seen = []
        return self

    def on_batch_end(self, net, training=False, loss=None, **kwargs):
        if training:
            row = net.history[-1, "batches", -1]
            self.seen.append((row["train_loss"], loss.item(), type(row["train_loss"])))


def test_a_callback_reading_the_batch_s_loss_in_on_batch_end_sees_it():
    X, y = _data(64)
    cb = ReadsTheBatch()
    net, _ = _fit(True, X, y, amp_enabled=True, callbacks=[cb])
    assert len(cb.seen) == 8
    for recorded, loss, kind in cb.seen:
        assert kind is float and recorded == loss


class PicklesMidEpoch(Callback):
    def initialize(self):
        self.snapshots = []
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history[-1]["batches"]) == 2:
            self.snapshots.append(pickle.loads(pickle.dumps(net.history)))
            self.snapshots.append(json.loads(json.dumps(net.history.to_list())))
            self.snapshots.append(copy.deepcopy(net.history))


def test_no_pending_value_reaches_a_reader():
    X, y = _data(64)
    cb = PicklesMidEpoch()
    net, _ = _fit(True, X, y, amp_enabled=True, callbacks=[cb])
    assert isinstance(net.history, DeferredHistory)
    for snapshot in cb.snapshots:
        for epoch in snapshot:
            for row in epoch["batches"]:
                assert PENDING not in row.values() and isinstance(row["train_loss"], float)
    for epoch in net.history:
        for row in epoch["batches"]:
            assert PENDING not in row.values()
    assert "PENDING" not in repr(net.history) and "pending" not in repr(net.history)


def test_skorch_s_callbacks_see_the_same(tmp_path):
    X, y = _data(100)

    def callbacks(name):
        return [ProgressBar(), EpochScoring("accuracy", on_train=True, name="train_acc"),
                BatchScoring("accuracy", on_train=True, name="batch_acc"), GradientNormClipping(1.0),
                Checkpoint(monitor="train_loss_best", dirname=str(tmp_path / name)),
                LRScheduler(StepLR, step_size=3, step_every="batch")]

    kw = dict(amp_enabled=True, amp_dtype="bfloat16", train_split=ValidSplit(5))
    ours = _fit(True, X, y, callbacks=callbacks("ours"), **kw)
    theirs = _fit(False, X, y, callbacks=callbacks("theirs"), **kw)
    _assert_same_fit(ours, theirs)
    saved = [json.loads((tmp_path / name / "history.json").read_text()) for name in ("ours", "theirs")]
    for a, b in zip(*saved):
        assert {k: v for k, v in a.items() if k != "dur"} == {k: v for k, v in b.items() if k != "dur"}


def test_the_flight_recorder_records_the_same():
    X, y = _data(96, nan_rows=(20,))
    kw = dict(amp_enabled=True, amp_dtype="bfloat16", callbacks=[AmpMonitor()], module__bad_grad_calls=(5,),
              iterator_train__shuffle=False)
    _assert_same_fit(_fit(True, X, y, **kw), _fit(False, X, y, **kw))


def test_skorch_s_doctor_records_the_same():
    from skorch.helper import SkorchDoctor

    X, y = _data(64)
    docs = []
    for gather in (True, False):
        torch.manual_seed(0)
        net = AmpNetClassifier(**net_kw(batch_size=16, batch_gather=gather, amp_enabled=True))
        doctor = SkorchDoctor(net)
        doctor.fit(X, y)
        docs.append(doctor)
    a, b = docs
    assert a.activation_recs_.keys() == b.activation_recs_.keys()
    for key in a.activation_recs_:
        for x, z in zip(a.activation_recs_[key], b.activation_recs_[key]):
            assert x.keys() == z.keys()
            for k in x:
                np.testing.assert_array_equal(x[k], z[k])


class Modes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(20, 8)
        self.drop = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(8, 2)
        self.modes = []

    def forward(self, X):
        self.modes.append((self.training, self.drop.training))
        return self.out(self.drop(torch.relu(self.hidden(X))))


class EvalsDropout(Callback):
    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            net.module_.drop.eval()  # skorch's step puts it back into training mode


@pytest.mark.parametrize("amp", [False, True])
def test_training_mode_is_set_as_skorch_sets_it(amp):
    from skorch import NeuralNetClassifier

    X, y = _data(64)
    kw = dict(module=Modes, criterion=torch.nn.CrossEntropyLoss, max_epochs=1, batch_size=16, train_split=None,
              verbose=0, callbacks=[EvalsDropout()])
    torch.manual_seed(0)
    ours = AmpNetClassifier(amp_enabled=amp, **kw).fit(X, y)
    torch.manual_seed(0)
    theirs = NeuralNetClassifier(**kw).fit(X, y)
    assert ours.module_.modes == theirs.module_.modes == [(True, True)] * 4
    for p, q in zip(ours.module_.parameters(), theirs.module_.parameters()):
        assert torch.equal(p, q) if not amp else p.shape == q.shape


def test_the_default_fit_reads_the_device_once_an_epoch():
    X, y = _data(256)
    torch.manual_seed(0)
    net = AmpNetClassifier(**net_kw(batch_size=16, max_epochs=2, amp_enabled=True, amp_dtype="bfloat16"))
    net.initialize()
    with HostReadCounter() as counter:
        net.partial_fit(X, y)
    # per epoch: one read of the pending values (and per fit: one of the first batch's outputs,
    # ampnet.training.output_checks); skorch's loop reads each of the 32 batches' losses
    assert counter.count <= 2 * 1 + 1, counter.count
    assert net.history[-1, "train_loss"] == pytest.approx(np.mean(net.history[-1, "batches", :, "train_loss"]))


def test_a_history_loaded_from_a_file_is_read_lazily_again(tmp_path):
    X, y = _data(64)
    net, _ = _fit(True, X, y, amp_enabled=True)
    net.save_params(f_history=str(tmp_path / "h.json"))
    other, _ = _fit(True, X, y, amp_enabled=True)
    other.load_params(f_history=str(tmp_path / "h.json"))
    assert type(other.history) is not DeferredHistory  # skorch's History.from_file
    other.partial_fit(X, y)
    assert isinstance(other.history, DeferredHistory) and len(other.history) == 4
    assert PENDING not in other.history[-1, "batches", -1].values()


class RecordingProgressBar(ProgressBar):
    """skorch's ProgressBar; what it reads from the history for its postfix, each batch, is kept."""

    def initialize(self):
        super().initialize()
        self.postfixes = []
        return self

    def _get_postfix_dict(self, net):
        postfix = super()._get_postfix_dict(net)
        self.postfixes.append(postfix)
        return postfix


def test_progress_bar_reads_each_batch_s_loss():
    X, y = _data(64)
    ours, theirs = RecordingProgressBar(), RecordingProgressBar()
    _fit(True, X, y, amp_enabled=True, callbacks=[ours])
    _fit(False, X, y, amp_enabled=True, callbacks=[theirs])
    assert len(ours.postfixes) == 8 and ours.postfixes == theirs.postfixes
    assert all(isinstance(p["train_loss"], float) for p in ours.postfixes)


class GuardOnDevice(Callback):
    """What begin_fit does on a GPU (ampnet.training.records.SkipGuard), on this CPU: the limit on runs
    of skipped steps kept on the device, the records read only at the epoch's end."""

    def on_train_begin(self, net, **kwargs):
        from ampnet.training.records import SkipGuard

        state = net.amp_step_state_
        state.guard = SkipGuard(net.amp_max_consecutive_skips, state.consecutive_skips, torch.device("cpu"))
        state.records.max_pending = 10**6


def test_with_the_limit_on_the_device_no_step_after_it_reaches_the_weights():
    X, y = _data(160)
    X[:48] = np.nan  # the first three batches: their steps are skipped; the later ones are good
    torch.manual_seed(0)
    net = AmpNetClassifier(**net_kw(batch_size=16, max_epochs=1, amp_enabled=True, amp_dtype="bfloat16",
                                    amp_max_consecutive_skips=3, callbacks=[GuardOnDevice()]))
    net.initialize()
    before = copy.deepcopy(net.module_.state_dict())
    with pytest.warns(AmpWarning), pytest.raises(AmpDivergenceError, match="3 optimizer steps in a row"):
        net.partial_fit(X, y)
    for name, value in net.module_.state_dict().items():  # the good batches after the limit did not step
        assert torch.equal(value, before[name]), name
    rows = net.history[-1, "batches"]
    assert len(rows) == 10  # read at the epoch's end: every batch ran
    assert [r["step_skipped"] for r in rows] == [True] * 10  # on the device, after the third, all skipped
    assert [r.get("skip_cause") for r in rows[:3]] == ["nonfinite_input"] * 3


def test_with_the_limit_on_the_device_a_recovering_run_trains_on():
    X, y = _data(160)
    X[:32] = np.nan  # two skipped steps, under the limit of three
    torch.manual_seed(0)
    net = AmpNetClassifier(**net_kw(batch_size=16, max_epochs=1, amp_enabled=True, amp_dtype="bfloat16",
                                    amp_max_consecutive_skips=3, callbacks=[GuardOnDevice()]))
    with pytest.warns(AmpWarning):
        net.fit(X, y)
    assert [r["step_skipped"] for r in net.history[-1, "batches"]] == [True, True] + [False] * 8
    assert net.amp_step_state_.consecutive_skips == 0


@pytest.mark.parametrize("verbose", [0, 1])
def test_print_log_prints_as_skorch_s(verbose, capsys):
    from skorch import NeuralNetClassifier
    from skorch.callbacks import PrintLog

    X, y = _data(64)
    kw = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, max_epochs=2, batch_size=16, train_split=None,
              verbose=verbose)
    net = AmpNetClassifier(**kw).fit(X, y)
    ours = capsys.readouterr().out
    NeuralNetClassifier(**kw).fit(X, y)
    theirs = capsys.readouterr().out
    assert isinstance(dict(net.callbacks_)["print_log"], PrintLog)
    assert not dict(net.callbacks_)["print_log"].first_iteration_
    if verbose:  # the same table (skorch's columns, AMP off; durations differ)
        assert ours.splitlines()[0].split() == theirs.splitlines()[0].split() == ["epoch", "train_loss", "dur"]
        assert len(ours.splitlines()) == len(theirs.splitlines()) == 4
    else:
        assert ours == theirs == ""
    # a sink of the user's own gets every line, silent or not
    lines = []
    AmpNetClassifier(**{**kw, "verbose": 0}, callbacks__print_log__sink=lines.append).fit(X, y)
    assert len(lines) == 4
