"""The inputs a new user passes first: a pandas DataFrame ``X``
(and pandas ``y``), and a 1-D ``y`` for a regressor (``ampnet.training.user_inputs``)."""

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpNetRegressor


@pytest.fixture
def pd():
    """pandas, for the DataFrame tests (the 1-D y tests run without it)."""
    return pytest.importorskip("pandas")


class Linear(torch.nn.Module):
    def __init__(self, n_in=3, n_out=2):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)

    def forward(self, X):
        return self.lin(X)


class ByColumn(torch.nn.Module):
    """Written for skorch's call: one keyword argument per column, each (batch, 1)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, age, income):
        return self.lin(torch.cat([age, income], dim=1).float())


def frame(pd, n=64, seed=0):
    rng = np.random.RandomState(seed)
    X = pd.DataFrame({"f0": rng.randn(n), "f1": rng.randint(0, 5, n), "f2": rng.randn(n) > 0})
    y = pd.Series((X["f0"] > 0).astype("int64"))
    return X, y


def classifier(module=Linear, **kw):
    torch.manual_seed(0)
    return AmpNetClassifier(module, criterion=torch.nn.CrossEntropyLoss, max_epochs=2, batch_size=16,
                            train_split=None, iterator_train__shuffle=False, verbose=0, **kw)


@pytest.mark.parametrize("amp", [False, True])
def test_a_numeric_dataframe_trains_as_its_float32_array(amp, pd):
    """A DataFrame of float, int and bool columns trains bitwise as
    X.to_numpy(dtype='float32') does (skorch: "unexpected keyword argument 'f0'")."""
    X, y = frame(pd)
    extra = dict(amp_enabled=True, amp_dtype="bfloat16") if amp else {}
    from_frame = classifier(**extra).fit(X, y)
    from_array = classifier(**extra).fit(X.to_numpy(dtype="float32"), np.array(y))
    for a, b in zip(from_frame.module_.parameters(), from_array.module_.parameters()):
        assert torch.equal(a, b)
    assert from_frame.history[:, "train_loss"] == from_array.history[:, "train_loss"]
    # a module whose forward takes the columns by name keeps skorch's call (one keyword per column)
    rng = np.random.RandomState(0)
    X = pd.DataFrame({"age": rng.randn(32).astype("float32"), "income": rng.randn(32).astype("float32")})
    net = classifier(ByColumn, **extra).fit(X, np.array(X["age"] > 0, dtype="int64"))
    assert net.predict_proba(X).shape == (32, 2)


def test_partial_fit_takes_a_dataframe_too(pd):
    X, y = frame(pd)
    net = classifier()
    net.partial_fit(X, y)
    assert len(net.history) == 2  # max_epochs


def test_a_dataframe_with_text_columns_is_refused_with_the_fix(pd):
    X, y = frame(pd, 16)
    X["city"] = ["Oslo", "Lima"] * 8
    with pytest.raises(ValueError) as info:
        classifier(Linear, module__n_in=4).fit(X, y)
    text = str(info.value)
    assert "'city' (object" in text or "'city' (str" in text
    assert "DataFrame" in text and "Fix:" in text and "OneHotEncoder" in text and "to_numpy" in text
    assert "f0" not in text  # the numeric columns are not named


def test_a_pandas_target_for_a_regressor(pd):
    """A DataFrame y (skorch cannot batch it: default_collate refuses a Series) trains as its array."""
    X, _ = frame(pd)
    y = pd.DataFrame({"t": X["f0"] * 2.0})
    torch.manual_seed(0)
    net = AmpNetRegressor(Linear, module__n_out=1, max_epochs=1, train_split=None, verbose=0).fit(X, y)
    assert np.isfinite(net.history[-1, "train_loss"])


# ---- a 1-D y for a regressor -----------------------------------------------------------------


def regressor(module=Linear, **kw):
    torch.manual_seed(0)
    return AmpNetRegressor(module, module__n_out=1, max_epochs=1, batch_size=16, train_split=None,
                           verbose=0, **kw)


@pytest.mark.parametrize("amp", [False, True])
def test_a_1d_target_for_a_column_output_is_refused_with_the_fix(amp):
    """skorch trains on (n, 1) against (n,), broadcast to (n, n), with torch's warning only."""
    rng = np.random.RandomState(0)
    X = rng.randn(64, 3).astype("float32")
    y = X[:, 0] * 2
    extra = dict(amp_enabled=True, amp_dtype="bfloat16") if amp else {}
    net = regressor(**extra)
    with pytest.raises(ValueError) as info:
        net.fit(X, y)
    text = str(info.value)
    assert "(16,)" in text and "(16, 1)" in text and "(16, 16)" in text  # both shapes and the broadcast
    assert "MSELoss" in text and "Fix:" in text and "y.reshape(-1, 1)" in text
    net.fit(X, y.reshape(-1, 1))  # the fix trains
    assert np.isfinite(net.history[-1, "train_loss"])


class Flat(Linear):
    def forward(self, X):
        return self.lin(X).squeeze(-1)


def test_a_1d_target_for_a_1d_output_trains():
    rng = np.random.RandomState(0)
    X = rng.randn(64, 3).astype("float32")
    net = regressor(Flat).fit(X, X[:, 0] * 2)
    assert np.isfinite(net.history[-1, "train_loss"])
    with pytest.raises(ValueError, match=r"y\.ravel\(\)"):  # the reverse mismatch
        regressor(Flat).fit(X, X[:, :1] * 2)


# ---- the dtype of a classifier's y (a new user's first data) ---------------------------


class _Logit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)

    def forward(self, X):
        return self.lin(X).squeeze(-1)


class _Probs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, X):
        return torch.softmax(self.lin(X), dim=-1)


def _xy(n=64, classes=2, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(n, 6).astype(np.float32)
    return X, rng.randint(0, classes, n)


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool", "float64", "uint8"])
def test_a_binary_classifier_takes_0_1_labels_of_any_numeric_dtype(dtype):
    from ampnet import AmpNetBinaryClassifier

    X, y = _xy()
    torch.manual_seed(0)
    net = AmpNetBinaryClassifier(_Logit, max_epochs=2, train_split=None, verbose=0).fit(X, y.astype(dtype))
    torch.manual_seed(0)
    same = AmpNetBinaryClassifier(_Logit, max_epochs=2, train_split=None, verbose=0).fit(X, y.astype("float32"))
    for a, b in zip(net.module_.parameters(), same.module_.parameters()):
        assert torch.equal(a, b)  # trains exactly as on float32 labels


def test_a_binary_classifier_refuses_labels_other_than_0_and_1():
    from ampnet import AmpNetBinaryClassifier

    X, y = _xy()
    with pytest.raises(ValueError, match=r"\[1, 2\].*0 and 1.*Fix: y = \(y == positive_label\)"):
        AmpNetBinaryClassifier(_Logit, max_epochs=1, train_split=None, verbose=0).fit(X, y + 1)


def test_a_classifier_casts_int32_labels_and_refuses_text_labels():
    from ampnet import AmpNetClassifier

    X, y = _xy(classes=3)
    torch.manual_seed(0)
    net = AmpNetClassifier(_Probs, max_epochs=1, train_split=None, verbose=0).fit(X, y.astype("int32"))
    torch.manual_seed(0)
    same = AmpNetClassifier(_Probs, max_epochs=1, train_split=None, verbose=0).fit(X, y)
    assert torch.equal(net.module_.lin.weight, same.module_.lin.weight)
    with pytest.raises(ValueError, match="text labels.*'a'.*LabelEncoder"):
        AmpNetClassifier(_Probs, max_epochs=1, train_split=None, verbose=0).fit(X, np.array(list("abc") * 21 + ["a"]))
    with pytest.raises(ValueError, match="text labels.*'b'.*LabelEncoder"):  # strings in an object array too
        AmpNetClassifier(_Probs, max_epochs=1, train_split=None, verbose=0).fit(
            X, np.array(list("bcd") * 21 + ["b"], dtype=object))


def test_an_object_y_of_sequences_is_not_taken_for_text():
    """skorch's variable-length targets (an object array of arrays, with a
    custom loss) reach the loss as skorch gives them."""
    from ampnet import AmpNetClassifier

    X = np.ones((4, 1), dtype=np.float32)
    y = np.empty(4, dtype=object)
    for i in range(4):
        y[i] = np.ones((i + 1, 1), dtype=np.float32)
    net = AmpNetClassifier(torch.nn.Linear, module__in_features=1, module__out_features=1, max_epochs=1,
                           batch_size=1, train_split=None, verbose=0)
    net.initialize()
    seen = []
    net.get_loss = lambda y_pred, y_true, *args, **kwargs: (seen.append(tuple(y_true.shape)), y_pred.sum())[1]
    net.check_data = lambda *args, **kwargs: None
    net.fit(X, y)
    assert sorted(seen) == [(1, 1, 1), (1, 2, 1), (1, 3, 1), (1, 4, 1)]
