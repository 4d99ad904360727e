"""The training loop under loss scaling: accumulation, multiple optimizers,
LR schedulers, the scale policy, divergence guards, visibility, fused
optimizers. Compared against hand-written torch where one exists."""

import warnings

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback, GradientNormClipping, LRScheduler, PrintLog, ProgressBar
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from ampnet import AmpDivergenceError, AmpNetClassifier, AmpWarning, GradScaler
from ampnet.callbacks import AmpMonitor
from conftest import MLP, Logits, net_kw, small_classifier


def nan_loss_warned():
    """The warning at the end of a fit whose last epoch's loss is NaN/inf (an
    injected inf in the forward pass makes the batch loss NaN)."""
    return pytest.warns(AmpWarning, match="Training ended with a non-finite training loss")


def fit_quiet(net, X, y):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
        return net.fit(X, y)


class CountingScaler(GradScaler):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.unscales = 0
        self.updates = 0

    def unscale_(self, optimizer):
        self.unscales += 1
        super().unscale_(optimizer)

    def update(self, new_scale=None):
        self.updates += 1
        super().update(new_scale)


class StepCounter(Callback):
    def initialize(self):
        self.grad_events = 0
        return self

    def on_grad_computed(self, net, **kwargs):
        self.grad_events += 1


# ---- gradient accumulation ------------------------------------------------------------


@pytest.mark.parametrize("n_rows", [64, 72])  # 72: a remainder group at the epoch end
def test_accumulation_matches_one_large_batch(classifier_data, n_rows, device_dtype):
    X, y = classifier_data[0][:n_rows], classifier_data[1][:n_rows]
    amp = dict(device_dtype.net_kwargs, grad_scaler__init_scale=256.0)
    torch.manual_seed(0)
    big = AmpNetClassifier(**net_kw(batch_size=32, max_epochs=2, **amp)).fit(X, y)
    torch.manual_seed(0)
    counter = StepCounter()
    acc = AmpNetClassifier(**net_kw(batch_size=8, gradient_accumulation_steps=4, max_epochs=2,
                                    callbacks=[counter], **amp)).fit(X, y)
    for a, b in zip(big.module_.parameters(), acc.module_.parameters()):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=device_dtype.atol, rtol=1e-5)
    assert counter.grad_events == 2 * len(range(0, n_rows, 32))
    steps = [b.get("step_skipped", False) for b in acc.history[-1, "batches"]]
    assert not any(steps) and len(steps) == len(range(0, n_rows, 8))


def test_fp16_accumulation_unscales_and_updates_once_per_step(classifier_data):
    X, y = classifier_data[0][:72], classifier_data[1][:72]
    torch.manual_seed(0)
    ref = AmpNetClassifier(**net_kw(batch_size=32)).fit(X, y)
    torch.manual_seed(0)
    net = AmpNetClassifier(**net_kw(batch_size=8, gradient_accumulation_steps=4, amp_enabled=True,
                                    amp_dtype="fp16", grad_scaler=CountingScaler,
                                    grad_scaler__init_scale=256.0))
    fit_quiet(net, X, y)
    assert net.grad_scaler_.unscales == 3 and net.grad_scaler_.updates == 3  # 9 micro-batches
    for a, b in zip(ref.module_.parameters(), net.module_.parameters()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
    flags = [b["step_skipped"] for b in net.history[-1, "batches"]]
    assert flags == [False] * 9


# ---- multiple optimizers ---------------------------------------------------------------


class TwoOptimizerNet(AmpNetClassifier):
    """hidden layer trained by optimizer_, output layer by optimizer2_,
    and an unused parameter by optimizer3_ (it never gets a gradient)."""

    def initialize_module(self):
        super().initialize_module()
        self.unused_ = torch.nn.Linear(1, 1)
        return self

    def initialize_optimizer(self, *args, **kwargs):
        self.optimizer_ = torch.optim.SGD(self.module_.hidden.parameters(), lr=self.lr)
        self.optimizer2_ = torch.optim.SGD(self.module_.out.parameters(), lr=self.lr)
        self.optimizer3_ = torch.optim.SGD(self.unused_.parameters(), lr=self.lr)
        return self


def test_overflow_in_one_optimizer_skips_only_that_one(classifier_data):
    X, y = classifier_data[0][:16], classifier_data[1][:16]
    net = TwoOptimizerNet(**net_kw(amp_enabled=True, amp_dtype="fp16", grad_scaler__init_scale=64.0))
    net.initialize()
    poison = {"on": False}
    net.module_.hidden.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    hidden0 = net.module_.hidden.weight.detach().clone()
    out0 = net.module_.out.weight.detach().clone()
    poison["on"] = True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
        net.partial_fit(X[:8], y[:8])
    assert torch.equal(net.module_.hidden.weight, hidden0)  # skipped
    assert not torch.equal(net.module_.out.weight, out0)  # stepped
    assert net.history[-1, "batches", 0, "step_skipped"] is True
    assert net.grad_scaler_.get_scale() == 32.0  # one backoff for the step
    poison["on"] = False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
        net.partial_fit(X[8:], y[8:])
    assert not torch.equal(net.module_.hidden.weight, hidden0)
    assert net.history[-1, "batches", 0, "step_skipped"] is False


class TwoCriteriaNet(AmpNetClassifier):
    """Two criteria registered the skorch way; the loss is their sum."""

    def initialize_criterion(self):
        super().initialize_criterion()
        self.criterion2_ = torch.nn.MultiMarginLoss()
        return self

    def get_loss(self, y_pred, y_true, X=None, training=False):
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        with self.precision_.forward_context():
            return loss + self.criterion2_(y_pred, torch.as_tensor(y_true))


def test_multiple_criteria_share_one_scaler(classifier_data):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    net = TwoCriteriaNet(**net_kw(module__bad_calls=(2,), amp_enabled=True, amp_dtype="fp16",
                                  grad_scaler__init_scale=64.0))
    with nan_loss_warned():
        fit_quiet(net, X, y)
    assert "criterion2" in net._criteria
    assert [b["step_skipped"] for b in net.history[-1, "batches"]] == [False, True, False, False]
    assert net.grad_scaler_.get_scale() == 64.0  # a forward-pass overflow keeps the scale
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())


# ---- LR schedulers -------------------------------------------------------------------


class LrRecorder(Callback):
    def initialize(self):
        self.lrs = []
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.lrs.append(net.optimizer_.param_groups[0]["lr"])


def test_batch_scheduler_does_not_advance_on_skipped_steps(classifier_data):
    X, y = classifier_data[0][:48], classifier_data[1][:48]
    rec = LrRecorder()
    sched = LRScheduler(StepLR, step_size=1, gamma=0.5, step_every="batch")
    net = AmpNetClassifier(**net_kw(module__bad_calls=(1, 3, 4), amp_enabled=True, amp_dtype="fp16",
                                    grad_scaler__init_scale=256.0, callbacks=[sched, rec]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.fit(X, y)
    skipped = [b["step_skipped"] for b in net.history[-1, "batches"]]
    assert skipped == [True, False, True, True, False, False]
    # the hand-computed sequence: halve after each applied step only
    expected, lr = [], 0.1
    for s in skipped:
        lr = lr if s else lr * 0.5
        expected.append(lr)
    assert rec.lrs == pytest.approx(expected)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize("policy, kwargs", [(StepLR, {"step_size": 1, "gamma": 0.5}),
                                            (ReduceLROnPlateau, {"patience": 0, "factor": 0.5,
                                                                 "monitor": "train_loss"})])
def test_epoch_scheduler_holds_for_an_epoch_without_steps(classifier_data, policy, kwargs):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    sched = LRScheduler(policy, step_every="epoch", **kwargs)
    net = AmpNetClassifier(**net_kw(module__bad_calls=(1, 2, 3, 4), max_epochs=2, amp_enabled=True,
                                    amp_dtype="bf16", callbacks=[sched]))
    net.fit(X, y)
    assert net.history[:, "skipped_steps"] == [4, 0]
    scheduler = sched.lr_scheduler_
    # one epoch with applied steps: the scheduler advanced exactly once
    assert scheduler.last_epoch == 1
    if policy is StepLR:
        assert net.optimizer_.param_groups[0]["lr"] == pytest.approx(0.05)


# ---- scale policy and divergence guards --------------------------------------------------


def test_500_overflows_keep_scale_at_minimum_and_weights_finite(classifier_data):
    rng = np.random.RandomState(0)
    X = rng.randn(1004, 4).astype(np.float32)  # 502 batches: 500 bad, 2 good
    y = (X[:, 0] > 0).astype(np.int64)
    net = AmpNetClassifier(**net_kw(module__n_in=4, module__bad_grad_calls=range(1, 501), batch_size=2,
                                    amp_enabled=True, amp_dtype="fp16", amp_max_consecutive_skips=None))
    fit_quiet(net, X, y)
    scales = [b["loss_scale"] for b in net.history[-1, "batches"]]
    assert scales[499] == 1.0 and min(scales) == 1.0
    assert net.history[-1, "skipped_steps"] == 500
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())
    assert scales[-1] == 1.0 and not net.history[-1, "batches", -1, "step_skipped"]


@pytest.mark.parametrize("dtype, hint", [("fp16", "try amp_dtype='bfloat16'"), ("bf16", "lower lr")])
def test_persistent_overflow_fails_fast_with_causes(classifier_data, dtype, hint):
    X, y = classifier_data
    net = AmpNetClassifier(**net_kw(module__bad_calls=range(1, 1000), max_epochs=10, amp_enabled=True,
                                    amp_dtype=dtype, amp_max_consecutive_skips=20))
    net.initialize()
    start = [p.detach().clone() for p in net.module_.parameters()]
    with pytest.raises(AmpDivergenceError, match=r"20 optimizer steps in a row were skipped") as exc:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
            net.partial_fit(X, y)
    assert hint in str(exc.value) and "learning rate" in str(exc.value)
    assert all(torch.equal(a, b) for a, b in zip(start, net.module_.parameters()))
    assert net.grad_scaler_.get_scale() >= 1.0


def test_nan_in_input_is_reported_as_data_not_overflow(classifier_data, device_dtype):
    X, y = classifier_data[0][:32].copy(), classifier_data[1][:32]
    X[10, 3] = np.nan  # in the second batch of 8
    net = AmpNetClassifier(**net_kw(grad_scaler__init_scale=128.0, **device_dtype.net_kwargs))
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    texts = [str(w.message) for w in record]
    assert any("holds NaN or inf in its input or target" in t for t in texts)
    assert any("non-finite training loss" in t and "bad data" in t for t in texts)
    batches = net.history[-1, "batches"]
    assert [b.get("step_skipped", False) for b in batches] == [False, True, False, False]
    assert batches[1]["nonfinite_input"] is True
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())
    if device_dtype.low:  # no backoff for bad data
        assert [b["loss_scale"] for b in batches] == [128.0 if device_dtype.scaled else 1.0] * 4


def test_divergence_guard_counts_steps_not_micro_batches(classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(**net_kw(module__bad_calls=range(1, 1000), max_epochs=5, amp_enabled=True,
                                    amp_dtype="bf16", gradient_accumulation_steps=2,
                                    amp_max_consecutive_skips=3))
    with pytest.raises(AmpDivergenceError, match="3 optimizer steps in a row"):
        net.fit(X, y)
    assert len(net.history) == 1  # stopped in the first epoch (8 micro-batches = 4 steps)


def test_all_nan_data_names_the_data_as_cause(classifier_data):
    X = np.full((32, 20), np.nan, dtype=np.float32)
    y = classifier_data[1][:32]
    net = AmpNetClassifier(**net_kw(amp_enabled=True, amp_dtype="bf16", amp_max_consecutive_skips=3))
    with pytest.raises(AmpDivergenceError, match="3 of these batches hold NaN or inf in the input"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AmpWarning)
            net.fit(X, y)


def test_nonfinite_step_is_skipped_and_recorded(classifier_data, device_dtype):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    net = AmpNetClassifier(**net_kw(module__bad_calls=(2,), grad_scaler__init_scale=512.0,
                                    **device_dtype.net_kwargs))
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    texts = [str(w.message) for w in record]
    assert any("Training ended with a non-finite training loss" in t for t in texts)  # the NaN batch's
    # AMP off: skorch would step the NaN in; ampnet skips and says so
    assert any("Non-finite gradients: the optimizer step was skipped" in t for t in texts) == (not device_dtype.low)
    batches = net.history[-1, "batches"]
    assert [b.get("step_skipped", False) for b in batches] == [False, True, False, False]
    assert net.history[-1, "skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())
    if device_dtype.low:  # float16: a forward-pass overflow keeps the scale; bfloat16: no scaling
        assert net.history[-1, "loss_scale"] == (512.0 if device_dtype.scaled else 1.0)


def test_without_guard_nonfinite_gradients_reach_the_weights(classifier_data):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    net = AmpNetClassifier(**net_kw(module__bad_calls=(2,), amp_enabled=True, amp_dtype="bf16",
                                    amp_skip_nonfinite=False))
    with pytest.warns(AmpWarning, match=r"non-finite training loss.*guard is off"):
        net.fit(X, y)
    assert not all(torch.isfinite(p).all() for p in net.module_.parameters())


def test_amp_off_guard_skips_and_warns(classifier_data):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    net = AmpNetClassifier(**net_kw(module__bad_calls=(2,)))
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    texts = [str(w.message) for w in record]
    assert any("Non-finite gradients: the optimizer step was skipped" in t for t in texts)
    assert any("non-finite training loss" in t for t in texts)
    assert net.history[-1, "batches", 1, "step_skipped"] is True
    assert net.history[-1, "skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())


# ---- visibility ------------------------------------------------------------------------------


def test_printlog_shows_scale_and_skips(classifier_data, capsys):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    net = AmpNetClassifier(**net_kw(module__bad_grad_calls=(2,), amp_enabled=True, amp_dtype="fp16",
                                    grad_scaler__init_scale=512.0, verbose=1))
    fit_quiet(net, X, y)
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert "loss_scale" in header and "skipped_steps" in header
    assert "256.0000" in row  # a backward-pass overflow: the scale backed off


def test_amp_monitor_reports_bursts_and_feeds_tensorboard(classifier_data, tmp_path):
    pytest.importorskip("tensorboard")  # in the dev extra, not in the lean test extra
    from skorch.callbacks import TensorBoard
    from torch.utils.tensorboard import SummaryWriter

    X, y = classifier_data[0][:64], classifier_data[1][:64]
    lines = []
    writer = SummaryWriter(log_dir=str(tmp_path))
    monitor = AmpMonitor(burst=3, report_scale_changes=True, sink=lines.append)
    net = AmpNetClassifier(**net_kw(module__bad_grad_calls=(2, 3, 4), amp_enabled=True, amp_dtype="fp16",
                                    grad_scaler__init_scale=512.0,
                                    callbacks=[monitor, TensorBoard(writer)]))
    fit_quiet(net, X, y)  # backward-pass overflows: the scale backs off
    writer.flush()
    bursts = [e for e in monitor.events_ if e["kind"] == "burst"]
    assert [e["value"] for e in bursts] == [3]
    # with gradient accumulation a burst counts steps, not micro-batches
    acc_monitor = AmpMonitor(burst=2, sink=lines.append)
    with nan_loss_warned():
        fit_quiet(AmpNetClassifier(**net_kw(module__bad_calls=(3, 4, 5, 6), amp_enabled=True,
                                            amp_dtype="bf16", gradient_accumulation_steps=2,
                                            callbacks=[acc_monitor])), X, y)
    assert [e["value"] for e in acc_monitor.events_ if e["kind"] == "burst"] == [2]
    assert any("3 optimizer steps in a row were skipped" in line for line in lines)
    assert net.history[-1, "max_skip_burst"] == 3
    assert net.history[-1, "scale_changes"] == 3  # 512 -> 256 -> 128 -> 64
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"amp/loss_scale", "amp/step_skipped", "loss_scale", "skipped_steps", "max_skip_burst"} <= set(tags)
    assert [e.value for e in acc.Scalars("amp/loss_scale")][:4] == [512.0, 256.0, 128.0, 64.0]


def test_progress_bar_works(classifier_data, capsys):
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    net = AmpNetClassifier(**net_kw(amp_enabled=True, amp_dtype="bf16", callbacks=[ProgressBar()]))
    net.fit(X, y)
    assert net.history[-1, "skipped_steps"] == 0
    err = capsys.readouterr().err
    # 32 rows in batches of 8: the bar counts 4 batches per epoch
    assert "| 0/4 [" in err


# ---- fused optimizers ------------------------------------------------------------------------


def test_fused_adam_with_scaling_and_clipping_matches_unfused(classifier_data):
    X, y = classifier_data[0][:64], classifier_data[1][:64]
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        net = AmpNetClassifier(**net_kw(optimizer=torch.optim.Adam, optimizer__fused=fused, lr=0.01,
                                        module__bad_calls=(3,), amp_enabled=True, amp_dtype="fp16",
                                        grad_scaler__init_scale=256.0,
                                        callbacks=[GradientNormClipping(0.1)]))
        with nan_loss_warned():
            fit_quiet(net, X, y)
        results.append(net)
    plain, fused = results
    assert [b["step_skipped"] for b in fused.history[-1, "batches"]][2] is True
    for a, b in zip(plain.module_.parameters(), fused.module_.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bad_data_in_an_earlier_micro_batch_is_bad_data_not_an_overflow(classifier_data):
    X, y = classifier_data[0][:32].copy(), classifier_data[1][:32]
    X[0, 0] = np.nan  # first micro-batch of the first group
    net = small_classifier(amp_enabled=True, amp_dtype="float16", gradient_accumulation_steps=2, batch_size=8, grad_scaler__init_scale=256.0,
               iterator_train__shuffle=False)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    texts = [str(w.message) for w in record]
    assert any("holds NaN or inf in its input" in t for t in texts)
    assert any("non-finite training loss" in t for t in texts)  # the NaN batch's loss
    first = net.history[0, "batches"][1]
    assert first["skip_cause"] == "nonfinite_input"
    assert first["step_skipped"] and first.get("nonfinite_input")
    assert first["loss_scale"] == 256.0  # kept, not backed off
