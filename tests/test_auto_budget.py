"""The probe's budget (``amp_autotune__budget``): ``amp_enabled='auto'``
measures only as much as the fit can pay for: at most a share of the fit's
float32 training time (3% by default). A fit too short for even the
cheapest probe keeps float32 without building a copy; a longer one
measures the simplest candidates first and stops when the budget is spent."""

from unittest import mock

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback
from skorch.dataset import ValidSplit

import ampnet.auto.probe
from ampnet import AmpNetClassifier
from ampnet.auto.budget import Budget
from ampnet.auto.enabled import MIN_ROUNDS
from conftest import timed_probes
from test_autotune import BF16_MIXED, FLOAT32, Timer, kw


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]  # batch_size 16: 4 steps an epoch


class StopAfter(Callback):
    """Ends the fit after ``epochs`` epochs, as skorch's EarlyStopping does."""

    def __init__(self, epochs=1):
        self.epochs = epochs

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) >= self.epochs:
            raise KeyboardInterrupt


def fit(data, timer=None, callbacks=(), fit_params=None, **extra):
    """A fitted 'auto' net with the default budget unless ``extra`` sets one."""
    params = {**kw(**extra), "callbacks": list(callbacks)}
    if "amp_autotune__budget" not in extra:
        del params["amp_autotune__budget"]  # the default: 0.03
    torch.manual_seed(0)
    with timed_probes(timer or Timer()), mock.patch.object(
            ampnet.auto.probe, "probe_copy", wraps=ampnet.auto.probe.probe_copy) as copies:
        net = AmpNetClassifier(**params).fit(*data, **(fit_params or {}))
    return net, copies.call_count


def test_a_fit_too_short_keeps_float32_without_measuring(data):
    net, copies = fit(data, max_epochs=2)  # 8 steps: 3% of them is a quarter of a step
    result = net.amp_autotune_
    assert copies == 0  # no copy built, no forward pass run
    assert result.params == FLOAT32 and net.precision_policy_.name == "float32"
    assert result.source == "probe" and result.budget == 0.03
    assert result.fit_steps == 8 and result.budget_spent == 0.0
    assert result.table[0]["chosen"] and all(row["step_time_s"] is None for row in result.table)
    assert [row["reason"] for row in result.table[1:]] == [
        "not measured: the fit is too short for the probe's budget"] * (len(result.table) - 1)
    assert "this fit's 8 training steps" in result.note and "amp_autotune__budget (or None" in result.note
    text = str(result)
    assert "Probe: no training step timed: no copy built, " in text
    assert "This fit is too short for measuring to pay off" in text
    assert "Fix: pin amp_enabled=True" in text
    assert len(net.history) == 2  # and the fit ran


def test_the_readme_threshold_about_310_steps(data):
    """The README: a fit of fewer than about 310 training steps keeps float32
    without measuring (the cheapest probe, about 9 float32 steps, over 3%)."""
    assert 9 <= Budget(0.03, 1, warmup=1).minimal() < 10
    short, copies = fit(data, max_epochs=77, callbacks=[StopAfter(1)])  # 308 steps
    assert copies == 0 and short.amp_autotune_.fit_steps == 308 and len(short.history) == 1
    long, copies = fit(data, max_epochs=78, callbacks=[StopAfter(1)])  # 312 steps
    assert copies >= 1 and long.amp_autotune_.fit_steps == 312
    assert long.amp_autotune_.table[0]["step_time_s"] is not None


def test_the_budget_measures_the_simplest_candidates_first(data):
    """Room for float32 and one AMP candidate: bf16 mixed (the simplest) is
    measured and chosen; pure is not measured, and says why."""
    budget = dict(amp_autotune__budget=1.0, max_epochs=4)  # 16 float32 steps
    net, copies = fit(data, timer=Timer(fp32=1.0, mixed=0.5, pure=0.7), **budget)
    result = net.amp_autotune_
    assert result.params == BF16_MIXED
    rows = {row["params"]["amp_level"] if row["params"]["amp_enabled"] else "fp32": row for row in result.table}
    assert rows["mixed"]["steps"] > 0 and rows["pure"]["steps"] == 0 and copies == 2
    assert rows["pure"]["reason"] == ("not measured: the probe's budget was spent (amp_autotune__budget=1 of "
                                     "this fit's 16 training steps, about 16.0 float32 steps)")
    assert 0 < result.budget_spent <= 16.0
    assert "Budget: the probe is budgeted at 100% of this fit's 16 training steps" in str(result)
    unlimited, copies = fit(data, timer=Timer(fp32=1.0, mixed=0.5, pure=0.7), amp_autotune__budget=None,
                            max_epochs=4)
    assert copies == 3 and all(row["steps"] > 0 for row in unlimited.amp_autotune_.table)


class NoisyTimer(Timer):
    """Step times that never settle: 1x and 1.6x the candidate's time in turn."""

    def __init__(self, **times):
        super().__init__(**times)
        self.n = 0

    def __call__(self, params, step):
        seconds = super().__call__(params, step)
        if params.get("autotune_screen"):
            return seconds
        self.n += 1
        return seconds * (1.6 if self.n % 2 else 1.0)


def test_rounds_stop_where_the_budget_ends(data):
    """Noisy timings would take every round (``steps``); the budget stops
    them early, never before MIN_ROUNDS."""
    unlimited, _ = fit(data, timer=NoisyTimer(), amp_autotune__budget=None, amp_autotune__steps=8)
    assert unlimited.amp_autotune_.table[0]["steps"] == 1 + 8
    net, _ = fit(data, timer=NoisyTimer(), amp_autotune__budget=1.0, amp_autotune__steps=8, max_epochs=4)
    result = net.amp_autotune_
    assert 1 + MIN_ROUNDS <= result.table[0]["steps"] < 1 + 8
    assert result.budget_spent <= 16.0


def test_fit_epochs_set_the_fit_the_budget_is_a_share_of(data):
    """``fit(X, y, epochs=n)`` runs n epochs: the budget counts those (and
    the split's training rows only), and the validation split still works."""
    net, copies = fit(data, max_epochs=2, train_split=ValidSplit(4), fit_params={"epochs": 1})
    assert net.amp_autotune_.fit_steps == 1 * 3  # 48 training rows of 64, batches of 16
    assert len(net.history) == 1 and copies == 0
    net, copies = fit(data, max_epochs=2, train_split=ValidSplit(4), fit_params={"epochs": 400},
                      callbacks=[StopAfter(1)])
    assert net.amp_autotune_.fit_steps == 400 * 3 and copies >= 2


@pytest.mark.parametrize("extra, steps", [
    ({"batch_size": -1}, 2),                               # one batch an epoch
    ({"iterator_train__drop_last": True, "batch_size": 24}, 2 * 2),  # 64 // 24
    ({"batch_size": 24}, 2 * 3),                           # ceil(64 / 24)
])
def test_the_fit_steps_follow_the_iterator(data, extra, steps):
    net, _ = fit(data, max_epochs=2, **extra)
    assert net.amp_autotune_.fit_steps == steps


def test_the_budget_is_a_probe_setting_that_changes_no_choice(data):
    net = AmpNetClassifier(**{**kw(), "amp_autotune__budget": 0.5}).initialize()
    assert net.get_params()["amp_autotune__budget"] == 0.5
    net.set_params(amp_autotune__budget=None)
    assert net.get_params()["amp_autotune__budget"] is None


def test_float32s_extra_rounds_leave_room_for_the_next_candidate(data):
    """Timings that never settle would take float32's rounds up to the
    budget; it stops after MIN_ROUNDS where another round would leave no
    room for bf16 mixed, which is then measured."""
    net, copies = fit(data, timer=NoisyTimer(), amp_autotune__budget=1.0, amp_autotune__steps=8, max_epochs=4)
    result = net.amp_autotune_
    mixed = next(row for row in result.table if row["params"]["amp_level"] == "mixed" and row["params"]["amp_enabled"])
    assert 1 + MIN_ROUNDS <= result.table[0]["steps"] < 1 + 8
    assert mixed["steps"] > 0 and copies >= 2 and result.budget_spent <= 16.0


def test_a_budget_spent_before_any_amp_candidate_says_so(data):
    """Room for float32's own measurement but not for an AMP candidate's:
    float32 is kept, and the note says that no verdict on AMP was reached,
    with the fix."""
    net, copies = fit(data, timer=Timer(fp32=1.0, mixed=0.5, pure=0.7), amp_autotune__budget=0.8, max_epochs=3)
    result = net.amp_autotune_
    assert copies == 1 and result.params == FLOAT32 and result.table[0]["steps"] > 0
    assert all(row["steps"] == 0 and row["reason"].startswith("not measured: the probe's budget was spent")
               for row in result.table[1:])
    assert result.note.startswith("the probe's budget (amp_autotune__budget=0.8 of this fit's 12 training steps")
    text = str(result)
    assert "before any AMP candidate was timed: float32 is kept without a verdict on AMP. Fix:" in text
    assert "amp_autotune__budget (or None" in text


def test_a_new_budget_drops_the_choice_and_the_next_fit_measures(data):
    """The note's fix works on the same net: set_params(amp_autotune__budget=None)
    drops the too-short choice, and the next fit measures; setting a value
    the net already has keeps the choice."""
    net, copies = fit(data, max_epochs=2)
    kept = net.amp_autotune_
    assert copies == 0 and kept.table[1]["steps"] == 0
    net.set_params(amp_autotune__budget=0.03)  # the default it has: nothing to measure again
    assert net.amp_autotune_ is kept
    net.set_params(amp_autotune__budget=None)
    assert "amp_autotune_" not in vars(net)
    with timed_probes(Timer(fp32=1.0, mixed=0.5, pure=0.7)):
        net.fit(*data)
    assert net.amp_autotune_.params == BF16_MIXED and net.precision_policy_.name == "bfloat16 (mixed)"
