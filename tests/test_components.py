"""The precision component over the device x dtype x level matrix, and
all-or-nothing ``set_params`` and ``initialize``."""

import pickle
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ampnet import AmpNetClassifier, AmpWarning
from conftest import small_classifier

LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class ConvNet(torch.nn.Module):
    """A convolution (4-D weights, for memory_format), a norm layer and a head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.LayerNorm(4 * 4 * 4)
        self.hidden = torch.nn.Linear(4 * 4 * 4, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        h = self.norm(torch.relu(self.conv(X)).flatten(1))
        return self.out(torch.relu(self.hidden(h)))


@pytest.fixture(scope="module")
def images():
    rng = np.random.RandomState(0)
    X = rng.randn(32, 1, 4, 4).astype(np.float32)
    y = (X[:, 0, 0, 0] > 0).astype(np.int64)
    return X, y


def make(**kw):
    base = dict(module=ConvNet, criterion=torch.nn.CrossEntropyLoss, max_epochs=1, lr=0.05,
                batch_size=16, train_split=None, verbose=0)
    base.update(kw)
    return AmpNetClassifier(**base)


def test_every_case_trains_with_the_policy_it_asks_for(precision_case, images):
    X, y = images
    net = make(**precision_case).fit(X, y)
    policy, layout = net.precision_policy_, net.amp_layout_
    dtype = LOW.get(precision_case.get("amp_dtype"))
    assert policy.enabled == (dtype is not None)
    assert policy.compute_dtype == dtype
    assert net.grad_scaler_.is_enabled() == (dtype == torch.float16)
    stored = {n: p.dtype for n, p in net.module_.named_parameters()}
    if precision_case["amp_level"] == "pure":
        assert layout.low_precision_params == ("conv.weight", "conv.bias", "hidden.weight",
                                               "hidden.bias", "out.weight", "out.bias")
        assert stored["norm.weight"] == torch.float32 and stored["hidden.weight"] == dtype
        assert set(net.amp_master_params_) == set(layout.low_precision_params)
        assert all(m.dtype == torch.float32 for m in net.amp_master_params_.values())
    else:
        assert set(stored.values()) == {torch.float32} and not net.amp_master_params_
    assert net.predict_proba(X).dtype == np.float32
    assert all(np.isfinite(net.history[:, "train_loss"]))
    if dtype is not None:
        assert net.history[-1, "skipped_steps"] == 0
    copy_ = pickle.loads(pickle.dumps(net))
    assert copy_.precision_policy_ == policy and copy_.amp_layout_ == layout
    np.testing.assert_array_equal(copy_.predict_proba(X), net.predict_proba(X))


# ---- set_params on a fitted net equals constructing with the same parameters ------------

#: Values each AMP parameter may take, valid and invalid.
CHOICES = {
    "amp_enabled": [False, True, np.True_, "yes"],
    "amp_dtype": ["bfloat16", "float16", "auto", "bf16", torch.float16, "float32"],
    "amp_level": ["mixed", "pure", "full"],
    "amp_master_weights": [True, False, "compensated", "kahan"],
    "amp_fp32_modules": [None, "out", ["hidden", torch.nn.LayerNorm], 3, "auto", ["out", "auto"]],
    "amp_modules": [None, "hidden"],
    "memory_format": ["preserve", "channels_last", "nchw"],
    "amp_skip_nonfinite": [True, False],
    "grad_scaler__init_scale": [256.0, 65536.0, -1.0],
    "grad_scaler__growth_interval": [3, 2000],
    "grad_scaler__enabled": [True, False],
    "gradient_accumulation_steps": [1, 2, 0],
    "amp_max_consecutive_skips": [None, 5],
}


def _observed(net):
    """Everything that ``set_params`` must leave as ``initialize`` would make it."""
    params = {k: v for k, v in net.get_params().items() if k in CHOICES or k.startswith("grad_scaler")}
    scaler = net.grad_scaler_
    return dict(
        params=params,
        policy=net.precision_policy_,
        layout=net.amp_layout_,
        scaler=(type(scaler), scaler.is_enabled(), scaler.get_settings()),
        dtypes={n: p.dtype for n, p in net.module_.named_parameters()},
        channels_last=net.module_.conv.weight.is_contiguous(memory_format=torch.channels_last),
        masters=sorted(net.amp_master_params_ or ()),
        closure=net.amp_step_state_.closure,
    )


def _weights(net):
    return {k: v.float().clone() for k, v in net.module_.state_dict().items()}


@pytest.fixture(scope="module")
def fitted_bf16(images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        return make(amp_enabled=True, amp_dtype="bfloat16").fit(*images)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(sorted(CHOICES)), st.just(None), min_size=1, max_size=4)
       .flatmap(lambda keys: st.fixed_dictionaries({k: st.sampled_from(CHOICES[k]) for k in keys})))
def test_set_params_on_a_fitted_net_is_all_or_nothing(fitted_bf16, changes):
    import copy

    net = copy.deepcopy(fitted_bf16)
    before, weights = _observed(net), _weights(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)  # fp16 on CPU, unmatched selectors...
        try:
            expected = make(**{**before["params"], **changes})
            expected.initialize()
        except (TypeError, ValueError) as exc:
            event("refused")
            # refused by the constructor path: set_params refuses too, changing nothing
            with pytest.raises(type(exc)):
                net.set_params(**changes)
            assert _observed(net) == before
            after = _weights(net)
            assert all(torch.equal(after[k], weights[k]) for k in weights)
            return
        net.set_params(**changes)
    event("applied")
    got, want = _observed(net), _observed(expected)
    assert got == want
    after = _weights(net)  # trained weights are kept (float32 view)
    assert after.keys() == weights.keys()
    for key, value in weights.items():
        if net.amp_layout_.low_precision_params and not net.amp_master_params_:
            torch.testing.assert_close(after[key], value, rtol=1e-2, atol=1e-2)  # stored low
        else:
            assert torch.equal(after[key], value), key


def test_issue_example_switch_to_fp16_pure_without_masters_and_scaling(fitted_bf16, images):
    import copy

    net = copy.deepcopy(fitted_bf16)
    changes = dict(amp_dtype="fp16", amp_level="pure", amp_master_weights=False, grad_scaler__enabled=False)
    with pytest.warns(AmpWarning, match="float16 training without loss scaling"):
        net.set_params(**changes)
    assert net.precision_policy_.compute_dtype == torch.float16 and net.precision_policy_.level == "pure"
    assert net.amp_layout_.level == "pure" and not net.grad_scaler_.is_enabled()
    assert net.module_.hidden.weight.dtype == torch.float16 and net.amp_master_params_ is None


def test_refused_value_is_not_kept(fitted_bf16):
    import copy

    net = copy.deepcopy(fitted_bf16)
    params, scaler = net.get_params(deep=False), net.grad_scaler_
    with pytest.raises(ValueError, match=r"grad_scaler__init_scale=-1 \(int\): must be a finite number > 0"):
        net.set_params(grad_scaler__init_scale=-1, amp_level="pure")
    assert net.get_params(deep=False) == params
    assert net.grad_scaler_ is scaler and net.amp_layout_.level == "mixed"
    assert "grad_scaler__init_scale" not in net.__dict__


def test_failed_initialize_leaves_the_net_uninitialized():
    net = make(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=-1)
    with pytest.raises(ValueError, match="grad_scaler__init_scale"):
        net.initialize()
    assert net.initialized_ is False
    with pytest.raises(AttributeError, match="call initialize"):
        net.grad_scaler_
    net.set_params(grad_scaler__init_scale=256.0)
    assert net.initialize().initialized_ and net.grad_scaler_.get_scale() == 256.0


def test_failed_reinitialize_leaves_initialized_false(images):
    net = make(amp_enabled=True, amp_dtype="bfloat16").fit(*images)
    net.module = "not a module"
    with pytest.raises(TypeError, match="'str' object is not callable"):
        net.initialize()
    assert net.initialized_ is False


def test_refused_set_params_undoes_live_scaler_and_optimizer_changes(classifier_data):
    X, y = classifier_data
    net = small_classifier(optimizer=torch.optim.LBFGS, amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
               grad_scaler__growth_factor=2.0).fit(X[:32], y[:32])
    scaler, lr = net.grad_scaler_, net.optimizer_.param_groups[0]["lr"]
    params = net.get_params(deep=False)
    with pytest.raises(ValueError, match="compensated"):
        net.set_params(grad_scaler__growth_factor=4.0, lr=0.5, amp_master_weights="compensated")
    assert net.grad_scaler_ is scaler and scaler.get_settings()["growth_factor"] == 2.0
    assert net.optimizer_.param_groups[0]["lr"] == lr
    assert net.get_params(deep=False) == params
