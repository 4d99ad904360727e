"""amp_enabled='auto' (ampnet.auto): the candidates, the choice
(with injected timings, so deterministic), health checks, bitwise pinning,
persistence, reuse and scikit-learn integration."""

import pickle
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.checkpoint import Checkpoint, LoadInitState
from ampnet.auto import AutotuneResult
from ampnet.auto.enabled import CHOICE_KEYS, choose

from conftest import timed_probes
from test_training_loop import Logits

BF16_MIXED = {"amp_enabled": True, "amp_dtype": "bfloat16", "amp_level": "mixed",
              "amp_master_weights": True, "memory_format": "preserve"}
FLOAT32 = {"amp_enabled": False, "amp_dtype": "auto", "amp_level": "mixed",
           "amp_master_weights": True, "memory_format": "preserve"}


class Timer:
    """Injected timings (see ``conftest.timed_probes``): seconds per step by
    candidate, and the calls counted."""

    def __init__(self, fp32=1.0, mixed=0.5, pure=0.7, channels_last=None):
        self.times = {"fp32": fp32, "mixed": mixed, "pure": pure}
        self.channels_last = channels_last
        self.calls = []
        self.screens = []  # the screen's forward passes, kept apart from the training steps

    def __call__(self, params, step):
        step()
        if params.get("autotune_screen"):
            self.screens.append(dict(params))
            params = {k: v for k, v in params.items() if k != "autotune_screen"}
        else:
            self.calls.append(dict(params))
        if params["memory_format"] == "channels_last" and self.channels_last is not None:
            return self.channels_last
        if not params["amp_enabled"]:
            return self.times["fp32"]
        return self.times[params["amp_level"]]


def kw(**extra):
    base = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.Adam,
                max_epochs=2, lr=0.05, batch_size=16, train_split=None, verbose=0,
                iterator_train__shuffle=True, amp_enabled="auto",
                amp_autotune__budget=None)  # these fits are far too short for the default budget
    base.update(extra)
    return base


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


def fit(data, timer=None, seed=0, **extra):
    """A fitted ``'auto'`` net whose probe is timed by ``timer`` (the wall clock if None)."""
    torch.manual_seed(seed)
    with timed_probes(timer):
        return AmpNetClassifier(**kw(**extra)).fit(*data)


# ---- the choice, from injected timings --------------------------------------------


def row(time_s, healthy=True, amp=True):
    return {"params": dict(BF16_MIXED if amp else FLOAT32), "step_time_s": time_s, "healthy": healthy,
            "grad_cosine": 1.0, "reason": None}


def test_choose_takes_the_fastest_healthy_candidate():
    table = [row(1.0, amp=False), row(0.9), row(0.5, healthy=False)]
    assert choose(table, 0.05) == 1
    assert [r["chosen"] for r in table] == [False, True, False]
    assert table[0]["reason"] == "slower than bfloat16 mixed"


def test_choose_keeps_float32_within_the_noise_margin():
    table = [row(1.0, amp=False), row(0.96)]
    assert choose(table, 0.05) == 0
    assert table[1]["reason"] == "4.0% faster than float32, within the 5% noise margin: not worth it"
    table = [row(1.0, amp=False), row(0.96)]
    assert choose(table, 0.0) == 1  # no margin: any gain counts


def test_choose_falls_back_to_float32_without_a_healthy_candidate():
    table = [row(1.0, amp=False), row(0.1, healthy=False), row(None, healthy=None)]
    assert choose(table, 0.05) == 0


def test_the_net_trains_with_the_fastest_candidate(data):
    timer = Timer(fp32=1.0, mixed=0.5, pure=0.7)
    net = fit(data, timer=timer)
    result = net.amp_autotune_
    assert result.params == BF16_MIXED
    assert set(result.params) == set(CHOICE_KEYS)
    assert net.precision_policy_.name == "bfloat16 (mixed)"
    assert net.get_params()["amp_enabled"] == "auto"
    labels = [r["params"] for r in result.table]
    assert labels == [FLOAT32, BF16_MIXED, {**BF16_MIXED, "amp_level": "pure",
                                            "amp_master_weights": "compensated"}]
    assert [r["step_time_s"] for r in result.table] == [1.0, 0.5, 0.7]
    assert [r["healthy"] for r in result.table] == [True, True, True]
    # steady timings settle after 2 timed steps: 1 warm-up + 2 timed per candidate
    assert [r["steps"] for r in result.table] == [3, 3, 3]
    assert [r["chosen"] for r in result.table] == [False, True, False]
    assert all(r["grad_cosine"] > 0.99 for r in result.table)
    # one candidate after the other; the warm-up steps are not timed
    assert [c["amp_level"] if c["amp_enabled"] else "fp32" for c in timer.calls] == [
        "fp32", "fp32", "mixed", "mixed", "pure", "pure"]
    text = str(result)
    assert text.startswith("amp_enabled='auto' on cpu: chose bfloat16 mixed")
    for part in ("float32 (AMP off)", "bfloat16 pure (compensated)", "1000.00", "500.00", "chosen",
                 "slower than bfloat16 mixed", "Probe: 9 training steps of 3 candidates"):
        assert part in text


def test_float32_wins_when_amp_is_not_faster_by_the_margin(data):
    net = fit(data, timer=Timer(fp32=1.0, mixed=0.97, pure=0.98))
    assert net.amp_autotune_.params == FLOAT32
    assert not net.precision_policy_.enabled
    assert net.optimizer_.defaults["fused"] is None  # AMP off: skorch's optimizer
    assert "within the 5% noise margin" in net.amp_autotune_.table[1]["reason"]


class NoisyTimer:
    """Injected timings that vary from call to call: ``seqs`` gives each
    candidate's successive step times (cycled); ``load(n)`` scales the n-th
    call's, as a machine whose load changes during the probe."""

    def __init__(self, fp32, mixed, pure=(9.0,), load=None):
        self.seqs = {"fp32": list(fp32), "mixed": list(mixed), "pure": list(pure)}
        self.load = load or (lambda n: 1.0)
        self.calls = []
        self.n = 0  # every call, the forward passes (screen and rounds' reference) included

    def __call__(self, params, step):
        step()
        key = "fp32" if not params["amp_enabled"] else params["amp_level"]
        load = self.load(self.n)
        self.n += 1
        if params.get("autotune_screen"):  # a forward pass: the candidate's typical time over float32's
            return self.seqs[key][0] / self.seqs["fp32"][0] * load
        i = sum(1 for c in self.calls if c == key)
        self.calls.append(key)
        return self.seqs[key][i % len(self.seqs[key])] * load


# float32 steady at 1.0; mixed noisy around it: the median alone is 8% or 3% faster,
# depending only on the order of the same kind of noise
NOISE_A = [0.70, 1.25, 0.92, 1.20, 0.80]
NOISE_B = [0.70, 1.25, 0.97, 1.20, 0.80]


def test_noise_that_flips_the_median_rule_keeps_float32(data):
    import statistics

    # the rule before interleaved rounds (median times, a 5% margin) flips between the two
    assert choose([row(1.0, amp=False), row(statistics.median(NOISE_A))], 0.05) == 1
    assert choose([row(1.0, amp=False), row(statistics.median(NOISE_B))], 0.05) == 0
    for noise in (NOISE_A, NOISE_B):
        net = fit(data, timer=NoisyTimer(fp32=[1.0], mixed=noise))
        assert net.amp_autotune_.params == FLOAT32
    # A: 8% faster, but the ratios' interquartile range is 0.40: too noisy to decide
    net = fit(data, timer=NoisyTimer(fp32=[1.0], mixed=NOISE_A))
    mixed = net.amp_autotune_.table[1]
    assert mixed["gain"] == pytest.approx(0.08) and mixed["spread"] == pytest.approx(0.40)
    assert mixed["reason"] == ("8.0% faster than float32, but its timings spread by 40.0% across the rounds: "
                               "too noisy to decide, float32 kept")
    assert net.amp_autotune_.table[0]["noisy"] is True
    text = str(net.amp_autotune_)
    assert "too noisy to decide" in text and "The timings were too noisy to decide" in text
    assert "-8.0% \u00b120.0%" in text  # the gain and half the spread, per candidate


def test_a_clear_win_in_noisy_timings_still_picks_amp(data):
    # the machine's load moves a round's forward pass and step alike (calls 4, 5 are round 1, after
    # the screen's 4): the steps vary by 30%, their ratios to the round's reference not at all
    pattern = [1.0, 1.3, 0.9, 1.1, 1.0]
    net = fit(data, timer=NoisyTimer(fp32=[1.0], mixed=[0.5], load=lambda n: pattern[(n // 2) % 5]))
    assert net.amp_autotune_.params == BF16_MIXED
    row_ = net.amp_autotune_.table[1]
    assert row_["gain"] == pytest.approx(0.5) and row_["spread"] < 0.01
    assert net.amp_autotune_.table[0]["noisy"] is False and net.amp_autotune_.disturbed is None
    assert "too noisy" not in str(net.amp_autotune_)


def test_the_reference_forward_pass_cancels_a_change_of_load(data):
    """The machine slows down during the probe (20% per call): measured one
    candidate after the other by their raw times, float32 (first) looks
    faster than mixed (20% faster in truth); over the float32 forward pass
    timed just before each step, each step sees its own load. The load
    nearly quadrupled during the probe: the result says the machine was busy, and
    the fit warns with the fix."""
    import statistics

    load = lambda n: 1 + 0.2 * n  # noqa: E731
    sequential_fp32 = statistics.median(1.0 * load(n) for n in range(5))
    sequential_mixed = statistics.median(0.8 * load(n) for n in range(5, 10))
    assert choose([row(sequential_fp32, amp=False), row(sequential_mixed)], 0.05) == 0  # raw times
    timer = NoisyTimer(fp32=[1.0], mixed=[0.8], load=load)
    with pytest.warns(AmpWarning, match="busy machine.*load changed.*once, for the whole fit.*Fix: re-run"):
        net = fit(data, timer=timer)
    assert net.amp_autotune_.params == BF16_MIXED
    assert net.amp_autotune_.table[1]["gain"] == pytest.approx(0.2, abs=0.03)
    assert "load changed during the probe" in net.amp_autotune_.disturbed
    assert "The machine was busy during the probe" in str(net.amp_autotune_)


def test_one_slow_round_does_not_rule_a_candidate_out(data):
    """1.4x float32's time in the first round only (a busy moment; within the
    screen's 1.5x): timed on."""
    timer = NoisyTimer(fp32=[1.0], mixed=[1.4, 0.5, 0.5, 0.5, 0.5])
    net = fit(data, timer=timer)
    assert timer.calls.count("mixed") == 5 and timer.calls.count("pure") == 2  # pure: 9x, twice
    assert timer.calls.count("fp32") == 2  # steady: settled after two
    assert net.amp_autotune_.params == BF16_MIXED


def test_the_settings_of_the_probe(data):
    timer = Timer(fp32=1.0, mixed=0.97, pure=2.0)
    net = fit(data, timer=timer, amp_autotune__steps=3, amp_autotune__warmup=1,
              amp_autotune__margin=0.01)
    assert net.amp_autotune_.params == BF16_MIXED
    # up to 3 rounds each, one candidate after the other; steady timings settle after two
    assert [c["amp_level"] if c["amp_enabled"] else "fp32" for c in timer.calls] == [
        "fp32", "fp32", "mixed", "mixed", "pure", "pure"]
    assert [r["steps"] for r in net.amp_autotune_.table] == [3, 3, 3]
    assert (net.amp_autotune_.steps, net.amp_autotune_.warmup, net.amp_autotune_.margin) == (3, 1, 0.01)


def test_verbose_prints_the_table_once(data, capsys):
    net = fit(data, timer=Timer(), verbose=1)
    out = capsys.readouterr().out
    assert out.count("amp_enabled='auto' on cpu: chose bfloat16 mixed") == 1
    net.partial_fit(*data)
    assert "amp_enabled='auto'" not in capsys.readouterr().out


# ---- health -----------------------------------------------------------------------


class Fragile(Logits):
    """Non-finite (``mode='nan'``) or reversed (``mode='flip'``) outputs under autocast."""

    def __init__(self, mode="nan", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    def forward(self, X):
        out = super().forward(X)
        if torch.is_autocast_enabled("cpu"):
            out = out * float("nan") if self.mode == "nan" else -out
        return out


def test_nonfinite_candidates_are_unhealthy(data):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = fit(data, module=Fragile, module__mode="nan", timer=Timer(mixed=0.1, pure=0.1))
    table = net.amp_autotune_.table
    assert net.amp_autotune_.params == FLOAT32
    assert [r["healthy"] for r in table] == [True, False, False]
    assert table[1]["reason"] == "unhealthy: the loss is not finite"
    assert np.isfinite(net.history[-1, "train_loss"])


def test_gradients_that_disagree_with_float32_are_unhealthy(data):
    net = fit(data, module=Fragile, module__mode="flip", timer=Timer(mixed=0.1, pure=0.1))
    table = net.amp_autotune_.table
    assert net.amp_autotune_.params == FLOAT32
    assert table[1]["healthy"] is False and table[1]["grad_cosine"] < 0
    assert table[1]["reason"].startswith("unhealthy: gradient cosine similarity with float32 -")


# ---- candidates and their narrowing ---------------------------------------------------


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.out = torch.nn.Linear(2 * 4 * 5, 2)

    def forward(self, X):
        return self.out(torch.relu(self.conv(X.reshape(-1, 1, 4, 5))).flatten(1))


def candidates(data, **extra):
    extra = {"timer": Timer(), **extra}
    net = fit(data, max_epochs=1, amp_autotune__steps=1, amp_autotune__warmup=1, **extra)
    return [(r["params"], r["reason"]) for r in net.amp_autotune_.table], net


def test_channels_last_candidates_for_4d_parameters(data):
    rows, net = candidates(data, module=Conv, timer=Timer(channels_last=0.3))
    formats = [(p["amp_enabled"], p["amp_level"], p["memory_format"]) for p, _ in rows]
    assert formats == [(False, "mixed", "preserve"), (False, "mixed", "channels_last"),
                       (True, "mixed", "preserve"), (True, "mixed", "channels_last"),
                       (True, "pure", "preserve")]
    assert net.amp_autotune_.params["memory_format"] == "channels_last"
    assert net.module_.conv.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("given, expected", [
    ({"amp_level": "pure"}, [("pure", "compensated")]),
    ({"amp_master_weights": False}, [("pure", False)]),
    ({"amp_master_weights": "compensated"}, [("pure", "compensated")]),
    ({"optimizer": torch.optim.Adadelta}, [("mixed", True), ("pure", "compensated")]),
    ({"optimizer": torch.optim.ASGD}, [("mixed", True), ("pure", True)]),  # no compensation for ASGD
])
def test_explicit_settings_narrow_the_amp_candidates(data, given, expected):
    rows, _ = candidates(data, **given)
    assert rows[0][0] == FLOAT32  # float32 is always measured: AMP must beat it
    assert [(p["amp_level"], p["amp_master_weights"]) for p, _ in rows[1:]] == expected


def test_explicit_dtype_and_memory_format_narrow_the_candidates(data):
    rows, _ = candidates(data, module=Conv, memory_format="channels_last")
    assert {p["memory_format"] for p, _ in rows} == {"channels_last"}
    rows, net = candidates(data, amp_dtype="float16")
    # float16 on a CPU is never measured
    assert [r for _, r in rows[1:]] == ["not measured: float16 on a CPU is emulated, "
                                        "many times slower than float32"] * 2
    assert [p["amp_dtype"] for p, _ in rows[1:]] == ["float16", "float16"]
    assert net.amp_autotune_.params == FLOAT32
    assert "not measured: float16 on a CPU" in str(net.amp_autotune_)


def test_invalid_combinations_are_refused_as_with_amp_on():
    net = AmpNetClassifier(Logits, amp_enabled="auto", amp_master_weights="compensated", amp_dtype="float16",
                           grad_scaler=torch.amp.GradScaler)
    with pytest.raises(ValueError, match="which torch.amp.GradScaler refuses"):
        net.initialize()
    assert not net.initialized_


def test_a_candidate_the_optimizer_cannot_serve_is_not_measured(data):
    rows, net = candidates(data, amp_master_weights="compensated", optimizer=torch.optim.ASGD)
    assert [p["amp_master_weights"] for p, _ in rows] == [True, "compensated"]
    assert rows[1][1].startswith("not possible: amp_master_weights='compensated' steps the compensation")
    assert net.amp_autotune_.params == FLOAT32


# ---- bad values --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", "autotune", 1, None, "true"])
def test_amp_enabled_other_values_are_refused(value):
    with pytest.raises(ValueError) as error:
        AmpNetClassifier(Logits, amp_enabled=value).initialize()
    message = str(error.value)
    assert "amp_enabled" in message and repr(value) in message and "Fix:" in message
    assert all(choice in message for choice in ("True", "False", "'auto'"))
    net = AmpNetClassifier(Logits).initialize()
    with pytest.raises(ValueError, match=r"amp_enabled must be .*'auto'"):
        net.set_params(amp_enabled=value)
    assert net.amp_enabled is False


@pytest.mark.parametrize("setting, match", [
    ({"amp_autotune__steps": 0}, r"amp_autotune__steps must be an int in \[1, 100\]; got 0"),
    ({"amp_autotune__margin": 1.5}, r"amp_autotune__margin must be a number in \[0, 1\)"),
    ({"amp_autotune__steps": 101}, r"amp_autotune__steps must be an int in \[1, 100\]; got 101"),
    ({"amp_autotune__budget": 0}, r"amp_autotune__budget must be None or a number in \(0, 1\]; got 0 \(int\)\. Fix: .*None"),
    ({"amp_autotune__budget": 1.5}, r"amp_autotune__budget must be None or a number in \(0, 1\]; got 1\.5"),
    ({"amp_autotune__budget": True}, r"amp_autotune__budget must be None or a number in \(0, 1\]; got True"),
    ({"amp_autotune__budget": "3%"}, r"amp_autotune__budget must be None or a number in \(0, 1\]; got '3%'"),
    ({"amp_autotune__timer": "fast"}, r"Unknown amp_autotune setting.*amp_autotune__timer"),
    ({"amp_autotune__stepz": 3}, r"amp_autotune__stepz \(did you mean amp_autotune__steps\?\)"),
])
@pytest.mark.parametrize("enabled", ["auto", True, False])
def test_bad_probe_settings_are_refused(setting, match, enabled):
    """Checked whatever amp_enabled is (a typo is never silently accepted), at
    initialize and by set_params, which then changes nothing."""
    with pytest.raises(ValueError, match=match):
        AmpNetClassifier(Logits, amp_enabled=enabled, **setting).initialize()
    net = AmpNetClassifier(Logits, amp_enabled=enabled).initialize()
    with pytest.raises(ValueError, match=match):
        net.set_params(**setting)
    assert not net.get_params_for("amp_autotune")


# ---- the screen: dtypes that cannot pay off are left out before any step ----------------


class Normed(Logits):
    """BatchNorm and dropout: a forward pass in train mode would move state."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = torch.nn.BatchNorm1d(20)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, X):
        return super().forward(self.drop(self.norm(X)))


def test_screen_leaves_out_a_dtype_whose_forward_pass_is_far_slower(data):
    timer = Timer(fp32=1.0, mixed=5.0, pure=0.5)  # pure shares mixed's dtype: screened with it
    net = fit(data, timer=timer)
    result = net.amp_autotune_
    assert result.params == FLOAT32 and not net.precision_policy_.enabled
    assert timer.calls == []  # no copy trained: float32 was left alone
    assert [s["amp_level"] if s["amp_enabled"] else "fp32" for s in timer.screens] == ["fp32", "mixed"] * 2
    fp32_row, *amp_rows = result.table
    assert fp32_row["chosen"] and fp32_row["steps"] == 0 and fp32_row["step_time_s"] is None
    assert [r["params"]["amp_level"] for r in amp_rows] == ["mixed", "pure"]
    for row in amp_rows:
        assert row["forward_ratio"] == pytest.approx(5.0) and row["steps"] == 0 and not row["chosen"]
        assert row["reason"].startswith("not measured: its forward pass took 5.0x")
        assert "float32" in row["reason"] and "1.5x" in row["reason"]
    text = str(result)
    assert "chose float32 (AMP off)" in text and "forward pass took 5.0x" in text


def test_screen_passes_a_dtype_within_its_bound_and_records_its_ratio(data):
    timer = Timer(fp32=1.0, mixed=1.45, pure=0.5)
    net = fit(data, timer=timer)
    rows = net.amp_autotune_.table
    assert [r["forward_ratio"] for r in rows[1:]] == pytest.approx([1.45, 1.45])
    assert "forward_ratio" not in rows[0]
    assert net.amp_autotune_.params["amp_level"] == "pure"  # timed as before: pure's steps win
    # steady timings: 2 timed steps each (mixed, 1.45x in its steps too, settled)
    assert [c["amp_level"] if c["amp_enabled"] else "fp32" for c in timer.calls].count("mixed") == 2
    assert len(timer.calls) == 6


def test_screen_moves_no_state_of_the_net(data):
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(module=Normed, module__n_in=20))
    net.initialize()
    net.module_.train()
    net.module_.drop.eval()  # a mixed set of flags, kept as they were
    stats = {k: v.clone() for k, v in net.module_.state_dict().items()}
    rng = torch.get_rng_state()
    from ampnet.auto.probe import run_probe

    with timed_probes(Timer(mixed=8.0, pure=8.0)):
        result = run_probe(net, *data)
    assert result.params == FLOAT32
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in net.module_.state_dict().items():
        assert torch.equal(v, stats[k]), k
    assert net.module_.training and net.module_.norm.training and not net.module_.drop.training


# ---- pinning: the same training, bitwise --------------------------------------------------


class Noisy(Logits):
    """Dropout: the training draws random numbers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, X):
        return super().forward(self.drop(X))


@pytest.mark.parametrize("timer", [Timer(mixed=0.5), Timer(pure=0.3), Timer(mixed=2.0, pure=2.0),
                                   Timer(mixed=8.0, pure=8.0)],
                         ids=["mixed", "pure", "float32", "float32-screened"])
def test_pinning_the_choice_trains_bitwise_the_same(data, timer):
    auto = fit(data, module=Noisy, timer=timer)
    after_auto = torch.rand(3)
    pinned = fit(data, module=Noisy, **auto.amp_autotune_.params)
    after_pinned = torch.rand(3)
    assert torch.equal(after_auto, after_pinned)  # the probe left the random state as it was
    for (name, a), b in zip(auto.module_.named_parameters(), pinned.module_.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert auto.history[:, "train_loss"] == pinned.history[:, "train_loss"]
    assert [len(row["batches"]) for row in auto.history] == [4, 4]
    assert type(auto.optimizer_) is type(pinned.optimizer_)
    assert auto.optimizer_.defaults == pinned.optimizer_.defaults


# ---- persistence and reuse -------------------------------------------------------------


def test_partial_fit_warm_start_and_refit_reuse_the_choice(data):
    timer = Timer()
    net = fit(data, timer=timer)
    first = net.amp_autotune_
    n = len(timer.calls)
    assert n > 0
    with timed_probes(timer):
        net.partial_fit(*data)
        net.set_params(warm_start=True).fit(*data)
        net.set_params(warm_start=False).fit(*data)
    assert len(timer.calls) == n and net.amp_autotune_ is first
    assert net.precision_policy_.name == "bfloat16 (mixed)"


def test_set_params_of_an_amp_setting_probes_again(data):
    timer = Timer()
    net = fit(data, timer=timer)
    n = len(timer.calls)
    net.set_params(lr=0.01)  # not an AMP setting: the choice stays
    assert net.amp_autotune_.params == BF16_MIXED
    net.set_params(amp_dtype="bfloat16")
    assert not hasattr(net, "amp_autotune_") and not net.precision_policy_.enabled
    with timed_probes(timer):
        net.partial_fit(*data)
    assert len(timer.calls) == 2 * n and net.amp_autotune_.params == BF16_MIXED


def test_pickle_keeps_the_choice_and_a_clone_probes_afresh(data):
    timer = Timer()
    net = fit(data, timer=timer)
    loaded = pickle.loads(pickle.dumps(net))
    assert loaded.amp_autotune_.params == BF16_MIXED and loaded.precision_policy_.enabled
    assert loaded.amp_autotune_.table == net.amp_autotune_.table
    fresh = clone(net)
    assert not hasattr(fresh, "amp_autotune_")
    assert fresh.get_params()["amp_enabled"] == "auto"
    assert "amp_autotune__timer" not in fresh.get_params()  # timings are injected, not a parameter


def test_save_and_load_params_keep_the_choice(data, tmp_path):
    net = fit(data, timer=Timer(pure=0.3))
    chosen = net.amp_autotune_.params
    assert chosen["amp_level"] == "pure"
    net.save_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    timer = Timer()
    other = AmpNetClassifier(**kw()).initialize()
    assert not other.precision_policy_.enabled  # float32 until it chooses
    other.load_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    assert other.amp_autotune_.params == chosen and other.amp_autotune_.source == "loaded"
    assert other.module_.hidden.weight.dtype == torch.bfloat16
    for a, b in zip(net.module_.parameters(), other.module_.parameters()):
        assert torch.equal(a, b)
    # the compensation buffers came with the optimizer state
    key = "ampnet_compensation"
    assert all(key in s for s in other.optimizer_.state.values())
    with timed_probes(timer):
        other.partial_fit(*data)
    assert timer.calls == []  # no probe
    assert "saved choice" in str(other.amp_autotune_)


def test_a_loaded_choice_does_not_replace_the_nets_own(data, tmp_path):
    net = fit(data, timer=Timer(pure=0.3))
    net.save_params(f_params=tmp_path / "p.pt")
    other = fit(data, timer=Timer(mixed=0.3))
    with pytest.warns(UserWarning, match=r"chose bfloat16 pure \(compensated\); this net chose bfloat16 "
                                         r"mixed and keeps its own choice"):
        other.load_params(f_params=tmp_path / "p.pt")
    assert other.amp_autotune_.params == BF16_MIXED


def test_a_resumed_run_takes_the_checkpoints_choice(data, tmp_path):
    def make():
        cp = Checkpoint(monitor=None, dirname=str(tmp_path))
        return AmpNetClassifier(**kw(max_epochs=1, callbacks=[LoadInitState(cp), cp]))

    with timed_probes(Timer(pure=0.3)):
        first = make().fit(*data)
    assert first.amp_autotune_.params["amp_level"] == "pure"
    timer = Timer(mixed=0.3)
    with timed_probes(timer):
        resumed = make().fit(*data)
    assert timer.calls == []  # no probe: the checkpoint's choice
    assert resumed.amp_autotune_.params == first.amp_autotune_.params
    assert len(resumed.history) == 2


# ---- scikit-learn --------------------------------------------------------------------------


def test_grid_search_and_pipeline(data):
    X, y = data
    search = GridSearchCV(AmpNetClassifier(**kw(max_epochs=1, train_split=None)),
                          {"lr": [0.01, 0.05]}, cv=2, refit=True)
    with timed_probes(Timer()):
        search.fit(X, y)
    assert search.best_estimator_.amp_autotune_.params == BF16_MIXED
    assert search.best_estimator_.get_params()["amp_enabled"] == "auto"
    pipe = make_pipeline(StandardScaler(), AmpNetClassifier(**kw(max_epochs=1)))
    with timed_probes(Timer(mixed=2.0, pure=2.0)):
        pipe.fit(X, y)
    assert pipe[-1].amp_autotune_.params == FLOAT32
    assert pipe.predict(X).shape == (len(X),)


def test_result_is_a_plain_record():
    result = AutotuneResult(params=dict(FLOAT32), source="loaded")
    assert str(result) == "amp_enabled='auto' on cpu: chose float32 (AMP off) (a saved choice; no probe ran)"


def test_gradient_accumulation_probes_whole_steps(data):
    net = fit(data, gradient_accumulation_steps=4, timer=Timer())
    assert [r["healthy"] for r in net.amp_autotune_.table] == [True, True, True]
    assert net.amp_autotune_.params == BF16_MIXED
    assert net.gradient_accumulation_steps == 4
    # the net itself accumulates: 4 micro-batches of 16 rows per step, one step per epoch
    assert {float(st["step"]) for st in net.optimizer_.state.values()} == {2.0}


def test_the_probe_leaves_callbacks_and_history_alone(data):
    from skorch.callbacks import Callback

    class Count(Callback):
        def initialize(self):
            self.grads, self.begins = 0, 0
            return self

        def on_train_begin(self, net, **kwargs):
            self.begins += 1

        def on_grad_computed(self, net, **kwargs):
            self.grads += 1

    count = Count()
    net = fit(data, callbacks=[count], timer=Timer())
    assert len(net.amp_autotune_.table) == 3  # 3 candidates x 6 probe steps ran on copies
    assert (count.begins, count.grads) == (1, 2 * 4)  # only the real steps: 2 epochs x 4 batches
    assert len(net.history) == 2 and [len(row["batches"]) for row in net.history] == [4, 4]


def test_the_demo_says_when_the_probe_was_too_noisy(data):
    from types import SimpleNamespace

    from ampnet.__main__ import _verdict

    noisy = fit(data, timer=NoisyTimer(fp32=[1.0], mixed=NOISE_A)).amp_autotune_
    assert "too noisy to tell whether AMP pays off" in _verdict(SimpleNamespace(amp_autotune_=noisy), "cpu")
    clear = fit(data, timer=NoisyTimer(fp32=[1.0], mixed=[0.6])).amp_autotune_
    assert "ran 40% faster per step" in _verdict(SimpleNamespace(amp_autotune_=clear), "cpu")


def test_the_demo_says_when_the_screen_left_amp_out(data):
    from types import SimpleNamespace

    from ampnet.__main__ import _verdict

    screened = fit(data, timer=Timer(mixed=6.0, pure=6.0)).amp_autotune_
    text = _verdict(SimpleNamespace(amp_autotune_=screened), "cpu")
    assert text.startswith("AMP does not pay off for this model on this machine: its forward pass in low "
                           "precision took 6.0x float32's, too slow for any AMP setting to be worth timing")
    timed = fit(data, timer=Timer(mixed=1.2, pure=1.2)).amp_autotune_
    assert "no AMP setting beat float32 by more than 5% in the probe" in _verdict(
        SimpleNamespace(amp_autotune_=timed), "cpu")
