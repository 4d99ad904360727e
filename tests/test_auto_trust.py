"""amp_enabled='auto' that can be trusted (issue 26): the probe has no side
effects on the user's module, random streams or warnings, falls back or
refuses clearly where it cannot measure, and a saved choice is untrusted
input like the rest of a checkpoint."""

import os
import threading
import warnings

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.auto.saved import ENABLED_KEY
from ampnet.checkpoint import Checkpoint, LoadInitState
from conftest import timed_probes
from test_autotune import fit, kw  # the auto test module's fitting helpers (one copy)
from test_training_loop import Logits

BF16_MIXED = {"amp_enabled": True, "amp_dtype": "bfloat16", "amp_level": "mixed",
              "amp_master_weights": True, "memory_format": "preserve"}
FLOAT32 = {"amp_enabled": False, "amp_dtype": "auto", "amp_level": "mixed",
           "amp_master_weights": True, "memory_format": "preserve"}


class Timer:
    """Injected timings: AMP (mixed) twice as fast as float32, pure slower."""

    def __init__(self, fp32=1.0, mixed=0.5, pure=0.9, during=None):
        self.times = {"fp32": fp32, "mixed": mixed, "pure": pure}
        self.during = during  # called at the first timed step
        self.calls = 0

    def __call__(self, params, step):
        if self.during is not None and self.calls == 0:
            self.during()
        self.calls += 1
        step()
        if not params["amp_enabled"]:
            return self.times["fp32"]
        return self.times[params["amp_level"]]


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]




def amp_messages(record):
    return [str(w.message) for w in record if issubclass(w.category, AmpWarning)]


# ---- 1. dropout: every candidate's health step draws float32's masks ----------------------


class Dropped(Logits):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, X):
        return super().forward(self.drop(X))


def test_dropout_does_not_make_amp_unhealthy(data):
    net = fit(data, Timer(mixed=0.5), module=Dropped)
    table = net.amp_autotune_.table
    assert net.amp_autotune_.params == BF16_MIXED
    assert all(row["healthy"] for row in table)
    assert all(row["grad_cosine"] > 0.98 for row in table), [row["grad_cosine"] for row in table]


# ---- 2. the screen and the probe never call the user's module -----------------------------


class Counting(Logits):
    """A buffer counting the rows of every forward pass, in any mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("rows", torch.zeros((), dtype=torch.int64))

    def forward(self, X):
        self.rows += X.shape[0]
        return super().forward(X)


@pytest.mark.parametrize("timer", [Timer(mixed=0.5), Timer(mixed=8.0, pure=8.0)], ids=["amp", "screened"])
def test_the_probe_does_not_call_the_users_module(data, timer):
    auto = fit(data, timer, module=Counting)
    pinned = fit(data, module=Counting, **auto.amp_autotune_.params)
    assert int(auto.module_.rows) == int(pinned.module_.rows) == 2 * len(data[0])


# ---- 3. numpy's global generator, whatever its bit generator ------------------------------


class NumpyNoise(Logits):
    """Draws noise from numpy's global generator in every training forward pass."""

    def forward(self, X):
        if self.training:
            X = X + torch.as_tensor(np.random.standard_normal(X.shape), dtype=X.dtype)
        return super().forward(X)


@pytest.fixture
def pcg64():
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))
    try:
        yield
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.usefixtures("pcg64")
def test_a_pcg64_global_generator_is_kept(data):
    start = np.random.get_bit_generator().state
    auto = fit(data, Timer(mixed=0.5), module=NumpyNoise)
    after_auto = np.random.random(3)
    np.random.get_bit_generator().state = start
    pinned = fit(data, module=NumpyNoise, **auto.amp_autotune_.params)
    after_pinned = np.random.random(3)
    assert auto.amp_autotune_.params == BF16_MIXED
    np.testing.assert_array_equal(after_auto, after_pinned)  # the probe drew nothing from numpy's stream
    for a, b in zip(auto.module_.parameters(), pinned.module_.parameters()):
        assert torch.equal(a, b)


# ---- 5. a module that cannot be deep-copied ------------------------------------------------


class Locked(Logits):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lock = threading.Lock()


def test_a_module_that_cannot_be_copied_falls_back_with_the_cause_and_a_fix(data):
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(module=Locked(), max_epochs=1))
    with pytest.warns(AmpWarning) as record:
        net.fit(*data)
    message = " ".join(amp_messages(record))
    assert "lock" in message  # the cause
    assert "amp_enabled=True or False" in message and "deep-copied" in message  # the fixes
    assert net.amp_autotune_.source == "fallback" and net.amp_autotune_.params == FLOAT32
    assert not net.precision_policy_.enabled
    assert "lock" in str(net.amp_autotune_)
    assert np.isfinite(net.history[-1, "train_loss"])


# ---- 7. a hostile saved choice --------------------------------------------------------------


HOSTILE = [
    {**BF16_MIXED, "amp_dtype": "float8"},
    {**BF16_MIXED, "amp_dtype": "float16", "amp_level": "pure", "amp_master_weights": "compensated"},
]


def write_choice(path, choice):
    state = torch.load(path, weights_only=True)
    state._metadata[""][ENABLED_KEY] = choice
    torch.save(state, path)


@pytest.mark.parametrize("choice", HOSTILE, ids=["float8", "float16-compensated-adam"])
def test_a_hostile_choice_in_a_checkpoint_is_refused_naming_the_file(data, tmp_path, choice):
    folder = tmp_path / "cp"
    cp = Checkpoint(monitor=None, dirname=str(folder))
    fit(data, Timer(mixed=0.5), max_epochs=1, callbacks=[cp])
    params = folder / "params.pt"
    write_choice(params, choice)
    cp = Checkpoint(monitor=None, dirname=str(folder))
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(max_epochs=1, callbacks=[LoadInitState(cp, resume="total"), cp]))
    with timed_probes(Timer(mixed=0.5)), pytest.warns(AmpWarning) as record:
        net.fit(*data)
    refusals = [m for m in amp_messages(record) if "params.pt" in m]
    assert refusals and all("ignored" in m or "keeps its own" in m for m in refusals)
    assert net.amp_autotune_.source == "probe" and net.amp_autotune_.params == BF16_MIXED
    assert net.precision_policy_.name == "bfloat16 (mixed)"
    # later fits work, with and without the folder
    with timed_probes(Timer(mixed=0.5)):
        net.partial_fit(*data)
        net.set_params(callbacks=[])
        net.fit(*data)
    assert net.amp_autotune_.params == BF16_MIXED and np.isfinite(net.history[-1, "train_loss"])


@pytest.mark.parametrize("choice", HOSTILE, ids=["float8", "float16-compensated-adam"])
def test_a_hostile_choice_is_refused_by_load_params(data, tmp_path, choice):
    saver = fit(data, Timer(mixed=0.5), max_epochs=1)
    path = tmp_path / "params.pt"
    saver.save_params(f_params=path)
    write_choice(path, choice)
    net = AmpNetClassifier(**kw(max_epochs=1)).initialize()
    with pytest.warns(AmpWarning) as record:
        net.load_params(f_params=path)
    assert any(str(path) in m and "ignored" in m for m in amp_messages(record))
    assert "amp_autotune_" not in vars(net) and not net.precision_policy_.enabled  # as it was
    for a, b in zip(saver.module_.parameters(), net.module_.parameters()):
        assert torch.equal(a.float(), b)  # the weights loaded
    with timed_probes(Timer(mixed=0.5)):
        net.partial_fit(*data)
    assert net.amp_autotune_.source == "probe" and net.amp_autotune_.params == BF16_MIXED


# ---- 8. a FIFO as the checkpoint's parameters file ----------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("enabled", [True, "auto"])
def test_a_fifo_as_the_checkpoints_params_does_not_hang(data, tmp_path, enabled):
    folder = tmp_path / "cp"
    cp = Checkpoint(monitor=None, dirname=str(folder))
    fit(data, Timer(mixed=0.5), max_epochs=1, callbacks=[cp], amp_enabled=enabled)
    params = folder / "params.pt"
    params.unlink()
    os.mkfifo(params)
    outcome = {}

    def resume():
        net = AmpNetClassifier(**kw(max_epochs=1, amp_enabled=enabled,
                                    callbacks=[LoadInitState(Checkpoint(monitor=None, dirname=str(folder)))]))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                net.fit(*data)
        except Exception as exc:  # noqa: BLE001 - the outcome is checked below
            outcome["error"] = exc

    with timed_probes(Timer(mixed=0.5)):
        worker = threading.Thread(target=resume, daemon=True)
        worker.start()
        worker.join(120)
    if worker.is_alive():  # unblock it: a writer ends the reader's open()
        with open(params, "wb"):
            pass
        worker.join(10)
        pytest.fail("resuming from a FIFO hung")
    assert "error" in outcome and "FIFO" in str(outcome["error"]), outcome


# ---- 9. the probe silences ampnet's warnings in its own thread only -------------------------


def test_another_threads_warning_is_not_silenced_by_the_probe(data):
    """An fp16 fit in another thread warns (once per fit) while the probe runs
    here: the probe's timer waits until the other fit has ended."""
    probing, other_done = threading.Event(), threading.Event()

    def other_fit():
        probing.wait(60)
        try:
            torch.manual_seed(1)
            AmpNetClassifier(**kw(max_epochs=1, amp_enabled=True, amp_dtype="float16")).fit(*data)
        finally:
            other_done.set()

    def during_probe():
        probing.set()
        assert other_done.wait(120), "the other fit did not end"

    worker = threading.Thread(target=other_fit, daemon=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        worker.start()
        auto = fit(data, Timer(mixed=0.5, during=during_probe), max_epochs=1)
        worker.join(60)
    assert auto.amp_autotune_.params == BF16_MIXED
    float16 = [m for m in amp_messages(record) if "float16" in m]
    assert float16, amp_messages(record)  # the other thread's fit warned


# ---- smaller: what the probe says about the data ------------------------------------------


def test_nan_in_the_first_batch_is_blamed_on_the_data(data):
    X, y = data[0].copy(), data[1]
    X[3, 2] = np.nan
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(max_epochs=1, amp_max_consecutive_skips=None))
    with timed_probes(Timer(mixed=0.5)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net.fit(X, y)
    table = net.amp_autotune_.table
    assert net.amp_autotune_.params == FLOAT32
    for row in table:
        assert "first training batch" in row["reason"] and "NaN" in row["reason"], row["reason"]
    assert "NaN" in str(net.amp_autotune_)


def test_float16_inputs_are_refused_with_a_fix(data):
    X, y = data[0].astype(np.float16), data[1]
    net = AmpNetClassifier(**kw(max_epochs=1))
    with pytest.raises(ValueError) as error:
        with timed_probes(Timer(mixed=0.5)):
            net.fit(X, y)
    message = str(error.value)
    assert "amp_enabled='auto'" in message and "float16" in message and "Fix:" in message
    assert "float32" in message and "amp_enabled=True" in message
    assert "amp_autotune_" not in vars(net)
    # the fix works
    with timed_probes(Timer(mixed=0.5)):
        AmpNetClassifier(**kw(max_epochs=1)).fit(X.astype(np.float32), y)


# ---- smaller: one rule for string choices ----------------------------------------------------


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.out = torch.nn.Linear(2 * 4 * 5, 2)

    def forward(self, X):
        return self.out(torch.relu(self.conv(X.reshape(-1, 1, 4, 5))).flatten(1))


def test_string_choices_whatever_their_case_are_stored_as_given_and_trained_as_canonical(data):
    given = dict(amp_enabled=True, amp_level="MIXED", memory_format=" Channels_Last")
    torch.manual_seed(0)
    odd = AmpNetClassifier(**kw(module=Conv, max_epochs=1, amp_dtype="BFloat16 ", **given))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        odd.fit(*data)
    torch.manual_seed(0)
    plain = AmpNetClassifier(**kw(module=Conv, max_epochs=1, amp_enabled=True, amp_dtype="bfloat16",
                                  amp_level="mixed", memory_format="channels_last")).fit(*data)
    params = odd.get_params()
    assert (params["amp_level"], params["memory_format"], params["amp_dtype"]) == ("MIXED", " Channels_Last",
                                                                                    "BFloat16 ")
    assert odd.precision_policy_.name == plain.precision_policy_.name == "bfloat16 (mixed)"
    assert odd.module_.conv.weight.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(odd.module_.parameters(), plain.module_.parameters()):
        assert torch.equal(a, b)
    # 'AUTO' is 'auto': it probes, and pinning its choice trains the same
    auto = fit(data, Timer(mixed=0.5), amp_enabled="AUTO", amp_level="Mixed")
    assert auto.get_params()["amp_enabled"] == "AUTO" and auto.amp_autotune_.params == BF16_MIXED
    # set_params takes them too, and a clone keeps them as given
    from sklearn.base import clone

    plain.set_params(amp_level=" Pure", memory_format="PRESERVE")
    assert plain.precision_policy_.level == "pure"
    assert clone(odd).get_params()["memory_format"] == " Channels_Last"


def test_every_torch_load_is_the_checked_readers():
    """Issue 26 item 8: the auto resume path opened params.pt with a plain
    torch.load. Every call of torch.load in ampnet is the checked reader's
    (ampnet.io.files), which refuses FIFOs, oversized and hostile files."""
    import ast
    from pathlib import Path

    import ampnet

    root = Path(ampnet.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if (isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "load"
                    and isinstance(func.value, ast.Name) and func.value.id == "torch"):
                calls.append(path.relative_to(root).as_posix())
    assert calls and set(calls) == {"io/files.py"}, calls
