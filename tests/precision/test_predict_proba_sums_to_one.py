"""``predict_proba`` of a classifier whose softmax ran in bfloat16 or float16
returns rows that sum to 1 within float32's precision, scikit-learn's
convention (rows summed to 0.997-1.003 without it, and skorch's own
``test_fit_predict_proba`` failed on it); everything else is left as it was. With AMP on,
``predict_proba`` is float32 whatever dtype the module returns."""

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier

from ampnet import AmpNet, AmpNetClassifier
from ampnet.training.output_checks import probabilities_summing_to_one
from checkpoint_helpers import data, quietly, tiny_net  # noqa: F401  (fixtures)


def _data(n=128, classes=5):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 20).astype(np.float32)
    return X, rng.randint(0, classes, n).astype(np.int64)


def _softmax_module(classes=5):
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes),
                               torch.nn.Softmax(dim=-1))


def _kw(**kwargs):
    params = dict(max_epochs=1, lr=0.1, batch_size=32, train_split=None, verbose=0)
    params.update(kwargs)
    return params


@pytest.mark.parametrize("dtype, level", [("bfloat16", "mixed"), ("bfloat16", "pure"), ("float16", "mixed")])
def test_rows_of_a_low_precision_softmax_sum_to_one(dtype, level):
    X, y = _data()
    torch.manual_seed(0)
    net = AmpNetClassifier(_softmax_module(), amp_enabled=True, amp_dtype=dtype, amp_level=level, **_kw())
    net.fit(X, y)
    raw = net.forward(X).numpy()  # the module's own output: rounded to the low-precision dtype
    # off by up to the dtype's unit roundoff: about 4e-3 (bfloat16), 5e-4 (float16)
    assert 1e-5 < np.abs(raw.sum(axis=1, dtype=np.float64) - 1).max() <= torch.finfo(getattr(torch, dtype)).eps / 2
    proba = net.predict_proba(X)
    assert proba.dtype == np.float32 and proba.shape == (128, 5)
    assert np.abs(proba.sum(axis=1, dtype=np.float64) - 1).max() < 1e-5
    assert (proba >= 0).all()
    np.testing.assert_allclose(proba, raw / raw.sum(axis=1, keepdims=True, dtype=np.float64), rtol=1e-6)
    assert (net.predict(X) == raw.argmax(axis=1)).all()  # the ranking of the classes is unchanged


def test_amp_off_is_skorchs_predict_proba_to_the_bit():
    X, y = _data()
    torch.manual_seed(0)
    ours = AmpNetClassifier(_softmax_module(), **_kw()).fit(X, y)
    torch.manual_seed(0)
    theirs = NeuralNetClassifier(_softmax_module(), **_kw()).fit(X, y)
    assert np.array_equal(ours.predict_proba(X), theirs.predict_proba(X))


def test_what_is_no_low_precision_softmax_is_returned_unchanged():
    X, y = _data()
    net = AmpNetClassifier(_softmax_module(), amp_enabled=True, amp_dtype="bfloat16", **_kw()).fit(X, y)
    raw = net.forward(X).numpy()
    log_probs = np.log(raw)  # negative: log-probabilities (a LogSoftmax module under NLLLoss)
    assert probabilities_summing_to_one(net, log_probs) is log_probs
    exact = raw / raw.sum(axis=1, keepdims=True, dtype=np.float64)
    exact = exact.astype(np.float32)  # rows already summing to 1 within float32's precision
    assert probabilities_summing_to_one(net, exact) is exact
    far = raw * 1.5  # rows far from summing to 1: no softmax output
    assert probabilities_summing_to_one(net, far) is far
    one_column = raw[:, :1]
    assert probabilities_summing_to_one(net, one_column) is one_column
    with_nan = raw.copy()
    with_nan[0, 0] = np.nan
    assert probabilities_summing_to_one(net, with_nan) is with_nan
    # a net that is no classifier (AmpNet: any output, e.g. multi-label sigmoids) is left alone
    generic = AmpNet(_softmax_module(), criterion=torch.nn.NLLLoss, amp_enabled=True, amp_dtype="bfloat16",
                     **_kw()).fit(X, y)
    assert probabilities_summing_to_one(generic, raw) is raw
    # AMP off: a float32 softmax is left alone whatever it sums to
    off = AmpNetClassifier(_softmax_module(), **_kw()).fit(X, y)
    assert probabilities_summing_to_one(off, raw) is raw


def test_logits_under_cross_entropy_keep_skorchs_float32_softmax():
    X, y = _data()
    module = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    net = AmpNetClassifier(module, criterion=torch.nn.CrossEntropyLoss, amp_enabled=True, amp_dtype="bfloat16",
                           **_kw()).fit(X, y)
    proba = net.predict_proba(X)
    expected = torch.softmax(net.forward(X), dim=-1).numpy()  # skorch's nonlinearity, on float32 outputs
    assert np.array_equal(proba, expected)
    assert np.abs(proba.sum(axis=1, dtype=np.float64) - 1).max() < 1e-5


class Float64Out(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, X):
        return torch.softmax(self.lin(X).double(), dim=-1)


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_predict_proba_is_float32_with_amp_whatever_the_module_returns(data, precision):
    """With AMP on, predict_proba and forward return float32 even where the module returns
    float64 (as the README says); AMP off keeps the module's dtype."""
    net = tiny_net(Float64Out, precision=precision, max_epochs=1)
    quietly(net.fit, *data)
    proba = net.predict_proba(data[0][:8])
    assert proba.dtype == np.float32
    assert net.forward(data[0][:8]).dtype == torch.float32
    assert np.allclose(proba.sum(1), 1.0, atol=1e-3)
    off = tiny_net(Float64Out, amp_enabled=False, amp_dtype="auto", max_epochs=1)
    quietly(off.fit, *data)
    assert off.predict_proba(data[0][:8]).dtype == np.float64  # AMP off: skorch's behaviour
