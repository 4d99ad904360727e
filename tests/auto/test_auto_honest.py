"""Issue 38: what ``amp_enabled="auto"`` remembers is right for every fit that
reads it, and its trial is honest. A complete key (item 1), float32 timed as a
float32 net runs (2), skipped steps untimed (3), an interrupted measurement
stores nothing (4), a stored choice judged on health (5), numpy values (7), the
non-finite rule (13), no single outlier decides and entries expire (16), and
the clock seam that CUDA events use (9). Explicit timers and clocks: nothing
here depends on this machine's speed."""

import json
import os
import time
import warnings

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.auto import cache
from ampnet.auto.trial import Clock, Trial

from test_autotune import BF16_MIXED, FLOAT32, Noisy, Timer, fit, kw  # the auto test module's helpers
from conftest import Logits

CANDIDATES = [FLOAT32, BF16_MIXED]


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


def key_of(data, X=None, **extra):
    net = AmpNetClassifier(**kw(**extra)).initialize()
    return cache.cache_key(net, CANDIDATES, data[0] if X is None else X)


# ---- item 1: the key takes what decides the choice ------------------------------------------


@pytest.mark.parametrize("change", [
    dict(iterator_train__batch_size=2),
    dict(criterion=torch.nn.NLLLoss),
    dict(amp_fp32_modules=["out"]),
    dict(module=Noisy, module__p=0.5),
    dict(gradient_accumulation_steps=2),
    dict(optimizer=torch.optim.SGD),
    dict(optimizer__foreach=False),
], ids=["iterator-batch-size", "criterion", "fp32-modules", "module-setting", "accumulation", "optimizer",
        "kernel"])
def test_the_key_changes_with_each_input_of_the_choice(data, change):
    if "module__p" in change:  # the same parameters, another dropout rate: only the module's structure differs
        class Dropping(Noisy):
            def __init__(self, p=0.2):
                super().__init__()
                self.drop = torch.nn.Dropout(p)

        base = key_of(data, module=Dropping, module__p=0.2)
        assert key_of(data, module=Dropping, module__p=0.5) != base
        return
    assert key_of(data, **change) != key_of(data)


def test_the_key_changes_with_the_inputs_shape_and_dtype(data):
    X = data[0]
    assert key_of(data, X=X) == key_of(data, X=X.copy())  # the same data: the same key
    assert key_of(data, X=X.astype(np.float64)) != key_of(data, X=X)
    assert key_of(data, X=torch.from_numpy(X)) != key_of(data, X=X)  # a tensor's dtype is named otherwise
    wider = np.concatenate([X, X], axis=1)
    assert key_of(data, X=wider, module__n_in=40) != key_of(data, X=X, module__n_in=40)


def test_a_choice_is_read_only_by_a_fit_at_the_batch_size_it_measured(data, native_bf16, auto_cache_dir):
    fit(data, amp_autotune__timer=Timer(mixed=0.5))  # measured at batch 16, stored
    same = fit(data, amp_autotune__timer=Timer(mixed=0.5))
    assert same.amp_autotune_.source == "cache"
    smaller = fit(data, iterator_train__batch_size=4, amp_autotune__timer=Timer(mixed=2.0))
    assert smaller.amp_autotune_.source == "measured" and smaller.amp_autotune_.params == FLOAT32


def test_a_choice_made_under_a_test_clock_is_not_the_machines(data, native_bf16, auto_cache_dir):
    fit(data, amp_autotune__timer=Timer(mixed=0.5))
    (path,) = auto_cache_dir.iterdir()
    assert json.loads(path.read_text())["key"]["clock"] == "amp_autotune__timer"
    real = fit(data, amp_autotune__min_steps=100)  # no timer: the machine's key, which holds nothing
    assert real.amp_autotune_.source == "device"


# ---- item 2: float32 timed as a float32 net runs ----------------------------------------------


class Seen(Callback):
    """Per training step: whether it was a float32 trial step, the loss scaling, the optimizer's kernel."""

    def initialize(self):
        self.steps = []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        d = net.optimizer_.defaults
        self.steps.append((net.amp_step_state_.float32_step, net.precision_.scaling, d.get("fused"), d.get("foreach")))


def test_a_float32_trial_step_runs_with_float32s_kernel_and_no_scaling(data, native_bf16, monkeypatch):
    import ampnet.auto

    real = ampnet.auto.candidate_params

    def float16(net):  # float16 mixed precision on this CPU: a loss scaler to set aside
        candidates, _ = real(net)
        return [candidates[0], {**candidates[1], "amp_dtype": "float16"}], None

    monkeypatch.setattr(ampnet.auto, "candidate_params", float16)
    seen = Seen()
    net = fit(data, callbacks=[seen], amp_autotune__timer=Timer(mixed=2.0))
    pinned32 = fit(data, **FLOAT32)
    pinned16 = fit(data, **{**BF16_MIXED, "amp_dtype": "float16"})
    float32_kernel = (pinned32.optimizer_.defaults.get("fused"), pinned32.optimizer_.defaults.get("foreach"))
    mixed_kernel = (pinned16.optimizer_.defaults.get("fused"), pinned16.optimizer_.defaults.get("foreach"))
    assert float32_kernel != mixed_kernel  # the test tells them apart
    trial = seen.steps[:8]
    assert [s[0] for s in trial] == [True, False] * 4
    for float32_step, scaling, *kernel in trial:
        assert (scaling, tuple(kernel)) == ((False, float32_kernel) if float32_step else (True, mixed_kernel))
    assert net.amp_autotune_.params == FLOAT32  # after the choice: the kernel timed
    assert (net.optimizer_.defaults.get("fused"), net.optimizer_.defaults.get("foreach")) == float32_kernel


class Raising(Logits):
    """Raises in its third training forward pass: the trial's second float32 step."""

    def forward(self, X):
        if self.training and self.calls == 2:
            raise RuntimeError("the data loader broke")
        return super().forward(X)


def test_a_float32_step_that_fails_gives_mixed_precision_its_setting_back(data, native_bf16, monkeypatch):
    import ampnet.auto

    real = ampnet.auto.candidate_params
    monkeypatch.setattr(ampnet.auto, "candidate_params",
                        lambda net: ([real(net)[0][0], {**real(net)[0][1], "amp_dtype": "float16"}], None))
    net = AmpNetClassifier(**kw(module=Raising, amp_autotune__timer=Timer()))
    with pytest.raises(RuntimeError, match="the data loader broke"):
        net.fit(*data)
    pinned16 = fit(data, **{**BF16_MIXED, "amp_dtype": "float16"})
    assert net.precision_.scaling and net.precision_.scaler is not None
    for key in ("fused", "foreach"):
        assert net.optimizer_.defaults.get(key) == pinned16.optimizer_.defaults.get(key)


# ---- item 3: a skipped step is never a timed sample -------------------------------------------


def test_a_skipped_step_is_not_timed_and_runs_again(data, native_bf16):
    timer = Timer(mixed=0.5)
    net = fit(data, module__bad_grad_calls=(4,), amp_autotune__timer=timer)  # step 4, mixed: inf gradients
    result = net.amp_autotune_
    assert net.history[0]["batches"][3]["step_skipped"] is True
    mixed, f32 = "bfloat16 mixed", "float32 (AMP off)"
    assert result.steps_run == [f32, mixed, f32, mixed, mixed, f32, mixed, f32, mixed]  # step 4 again
    assert timer.calls[:6] == [f32, mixed] * 3  # the skipped step timed nothing
    assert [row["timed"] for row in result.table] == [3, 3]


# ---- item 4: an interrupted measurement stores nothing ---------------------------------------


class Interrupt(Callback):
    def on_batch_end(self, net, training=False, **kwargs):
        if training and sum(len(r["batches"]) for r in net.history) == 3:
            raise KeyboardInterrupt


def test_an_interrupted_measurement_stores_nothing(data, native_bf16, auto_cache_dir):
    net = fit(data, callbacks=[Interrupt()], amp_autotune__timer=Timer(mixed=0.5))
    result = net.amp_autotune_
    assert "the fit ended before" in result.note
    assert list(auto_cache_dir.iterdir()) == []
    assert result.cache.startswith("not stored in ") and "the next fit measures" in result.cache
    again = fit(data, amp_autotune__timer=Timer(mixed=0.5))
    assert again.amp_autotune_.source == "measured" and again.amp_autotune_.params == BF16_MIXED


# ---- item 5: a stored choice is judged on its health ------------------------------------------


class Poisoned(Logits):
    """Its mixed-precision steps' loss goes non-finite while ``poisoned`` (a class switch: the same key)."""

    poisoned = False

    def forward(self, X):
        out = super().forward(X)
        return out * float("inf") if self.training and self.poisoned and torch.is_autocast_enabled("cpu") else out


def test_a_stored_choice_that_trains_unhealthy_is_dropped_and_said(data, native_bf16, auto_cache_dir, monkeypatch):
    fit(data, module=Poisoned, amp_autotune__timer=Timer(mixed=0.5))  # bf16 measured and stored
    assert len(list(auto_cache_dir.iterdir())) == 1
    monkeypatch.setattr(Poisoned, "poisoned", True)
    with pytest.warns(AmpWarning, match="non-finite training loss"):
        net = fit(data, module=Poisoned, amp_autotune__timer=Timer(mixed=0.5))
    result = net.amp_autotune_
    assert result.source == "cache" and result.params == BF16_MIXED
    assert result.check.startswith("epoch 1: mixed precision skipped 4 of its 4 steps")
    assert "the check dropped the stored choice" in result.cache
    assert list(auto_cache_dir.iterdir()) == []  # the next fit measures, and chooses float32
    again = fit(data, module=Poisoned, amp_autotune__timer=Timer(mixed=0.5))
    assert again.amp_autotune_.source == "measured" and again.amp_autotune_.params == FLOAT32


@pytest.mark.parametrize("step_s", [1e-9, 1e300, 10 ** 400])
def test_an_implausible_stored_step_time_is_untrusted(data, native_bf16, auto_cache_dir, step_s):
    net = AmpNetClassifier(**kw(amp_autotune__timer=Timer())).initialize()
    key = cache.cache_key(net, CANDIDATES, data[0], clock=True)
    cache.write_entry(key, BF16_MIXED, 0.5, str(auto_cache_dir))
    (path,) = auto_cache_dir.iterdir()
    text = path.read_text().replace('"step_s": 0.5', f'"step_s": {step_s}')
    path.write_text(text)
    with pytest.warns(UserWarning, match=r"'step_s' is not a step time .*untrusted"):
        again = fit(data, amp_autotune__timer=Timer(mixed=2.0))
    assert again.amp_autotune_.source == "measured" and again.amp_autotune_.params == FLOAT32


# ---- item 7: numpy values from a grid search --------------------------------------------------


def test_numpy_integers_in_the_params_are_stored(data, native_bf16, auto_cache_dir):
    net = fit(data, gradient_accumulation_steps=np.int64(2), max_epochs=6, amp_autotune__timer=Timer(mixed=0.5))
    assert net.amp_autotune_.source == "measured" and "stored in" in net.amp_autotune_.cache
    (path,) = auto_cache_dir.iterdir()
    assert json.loads(path.read_text())["key"]["accumulation"] == 2


# ---- item 13: mixed loses for a non-finite loss only where float32's was finite ---------------


def test_a_non_finite_loss_in_both_settings_does_not_blame_mixed(data, native_bf16, auto_cache_dir):
    with pytest.warns(AmpWarning, match="non-finite training loss"):
        net = fit(data, module__bad_calls=set(range(1, 100)), amp_autotune__timer=Timer(mixed=0.5))
    result = net.amp_autotune_
    assert "non-finite" not in (result.note or "")
    assert list(auto_cache_dir.iterdir()) == []  # nothing timed: nothing stored
    # each setting runs again after a skipped step, 3 times at most, then the other's turn
    f32, mixed = "float32 (AMP off)", "bfloat16 mixed"
    assert result.steps_run[:6] == [f32] * 3 + [mixed] * 3
    assert "not stored" in result.cache


def test_a_mixed_only_non_finite_loss_chooses_float32(data, native_bf16):
    class Overflow(Logits):
        def forward(self, X):
            out = super().forward(X)
            return out * float("inf") if torch.is_autocast_enabled("cpu") else out

    note = fit(data, module=Overflow, amp_autotune__timer=Timer(mixed=0.1)).amp_autotune_.note
    assert note == "a mixed step's loss went non-finite (NaN/inf) where float32's steps' had not"


# ---- item 16: one outlier decides nothing; a stored choice expires ----------------------------


class Preempted(Timer):
    """Mixed 0.8x float32, but its first timed step was preempted (2.0x)."""

    def __call__(self, params, seconds):
        value = super().__call__(params, seconds)
        mixed_calls = sum(1 for c in self.calls if c != "float32 (AMP off)")
        return 2.0 if params["amp_enabled"] and mixed_calls == 1 else value


def test_one_preempted_step_does_not_decide(data, native_bf16):
    result = fit(data, max_epochs=4, amp_autotune__timer=Preempted(mixed=0.8)).amp_autotune_
    assert result.params == BF16_MIXED
    assert "the pairs disagreeing: decided by the median" in result.note
    assert [row["timed"] for row in result.table] == [6, 6]  # confirmed by more pairs, up to amp_autotune__steps


def test_an_expired_choice_is_measured_again(data, native_bf16, auto_cache_dir):
    fit(data, amp_autotune__timer=Timer(mixed=0.5))
    (path,) = auto_cache_dir.iterdir()
    entry = json.loads(path.read_text())
    entry["written"] = time.time() - cache.EXPIRES_S - 3600
    path.write_text(json.dumps(entry))
    net = fit(data, amp_autotune__timer=Timer(mixed=2.0))
    result = net.amp_autotune_
    assert result.source == "measured" and result.params == FLOAT32
    assert json.loads(path.read_text())["params"] == FLOAT32  # the new measurement replaced it


# ---- item 9: the clock seam (CUDA events on a GPU) --------------------------------------------


class DeferredClock(Clock):
    """Like CUDA events: a reading is known only some steps later (``lag``), or when waited for;
    counts its starts and stops."""

    def __init__(self, lag=2):
        self.lag, self.ended, self.starts, self.stops, self.waits = lag, 0, 0, 0, 0

    def start(self):
        self.starts += 1
        return self.ended

    def stop(self, mark):
        self.stops += 1
        self.ended += 1
        return self.ended

    def read(self, reading):
        return 0.01 if self.ended >= reading + self.lag else None

    def wait(self, reading):
        self.waits += 1
        return 0.01


def test_a_deferred_clock_decides_without_waiting_and_times_whole_steps(data, native_bf16, monkeypatch):
    import ampnet.auto.trial as trial_module

    clocks = []
    monkeypatch.setattr(trial_module, "clock_for", lambda device: clocks.append(DeferredClock()) or clocks[-1])
    timer = Timer(mixed=0.5)
    net = fit(data, gradient_accumulation_steps=2, max_epochs=6, amp_autotune__timer=timer)
    result = net.amp_autotune_
    (clock,) = clocks
    assert result.source == "measured" and result.params == BF16_MIXED
    assert clock.starts == clock.stops == 12  # one reading per step of 2 micro-batches: the whole step
    # decided from readings known without waiting: 2 steps after the third pair's end
    assert len(result.steps_run) == 10 and clock.waits == 2  # the watch waits once per reading, at the epochs' end


def test_the_watch_on_a_gpu_reads_its_steps_at_the_epochs_end(data, native_bf16, monkeypatch):
    """The epoch check watches the choice on any device (the clock seam stands for CUDA events)."""
    clock = DeferredClock(lag=100)  # never known without waiting
    trial = Trial(CANDIDATES, 0.05, 6, 1, torch.device("cuda"), chosen=1, predicted_s=0.005, clock=clock)
    trial.watched = [clock.stop(clock.start()) for _ in range(4)]
    finding = trial.end_epoch(1, rows=[{"step_skipped": False}] * 4, loss=0.5)
    assert clock.waits == 4 and finding.startswith("epoch 1: its steps took 10.0 ms, 2.00x the 5.0 ms measured")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_the_trial_and_the_watch(data, auto_cache_dir):
    from ampnet.auto.trial import EventClock

    class Slowing(Timer):
        def __call__(self, params, seconds):
            value = super().__call__(params, seconds)
            return value * 3 if len(self.calls) > 6 else value

    net = fit(data, device="cuda", max_epochs=3, amp_autotune__timer=Slowing())
    result = net.amp_autotune_
    assert isinstance(net.amp_step_state_.trial.clock, EventClock)
    assert result.source == "measured" and result.check.startswith("epoch 3:")


def test_a_trial_pickles_without_its_readings_in_flight():
    """CUDA events do not pickle: a copy of a net taken mid-epoch (or after its fit) leaves them behind."""
    import pickle

    trial = Trial(CANDIDATES, 0.05, 6, 1, torch.device("cpu"), chosen=1, predicted_s=0.005)
    trial.watched, trial._mark, trial._pending = [lambda: None], lambda: None, [(0, lambda: None)]
    copy = pickle.loads(pickle.dumps(trial))
    assert copy.watched == [] and copy._mark is None and copy._pending == [] and copy.chosen == 1
    assert len(trial.watched) == 1  # the original keeps its own


def test_a_measurement_whose_steps_keep_being_skipped_gives_up_and_stores_nothing(data, native_bf16, auto_cache_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)  # the skipped steps' and the loss's own warnings
        net = fit(data, max_epochs=8, module__bad_calls=set(range(1, 100)), amp_autotune__timer=Timer(mixed=0.5))
    result = net.amp_autotune_
    assert len(result.steps_run) == 28  # 2 x (warm-up + 6 pairs) x 2: then it stops measuring
    assert result.note == "the measurement's steps kept being skipped, before a timed pair: float32 kept"
    assert result.cache.startswith("not stored in ") and "the measurement did not decide" in result.cache
    assert list(auto_cache_dir.iterdir()) == []



@pytest.mark.parametrize("seconds, text", [(0.0, "0 ms"), (0.0003, "under 1 ms"), (0.0034, "3 ms"), (0.05, "50 ms"),
                                           (0.9994, "999 ms"), (1.0, "1.00 s"), (12.345, "12.35 s")])
def test_a_measurement_s_cost_reads_in_milliseconds_under_a_second(seconds, text):
    from ampnet.auto import AutotuneResult, duration

    assert duration(seconds) == text
    result = AutotuneResult({"amp_enabled": True}, source="measured", steps_run=["float32", "mixed"], cost_s=seconds)
    assert f"Cost: {text}." in str(result)
