"""amp_enabled='auto' (ampnet.auto): measured in the fit's own steps, with an
explicit timer (``amp_autotune__timer``) standing for a machine where mixed
precision is faster or slower, so that both sides of the choice are tested
on any CPU; then the choice pinned, remembered, saved and reused."""

import copy
import json
import pickle
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from skorch.callbacks import LRScheduler

from ampnet import AmpNetClassifier
from ampnet.auto import AutotuneResult
from ampnet.auto.enabled import label
from ampnet.auto.trial import decide
from ampnet.checkpoint import Checkpoint, LoadInitState

from conftest import Logits

BF16_MIXED = {"amp_enabled": True, "amp_dtype": "bfloat16", "amp_level": "mixed",
              "amp_master_weights": True, "memory_format": "preserve"}
FLOAT32 = {"amp_enabled": False, "amp_dtype": "auto", "amp_level": "mixed",
           "amp_master_weights": True, "memory_format": "preserve"}


class Timer:
    """``amp_autotune__timer``: the seconds to count for a step of each
    candidate (mixed over float32 = ``mixed``), and the steps it saw."""

    def __init__(self, mixed=0.5, fp32=1.0):
        self.mixed, self.fp32 = mixed, fp32
        self.calls = []

    def __call__(self, params, seconds):
        assert seconds > 0  # the step's measured wall time
        self.calls.append(label(params))
        return self.mixed if params["amp_enabled"] else self.fp32


def kw(**extra):
    base = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.Adam,
                max_epochs=3, lr=0.05, batch_size=16, train_split=None, verbose=0,
                iterator_train__shuffle=True, amp_enabled="auto",
                amp_autotune__min_steps=0)  # these fits of 12 steps measure, as longer ones do
    base.update(extra)
    return base


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


def fit(data, seed=0, **extra):
    torch.manual_seed(seed)
    return AmpNetClassifier(**kw(**extra)).fit(*data)


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.module_.parameters(), b.module_.parameters()))


# ---- the rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("ratios, expected", [
    ([0.1], None), ([10.0], None), ([0.5, 0.5], None),            # one or two pairs never decide, however far apart
    ([0.9, 0.92, 0.9], 1), ([1.0, 0.97, 1.2], 0), ([0.9, 1.0, 0.9], None),  # three that agree decide
    ([0.8, 0.8, 2.0, 0.8, 0.8, 0.8], 1),                         # one preempted step: confirmed by more pairs
    ([0.9, 1.0, 0.93, 0.99, 0.94, 0.9], 1), ([0.9, 1.0, 0.97, 0.99, 0.92, 1.1], 0),  # else the median
])
def test_decide(ratios, expected):
    choice, reason = decide(ratios, margin=0.05, pairs=6)
    assert choice == expected
    assert (reason == "") == (expected is None)


# ---- measured in the fit's own steps --------------------------------------------------------


class Recording(Logits):
    """Counts its training forward passes and records whether each ran under autocast."""

    def __init__(self):
        super().__init__()
        self.autocast = []

    def forward(self, X):
        if self.training:
            self.autocast.append(torch.is_autocast_enabled("cpu"))
        return super().forward(X)


@pytest.mark.parametrize("mixed, chosen", [(0.5, BF16_MIXED), (2.0, FLOAT32)], ids=["mixed", "float32"])
def test_the_fits_first_steps_are_the_measurement(data, native_bf16, mixed, chosen):
    timer = Timer(mixed=mixed)
    net = fit(data, module=Recording, amp_autotune__timer=timer)
    result = net.amp_autotune_
    assert result.params == chosen and result.source == "measured"
    # float32 first, then alternating; one warm-up step each and three pairs that agree
    assert result.steps_run == ["float32 (AMP off)", "bfloat16 mixed"] * 4
    assert timer.calls[:6] == result.steps_run[2:]  # each candidate's warm-up step is not timed
    seen = net.module_.autocast
    assert len(seen) == 12 == sum(len(row["batches"]) for row in net.history)  # no extra forward pass
    assert seen[:8] == [False, True] * 4
    assert seen[8:] == [bool(chosen["amp_enabled"])] * 4
    assert net.precision_policy_.enabled == chosen["amp_enabled"]
    assert [row["timed"] for row in result.table] == [3, 3]
    assert result.table[1]["step_s"] == mixed and result.table[0]["step_s"] == 1.0
    assert result.cost_s == pytest.approx(abs(1.0 - mixed) * 3)  # the three timed steps in the other setting
    assert len(str(result).splitlines()) <= 10


def test_no_copy_of_the_module(data, native_bf16):
    class Counted(Logits):
        copies = 0

        def __deepcopy__(self, memo):
            type(self).copies += 1
            new = Logits.__new__(type(self))
            memo[id(self)] = new
            for k, v in self.__dict__.items():
                setattr(new, k, copy.deepcopy(v, memo))
            return new

    fit(data, module=Counted, amp_enabled=True)
    pinned = Counted.copies
    Counted.copies = 0
    fit(data, module=Counted, amp_autotune__timer=Timer())
    assert Counted.copies <= pinned


def test_a_module_that_cannot_be_copied_trains_under_auto(data, native_bf16):
    class Uncopyable(Logits):
        def __deepcopy__(self, memo):
            raise ValueError("no copies of this module")

    net = AmpNetClassifier(**kw(module=Uncopyable(), amp_autotune__timer=Timer())).fit(*data)
    assert net.amp_autotune_.params == BF16_MIXED and len(net.history) == 3


def test_a_float32_choice_keeps_the_optimizer_and_its_schedule(data, native_bf16):
    sched = LRScheduler(policy=torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    net = fit(data, callbacks=[sched], amp_autotune__timer=Timer(mixed=2.0), optimizer=torch.optim.AdamW)
    assert net.amp_autotune_.params == FLOAT32
    assert sched.lr_scheduler_.optimizer is net.optimizer_  # the schedule steps the optimizer that trains
    assert net.optimizer_.param_groups[0]["lr"] == pytest.approx(0.05 * 0.125)
    pinned = fit(data, callbacks=[LRScheduler(policy=torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)],
                 optimizer=torch.optim.AdamW, **FLOAT32)
    for key in ("fused", "foreach"):  # the kernel a float32 net builds
        assert net.optimizer_.defaults[key] == pinned.optimizer_.defaults[key]
        assert net.optimizer_.param_groups[0][key] == pinned.optimizer_.param_groups[0][key]
    assert not net.amp_step_state_.float32_step


def test_a_mixed_step_whose_forward_pass_overflows_is_unhealthy(data, native_bf16):
    class Overflow(Logits):  # the mixed steps' outputs are inf, float32's are finite
        def forward(self, X):
            out = super().forward(X)
            return out * float("inf") if torch.is_autocast_enabled("cpu") else out

    net = fit(data, module=Overflow, amp_autotune__timer=Timer(mixed=0.1))
    assert net.amp_autotune_.params == FLOAT32
    assert "non-finite" in net.amp_autotune_.note


def test_gradient_accumulation_measures_whole_steps(data, native_bf16):
    timer = Timer()
    net = fit(data, gradient_accumulation_steps=2, max_epochs=4, amp_autotune__timer=timer)
    assert net.amp_autotune_.steps_run == ["float32 (AMP off)", "bfloat16 mixed"] * 4
    assert len(timer.calls) == 6  # one timed value per step of 2 micro-batches (warm-up steps are not timed)
    assert {float(st["step"]) for st in net.optimizer_.state.values()} == {8.0}


def test_a_fit_too_short_to_measure_decides_without_a_training_step(data, native_bf16):
    from ampnet.auto import cache
    from ampnet.auto.enabled import device_choice

    timer = Timer()
    net = fit((data[0][:32], data[1][:32]), max_epochs=1, amp_autotune__timer=timer)  # 2 steps
    result = net.amp_autotune_
    assert timer.calls == [] and result.source == "device" and result.steps_run == []
    assert "this fit has 2 training steps, fewer than the 8 a measurement takes here" in result.note
    candidates = [FLOAT32, BF16_MIXED]
    expected, why = device_choice(candidates, torch.device("cpu"), cache.machine(torch.device("cpu")))
    assert result.params == expected and why in result.note
    # and by default a fit shorter than 64 steps does not measure either: 8 steps here
    assert fit(data, amp_autotune__min_steps=64, amp_autotune__timer=timer).amp_autotune_.source == "device"
    assert timer.calls == []


@pytest.mark.parametrize("machine, chosen", [
    ({"vendor": "GenuineIntel", "flags": ["avx512_bf16"]}, FLOAT32),
    ({"vendor": "GenuineIntel", "flags": ["avx512_bf16", "amx_bf16"]}, BF16_MIXED),
    ({"vendor": "AuthenticAMD", "flags": ["avx512_bf16"]}, BF16_MIXED),
    ({"vendor": "AuthenticAMD", "flags": ["avx2"]}, FLOAT32),
])
def test_the_choice_without_a_measurement_follows_the_cpu(machine, chosen):
    from ampnet.auto.enabled import device_choice

    assert device_choice([FLOAT32, BF16_MIXED], torch.device("cpu"), machine)[0] == chosen


@pytest.mark.parametrize("cpu_flags", [["amx_bf16"], []], ids=["amx", "no-amx"])
def test_a_short_fit_follows_the_machine_and_the_model_only(data, native_bf16, auto_cache_dir, monkeypatch,
                                                           cpu_flags):
    """Issue 38 item 6: neither other models' entries nor junk files steer a short fit's choice."""
    from ampnet.auto import cache

    monkeypatch.setattr(cache, "_cpu", lambda: {"cpu": "test", "vendor": "GenuineIntel", "flags": cpu_flags})
    empty = fit(data, module=Noisy, amp_autotune__min_steps=100).amp_autotune_
    assert empty.source == "device" and empty.params == (BF16_MIXED if cpu_flags else FLOAT32)

    class Wider(Logits):
        def __init__(self):
            super().__init__()
            self.hidden = torch.nn.Linear(20, 8)
            self.extra = torch.nn.Linear(2, 2)

    other = FLOAT32 if cpu_flags else BF16_MIXED  # the opposite of the machine's choice, stored for 2 models
    for module in (Logits, Wider):
        cache.write_entry(cache.cache_key(AmpNetClassifier(**kw(module=module)).initialize(),
                                          [FLOAT32, BF16_MIXED], data[0]), other, 0.01, str(auto_cache_dir))
    for i in range(3):  # junk with no version or step_s, and a name that does not match its key
        (auto_cache_dir / f"auto-{i:040x}.json").write_text(json.dumps({"params": {"amp_enabled": other["amp_enabled"]}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short = fit(data, module=Noisy, amp_autotune__min_steps=100).amp_autotune_
    assert short.params == empty.params and short.note == empty.note


def test_an_emulated_bfloat16_is_not_measured(data, monkeypatch):
    import ampnet.auto.enabled

    monkeypatch.setattr(ampnet.auto.enabled, "cpu_has_native_bf16", lambda: False)
    timer = Timer(mixed=0.1)
    net = fit(data, amp_autotune__timer=timer)
    assert timer.calls == [] and net.amp_autotune_.params == FLOAT32
    assert net.amp_autotune_.source == "device"
    assert "no native bfloat16" in net.amp_autotune_.table[1]["reason"]


def test_settings_that_cannot_switch_per_step_are_refused():
    for name, value in (("amp_level", "pure"), ("amp_master_weights", "compensated")):
        net = AmpNetClassifier(**kw(**{name: value}))
        with pytest.raises(ValueError, match=rf"cannot switch to {name}={value!r} between two steps.*"
                                             rf"Fix: pin it, with amp_enabled=True and {name}"):
            net.initialize()
        assert not net.initialized_


def test_removed_settings_say_so():
    with pytest.raises(ValueError, match=r"amp_autotune__budget was removed in ampnet 0.4: auto measures in "
                                         r"the fit's own steps.*Fix: drop amp_autotune__budget=0.03"):
        AmpNetClassifier(**kw(amp_autotune__budget=0.03)).initialize()


def test_the_choice_is_checked_against_the_fits_epochs(data, native_bf16, auto_cache_dir):
    class Slowing(Timer):  # the chosen setting's later steps run 3x slower than measured
        def __call__(self, params, seconds):
            value = super().__call__(params, seconds)
            return value * 3 if len(self.calls) > 6 else value

    net = fit(data, max_epochs=3, amp_autotune__timer=Slowing())
    result = net.amp_autotune_
    assert result.params == BF16_MIXED
    assert result.check.startswith("epoch 3:") and "3.00x the 500.0 ms measured" in result.check
    assert result.cache.startswith("not kept in ") and "the check dropped the stored choice" in str(result)
    assert list(auto_cache_dir.iterdir()) == []  # the next fit measures again
    again = Timer()
    fit(data, amp_autotune__timer=again)
    assert again.calls[:6] == ["float32 (AMP off)", "bfloat16 mixed"] * 3


def test_a_choice_slower_than_the_other_settings_measurement_is_dropped(data, native_bf16, auto_cache_dir):
    class Turning(Timer):  # mixed 10% faster while measured (6 steps), then 10% slower than float32 was;
        # epoch 2 holds 2 steps of the choice, too few to judge, epoch 3 four
        def __call__(self, params, seconds):
            value = super().__call__(params, seconds)
            return 1.1 if len(self.calls) > 6 else value

    net = fit(data, max_epochs=3, amp_autotune__timer=Turning(mixed=0.9))
    result = net.amp_autotune_
    assert result.params == BF16_MIXED and result.steps_run == ["float32 (AMP off)", "bfloat16 mixed"] * 4
    assert result.check.startswith("epoch 3:") and "slower than the 1000.0 ms measured for float32" in result.check
    assert list(auto_cache_dir.iterdir()) == []


# ---- remembered ---------------------------------------------------------------------------


class Noisy(Logits):
    """Dropout: training draws from torch's random stream."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, X):
        return super().forward(self.drop(X))


@pytest.mark.parametrize("mixed", [0.5, 2.0], ids=["mixed", "float32"])
def test_a_second_fit_measures_nothing_and_trains_bitwise_as_pinned(data, native_bf16, mixed):
    first = fit(data, module=Noisy, amp_autotune__timer=Timer(mixed=mixed))
    assert first.amp_autotune_.source == "measured"
    timer = Timer(mixed=mixed)
    second = fit(data, module=Noisy, amp_autotune__timer=timer)
    after_second = torch.rand(3)
    assert second.amp_autotune_.source == "cache" and second.amp_autotune_.params == first.amp_autotune_.params
    assert second.amp_autotune_.steps_run == [] and "Read from" in str(second.amp_autotune_)
    pinned = fit(data, module=Noisy, **first.amp_autotune_.params)
    after_pinned = torch.rand(3)
    assert torch.equal(after_second, after_pinned)  # the same random streams
    assert same_weights(second, pinned)
    assert second.history[:, "train_loss"] == pinned.history[:, "train_loss"]
    assert second.optimizer_.defaults == pinned.optimizer_.defaults


def test_a_clone_and_the_next_fold_start_with_the_stored_choice(data, native_bf16):
    net = fit(data, amp_autotune__timer=Timer())
    fresh = clone(net)
    assert not hasattr(fresh, "amp_autotune_") and fresh.get_params()["amp_enabled"] == "auto"
    fresh.fit(*data)
    assert fresh.amp_autotune_.source == "cache" and fresh.amp_autotune_.params == BF16_MIXED


def test_cache_false_reads_and_writes_nothing(data, native_bf16, auto_cache_dir):
    fit(data, amp_autotune__timer=Timer(), amp_autotune__cache=False)
    assert list(auto_cache_dir.iterdir()) == []
    fit(data, amp_autotune__timer=Timer())  # stores
    assert len(list(auto_cache_dir.iterdir())) == 1
    timer = Timer()
    net = fit(data, amp_autotune__timer=timer, amp_autotune__cache=False)
    assert net.amp_autotune_.source == "measured" and len(timer.calls) == 10  # 6 timed, then 4 watched


@pytest.mark.parametrize("damage", ["garbage", "json", "nan", "huge", "fifo", "symlink", "deep"])
def test_a_corrupt_cache_entry_warns_once_trains_and_is_replaced(data, native_bf16, auto_cache_dir, tmp_path,
                                                                damage):
    import os

    fit(data, amp_autotune__timer=Timer())
    (entry,) = auto_cache_dir.iterdir()
    entry.unlink()
    if damage == "fifo":
        os.mkfifo(entry)
    elif damage == "symlink":
        (tmp_path / "elsewhere.json").write_text(open(os.devnull).read())
        entry.symlink_to(tmp_path / "elsewhere.json")
    else:
        entry.write_text({
            "garbage": "\x00\xff not json", "json": '{"version": 1, "key": {}, "params": {}, "step_s": 1}',
            "nan": "NaN", "huge": " " * 100_000, "deep": "[" * 100_000 + "]" * 100_000,
        }[damage])
    with pytest.warns(UserWarning, match=r"ignored a cache entry it cannot use \(.*auto-[0-9a-f]+\.json") as rec:
        net = fit(data, amp_autotune__timer=Timer())
    assert len([w for w in rec if "cache entry" in str(w.message)]) == 1
    assert net.amp_autotune_.source == "measured" and net.amp_autotune_.params == BF16_MIXED
    assert entry.is_file() and not entry.is_symlink()  # replaced by a whole entry
    assert fit(data, amp_autotune__timer=Timer()).amp_autotune_.source == "cache"


def test_a_stored_choice_another_net_cannot_use_is_ignored(data, native_bf16, auto_cache_dir):
    import json

    fit(data, amp_autotune__timer=Timer())
    (entry,) = auto_cache_dir.iterdir()
    stored = json.loads(entry.read_text())
    stored["params"] = {**BF16_MIXED, "amp_level": "pure"}
    entry.write_text(json.dumps(stored))
    with pytest.warns(UserWarning, match="is not one of this net's candidates"):
        net = fit(data, amp_autotune__timer=Timer())
    assert net.amp_autotune_.source == "measured"


def test_grid_search_with_two_processes_sharing_the_cache(data, tmp_path):
    X, y = data
    folder = tmp_path / "shared"  # a folder of the net's own: worker processes outlive a test's environment
    search = GridSearchCV(AmpNetClassifier(**kw(max_epochs=2, batch_size=8, amp_autotune__cache=str(folder))),
                          {"lr": [0.01, 0.05]}, cv=2, n_jobs=2)
    search.fit(X, y)
    choice = search.best_estimator_.amp_autotune_
    assert choice.params in (BF16_MIXED, FLOAT32) and choice.source in ("measured", "cache", "device")
    assert search.best_estimator_.get_params()["amp_enabled"] == "auto"
    assert np.isfinite(search.best_score_)
    entries = list(folder.glob("auto-*.json"))
    # one key, so one entry at most (none where the device decided, or a fit's check dropped it); whole
    assert len(entries) <= 1 and all(json.loads(e.read_text())["params"] in (BF16_MIXED, FLOAT32) for e in entries)
    assert not list(folder.glob(".tmp-*"))  # no half-written entry left


def test_the_cache_setting_takes_a_folder(data, native_bf16, tmp_path):
    fit(data, amp_autotune__timer=Timer(), amp_autotune__cache=tmp_path / "mine")
    assert len(list((tmp_path / "mine").glob("auto-*.json"))) == 1
    with pytest.raises(ValueError, match=r"amp_autotune__cache must be True, False or a folder; got 3"):
        AmpNetClassifier(**kw(amp_autotune__cache=3)).initialize()


# ---- kept in the net ----------------------------------------------------------------------


def test_partial_fit_warm_start_and_refit_reuse_the_choice(data, native_bf16):
    timer = Timer()
    net = fit(data, amp_autotune__timer=timer)
    first, n = net.amp_autotune_, len(timer.calls)
    net.partial_fit(*data)
    net.set_params(warm_start=True).fit(*data)
    assert net.amp_autotune_ is first and timer.calls[n:] == ["bfloat16 mixed"] * len(timer.calls[n:])
    assert net.precision_policy_.name == "bfloat16 (mixed)"


def test_set_params_of_an_amp_setting_drops_the_choice(data, native_bf16):
    net = fit(data, amp_autotune__timer=Timer())
    net.set_params(lr=0.01)  # not an AMP setting: the choice stays
    assert net.amp_autotune_.params == BF16_MIXED
    net.set_params(amp_dtype="bfloat16")
    assert not hasattr(net, "amp_autotune_") and not net.precision_policy_.enabled
    net.partial_fit(*data)
    assert net.amp_autotune_.params == BF16_MIXED and net.amp_autotune_.source == "cache"


def test_pickle_keeps_the_choice(data, native_bf16):
    net = fit(data, amp_autotune__timer=Timer())
    loaded = pickle.loads(pickle.dumps(net))
    assert loaded.amp_autotune_ == net.amp_autotune_ and loaded.precision_policy_.enabled


def test_save_and_load_params_keep_the_choice(data, native_bf16, tmp_path):
    net = fit(data, amp_autotune__timer=Timer())
    net.save_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    timer = Timer()
    other = AmpNetClassifier(**kw(amp_autotune__cache=False, amp_autotune__timer=timer)).initialize()
    assert not other.precision_policy_.enabled  # float32 until it chooses
    other.load_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    assert other.amp_autotune_.params == BF16_MIXED and other.amp_autotune_.source == "loaded"
    assert same_weights(net, other)
    other.partial_fit(*data)
    assert timer.calls == [] and other.precision_policy_.name == "bfloat16 (mixed)"  # nothing measured
    assert "read by load_params" in str(other.amp_autotune_)


def test_a_resumed_run_takes_the_checkpoints_choice(data, native_bf16, tmp_path):
    def make(timer):
        cp = Checkpoint(monitor=None, dirname=str(tmp_path))
        return AmpNetClassifier(**kw(max_epochs=1, batch_size=8, amp_autotune__cache=False,
                                     amp_autotune__timer=timer, callbacks=[LoadInitState(cp), cp]))

    first = make(Timer(mixed=2.0)).fit(*data)
    assert first.amp_autotune_.params == FLOAT32
    resumed = make(Timer(mixed=0.1)).fit(*data)
    assert resumed.amp_autotune_.source == "checkpoint" and resumed.amp_autotune_.params == FLOAT32
    assert len(resumed.history) == 2


def test_grid_search_and_pipeline(data, native_bf16):
    X, y = data
    search = GridSearchCV(AmpNetClassifier(**kw(max_epochs=1, batch_size=8, amp_autotune__timer=Timer())),
                          {"lr": [0.01, 0.05]}, cv=2, refit=True)
    search.fit(X, y)
    assert search.best_estimator_.amp_autotune_.params == BF16_MIXED
    pipe = make_pipeline(StandardScaler(), AmpNetClassifier(**kw(amp_autotune__timer=Timer(mixed=2.0),
                                                                 amp_autotune__cache=False)))
    pipe.fit(X, y)
    assert pipe[-1].amp_autotune_.params == FLOAT32
    assert pipe.predict(X).shape == (len(X),)


def test_result_is_a_plain_record():
    result = AutotuneResult(params=dict(FLOAT32), source="loaded")
    assert str(result) == "amp_enabled='auto' on cpu: float32 (AMP off) (read by load_params; nothing measured)"
    assert result.chosen == "float32 (AMP off)"


def test_verbose_prints_the_record_once(data, native_bf16, capsys):
    fit(data, verbose=1, amp_autotune__timer=Timer())
    out = capsys.readouterr().out
    assert out.count("amp_enabled='auto' on cpu: bfloat16 mixed (measured in this fit's first steps)") == 1


def test_the_demo_says_what_auto_found(data, native_bf16):
    from types import SimpleNamespace

    from ampnet.__main__ import _verdict

    rows = [("float32 (AMP off)", "float32", "0.9", "20.0"), ("AMP on", "bfloat16 (mixed)", "0.9", "10.0")]
    faster = fit(data, amp_autotune__timer=Timer(mixed=0.5)).amp_autotune_
    assert faster.params == BF16_MIXED and faster.source == "measured"
    verdict = _verdict(SimpleNamespace(amp_autotune_=faster), "cpu", rows)
    assert verdict.startswith("In this run, AMP pays off: bfloat16 (mixed) took 0.50x")
    assert "amp_enabled='auto' measured 0.50x float32's step time" in verdict
    slower = fit(data, amp_autotune__timer=Timer(mixed=2.0), amp_autotune__cache=False).amp_autotune_
    assert "measured 2.00x float32's step time" in _verdict(SimpleNamespace(amp_autotune_=slower), "cpu", rows)
    stored = fit(data, amp_autotune__timer=Timer(mixed=0.5)).amp_autotune_
    assert "it measured nothing" in _verdict(SimpleNamespace(amp_autotune_=stored), "cpu", rows)


def test_amp_autotune_on_a_net_that_is_not_auto_says_what_it_is():
    net = AmpNetClassifier(Logits, amp_enabled=True, max_epochs=1, train_split=None, verbose=0)
    with pytest.raises(AttributeError, match=r"no 'amp_autotune_': it is the record of amp_enabled='auto'.*"
                                             r"\(this one has amp_enabled=True\)"):
        net.amp_autotune_
    assert not hasattr(net, "amp_autotune_") and "amp_autotune_" not in vars(net)


def test_amp_autotune_can_be_copied_onto_another_net_and_deleted(data):
    X, y = data
    first = AmpNetClassifier(Logits, criterion=torch.nn.CrossEntropyLoss, amp_enabled="auto",
                             amp_autotune__cache=False, max_epochs=1, train_split=None, verbose=0).fit(X, y)
    second = AmpNetClassifier(Logits, amp_enabled="auto", amp_autotune__cache=False, max_epochs=1,
                              train_split=None, verbose=0)
    second.amp_autotune_ = first.amp_autotune_
    assert vars(second)["amp_autotune_"] is first.amp_autotune_
    del second.amp_autotune_
    assert not hasattr(second, "amp_autotune_")
    with pytest.raises(AttributeError):
        del second.amp_autotune_
