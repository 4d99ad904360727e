"""Natural mistakes caught at the first training batch (ampnet.training.output_checks):
logits with skorch's default NLLLoss (an AmpWarning), float y for class
indices (a ValueError); valid setups pass without either."""

import inspect
import re
import warnings

import numpy as np
import pytest
import torch

import ampnet.net
import ampnet.training.lean
from ampnet import AmpNet, AmpNetBinaryClassifier, AmpNetClassifier, AmpWarning
from checkpoint_helpers import quietly, tiny_net
from resume_script import make_data

AMP = [{}, {"amp_enabled": True, "amp_dtype": "bfloat16"}]
AMP_IDS = ["off", "bf16"]


class Logits(torch.nn.Module):
    def __init__(self, n_out=3):
        super().__init__()
        self.lin = torch.nn.Linear(5, n_out)

    def forward(self, X):
        return self.lin(X)


class Softmax(Logits):
    def forward(self, X):
        return torch.softmax(self.lin(X), dim=-1)


class Sigmoids(Logits):
    """Each value in [0, 1], rows not summing to 1."""

    def forward(self, X):
        return torch.sigmoid(self.lin(X))


def data(n=64, classes=3):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 5).astype(np.float32)
    return X, (np.abs(X[:, 0] * 2).astype(np.int64) % classes)


def make(cls=AmpNetClassifier, module=Logits, **kwargs):
    torch.manual_seed(0)
    settings = dict(max_epochs=2, batch_size=16, train_split=None, verbose=0)
    settings.update(kwargs)
    return cls(module, **settings)


NLL_MESSAGE = (
    r"AmpNetClassifier trains with criterion=NLLLoss \(skorch's default for a classifier, unless "
    r"criterion is set\), which "
    r"takes the log of the module's output as class probabilities, but {module} does not return "
    r"probabilities: on the first training batch its outputs range from \S+ to \S+ and its rows "
    r"sum to \S+ \.\.\. \S+, not 1 \(logits\?\)\. .*Fix: criterion=torch.nn.CrossEntropyLoss for a "
    r"module that returns logits .* or end the module's forward with torch.softmax\(\.\.\., dim=-1\)"
)


@pytest.mark.parametrize("amp", AMP, ids=AMP_IDS)
@pytest.mark.parametrize("module", [Logits, Sigmoids])
def test_nllloss_with_outputs_that_are_not_probabilities_warns_once_at_the_fit(module, amp):
    X, y = data()
    net = make(module=module, max_epochs=1, **amp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        net.fit(X, y)
    found = [w for w in caught if issubclass(w.category, AmpWarning)
             and re.search(NLL_MESSAGE.format(module=module.__name__), str(w.message))]
    assert len(found) == 1  # the first training batch only
    assert (found[0].filename, found[0].lineno) == (__file__, line)  # the user's fit


#: What the warning must say: the criterion, the module, the evidence, the effect and both fixes.
CE_PARTS = (
    "criterion=CrossEntropyLoss", "but Softmax already returns probabilities", "every row sums to 1",
    "The softmax is applied twice", "Fix: return logits", "criterion=torch.nn.NLLLoss",
)


@pytest.mark.parametrize("amp", AMP, ids=AMP_IDS)
def test_crossentropy_with_a_module_that_returns_probabilities_warns_once(amp):
    X, y = data()
    net = make(module=Softmax, criterion=torch.nn.CrossEntropyLoss, **amp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        net.fit(X, y)
    found = [w for w in caught if issubclass(w.category, AmpWarning) and "criterion=CrossEntropyLoss" in str(w.message)]
    assert len(found) == 1  # the first training batch of the fit only
    assert all(part in str(found[0].message) for part in CE_PARTS), str(found[0].message)
    assert (found[0].filename, found[0].lineno) == (__file__, line)
    # what it warns about: predict_proba's rows, softmax of probabilities, are squashed
    assert net.predict_proba(X).max() < 0.6


@pytest.mark.parametrize("setup", ["logits", "sigmoids", "one-row"])
def test_crossentropy_with_outputs_that_are_not_probabilities_does_not_warn(setup):
    X, y = data()
    module = {"logits": Logits, "sigmoids": Sigmoids, "one-row": Softmax}[setup]
    net = make(module=module, criterion=torch.nn.CrossEntropyLoss, max_epochs=1,
               batch_size=1 if setup == "one-row" else 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpWarning)
        net.partial_fit(X[:4] if setup == "one-row" else X, y[:4] if setup == "one-row" else y)


@pytest.mark.parametrize("criterion", [torch.nn.CrossEntropyLoss, torch.nn.NLLLoss])
@pytest.mark.parametrize("amp", AMP, ids=AMP_IDS)
def test_float_y_for_class_indices_names_y_and_the_fix(criterion, amp):
    X, y = data()
    module = Softmax if criterion is torch.nn.NLLLoss else Logits
    net = make(module=module, criterion=criterion, **amp)
    with pytest.raises(ValueError, match=re.escape(
        f"y holds floating-point values (dtype float32: 0.0, 1.0, 2.0), but {criterion.__name__} "
        "needs class indices, integers from 0 to n_classes - 1. Fix: pass y as integers, e.g. "
        "y.astype(numpy.int64)"
    )) as info:
        net.fit(X, y.astype(np.float32))
    assert "AmpNetRegressor" in str(info.value)
    assert "expected" not in str(info.value).lower()  # not torch's "expected scalar type Long"


@pytest.mark.parametrize("amp", AMP + [{"amp_enabled": True, "amp_dtype": "bfloat16",
                                        "amp_level": "pure"}], ids=AMP_IDS + ["bf16-pure"])
@pytest.mark.parametrize("setup", ["softmax-nll", "logits-crossentropy", "binary", "probability-targets"])
def test_valid_setups_train(setup, amp):
    X, y = data()
    if setup == "softmax-nll":  # skorch's default criterion, a module returning probabilities
        net = make(module=Softmax, **amp)
    elif setup == "logits-crossentropy":
        net = make(criterion=torch.nn.CrossEntropyLoss, **amp)
    elif setup == "binary":  # BCEWithLogitsLoss, float y of 0/1 as skorch wants it
        net = make(AmpNetBinaryClassifier, module=Logits, module__n_out=1, **amp)
        y = (y > 0).astype(np.float32)
    else:  # CrossEntropyLoss with class probabilities as targets (float y, the output's shape)
        net = make(AmpNet, criterion=torch.nn.CrossEntropyLoss, **amp)
        y = np.eye(3, dtype=np.float32)[y] * 0.9 + 0.1 / 3
    net.fit(X, y)
    losses = net.history[:, "train_loss"]
    assert len(losses) == 2 and np.isfinite(losses).all()


def test_checked_on_the_first_training_batch_of_a_fit_only(monkeypatch):
    calls = []
    real = ampnet.net.check_loss_inputs
    for module in (ampnet.net, ampnet.training.lean):  # the protocol's get_loss, and the lean epoch
        monkeypatch.setattr(module, "check_loss_inputs",
                            lambda net, y_pred, y_true: calls.append(len(y_pred)) or real(net, y_pred, y_true))
    X, y = data()
    net = make(module=Softmax, max_epochs=3, batch_size=24).fit(X, y)  # 3 batches an epoch
    assert calls == [24]
    net.partial_fit(X[:16], y[:16])  # each fit call: the module may have changed
    assert calls == [24, 16]


class TupleLoss(torch.nn.NLLLoss):
    def forward(self, y_pred, y_true):
        loss = super().forward(torch.log(y_pred), y_true)
        return loss, {"nll": loss.detach()}


class FloatLoss(torch.nn.NLLLoss):
    def forward(self, y_pred, y_true):
        return super().forward(torch.log(y_pred), y_true).detach().item()


@pytest.mark.parametrize("criterion, what", [(TupleLoss, "a tuple of 2"), (FloatLoss, "a float")])
@pytest.mark.parametrize("amp", [True, False])
def test_a_criterion_that_returns_no_tensor_gets_a_clear_type_error(criterion, what, amp):
    """A criterion returning a tuple or a float is a TypeError that says what it returned and the fix
    (not AttributeError: 'tuple' object has no attribute 'backward')."""
    net = tiny_net(criterion=criterion, **({} if amp else {"amp_enabled": False, "amp_dtype": "auto"}))
    with pytest.raises(TypeError, match=f"The criterion {criterion.__name__} returned {what} ") as info:
        quietly(net.fit, *make_data())
    info.match("get_loss must return the loss as a floating tensor")
    info.match("Fix: make the criterion's forward return the loss tensor")
