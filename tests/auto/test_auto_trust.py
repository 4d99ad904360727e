"""amp_enabled='auto' that can be trusted: its measurement draws nothing
from the random streams and copies nothing (a module that cannot be
copied trains), it chooses what works for inputs float32 cannot take, and
a saved choice is untrusted input like the rest of a checkpoint (as the
trust model page, "What 'auto' reads and keeps", says)."""

import os
import random
import threading
import warnings

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.auto.saved import ENABLED_KEY
from ampnet.checkpoint import Checkpoint, LoadInitState
from test_autotune import BF16_MIXED, Timer, fit, kw  # the auto test module's helpers (one copy)
from conftest import Logits


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


def amp_messages(record):
    return [str(w.message) for w in record if issubclass(w.category, AmpWarning)]


# ---- the random streams: the measurement draws nothing of its own -----------------------------


class Noisy(Logits):
    """Draws from torch's (dropout), numpy's and Python's global streams in
    every training forward pass."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, X):
        if self.training:
            X = X + float(np.random.standard_normal()) * 1e-3 + random.random() * 1e-3
        return super().forward(self.drop(X))


def draws():
    return torch.rand(3), np.random.rand(3), random.random()


@pytest.mark.parametrize("mixed", [0.5, 2.0], ids=["mixed", "float32"])
def test_the_measurement_keeps_every_global_random_stream(data, native_bf16, mixed):
    np.random.seed(3)
    random.seed(3)
    auto = fit(data, module=Noisy, amp_autotune__timer=Timer(mixed=mixed))
    after_auto = draws()
    np.random.seed(3)
    random.seed(3)
    fit(data, module=Noisy, amp_autotune__cache=False, **auto.amp_autotune_.params)
    after_pinned = draws()
    assert torch.equal(after_auto[0], after_pinned[0])
    np.testing.assert_array_equal(after_auto[1], after_pinned[1])
    assert after_auto[2] == after_pinned[2]


# ---- a module that cannot be deep-copied ---------------------------------------------------


class Locked(Logits):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lock = threading.Lock()


def test_a_module_holding_a_lock_trains_under_auto_without_a_warning(data, native_bf16):
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(module=Locked(), amp_autotune__timer=Timer()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpWarning)
        net.fit(*data)
    assert net.amp_autotune_.source == "measured" and net.amp_autotune_.params == BF16_MIXED
    assert np.isfinite(net.history[-1, "train_loss"])


# ---- inputs float32 cannot take ---------------------------------------------------------------


def test_float16_inputs_choose_mixed_precision_which_takes_them(data, native_bf16):
    X, y = data[0].astype(np.float16), data[1]
    net = fit((X, y), amp_autotune__timer=Timer(mixed=2.0))
    assert net.amp_autotune_.params == BF16_MIXED and net.amp_autotune_.steps_run == []  # no float32 step
    assert "float16 inputs, which float32 cannot take" in net.amp_autotune_.note
    assert np.isfinite(net.history[-1, "train_loss"])


# ---- a hostile saved choice --------------------------------------------------------------


HOSTILE = [
    {**BF16_MIXED, "amp_dtype": "float8"},
    {**BF16_MIXED, "amp_dtype": "float16", "amp_level": "pure", "amp_master_weights": "compensated"},
]


def write_choice(path, choice):
    state = torch.load(path, weights_only=True)
    state._metadata[""][ENABLED_KEY] = choice
    torch.save(state, path)



# ---- a malformed saved choice: warned about, naming the file, and ignored


MALFORMED = {
    "list": (["amp_enabled", True], "expected a dict with the keys"),
    "missing-key": ({k: v for k, v in BF16_MIXED.items() if k != "memory_format"}, "expected a dict with the keys"),
    "extra-key": ({**BF16_MIXED, "device": "cpu"}, "expected a dict with the keys"),
    "int-value": ({**BF16_MIXED, "amp_enabled": 1}, "amp_enabled holds a int, not a bool or a str"),
    "tensor-value": ({**BF16_MIXED, "amp_level": torch.tensor(1.0)}, "amp_level holds a Tensor"),
    "unknown-level": ({**BF16_MIXED, "amp_level": "half"}, "amp_level"),
    "auto": ({**BF16_MIXED, "amp_enabled": "AUTO"}, "amp_enabled is 'auto'"),
}


def _load_with_choice(data, tmp_path, choice):
    """A saved parameters file whose auto choice is ``choice``, loaded into a fresh 'auto' net: the net
    that saved it, the file's path, the net that loaded it and the AmpWarnings of the load."""
    saver = fit(data, max_epochs=1, amp_autotune__timer=Timer())
    path = tmp_path / "params.pt"
    saver.save_params(f_params=path)
    write_choice(path, choice)
    net = AmpNetClassifier(**kw(max_epochs=2, amp_autotune__cache=False, amp_autotune__timer=Timer())).initialize()
    with pytest.warns(AmpWarning) as record:
        net.load_params(f_params=path)
    return saver, path, net, record


@pytest.mark.parametrize("choice, problem", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_choice_is_ignored_with_a_warning_naming_the_file(data, native_bf16, tmp_path, choice, problem):
    saver, path, net, record = _load_with_choice(data, tmp_path, choice)
    refusals = [m for m in amp_messages(record) if str(path) in m]
    assert refusals and "ignored" in refusals[0] and problem in refusals[0], amp_messages(record)
    assert "amp_autotune_" not in vars(net) and not net.precision_policy_.enabled  # as it was
    for a, b in zip(saver.module_.parameters(), net.module_.parameters()):
        assert torch.equal(a.float(), b)  # the rest of the file loaded
    net.partial_fit(*data)  # the net measures its own
    assert net.amp_autotune_.source == "measured" and net.amp_autotune_.params == BF16_MIXED


@pytest.mark.parametrize("choice", HOSTILE, ids=["float8", "float16-compensated-adam"])
def test_a_hostile_choice_in_a_checkpoint_is_refused_naming_the_file(data, native_bf16, tmp_path, choice):
    folder = tmp_path / "cp"
    cp = Checkpoint(monitor=None, dirname=str(folder))
    fit(data, max_epochs=1, callbacks=[cp], amp_autotune__timer=Timer())
    params = folder / "params.pt"
    write_choice(params, choice)
    cp = Checkpoint(monitor=None, dirname=str(folder))
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(max_epochs=2, callbacks=[LoadInitState(cp, resume="total"), cp],
                                amp_autotune__cache=False, amp_autotune__timer=Timer()))
    with pytest.warns(AmpWarning) as record:
        net.fit(*data)
    refusals = [m for m in amp_messages(record) if "params.pt" in m]
    assert refusals and all("ignored" in m or "keeps its own" in m for m in refusals)
    assert net.amp_autotune_.source == "measured" and net.amp_autotune_.params == BF16_MIXED
    assert net.precision_policy_.name == "bfloat16 (mixed)"
    # later fits work, with and without the folder
    net.partial_fit(*data)
    net.set_params(callbacks=[])
    net.fit(*data)
    assert net.amp_autotune_.params == BF16_MIXED and np.isfinite(net.history[-1, "train_loss"])


@pytest.mark.parametrize("choice", HOSTILE, ids=["float8", "float16-compensated-adam"])
def test_a_hostile_choice_is_refused_by_load_params(data, native_bf16, tmp_path, choice):
    saver, path, net, record = _load_with_choice(data, tmp_path, choice)
    assert any(str(path) in m and "ignored" in m for m in amp_messages(record))
    assert "amp_autotune_" not in vars(net) and not net.precision_policy_.enabled  # as it was
    for a, b in zip(saver.module_.parameters(), net.module_.parameters()):
        assert torch.equal(a.float(), b)  # the weights loaded
    net.partial_fit(*data)
    assert net.amp_autotune_.source == "measured" and net.amp_autotune_.params == BF16_MIXED


# ---- a FIFO as the checkpoint's parameters file ----------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("enabled", [True, "auto"])
def test_a_fifo_as_the_checkpoints_params_does_not_hang(data, tmp_path, enabled):
    folder = tmp_path / "cp"
    cp = Checkpoint(monitor=None, dirname=str(folder))
    fit(data, max_epochs=1, callbacks=[cp], amp_enabled=enabled)
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

    worker = threading.Thread(target=resume, daemon=True)
    worker.start()
    worker.join(120)
    if worker.is_alive():  # unblock it: a writer ends the reader's open()
        with open(params, "wb"):
            pass
        worker.join(10)
        pytest.fail("resuming from a FIFO hung")
    assert "error" in outcome and "FIFO" in str(outcome["error"]), outcome


# ---- smaller: one rule for string choices ----------------------------------------------------


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.out = torch.nn.Linear(2 * 4 * 5, 2)

    def forward(self, X):
        return self.out(torch.relu(self.conv(X.reshape(-1, 1, 4, 5))).flatten(1))


def test_string_choices_whatever_their_case_are_stored_as_given_and_trained_as_canonical(data, native_bf16):
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
    # 'AUTO' is 'auto'
    auto = fit(data, amp_enabled="AUTO", amp_level="Mixed", amp_autotune__timer=Timer())
    assert auto.get_params()["amp_enabled"] == "AUTO" and auto.amp_autotune_.params == BF16_MIXED
    # set_params takes them too, and a clone keeps them as given
    from sklearn.base import clone

    plain.set_params(amp_level=" Pure", memory_format="PRESERVE")
    assert plain.precision_policy_.level == "pure"
    assert clone(odd).get_params()["memory_format"] == " Channels_Last"


def test_every_torch_load_is_the_checked_readers():
    """Every call of torch.load in ampnet is the checked reader's
    (ampnet.io.state_files), which refuses FIFOs, oversized and hostile files."""
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
    assert calls and set(calls) == {"io/state_files.py"}, calls
