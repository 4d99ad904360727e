"""The end-of-fit warning for a non-finite training loss names the likely
cause from the record, the evidence considered in order
(``ampnet.diagnostics.flight.nonfinite_loss_message``): bad data, then a
classifier's ``NLLLoss`` on outputs that are not probabilities, then a
float16 overflow (only on evidence of one), then the learning rate. Each
branch is produced by a run."""

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.callbacks import AmpMonitor
from ampnet.diagnostics.flight import REPEATED_OVERFLOW_SHARE, REPEATED_OVERFLOWS

from test_flight_recorder import Inject, data, fp16_quiet, make_net, skipped_rows


def end_warning(record):
    end = [str(w.message) for w in record if "non-finite training loss" in str(w.message)]
    assert len(end) == 1, [str(w.message) for w in record]
    return end[0]


class Coded(torch.nn.Module):
    """Column 20 codes each batch: 1 overflows in the backward pass (finite
    loss, an inf gradient), 2 in the forward pass (an inf activation)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(20, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        h = torch.relu(self.inp(X[:, :20]))
        code = float(X[:, 20].max()) if self.training else 0.0
        if code == 1.0:
            h = Inject.apply(h)
        elif code == 2.0:
            h = h * float("inf")
        return self.out(h)


def coded_data(codes, batch_size=16):
    """One batch per entry of ``codes`` (0: clean)."""
    X, y = data(len(codes) * batch_size)
    for b, code in enumerate(codes):
        X[b * batch_size, 20] = code
    return X, y


class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 3)

    def forward(self, X):
        return self.lin(X[:, :20])


# ---- 2. the loss set-up, before any precision cause -----------------------------------------


@fp16_quiet
@pytest.mark.parametrize("amp", [
    dict(amp_enabled=True, amp_dtype="float16"),
    dict(amp_enabled=True, amp_dtype="float16", callbacks=[AmpMonitor(sink=lambda line: None)]),
    dict(amp_enabled=False),
])
def test_logits_under_nllloss_blame_the_loss_setup(amp):
    """The bug: a classifier with skorch's default NLLLoss on a module that
    returns logits was blamed on a float16 overflow (or the learning rate)."""
    X, _ = data(64)
    y = np.arange(64) % 3
    torch.manual_seed(0)
    net = AmpNetClassifier(Logits, max_epochs=2, batch_size=16, train_split=None, verbose=0, **amp)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    assert any("does not return probabilities" in str(w.message) for w in record)  # at fit start
    text = end_warning(record)
    assert "Likely cause: the loss set-up" in text and "criterion=NLLLoss" in text
    assert "criterion=torch.nn.CrossEntropyLoss" in text and "torch.softmax" in text
    assert "float16 overflow" not in text and "learning rate" not in text


@fp16_quiet
def test_bad_data_comes_before_the_loss_setup():
    X, _ = data(64)
    X[20, 3] = np.nan
    y = np.arange(64) % 3
    net = AmpNetClassifier(Logits, max_epochs=1, batch_size=16, train_split=None, verbose=0,
                           amp_enabled=False)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    text = end_warning(record)
    assert "Likely cause: bad data (1 batch holds NaN or inf" in text and "NLLLoss" not in text


def test_probabilities_under_nllloss_are_not_blamed():
    """The flag is the output check's verdict, reset at each fit."""
    X, y = coded_data([0, 0])
    net = make_net(module=Coded, criterion=torch.nn.CrossEntropyLoss, monitor=False).fit(X, y)
    assert net.amp_step_state_.not_probabilities is False
    X2, _ = data(32)
    net = AmpNetClassifier(Logits, max_epochs=1, batch_size=16, train_split=None, verbose=0,
                           amp_enabled=False)
    with pytest.warns(AmpWarning, match="does not return probabilities"):
        net.fit(X2, np.arange(32) % 3)
    assert net.amp_step_state_.not_probabilities is True
    net.set_params(criterion=torch.nn.CrossEntropyLoss)
    net.fit(X2, np.arange(32) % 3)  # no warning: the new fit's check passes
    assert net.amp_step_state_.not_probabilities is False


# ---- 3. float16 overflow, only on evidence ----------------------------------------------------


@fp16_quiet
def test_overflow_with_the_scale_at_its_floor():
    """A clean step, then two backward overflows bring the scale from 4 to its
    floor 1, then a forward overflow: no AmpMonitor, still a float16 verdict."""
    codes = [0, 1, 1, 0, 0, 0, 0, 2]
    X, y = coded_data(codes)
    net = make_net(module=Coded, monitor=False, amp_dtype="float16", grad_scaler__init_scale=4.0)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    assert [b.get("skip_cause") for _, b in skipped_rows(net)] == ["overflow", "overflow", "nonfinite_loss"]
    assert net.history[-1, "batches", 2]["loss_scale"] == 1.0
    assert 2 < REPEATED_OVERFLOW_SHARE * len(codes)  # not "repeated": the floor decides
    text = end_warning(record)
    assert "Likely cause: a float16 overflow (2 steps skipped as overflow, the loss scale at its floor (1))" in text
    assert "amp_dtype='bfloat16'" in text and "amp_fp32_modules" in text


@fp16_quiet
def test_repeated_overflow():
    codes = [0, 1, 1, 1, 1, 1, 0, 2]
    X, y = coded_data(codes)
    net = make_net(module=Coded, monitor=False, amp_dtype="float16")
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    assert min(b["loss_scale"] for b in net.history[-1, "batches"]) > 1.0  # never at the floor
    assert 5 >= REPEATED_OVERFLOWS and 5 >= REPEATED_OVERFLOW_SHARE * len(codes)
    assert "Likely cause: a float16 overflow (5 of 8 steps skipped as overflow)" in end_warning(record)


@fp16_quiet
def test_a_lone_overflow_is_no_evidence():
    """One ordinary backoff (65536 -> 32768) and a non-finite loss after
    applied steps: the old rule blamed float16 on any non-finite loss."""
    X, y = coded_data([0, 1, 0, 0, 0, 2])
    net = make_net(module=Coded, monitor=False, amp_dtype="float16")
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    assert [b.get("skip_cause") for _, b in skipped_rows(net)] == ["overflow", "nonfinite_loss"]
    text = end_warning(record)
    assert "Likely cause: the loss diverged. Fix: lower the learning rate (lr)" in text
    assert "A float16 overflow in the forward pass leaves the same record" in text  # how to tell


@fp16_quiet
def test_nonfinite_with_the_initial_weights_is_no_learning_rate():
    """Float16 and inputs around 1e6, without AmpMonitor:
    the loss is non-finite before any step was applied."""
    X, y = data(32)
    X[:, :20] *= 1e6
    net = make_net(amp_dtype="float16", monitor=False)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    text = end_warning(record)
    assert ("Likely cause: a float16 overflow (the loss was non-finite before any step was applied)"
            in text)
    assert "learning rate" not in text


# ---- 4. otherwise the learning rate ----------------------------------------------------------


@pytest.mark.parametrize("amp", [dict(amp_enabled=False), dict(amp_enabled=True, amp_dtype="bfloat16")])
def test_a_diverging_learning_rate(amp):
    X, y = data(64)
    net = make_net(monitor=False, optimizer=torch.optim.SGD, lr=1e12, max_epochs=3, **amp)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    assert np.isfinite(net.history[0, "batches", 0]["train_loss"])  # it trained before it diverged
    text = end_warning(record)
    assert "Likely cause: the loss diverged. Fix: lower the learning rate (lr)" in text
    assert "float16" not in text and "NLLLoss" not in text
