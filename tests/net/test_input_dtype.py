"""float64 inputs train the same way with AMP on or off: cast to float32 for
a float32 module, kept for a float64 module with AMP off; float32 inputs
stay bitwise skorch's."""

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from ampnet import AmpNetClassifier


class MLP(torch.nn.Module):
    def __init__(self, n_in=30, dtype=torch.float32):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, 16, dtype=dtype)
        self.out = torch.nn.Linear(16, 2, dtype=dtype)
        self.seen = []  # input dtypes of forward calls

    def forward(self, X):
        self.seen.append(X.dtype)
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


@pytest.fixture(scope="module")
def cancer():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:128]
    return X, y[:128].astype(np.int64)


def fit(cls, X, y, **kwargs):
    torch.manual_seed(0)
    net = cls(MLP, max_epochs=2, batch_size=32, lr=0.05, train_split=None, verbose=0, **kwargs)
    return net.fit(X, y)


def same_weights(a, b):
    return all(
        p.dtype == q.dtype and torch.equal(p, q)
        for p, q in zip(a.module_.parameters(), b.module_.parameters())
    )


def losses(net):
    return [b["train_loss"] for row in net.history for b in row["batches"]]


def test_skorch_fails_on_float64_that_ampnet_casts(cancer):
    X, y = cancer
    assert X.dtype == np.float64
    with pytest.raises(RuntimeError, match="dtype"):
        fit(NeuralNetClassifier, X, y)  # skorch: "mat1 and mat2 must have the same dtype"


@pytest.mark.parametrize("amp", [False, True])
def test_float64_input_trains_as_float32_input(cancer, amp):
    X, y = cancer
    kwargs = {"amp_enabled": True, "amp_dtype": "bfloat16"} if amp else {}
    net64 = fit(AmpNetClassifier, X, y, **kwargs)
    net32 = fit(AmpNetClassifier, X.astype(np.float32), y, **kwargs)
    assert set(net64.module_.seen) == {torch.float32}
    assert losses(net64) == losses(net32) and same_weights(net64, net32)
    proba = net64.predict_proba(X)
    assert proba.dtype == np.float32
    np.testing.assert_array_equal(proba, net32.predict_proba(X.astype(np.float32)))


def test_amp_off_float32_input_is_bitwise_skorch(cancer):
    X, y = cancer
    ours = fit(AmpNetClassifier, X.astype(np.float32), y)
    theirs = fit(NeuralNetClassifier, X.astype(np.float32), y)
    assert losses(ours) == losses(theirs) and same_weights(ours, theirs)
    # float64 data into ampnet trains exactly like float32 data into skorch
    assert same_weights(fit(AmpNetClassifier, X, y), theirs)


def test_float64_module_keeps_float64_with_amp_off(cancer):
    X, y = cancer
    ours = fit(AmpNetClassifier, X, y, module__dtype=torch.float64)
    theirs = fit(NeuralNetClassifier, X, y, module__dtype=torch.float64)
    assert set(ours.module_.seen) == {torch.float64}
    assert {p.dtype for p in ours.module_.parameters()} == {torch.float64}
    assert losses(ours) == losses(theirs) and same_weights(ours, theirs)


GRIDS = [
    {"ampnetclassifier__amp_enabled": [False, True]},
    # the README's grid with AMP settings in the AMP branch only: no "no effect" warning
    [{"ampnetclassifier__amp_enabled": [False]},
     {"ampnetclassifier__amp_enabled": [True], "ampnetclassifier__amp_dtype": ["bfloat16"]}],
]


@pytest.mark.parametrize("grid", GRIDS, ids=["dict", "list"])
def test_grid_over_amp_enabled_in_a_scaler_pipeline(grid):
    X, y = load_breast_cancer(return_X_y=True)
    X, y = X[:150], y[:150].astype(np.int64)  # raw float64, scaled inside the pipeline
    net = AmpNetClassifier(MLP, max_epochs=2, batch_size=32, lr=0.05, train_split=None, verbose=0)
    search = GridSearchCV(make_pipeline(StandardScaler(), net), grid, cv=2, error_score="raise")
    search.fit(X, y)  # an AmpWarning would be an error in this suite
    scores = search.cv_results_["mean_test_score"]
    assert len(scores) == 2 and all(0.5 < s <= 1.0 for s in scores)
    best = search.best_estimator_[-1]
    assert best.precision_policy_.enabled is search.best_params_["ampnetclassifier__amp_enabled"]


@pytest.mark.parametrize("features", [np.float32, np.float64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float64_module_under_amp_names_the_parameters_not_the_features(cancer, features, dtype):
    X, y = cancer
    with pytest.raises(TypeError) as info:
        fit(AmpNetClassifier, X.astype(features), y, module__dtype=torch.float64, amp_enabled=True,
            amp_dtype=dtype)
    text = str(info.value)
    assert text.startswith(f"The module failed under {dtype} (mixed) autocast: its parameters are "
                           "float64 (hidden.weight, hidden.bias, out.weight, out.bias).")
    assert "Fix: build the module in float32" in text and "amp_enabled=False" in text
    assert "pass float32 features" not in text  # they were float32 (or cast to it)


def test_integer_features_under_amp_name_the_input_dtype(cancer):
    X, y = cancer
    with pytest.raises(TypeError, match=r"autocast with an input of dtype torch.int64: .*Fix: pass float32 "
                                        r"features \(e.g. X.astype\(numpy.float32\)\)"):
        fit(AmpNetClassifier, X.astype(np.int64), y, amp_enabled=True, amp_dtype="bfloat16")
