"""Every AMP setting with every other part of a user's work: the seams.

One table of AMP settings (:data:`SETTINGS`) is crossed with skorch's two
common splits (its default ``ValidSplit`` and ``train_split=None``), three
tasks (classifier, binary classifier, regressor) and the paths a user takes
(:data:`PATHS`: fit, partial_fit, warm_start, predict, pickle,
save/load_params, Checkpoint + LoadInitState, clone + fit, GridSearchCV,
export). The full product is too large, so :func:`covering_cases` draws a
covering design from it: every setting meets every path once, and every
setting, path, split and task meets every split and task (checked by
``test_the_design_covers_every_pair``). Data are tiny and runs are one or
two epochs.

Every case must pass: there is no list of known bugs to hide one behind (a
bug found here is fixed, or the setting leaves the table with a note saying
why).
"""

from __future__ import annotations

import itertools
import pickle
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV

from ampnet import AmpNetBinaryClassifier, AmpNetClassifier, AmpNetRegressor, AmpWarning
from ampnet.callbacks import Checkpoint, LoadInitState

# ---- the table of AMP settings -----------------------------------------------------------

BF16 = dict(amp_enabled=True, amp_dtype="bfloat16")
FP16 = dict(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0)

class FixedTimer:
    """``amp_autotune__timer`` with fixed timings, so that ``amp_enabled="auto"`` chooses bf16 mixed
    on every machine (with ``conftest.native_bf16`` for CPUs without native bfloat16)."""

    def __call__(self, params, seconds):
        return 0.5 if params["amp_enabled"] else 1.0

    def __eq__(self, other):  # a clone's copy is the same timer
        return isinstance(other, FixedTimer)

    __hash__ = object.__hash__


#: name -> (net keyword arguments, module kind: "mlp" or "conv")
SETTINGS = {
    "off": ({}, "mlp"),
    # batch 4: 8 steps or more a fit, enough for 'auto' to time its three pairs at least
    "auto-enabled": (dict(amp_enabled="auto", amp_autotune__warmup=0, amp_autotune__cache=False,
                          amp_autotune__min_steps=0, amp_autotune__timer=FixedTimer(), batch_size=4), "mlp"),
    "bf16-mixed": (BF16, "mlp"),
    "fp16-mixed": (FP16, "mlp"),
    "bf16-pure-masters": (dict(BF16, amp_level="pure"), "mlp"),
    "fp16-pure-masters": (dict(FP16, amp_level="pure"), "mlp"),
    "bf16-pure-no-masters": (dict(BF16, amp_level="pure", amp_master_weights=False), "mlp"),
    "bf16-pure-compensated": (dict(BF16, amp_level="pure", amp_master_weights="compensated"), "mlp"),
    "bf16-fp32-list": (dict(BF16, amp_fp32_modules=["out"]), "mlp"),
    "bf16-pure-fp32-list": (dict(BF16, amp_level="pure", amp_fp32_modules=[torch.nn.Linear]), "conv"),
    "bf16-regions": (dict(BF16, amp_modules=["hidden"]), "mlp"),
    "fp16-auto-fp32": (dict(FP16, amp_fp32_modules="auto"), "mlp"),
    "bf16-accumulation": (dict(BF16, gradient_accumulation_steps=2), "mlp"),
    "fp16-accumulation": (dict(FP16, gradient_accumulation_steps=2), "mlp"),
    "bf16-fused-adamw": (dict(BF16, optimizer=torch.optim.AdamW, optimizer__fused=True, lr=0.01), "mlp"),
    "fp16-fused-adam": (dict(FP16, optimizer=torch.optim.Adam, optimizer__fused=True, lr=0.01), "mlp"),
    "bf16-compensated-fused": (
        dict(BF16, amp_level="pure", amp_master_weights="compensated", optimizer=torch.optim.AdamW,
             optimizer__fused=True, lr=0.01), "mlp"),
    "bf16-channels-last": (dict(BF16, memory_format="channels_last"), "conv"),
    "bf16-pure-channels-last": (dict(BF16, amp_level="pure", memory_format="channels_last"), "conv"),
}

SPLITS = ("valid-split", "no-split")
TASKS = ("classifier", "binary", "regressor")
PATHS = ("fit", "partial_fit", "warm_start", "predict", "pickle", "save_load", "checkpoint_resume",
         "clone_fit", "grid_search", "export")



def covering_cases(settings=tuple(SETTINGS), paths=PATHS, splits=SPLITS, tasks=TASKS):
    """A covering design of settings x paths x splits x tasks.

    Every (setting, path) pair once; the split and task of the pair at
    (i, j) rotate with ``i + j`` and ``i + 2 j``, so that each setting and
    each path meets both splits and all three tasks, and each split meets
    each task (given at least 3 paths and 3 settings; checked by a test).
    Deterministic: the same list on every run.
    """
    return [
        (setting, path, splits[(i + j) % len(splits)], tasks[(i + 2 * j) % len(tasks)])
        for i, setting in enumerate(settings)
        for j, path in enumerate(paths)
    ]


CASES = covering_cases()


def _param(setting, path, split, task):
    return pytest.param(setting, path, split, task, id=f"{setting}-{path}-{split}-{task}")


# ---- tiny modules and data ---------------------------------------------------------------


class Body(torch.nn.Module):
    """``hidden`` (Linear or Conv2d) then ``out``; ``softmax`` for skorch's default NLLLoss
    classifier, ``squeeze`` for the binary classifier's one logit."""

    def __init__(self, kind="mlp", n_out=3, softmax=False, squeeze=False):
        super().__init__()
        self.kind, self.softmax, self.squeeze = kind, softmax, squeeze
        if kind == "conv":
            self.hidden = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.out = torch.nn.Linear(4 * 4 * 4, n_out)
        else:
            self.hidden = torch.nn.Linear(8, 12)
            self.out = torch.nn.Linear(12, n_out)

    def forward(self, X):
        h = torch.relu(self.hidden(X))
        out = self.out(h.flatten(1))
        if self.softmax:
            return torch.softmax(out, dim=-1)
        return out.squeeze(-1) if self.squeeze else out


N_ROWS = 40


def make_data(task, kind):
    rng = np.random.RandomState(0)
    X = rng.randn(N_ROWS, 16 if kind == "conv" else 8).astype(np.float32)
    score = X[:, 0] + 0.5 * X[:, 1]
    if task == "classifier":
        y = np.digitize(score, np.quantile(score, [1 / 3, 2 / 3])).astype(np.int64)
    elif task == "binary":
        y = (score > np.median(score)).astype(np.float32)
    else:
        y = score[:, None].astype(np.float32)
    if kind == "conv":
        X = X.reshape(N_ROWS, 1, 4, 4)
    return X, y


NET_CLASSES = {"classifier": AmpNetClassifier, "binary": AmpNetBinaryClassifier, "regressor": AmpNetRegressor}


def make_net(setting, split, task, **overrides):
    kwargs, kind = SETTINGS[setting]
    module = dict(
        classifier=dict(module__n_out=3, module__softmax=True),
        binary=dict(module__n_out=1, module__squeeze=True),
        regressor=dict(module__n_out=1),
    )[task]
    params = dict(module=Body, module__kind=kind, **module, max_epochs=1, lr=0.05, batch_size=8,
                  verbose=0, iterator_train__shuffle=False)
    if split == "no-split":
        params["train_split"] = None
    params.update(kwargs)
    params.update(overrides)
    return NET_CLASSES[task](**params)


def quietly(fn, *args, **kwargs):
    """Run ``fn`` without the slow-on-CPU notices (float16 everywhere, bfloat16 without
    native support); every other AmpWarning is still an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
        warnings.filterwarnings("ignore", "this CPU has no native bfloat16", AmpWarning)
        return fn(*args, **kwargs)


def fitted(setting, split, task, X, y, seed=0, **overrides):
    torch.manual_seed(seed)
    net = make_net(setting, split, task, **overrides)
    return quietly(net.fit, X, y)


# ---- what every trained net shows --------------------------------------------------------


def low_dtype(setting):
    kwargs = SETTINGS[setting][0]
    if not kwargs.get("amp_enabled"):
        return None
    if kwargs["amp_enabled"] == "auto":
        return torch.bfloat16  # FixedTimer's choice
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[kwargs["amp_dtype"]]


def check_trained(net, setting, split, task, X, epochs):
    """History, precision and parameter dtypes, outputs: what a user sees."""
    kwargs = SETTINGS[setting][0]
    dtype = low_dtype(setting)
    history = net.history
    assert len(history) == epochs
    assert all(np.isfinite(history[:, "train_loss"]))
    assert ("valid_loss" in history[-1]) == (split == "valid-split")
    if split == "valid-split":
        assert all(np.isfinite(history[:, "valid_loss"]))
    if dtype is None:
        assert net.precision_policy_.name == "float32"
        assert all(p.dtype == torch.float32 for p in net.module_.parameters())
    else:
        level = kwargs.get("amp_level", "mixed")
        if kwargs.get("amp_enabled") == "auto":
            assert net.amp_autotune_.params["amp_level"] == "mixed"  # what FixedTimer makes fastest
        assert net.precision_policy_.compute_dtype == dtype
        assert net.precision_policy_.name.startswith(f"{str(dtype)[6:]} ({level}")
        assert {"loss_scale", "skipped_steps"} <= set(history[-1])
        assert net.grad_scaler_.is_enabled() == (dtype == torch.float16)
        stored = {name: p.dtype for name, p in net.module_.named_parameters()}
        if level == "pure":
            low = set(net.amp_layout_.low_precision_params)
            assert low and all(stored[name] == dtype for name in low)
            assert all(stored[name] == torch.float32 for name in stored.keys() - low)
            fp32 = kwargs.get("amp_fp32_modules")
            if fp32 is not None and fp32 != "auto":
                assert not low & {"out.weight", "out.bias"}  # the float32 region stays float32
        else:
            assert all(d == torch.float32 for d in stored.values())
        if kwargs.get("memory_format") == "channels_last":
            assert net.module_.hidden.weight.is_contiguous(memory_format=torch.channels_last)
    check_outputs(net, task, X)


def check_outputs(net, task, X):
    # the classifier's module computes its softmax under autocast: rows sum to 1 within bf16's ulp
    atol = 1e-6 if not net.amp_enabled else 1e-2
    proba = quietly(net.predict_proba, X)
    pred = quietly(net.predict, X)
    assert proba.dtype == np.float32 and np.isfinite(proba).all()
    if task == "classifier":
        assert proba.shape == (len(X), 3)
        np.testing.assert_allclose(proba.sum(1), 1.0, atol=atol)
        assert pred.shape == (len(X),) and set(pred) <= {0, 1, 2}
        np.testing.assert_array_equal(pred, proba.argmax(1))
    elif task == "binary":
        assert proba.shape == (len(X), 2)
        np.testing.assert_allclose(proba.sum(1), 1.0, atol=1e-6)
        assert set(np.unique(pred)) <= {0, 1}
    else:
        assert proba.shape == (len(X), 1)
        assert pred.dtype == np.float32 and pred.shape == (len(X), 1)
    return proba


def module_state(net):
    return {k: v.detach().clone() for k, v in net.module_.state_dict().items()}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


# ---- the paths ---------------------------------------------------------------------------


def path_fit(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y, max_epochs=2)
    check_trained(net, setting, split, task, X, epochs=2)
    # a second fit starts again: same seed, same result
    torch.manual_seed(0)
    again = quietly(net.fit, X, y)
    assert len(again.history) == 2


def path_partial_fit(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y)
    before = module_state(net)
    scale = net.grad_scaler_.get_scale()
    quietly(net.partial_fit, X, y)
    check_trained(net, setting, split, task, X, epochs=2)
    assert any(not torch.equal(before[k], v) for k, v in module_state(net).items())
    # the scaler goes on from where the first fit left it
    first = net.history[1, "batches"][0]
    if net.grad_scaler_.is_enabled() and not first["step_skipped"]:
        assert first["loss_scale"] >= scale


def path_warm_start(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y, warm_start=True)
    layout = net.amp_layout_
    state = module_state(net)
    quietly(net.fit, X, y)
    check_trained(net, setting, split, task, X, epochs=2)
    assert net.amp_layout_ == layout
    assert any(not torch.equal(state[k], v) for k, v in module_state(net).items())


def path_predict(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y)
    check_trained(net, setting, split, task, X, epochs=1)
    proba = quietly(net.predict_proba, X)
    np.testing.assert_array_equal(quietly(net.predict_proba, X), proba)  # deterministic
    # a float64 input predicts as float32 features would
    np.testing.assert_allclose(quietly(net.predict_proba, X.astype(np.float64)), proba, atol=1e-6)


def assert_train_on_alike(net, copy, X, y):
    """One more seeded epoch of ``net`` and of its ``copy`` ends in the same state."""
    torch.manual_seed(1)
    quietly(net.partial_fit, X, y)
    torch.manual_seed(1)
    quietly(copy.partial_fit, X, y)
    assert_same_state(module_state(copy), module_state(net))


def path_pickle(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y)
    loaded = pickle.loads(pickle.dumps(net))
    assert_same_state(module_state(loaded), module_state(net))
    assert loaded.precision_policy_ == net.precision_policy_
    assert loaded.amp_layout_ == net.amp_layout_
    assert loaded.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()
    np.testing.assert_array_equal(quietly(loaded.predict_proba, X), quietly(net.predict_proba, X))
    assert_train_on_alike(net, loaded, X, y)  # both go on training the same way
    check_trained(loaded, setting, split, task, X, epochs=2)


def path_save_load(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y)
    files = {f"f_{name}": str(tmp_path / f"{name}.pt") for name in ("params", "optimizer", "grad_scaler")}
    files["f_history"] = str(tmp_path / "history.json")
    net.save_params(**files)
    torch.manual_seed(5)  # other initial weights
    other = quietly(make_net(setting, split, task).initialize)
    quietly(other.load_params, **files)
    assert_same_state(module_state(other), module_state(net))
    assert other.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()
    assert other.history.to_list() == net.history.to_list()
    np.testing.assert_array_equal(quietly(other.predict_proba, X), quietly(net.predict_proba, X))
    assert_train_on_alike(net, other, X, y)  # the optimizer state was loaded too


def path_checkpoint_resume(setting, split, task, X, y, tmp_path):
    def run(epochs, callbacks):
        return fitted(setting, split, task, X, y, max_epochs=epochs, callbacks=callbacks,
                      iterator_train__shuffle=True)

    uninterrupted = run(2, [])
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    run(1, [cp])
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    resumed = run(2, [LoadInitState(cp, resume="total"), cp])
    check_trained(resumed, setting, split, task, X, epochs=2)
    # bit-exact: weights, the loss scale and the losses of an uninterrupted run
    assert_same_state(module_state(resumed), module_state(uninterrupted))
    assert resumed.grad_scaler_.state_dict() == uninterrupted.grad_scaler_.state_dict()
    assert resumed.history[:, "train_loss"] == uninterrupted.history[:, "train_loss"]


def path_clone_fit(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y)
    twin = clone(net)
    assert not twin.initialized_
    assert twin.get_params().keys() == net.get_params().keys()
    for key in SETTINGS[setting][0]:
        assert twin.get_params()[key] == net.get_params()[key], key
    torch.manual_seed(0)
    quietly(twin.fit, X, y)
    check_trained(twin, setting, split, task, X, epochs=1)
    assert_same_state(module_state(twin), module_state(net))  # same seed, same training


def path_grid_search(setting, split, task, X, y, tmp_path):
    torch.manual_seed(0)
    search = GridSearchCV(make_net(setting, split, task), {"lr": [0.01, 0.05]}, cv=2,
                          error_score="raise", refit=True)
    quietly(search.fit, X, y)
    assert len(search.cv_results_["params"]) == 2
    assert np.isfinite(search.cv_results_["mean_test_score"]).all()
    best = search.best_estimator_
    assert best.lr == search.best_params_["lr"]
    check_trained(best, setting, split, task, X, epochs=1)


def _export(net, setting, X, path, trimmed=False):
    """Export; a pure net without float32 masters (none kept, or dropped by the trim) says that
    the file holds its low-precision values."""
    kwargs = SETTINGS[setting][0]
    pure = kwargs.get("amp_enabled") and kwargs.get("amp_level") == "pure"
    if pure and (trimmed or kwargs.get("amp_master_weights") is False):
        with pytest.warns(AmpWarning, match="without float32 master copies"):
            written = quietly(net.export, path, X[:2], format="torch.export")
    else:
        written = quietly(net.export, path, X[:2], format="torch.export")
    with torch.no_grad():
        return torch.export.load(str(written)).module()(torch.from_numpy(X)).numpy()


def path_export(setting, split, task, X, y, tmp_path):
    net = fitted(setting, split, task, X, y)
    proba = quietly(net.predict_proba, X)
    out = _export(net, setting, X, tmp_path / "model.pt2")
    assert out.dtype == np.float32 and out.shape == proba.shape
    # the file computes in float32 what predict_proba computes under AMP
    atol = 1e-5 if low_dtype(setting) is None else 0.05
    np.testing.assert_allclose(out, proba, atol=atol)
    # a net trimmed for prediction exports the same model (the README's promise)
    net.trim_for_prediction()
    trimmed = _export(net, setting, X, tmp_path / "trimmed.pt2", trimmed=True)
    np.testing.assert_allclose(trimmed, proba, atol=atol)


# ---- the suite -----------------------------------------------------------------------------


@pytest.mark.parametrize("setting, path, split, task", [_param(*case) for case in CASES])
def test_combination(setting, path, split, task, tmp_path, native_bf16):
    X, y = make_data(task, SETTINGS[setting][1])
    globals()[f"path_{path}"](setting, split, task, X, y, tmp_path)


def test_the_design_covers_every_pair():
    factors = {"setting": tuple(SETTINGS), "path": PATHS, "split": SPLITS, "task": TASKS}
    names = list(factors)
    rows = [dict(zip(names, case)) for case in CASES]
    assert len(rows) == len(set(CASES)) == len(SETTINGS) * len(PATHS)
    for a, b in itertools.combinations(names, 2):
        if {a, b} == {"split", "task"} or "setting" in (a, b) or "path" in (a, b):
            seen = {(row[a], row[b]) for row in rows}
            assert seen == set(itertools.product(factors[a], factors[b])), (a, b)
    for path in PATHS:
        assert callable(globals()[f"path_{path}"])
