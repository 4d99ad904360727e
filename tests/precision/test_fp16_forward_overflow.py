"""A float16 forward-pass overflow, as a new user meets it: a few rows of a far
larger scale than the others.

- The loss scale moves only on what it can fix, an overflow in the backward
  pass: a step skipped as ``'nonfinite_loss'`` (the forward pass already went
  non-finite) keeps it, as bad data does.
- The epoch's ``train_loss`` is the mean over the batches whose step was
  applied: the skipped batch keeps its own loss in its batch record and is
  counted in ``skipped_steps``, so the printed log and ``plot_precision`` show
  finite losses.
"""

import math
import warnings

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier

from ampnet import AmpNetClassifier
from ampnet.exceptions import AmpWarning
from ampnet.training.default_callbacks import TrainLoss
from conftest import MLP, small_classifier


def _large_rows(n=64, rows=(3,)):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    X[list(rows)] *= 1e5  # beyond float16's range (65504) once through a layer
    return X, y


def _fit_fp16(X, y, **kwargs):
    params = dict(amp_enabled=True, amp_dtype="float16", max_epochs=6, iterator_train__shuffle=False)
    params.update(kwargs)
    net = small_classifier(**params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.fit(X, y)
    return net, [str(w.message) for w in caught if issubclass(w.category, AmpWarning)]


def _applied_mean(epoch):
    rows = [b for b in epoch["batches"] if "train_loss" in b and not b.get("step_skipped")]
    return np.average([b["train_loss"] for b in rows], weights=[b["train_batch_size"] for b in rows])


def test_a_forward_overflow_keeps_the_loss_scale_and_the_epoch_loss_finite():
    net, messages = _fit_fp16(*_large_rows())
    for epoch in net.history:
        causes = [b.get("skip_cause") for b in epoch["batches"]]
        assert causes == ["nonfinite_loss", None, None, None]
        assert epoch["skipped_steps"] == 1
        # the scale moved on nothing it could fix: 65536 throughout (it used to halve each epoch)
        assert [b["loss_scale"] for b in epoch["batches"]] == [65536.0] * 4
        assert epoch["loss_scale"] == 65536.0
        # the skipped batch keeps its own loss; the epoch's is the mean over the applied steps
        assert not math.isfinite(epoch["batches"][0]["train_loss"])
        assert math.isfinite(epoch["train_loss"]) and epoch["train_loss"] == _applied_mean(epoch)
    losses = net.history[:, "train_loss"]
    assert losses == sorted(losses, reverse=True)  # training went on: the loss falls
    # the end of the fit still tells of the non-finite batch loss, with its cause
    end = [m for m in messages if m.startswith("Training ended with a non-finite training loss")]
    assert len(end) == 1
    assert end[0].startswith("Training ended with a non-finite training loss in 1 of the last epoch's 4 "
                             "training batches (train_loss=")
    assert "1 of its 4 batches skipped their step: 1 nonfinite_loss" in end[0]


def test_a_backward_overflow_still_backs_off():
    class BackwardInf(MLP):
        def forward(self, X):
            out = super().forward(X)
            if self.training and X.shape[0] == 15:  # the epoch's last batch: 63 rows, batches of 16
                out = out.clone()
                out.register_hook(lambda g: g * float("inf"))
            return out

    X, y = _large_rows(63, rows=())
    net, _ = _fit_fp16(X, y, module=BackwardInf, max_epochs=2)
    assert net.history[:, "batches", -1, "skip_cause"] == ["overflow", "overflow"]
    assert net.history[:, "loss_scale"] == [32768.0, 16384.0]
    assert net.history[:, "train_loss"] == [_applied_mean(e) for e in net.history]


def test_a_skipped_accumulation_group_leaves_all_its_micro_batches_out():
    net, _ = _fit_fp16(*_large_rows(rows=(20,)), gradient_accumulation_steps=2, max_epochs=1)
    rows = net.history[-1, "batches"]
    # batch 1 (rows 16-31) holds the large row: the group of batches 0 and 1 is skipped at batch 1
    assert [b.get("skip_cause") for b in rows] == [None, "nonfinite_loss", None, None]
    assert not math.isfinite(rows[1]["train_loss"]) and math.isfinite(rows[0]["train_loss"])
    applied = rows[2:]
    expected = np.average([b["train_loss"] for b in applied], weights=[b["train_batch_size"] for b in applied])
    assert net.history[-1, "train_loss"] == expected
    assert net.history[-1, "loss_scale"] == 65536.0


def test_printed_log_and_plot_show_the_loss(capsys):
    X, y = _large_rows()
    net, _ = _fit_fp16(X, y, max_epochs=2, verbose=1)
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    pytest.importorskip("matplotlib")
    import ampnet

    loss = ampnet.plot_precision(net).axes[0]
    assert loss.get_title() == "Loss"  # nothing left out
    (line,) = loss.get_lines()
    assert list(line.get_ydata()) == net.history[:, "train_loss"]


def test_without_skipped_steps_train_loss_is_skorchs_to_the_bit(classifier_data):
    X, y = classifier_data
    kw = dict(module=MLP, max_epochs=2, lr=0.05, batch_size=16, train_split=None, verbose=0)
    torch.manual_seed(0)
    ours = AmpNetClassifier(**kw).fit(X, y)
    torch.manual_seed(0)
    theirs = NeuralNetClassifier(**kw).fit(X, y)
    assert ours.history[:, "train_loss"] == theirs.history[:, "train_loss"]
    assert isinstance(dict(ours.callbacks_)["train_loss"], TrainLoss)


def test_an_epoch_without_an_applied_step_keeps_skorchs_mean():
    X, y = _large_rows(32, rows=(3, 20))  # both batches of 16 hold a large row
    net, messages = _fit_fp16(X, y, max_epochs=1, amp_max_consecutive_skips=None)
    assert net.history[-1, "skipped_steps"] == 2
    assert not math.isfinite(net.history[-1, "train_loss"])  # the mean over all (non-finite) batches
    assert any(m.startswith("Training ended with a non-finite training loss (train_loss=") for m in messages)
