"""scikit-learn contracts: clone, params, pickle/joblib, Pipeline, grid search."""

import io
import pickle

import joblib
import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from ampnet import AmpNetClassifier
from conftest import MLP


def make_net(**kw):
    base = dict(module=MLP, amp_enabled=True, amp_dtype="bfloat16", max_epochs=2, lr=0.1,
                verbose=0, train_split=None)
    base.update(kw)
    return AmpNetClassifier(**base)


def test_clone_keeps_amp_params_and_drops_fitted_state(classifier_data):
    X, y = classifier_data
    net = make_net(grad_scaler__growth_interval=7, gradient_accumulation_steps=2).fit(X, y)
    twin = clone(net)
    params = twin.get_params()
    assert params["amp_enabled"] is True and params["amp_dtype"] == "bfloat16"
    assert params["grad_scaler__growth_interval"] == 7 and params["gradient_accumulation_steps"] == 2
    assert not twin.initialized_
    assert not hasattr(twin, "grad_scaler_") and not hasattr(twin, "precision_policy_")


def test_get_set_params_round_trip():
    net = make_net()
    params = net.get_params()
    for key in ("amp_enabled", "amp_dtype", "amp_level", "grad_scaler", "gradient_accumulation_steps",
                "amp_max_consecutive_skips", "amp_skip_nonfinite"):
        assert key in params
    net.set_params(amp_dtype="float16", grad_scaler__init_scale=8.0)
    assert net.get_params()["amp_dtype"] == "float16"
    assert net.get_params()["grad_scaler__init_scale"] == 8.0


@pytest.mark.parametrize("dump", ["pickle", "joblib"])
def test_fitted_fp16_net_round_trips_with_scaler_state(classifier_data, dump):
    X, y = classifier_data
    net = make_net(amp_dtype="fp16", grad_scaler__init_scale=2.0**10, grad_scaler__growth_interval=2,
                   max_epochs=1, batch_size=32)
    with pytest.warns(Warning, match="slower than float32"):
        net.fit(X[:64], y[:64])
    if dump == "pickle":
        loaded = pickle.loads(pickle.dumps(net))
    else:
        buf = io.BytesIO()
        joblib.dump(net, buf)
        buf.seek(0)
        loaded = joblib.load(buf)
    assert loaded.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()
    assert loaded.grad_scaler_.get_scale() == net.grad_scaler_.get_scale() == 2.0**10 * 2
    np.testing.assert_array_equal(loaded.predict_proba(X), net.predict_proba(X))
    assert loaded.precision_policy_ == net.precision_policy_


def test_pipeline_with_standard_scaler_float64(classifier_data):
    X, y = classifier_data
    pipe = Pipeline([("scale", StandardScaler()), ("net", make_net())])
    pipe.fit(X.astype(np.float64), y)
    proba = pipe.predict_proba(X.astype(np.float64))
    assert proba.dtype == np.float32 and proba.shape == (len(X), 2)


def test_cross_val_score(classifier_data):
    from skorch import NeuralNetClassifier

    X, y = classifier_data
    torch.manual_seed(0)
    ours = cross_val_score(make_net(max_epochs=3, amp_enabled=False, amp_dtype="auto"), X, y, cv=2)
    torch.manual_seed(0)
    theirs = cross_val_score(
        NeuralNetClassifier(MLP, max_epochs=3, lr=0.1, verbose=0, train_split=None), X, y, cv=2
    )
    np.testing.assert_array_equal(ours, theirs)  # AMP off: skorch's scores, bitwise
    amp = cross_val_score(make_net(max_epochs=20, batch_size=16), X, y, cv=2)
    assert amp.shape == (2,) and amp.min() >= 0.8  # the task is learnable in bf16


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:float16 autocast on CPU:ampnet.exceptions.AmpWarning")
def test_grid_search_over_amp_params_in_parallel(classifier_data):
    X, y = classifier_data
    pipe = Pipeline([("scale", StandardScaler()), ("net", make_net(max_epochs=1, batch_size=64))])
    grid = GridSearchCV(
        pipe,
        {"net__amp_dtype": ["float16", "bfloat16"], "net__lr": [0.05, 0.1]},
        cv=2,
        n_jobs=2,
        error_score="raise",
    )
    grid.fit(X[:64], y[:64])
    assert len(grid.cv_results_["params"]) == 4
    best = grid.best_estimator_.named_steps["net"]
    dtype = best.precision_policy_.compute_dtype
    assert dtype == {"float16": torch.float16, "bfloat16": torch.bfloat16}[best.amp_dtype]
    assert best.grad_scaler_.is_enabled() == (dtype == torch.float16)
