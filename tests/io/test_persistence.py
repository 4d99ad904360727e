"""save_params/load_params with the loss-scaler, RNG and scheduler states,
validation before load, crash-safe writes, checkpoint callbacks, precision
changes between save and load, pickling and copies."""

import copy
import dataclasses
import io
import json
import os
import pickle
import random
import re
from pathlib import Path

import joblib
import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, LRScheduler
from skorch.callbacks import Checkpoint as SkorchCheckpoint
from skorch.dataset import ValidSplit
from skorch.exceptions import DeviceWarning

from ampnet import AmpNetClassifier
from ampnet.io import atomic
from ampnet.io.atomic import JOURNAL_NAME, TEMP_SUFFIX, recover
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState, TrainEndCheckpoint
from ampnet.exceptions import AmpWarning
from ampnet.io.rng import get_rng_state
from checkpoint_helpers import quietly
from resume_script import Tiny, differences, make_data

PRECISIONS = {
    "fp16": dict(amp_enabled=True, amp_dtype="float16"),
    "bf16": dict(amp_enabled=True, amp_dtype="bfloat16"),
    "off": dict(amp_enabled=False),
}
INIT_SCALE = 2.0**20
FILES = ("f_params", "f_optimizer", "f_criterion", "f_history", "f_grad_scaler", "f_rng_state")


def tiny_net(precision="fp16", **kwargs):
    params = dict(
        optimizer=torch.optim.Adam, lr=0.05, batch_size=16, max_epochs=1, train_split=None,
        verbose=0, grad_scaler__init_scale=INIT_SCALE, grad_scaler__growth_interval=3,
        **PRECISIONS[precision],
    )
    params.update(kwargs)
    return AmpNetClassifier(Tiny, **params)


def snapshot(net):
    return copy.deepcopy({
        "params": net.module_.state_dict(),
        "optimizer": net.optimizer_.state_dict(),
        "scaler": net.grad_scaler_.state_dict(),
        "history": net.history.to_list(),
        "device": net.device,
        "rng": torch.get_rng_state(),
    })


def paths(root, names=FILES, prefix=""):
    ext = {"f_history": ".json"}
    return {name: str(Path(root) / f"{prefix}{name[2:]}{ext.get(name, '.pt')}") for name in names}


def params_equal(a, b):
    return differences(a.module_.state_dict(), b.module_.state_dict()) == []


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def fitted(data):
    """An fp16 net whose scale has moved away from init_scale (do not mutate)."""
    torch.manual_seed(0)
    net = tiny_net(max_epochs=2)
    quietly(net.fit, *data)
    assert net.grad_scaler_.get_scale() != INIT_SCALE
    return net


# ---- save_params / load_params ------------------------------------------


def test_roundtrip_restores_every_state(tmp_path, fitted):
    files = paths(tmp_path)
    fitted.save_params(**files)
    saved = torch.load(files["f_grad_scaler"], weights_only=True)
    assert saved == fitted.grad_scaler_.state_dict()
    assert isinstance(saved["scale"], float) and saved["_growth_tracker"] >= 0
    net = tiny_net().initialize()
    assert net.grad_scaler_.get_scale() == INIT_SCALE
    net.load_params(**files)
    keys = ("params", "optimizer", "scaler", "history")
    assert differences({k: snapshot(net)[k] for k in keys}, {k: snapshot(fitted)[k] for k in keys}) == []
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX) or n == JOURNAL_NAME]


def test_file_objects_roundtrip(fitted):
    scaler, rng = io.BytesIO(), io.BytesIO()
    fitted.save_params(f_grad_scaler=scaler, f_rng_state=rng)
    expected = torch.rand(3)
    scaler.seek(0)
    rng.seek(0)
    net = tiny_net().initialize()
    net.load_params(f_grad_scaler=scaler, f_rng_state=rng)
    assert net.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict()
    assert torch.equal(torch.rand(3), expected)


def _bad_scaler_state(fitted, case, files):
    state = fitted.grad_scaler_.state_dict()
    if case == "disabled":
        return {}
    if case == "optimizer file":
        return torch.load(files["f_optimizer"], weights_only=True)
    if case == "partial":
        del state["growth_interval"]
        return state
    state["scale"] = {"nan": float("nan"), "zero": 0.0, "negative": -2.0, "inf": float("inf")}[case]
    return state


@pytest.mark.parametrize("case, problem", [
    ("disabled", "empty loss-scaler state: it was saved from a disabled scaler"),
    ("optimizer file", r"is not a loss-scaler state: keys \['scale', .*\] are missing"),
    ("partial", r"is not a loss-scaler state: keys \['growth_interval'\] are missing"),
    ("nan", "invalid loss scale nan"),
    ("zero", "invalid loss scale 0.0"),
    ("negative", "invalid loss scale -2.0"),
    ("inf", "invalid loss scale inf"),
])
def test_invalid_scaler_file_raises_and_changes_nothing(tmp_path, fitted, case, problem):
    files = paths(tmp_path, ("f_params", "f_optimizer", "f_history", "f_rng_state"))
    fitted.save_params(**files)
    bad = str(tmp_path / "bad_scaler.pt")
    torch.save(_bad_scaler_state(fitted, case, files), bad)
    net = tiny_net().initialize()
    before = snapshot(net)
    with pytest.raises(ValueError, match=problem) as info:
        net.load_params(**files, f_grad_scaler=bad)
    info.match(re.escape(f"f_grad_scaler file {bad!r}"))
    assert differences(snapshot(net), before) == []


@pytest.mark.parametrize("key, wrong, problem", [
    ("f_params", "f_optimizer", "does not match net.module_: missing keys"),
    ("f_optimizer", "f_params", "is not an optimizer state for net.optimizer_"),
    ("f_params", "wider module", r"shape mismatch hidden.weight: \(9, 4\) in the file, \(8, 4\)"),
    ("f_rng_state", "f_optimizer", "is not an ampnet RNG state: keys"),
    ("f_history", "f_params", "is not a JSON history"),
])
def test_wrong_file_raises_and_changes_nothing(tmp_path, fitted, key, wrong, problem):
    files = paths(tmp_path, ("f_params", "f_optimizer", "f_grad_scaler", "f_history"))
    fitted.save_params(**files)
    if wrong == "wider module":
        state = {k: v.clone() for k, v in fitted.module_.state_dict().items()}
        state["hidden.weight"] = torch.zeros(9, 4)
        bad = str(tmp_path / "wide.pt")
        torch.save(state, bad)
    else:
        bad = files[wrong]
    net = tiny_net().initialize()
    before = snapshot(net)
    with pytest.raises(ValueError, match=problem) as info:
        net.load_params(**{**files, key: bad})
    info.match(re.escape(f"{key} file {bad!r}"))
    assert differences(snapshot(net), before) == []


class _RunsCode:
    """A pickle that creates a file when it is unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("key", ["f_grad_scaler", "f_rng_state", "f_params", "f_history"])
def test_malicious_file_is_refused_without_running_code(tmp_path, key):
    marker = tmp_path / "code-ran"
    bad = str(tmp_path / "evil.pt")
    torch.save({"scale": _RunsCode(marker), "growth_factor": 2.0}, bad)
    net = tiny_net().initialize()
    before = snapshot(net)
    problem = "is not a JSON history" if key == "f_history" else "which a safe load refuses"
    with pytest.raises(ValueError, match=problem):
        net.load_params(**{key: bad})
    assert not marker.exists()
    assert differences(snapshot(net), before) == []


def test_file_settings_warn_and_net_settings_stay_in_force(tmp_path):
    src = tiny_net(grad_scaler__init_scale=1024.0, grad_scaler__growth_interval=7).initialize()
    src.save_params(f_grad_scaler=str(tmp_path / "s.pt"))
    net = tiny_net().initialize()
    with pytest.warns(AmpWarning, match="growth_interval=7 in the file, 3 in the net"):
        net.load_params(f_grad_scaler=str(tmp_path / "s.pt"))
    assert net.grad_scaler_.get_scale() == 1024.0  # the state comes from the file
    assert net.grad_scaler_.get_growth_interval() == 3 == net.get_params()["grad_scaler__growth_interval"]


def test_scale_outside_the_net_bounds_is_clamped_with_a_warning(tmp_path, fitted):
    fitted.save_params(f_grad_scaler=str(tmp_path / "s.pt"))
    net = tiny_net(grad_scaler__init_scale=8.0, grad_scaler__max_scale=8.0).initialize()
    with pytest.warns(AmpWarning, match=r"lies outside .* and was clamped to 8"):
        net.load_params(f_grad_scaler=str(tmp_path / "s.pt"))
    assert net.grad_scaler_.get_scale() == 8.0


@pytest.mark.parametrize("saved", ["fp16", "bf16", "off"])
@pytest.mark.parametrize("loaded", ["fp16", "bf16", "off"])
def test_precision_change_between_save_and_load(tmp_path, saved, loaded):
    """The 9 cells of the table in ampnet.io.persistence."""
    files = {"f_params": str(tmp_path / "p.pt"), "f_grad_scaler": str(tmp_path / "s.pt")}
    src = tiny_net(saved, grad_scaler__init_scale=512.0).initialize()
    src.save_params(**files)
    assert (torch.load(files["f_grad_scaler"], weights_only=True) == {}) == (saved != "fp16")
    net = tiny_net(loaded).initialize()
    before = snapshot(net)
    if saved == "fp16" and loaded == "fp16":
        net.load_params(**files)
        assert net.grad_scaler_.get_scale() == 512.0
    elif saved == "fp16":
        with pytest.warns(AmpWarning, match=r"s.pt' holds the state of an enabled loss scaler "
                          r"\(scale 512\), but this net trains in bfloat16|float32"):
            net.load_params(**files)
        assert not net.grad_scaler_.is_enabled()
    elif loaded == "fp16":
        with pytest.raises(ValueError, match="s.pt' holds an empty loss-scaler state"):
            net.load_params(**files)
        assert differences(snapshot(net), before) == []
        return
    else:
        net.load_params(**files)  # no scaler state on either side: silent
        assert not net.grad_scaler_.is_enabled()
    assert params_equal(net, src)


def test_safetensors_for_every_file_it_applies_to(tmp_path, fitted):
    safetensors = pytest.importorskip("safetensors.torch")
    files = paths(tmp_path, ("f_params", "f_criterion", "f_history", "f_grad_scaler", "f_rng_state"))
    fitted.save_params(**files, use_safetensors=True)
    scaler = safetensors.load_file(files["f_grad_scaler"])
    assert scaler["scale"].dtype == torch.float64
    assert scaler["scale"].item() == fitted.grad_scaler_.get_scale()
    assert safetensors.load_file(files["f_rng_state"])["torch"].dtype == torch.uint8
    expected = torch.rand(3)
    net = tiny_net().initialize()
    net.load_params(**files, use_safetensors=True)
    assert net.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict()
    assert params_equal(net, fitted)
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match="f_grad_scaler file .* cannot be read as a torch file"):
        net.load_params(f_grad_scaler=files["f_grad_scaler"])  # saved as safetensors

    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match=r"Cannot save f_optimizer file .* use_safetensors=True"):
        fitted.save_params(**paths(other, ("f_params", "f_optimizer")), use_safetensors=True)
    assert os.listdir(other) == []  # all or nothing
    with pytest.raises(ValueError, match="Cannot load f_optimizer with use_safetensors=True"):
        net.load_params(f_optimizer=files["f_params"], use_safetensors=True)

    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"), f_optimizer=None,
                    event_name=None, use_safetensors=True)
    cp.initialize()
    cp.save_model(fitted)
    fresh = tiny_net().initialize()
    fresh.load_params(checkpoint=cp, use_safetensors=True)
    assert fresh.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict()


# ---- crash safety ---------------------------------------------------------


def test_failed_save_changes_no_file(tmp_path, fitted):
    files = paths(tmp_path)
    fitted.save_params(**files)
    before = {name: Path(path).read_bytes() for name, path in files.items()}
    net = copy.deepcopy(fitted)
    with torch.no_grad():
        net.module_.hidden.weight.fill_(3.0)
    net.history.record("not_json", object())
    with pytest.raises(TypeError, match="not JSON serializable"):
        net.save_params(**files)
    assert {name: Path(path).read_bytes() for name, path in files.items()} == before
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in files.values())


def test_save_killed_between_renames_is_completed_on_load(tmp_path, fitted, monkeypatch):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    changed = copy.deepcopy(fitted)
    with torch.no_grad():
        changed.module_.hidden.weight.fill_(0.5)
    changed.optimizer_.param_groups[0]["lr"] = 0.125
    real_replace, calls = os.replace, []

    def killed_after_three(src, dst):
        calls.append(dst)
        if len(calls) > 3:  # the journal and two files are in place
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        cp.save_model(changed)
    monkeypatch.undo()
    assert calls[0].endswith(JOURNAL_NAME)
    assert (tmp_path / JOURNAL_NAME).exists()
    net = tiny_net().initialize()
    net.load_params(checkpoint=cp)  # completes the pending save first
    assert params_equal(net, changed)
    assert net.optimizer_.param_groups[0]["lr"] == 0.125
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX) or n == JOURNAL_NAME]


def test_foreign_journal_raises(tmp_path):
    (tmp_path / JOURNAL_NAME).write_text("not json")
    with pytest.raises(ValueError, match="is not an ampnet journal: it is not UTF-8 JSON"):
        recover([str(tmp_path)])


# ---- checkpoints ------------------------------------------------------------


def test_checkpoints_save_scaler_rng_and_schedulers_by_default():
    for cp in (Checkpoint(), TrainEndCheckpoint()):
        params = cp.get_params()
        assert params["f_grad_scaler"] == "grad_scaler.pt"
        assert params["f_rng_state"] == "rng_state.pt"
        assert params["f_lr_schedulers"] == "lr_schedulers.json"


class ScaleAtFirstEpoch(Callback):
    def initialize(self):
        self.scale_ = self.params_ = None
        return self

    def on_epoch_begin(self, net, **kwargs):
        if self.scale_ is None:
            self.scale_ = net.grad_scaler_.get_scale()
            self.params_ = copy.deepcopy(net.module_.state_dict())


def test_train_end_checkpoint_and_load_init_state_restore_the_scale(tmp_path, data, device_dtype):
    amp = device_dtype.net_kwargs
    torch.manual_seed(0)
    net = tiny_net("off", callbacks=[TrainEndCheckpoint(dirname=str(tmp_path))], **amp)
    quietly(net.fit, *data)
    saved = torch.load(tmp_path / "train_end_grad_scaler.pt", weights_only=True)
    assert saved == net.grad_scaler_.state_dict()
    if device_dtype.scaled:  # the scale moved (without loss scaling the state is empty)
        assert saved["scale"] == net.grad_scaler_.get_scale() != INIT_SCALE
    probe = ScaleAtFirstEpoch()
    torch.manual_seed(1)  # other initial weights: the checkpoint's replace them
    resumed = tiny_net("off", callbacks=[LoadInitState(TrainEndCheckpoint(dirname=str(tmp_path))), probe],
                       **amp)
    quietly(resumed.fit, *data)
    assert probe.scale_ == net.grad_scaler_.get_scale()
    assert differences(probe.params_, net.module_.state_dict()) == []
    assert len(resumed.history) == 2
    assert resumed.precision_policy_ == net.precision_policy_


def test_load_init_state_first_run_loads_nothing(tmp_path, data):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "new"))
    probe = ScaleAtFirstEpoch()
    net = tiny_net(callbacks=[LoadInitState(cp), cp, probe])
    quietly(net.fit, *data)
    assert probe.scale_ == INIT_SCALE
    assert len(net.history) == 1


def test_checkpoint_pickle_is_written_with_the_group(tmp_path, fitted):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), event_name=None, f_pickle="net.pkl")
    cp.initialize()
    cp.save_model(fitted)
    with open(tmp_path / "net.pkl", "rb") as f:
        net = pickle.load(f)
    assert net.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict()
    fresh = tiny_net().initialize()
    fresh.load_params(checkpoint=TrainEndCheckpoint(dirname=str(tmp_path), fn_prefix=""))
    assert params_equal(fresh, fitted)


def test_old_checkpoint_without_ampnet_files_loads_with_a_warning(tmp_path, fitted):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    for name in ("grad_scaler.pt", "rng_state.pt", "lr_schedulers.json"):
        os.remove(tmp_path / name)
    net = tiny_net().initialize()
    with pytest.warns(AmpWarning, match=r"grad_scaler.pt' does not exist, so the loss scale "
                      r"restarts .*rng_state.pt' does not exist"):
        net.load_params(checkpoint=cp)
    assert params_equal(net, fitted)
    assert net.grad_scaler_.get_scale() == INIT_SCALE


def test_skorch_checkpoint_loads_with_a_warning(tmp_path, fitted):
    cp = SkorchCheckpoint(monitor=None, dirname=str(tmp_path), event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    net = tiny_net().initialize()
    with pytest.warns(AmpWarning, match="it does not save f_grad_scaler .a skorch Checkpoint"):
        net.load_params(checkpoint=cp)
    assert params_equal(net, fitted)


def test_incomplete_checkpoint_raises_and_changes_nothing(tmp_path, fitted):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    os.remove(tmp_path / "optimizer.pt")
    net = tiny_net().initialize()
    before = snapshot(net)
    with pytest.raises(FileNotFoundError, match=r"incomplete: f_optimizer='.*optimizer.pt' not found"):
        net.load_params(checkpoint=cp)
    assert differences(snapshot(net), before) == []


class StateAtTrainEnd(Callback):
    def on_train_end(self, net, **kwargs):
        self.rng_ = torch.get_rng_state()
        self.params_ = copy.deepcopy(net.module_.state_dict())


def test_load_best_restores_the_best_state_but_not_the_rng(tmp_path, data):
    probe = StateAtTrainEnd()  # runs before the Checkpoint loads the best epoch
    cp = Checkpoint(monitor=lambda net: len(net.history) == 1, load_best=True, dirname=str(tmp_path))
    torch.manual_seed(0)
    net = tiny_net(max_epochs=2, train_split=ValidSplit(4), callbacks=[probe, cp])
    quietly(net.fit, *data)
    assert len(net.history) == 1  # epoch 1's history, parameters and scale
    assert differences(net.module_.state_dict(), probe.params_) != []
    assert net.grad_scaler_.state_dict() == torch.load(tmp_path / "grad_scaler.pt", weights_only=True)
    assert torch.equal(torch.get_rng_state(), probe.rng_)  # not rewound to epoch 1


def test_checkpoint_needs_an_ampnet_net(tmp_path, data):
    net = NeuralNetClassifier(Tiny, max_epochs=1, verbose=0,
                              callbacks=[Checkpoint(dirname=str(tmp_path))])
    with pytest.raises(TypeError, match="needs an ampnet net .* got NeuralNetClassifier"):
        net.fit(*data)


def test_checkpoint_before_an_lr_scheduler_warns(tmp_path, data):
    net = tiny_net("off", callbacks=[
        Checkpoint(monitor=None, dirname=str(tmp_path)),
        LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1),
    ])
    with pytest.warns(AmpWarning, match="LRScheduler \\['LRScheduler'\\] comes after this Checkpoint"):
        net.fit(*data)


def test_scheduler_state_of_another_policy_is_not_loaded(tmp_path, data):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path))

    def net_with(policy, **kwargs):
        return tiny_net("off", callbacks=[LoadInitState(cp), LRScheduler(policy, **kwargs), cp])

    net_with(torch.optim.lr_scheduler.StepLR, step_size=1).fit(*data)
    resumed = net_with(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=5)
    with pytest.warns(AmpWarning, match="is a CosineAnnealingLR, the file holds a StepLR"):
        resumed.fit(*data)
    idle = tiny_net("off", callbacks=[LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1)])
    idle.initialize()
    with pytest.warns(AmpWarning, match="'LRScheduler' is not running"):
        idle.load_params(f_lr_schedulers=str(tmp_path / "lr_schedulers.json"))


# ---- warm start, partial_fit ----------------------------------------------


def test_warm_start_and_partial_fit_continue_with_the_current_scale(data):
    def trained(epochs_per_call, calls, warm_start=False, fresh_scaler=False):
        torch.manual_seed(0)
        net = tiny_net(max_epochs=epochs_per_call, warm_start=warm_start)
        quietly(net.fit, *data)
        for _ in range(calls - 1):
            if fresh_scaler:
                net.initialize_grad_scaler()
            quietly(net.partial_fit if not warm_start else net.fit, *data)
        return net

    whole = trained(2, 1)
    first = trained(1, 1)
    assert first.grad_scaler_.get_scale() != INIT_SCALE
    for net in (trained(1, 2), trained(1, 2, warm_start=True)):
        assert net.grad_scaler_.state_dict() == whole.grad_scaler_.state_dict()
        assert params_equal(net, whole)
    assert not params_equal(trained(1, 2, fresh_scaler=True), whole)  # the scale matters


# ---- pickle, joblib, deepcopy ---------------------------------------------


def _copies(net, tmp_path):
    joblib.dump(net, tmp_path / "net.joblib")
    return {
        "pickle": pickle.loads(pickle.dumps(net)),
        "joblib": joblib.load(tmp_path / "net.joblib"),
        "deepcopy": copy.deepcopy(net),
    }


def test_pickle_joblib_deepcopy_keep_the_scaler(tmp_path, fitted, data):
    X, y = data
    expected = fitted.predict_proba(X)
    trained = {}
    for name, net in _copies(fitted, tmp_path).items():
        assert net.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict(), name
        proba = net.predict_proba(X)
        assert proba.dtype == np.float32 and np.array_equal(proba, expected), name
        torch.manual_seed(1)
        quietly(net.partial_fit, X, y)
        trained[name] = net
    first = trained.pop("pickle")
    for name, net in trained.items():  # training continues identically
        assert params_equal(net, first), name
        assert net.grad_scaler_.state_dict() == first.grad_scaler_.state_dict(), name


class CopyMidStep(Callback):
    """Pickle and deep-copy the net between unscale_ and the optimizer step."""

    def initialize(self):
        self.copies_ = None
        return self

    def on_grad_computed(self, net, named_parameters, batch=None, training=False, **kwargs):
        if self.copies_ is None and len(net.history[-1, "batches"]) == 2:
            assert net.grad_scaler_.step_pending  # really mid-step
            self.copies_ = (net.grad_scaler_.get_scale(), pickle.dumps(net), copy.deepcopy(net))


def test_pickle_and_deepcopy_from_inside_a_callback_mid_step(data):
    grab = CopyMidStep()
    torch.manual_seed(0)
    net = tiny_net(callbacks=[grab])
    quietly(net.fit, *data)
    scale, pickled, deep = grab.copies_
    for copy_ in (pickle.loads(pickled), deep):
        assert copy_.grad_scaler_.get_scale() == scale
        assert not copy_.grad_scaler_.step_pending
        assert copy_.predict_proba(data[0]).dtype == np.float32
        quietly(copy_.partial_fit, *data)
        assert all(bool(torch.isfinite(p).all()) for p in copy_.module_.parameters())


def test_net_pickled_on_cuda_loads_and_predicts_on_cpu(fitted, data, monkeypatch):
    """Simulated as skorch's tests do: the net claims CUDA when pickled, and
    torch.cuda.is_available() is False when it is loaded."""
    on_cuda = copy.deepcopy(fitted)
    on_cuda.device = "cuda"
    prec = on_cuda.precision_
    prec.settings = dataclasses.replace(prec.settings, policy=dataclasses.replace(prec.policy, device_type="cuda"))
    on_cuda.grad_scaler_._ampnet_device = "cuda"  # as if made on a GPU (its tensors travel as values)
    data_bytes = pickle.dumps(on_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(DeviceWarning, match="(?i)cuda"):
        net = pickle.loads(data_bytes)
    assert torch.device(net.device).type == "cpu"
    assert net.precision_policy_.device_type == "cpu"
    assert net.grad_scaler_.device == "cpu"
    assert net.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict()
    proba = net.predict_proba(data[0])
    assert proba.dtype == np.float32 and np.array_equal(proba, fitted.predict_proba(data[0]))
    quietly(net.partial_fit, *data)
    assert net.grad_scaler_.scale_tensor().device.type == "cpu"


# ---- RNG --------------------------------------------------------------------


def test_rng_state_roundtrip(tmp_path, fitted):
    path = str(tmp_path / "rng.pt")
    fitted.save_params(f_rng_state=path)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    tiny_net().initialize().load_params(f_rng_state=path)
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0])
    assert np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]


def test_cuda_rng_states_without_cuda_warn(tmp_path, monkeypatch):
    state = get_rng_state()
    state["cuda.0"] = torch.zeros(16, dtype=torch.uint8)
    torch.save(state, tmp_path / "rng.pt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(AmpWarning, match="CUDA RNG states for 1 device.*only 0 CUDA"):
        tiny_net().initialize().load_params(f_rng_state=str(tmp_path / "rng.pt"))


def test_history_json_is_plain(tmp_path, fitted):
    fitted.save_params(f_history=str(tmp_path / "h.json"))
    rows = json.loads((tmp_path / "h.json").read_text())
    assert [row["epoch"] for row in rows] == [1, 2]
    assert all("loss_scale" in row for row in rows)
