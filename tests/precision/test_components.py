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
from conftest import Logits

LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class ConvNet(torch.nn.Module):
    """A convolution (4-D weights, for memory_format), a norm layer and a head."""

    def __init__(self, hidden=8):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.LayerNorm(4 * 4 * 4)
        self.hidden = torch.nn.Linear(4 * 4 * 4, hidden)
        self.out = torch.nn.Linear(hidden, 2)

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

#: Values each parameter may take, valid and invalid, from every family: AMP,
#: module__*, optimizer__* (and lr), criterion__*, callbacks__*, iterator_*, device.
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
    "module__hidden": [8, 12, "bad"],
    "optimizer__momentum": [0.0, 0.9, -1.0],
    "optimizer__nesterov": ["maybe"],  # refused by SGD: nesterov needs momentum > 0
    "lr": [0.05, 0.1, -1.0],
    "criterion__label_smoothing": [0.0, 0.1],
    "criterion__smoothing": [0.1],  # no such argument
    "callbacks__print_log__floatfmt": [".3f", ".5f"],
    "callbacks__print_log__no_such_setting": [1],
    "callbacks__no_such_callback__x": [1],
    "iterator_train__shuffle": [True, False],
    "iterator_train__batch_size": [8, 16],
    "iterator_train_shuffle": [True],  # a typo skorch refuses
    "device": ["cpu", torch.device("cpu"), "gpu", "cuda:7"],
}


def _groups(net):
    """The optimizer's hyper-parameters by group; not its kernel (``fused``/``foreach``),
    which ampnet picks for AMP and documents as no part of the state (ampnet.precision.kernels)."""
    return [{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")}
            for g in net.optimizer_.param_groups]


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
        groups=_groups(net),
        smoothing=net.criterion_.label_smoothing,
        floatfmt=dict(net.callbacks_)["print_log"].floatfmt,
    )


def _hooks(net):
    """Every hook on every submodule, by module name and hook kind."""
    return {
        (name, kind): list(getattr(m, kind).values())
        for name, m in net.module_.named_modules()
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")
    }


def _optimizer_state(net):
    state = net.optimizer_.state_dict()
    return {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
            for k, s in state["state"].items()}, state["param_groups"]


def _untouched(net):
    """Everything a refused ``set_params`` or ``initialize`` must leave as it was."""
    return dict(
        observed=_observed(net),
        params=net.get_params(deep=False),
        initialized=net.initialized_,
        parts=[id(net.__dict__.get(n)) for n in ("module_", "criterion_", "optimizer_", "precision_",
                                                 "amp_step_state_", "parallel_", "history_")],
        callbacks=[(name, id(cb), dict(vars(cb))) for name, cb in net.callbacks_],
        hooks=_hooks(net),
        scale=net.grad_scaler_.get_scale(),
    )


def _assert_untouched(net, before, weights, optimizer_state):
    assert _untouched(net) == before
    after = _weights(net)
    assert after.keys() == weights.keys() and all(torch.equal(after[k], weights[k]) for k in weights)
    state, groups = _optimizer_state(net)
    assert groups == optimizer_state[1] and state.keys() == optimizer_state[0].keys()
    for key, values in state.items():
        for name, value in values.items():
            want = optimizer_state[0][key][name]
            assert torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want


def _weights(net):
    return {k: v.float().clone() for k, v in net.module_.state_dict().items()}


#: The fitted nets the property tests start from: pure bfloat16 (low-precision
#: weights and float32 masters) and mixed with a float32 region (forward hooks).
STARTS = {
    "pure": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", optimizer__momentum=0.5),
    "region": dict(amp_enabled=True, amp_dtype="bfloat16", amp_fp32_modules=["out"], optimizer__momentum=0.5),
}


@pytest.fixture(scope="module")
def fitted_nets(images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        return {name: make(**kw).fit(*images) for name, kw in STARTS.items()}


@pytest.fixture(scope="module")
def fitted_bf16(images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        return make(amp_enabled=True, amp_dtype="bfloat16").fit(*images)


CHANGES = (
    st.dictionaries(st.sampled_from(sorted(CHOICES)), st.just(None), min_size=1, max_size=4)
    .flatmap(lambda keys: st.fixed_dictionaries({k: st.sampled_from(CHOICES[k]) for k in keys}))
)


def _expected(before, changes):
    """A net built with the same parameters, or the exception that refuses them."""
    if "callbacks__no_such_callback__x" in changes:
        # skorch's set_params refuses a setting of a callback that does not exist
        # (its initialize ignores it)
        return ValueError("Trying to set a parameter for callback no_such_callback which does not exist.")
    try:
        expected = make(**{**before["params"], **changes})
        expected.initialize()
    except (TypeError, ValueError) as exc:
        return exc
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("start", sorted(STARTS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=CHANGES)
def test_set_params_on_a_fitted_net_is_all_or_nothing(fitted_nets, start, changes):
    import copy

    net = copy.deepcopy(fitted_nets[start])
    before, weights, state = _untouched(net), _weights(net), _optimizer_state(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)  # fp16 on CPU, unmatched selectors...
        expected = _expected(before["observed"], changes)
        if isinstance(expected, Exception):
            event("refused")
            # refused by the constructor path: set_params refuses too, changing nothing
            # (with several bad values, it may name another one first)
            with pytest.raises((TypeError, ValueError)):
                net.set_params(**changes)
            _assert_untouched(net, before, weights, state)
            return
        net.set_params(**changes)
    event("applied")
    got, want = _observed(net), _observed(expected)
    assert got == want
    if "module__hidden" in changes:
        return  # a new module: new weights
    after = _weights(net)  # trained weights are kept (float32 view)
    assert after.keys() == weights.keys()
    for key, value in weights.items():
        if net.amp_layout_.low_precision_params and not net.amp_master_params_:
            torch.testing.assert_close(after[key], value, rtol=1e-2, atol=1e-2)  # stored low
        else:
            assert torch.equal(after[key], value), key


@pytest.mark.parametrize("start", sorted(STARTS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=CHANGES)
def test_initialize_on_a_fitted_net_is_all_or_nothing(fitted_nets, start, changes):
    """Parameters set as attributes (``net.module__hidden = ...``), then
    ``initialize()``: it succeeds, or raises and leaves the net as it was."""
    import copy

    net = copy.deepcopy(fitted_nets[start])
    vars(net).update(changes)
    net._params_to_validate.update(changes)
    before, weights, state = _untouched(net), _weights(net), _optimizer_state(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        try:
            net.initialize()
        except (TypeError, ValueError):
            event("refused")
            _assert_untouched(net, before, weights, state)
            return
    event("applied")
    assert net.initialized_


def test_switch_to_fp16_pure_without_masters_and_scaling_warns_and_applies(fitted_bf16, images):
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


def test_failed_reinitialize_leaves_the_net_as_it_was(fitted_nets, images):
    import copy

    net = copy.deepcopy(fitted_nets["region"])
    proba = net.predict_proba(images[0])
    before, weights, state = _untouched(net), _weights(net), _optimizer_state(net)
    net.module = "not a module"
    before["params"]["module"] = "not a module"
    with pytest.raises(TypeError, match="'str' object is not callable"):
        net.initialize()
    _assert_untouched(net, before, weights, state)
    assert net.initialized_ and len(net.module_.out._forward_hooks) == 1
    np.testing.assert_array_equal(net.predict_proba(images[0]), proba)


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


# ---- a refused set_params changes nothing, one family of parameters at a time ----------


def test_refused_module_param_keeps_a_pure_net_pure(fitted_nets, images):
    import copy

    net = copy.deepcopy(fitted_nets["pure"])
    masters = dict(net.amp_master_params_)
    with pytest.raises(TypeError):
        net.set_params(module__hidden="bad")
    assert net.module_.hidden.weight.dtype == torch.bfloat16 and net.precision_policy_.level == "pure"
    assert net.amp_master_params_ == masters
    params = {id(p) for g in net.optimizer_.param_groups for p in g["params"]}
    assert params == {id(p) for n, p in net.module_.named_parameters() if n not in masters} | {
        id(m) for m in masters.values()}
    net.partial_fit(*images)  # trains in pure bfloat16, on the masters
    assert net.module_.hidden.weight.dtype == torch.bfloat16
    torch.testing.assert_close(net.module_.hidden.weight.float(), net.amp_master_params_["hidden.weight"],
                               rtol=1e-2, atol=1e-2)


def test_refused_module_param_keeps_the_float32_region(fitted_nets):
    import copy

    net = copy.deepcopy(fitted_nets["region"])
    hooks = _hooks(net)
    assert len(net.module_.out._forward_hooks) == len(net.module_.out._forward_pre_hooks) == 1
    with pytest.raises(TypeError):
        net.set_params(module__hidden="bad")
    assert _hooks(net) == hooks


def test_refused_optimizer_setting_changes_nothing_and_a_valid_one_is_kept(fitted_nets):
    import copy
    from sklearn.base import clone

    net = copy.deepcopy(fitted_nets["region"])
    with pytest.raises(ValueError, match="Invalid momentum value: -1"):
        net.set_params(optimizer__momentum=-1.0)  # skorch sets it in the live optimizer unchecked
    assert _groups(net)[0]["momentum"] == 0.5 and net.get_params()["optimizer__momentum"] == 0.5
    net.set_params(optimizer__momentum=0.9)
    assert _groups(net)[0]["momentum"] == 0.9
    assert net.get_params()["optimizer__momentum"] == 0.9  # skorch forgets it
    assert clone(net).initialize().optimizer_.param_groups[0]["momentum"] == 0.9


def test_iterator_settings_on_a_fitted_net(fitted_nets, images):
    import copy

    net = copy.deepcopy(fitted_nets["region"])
    net.set_params(iterator_train__shuffle=True, iterator_train__batch_size=8)  # skorch: "Something went wrong"
    assert net.get_params()["iterator_train__batch_size"] == 8
    net.partial_fit(*images)
    assert len(net.history[-1, "batches"]) == 4
    with pytest.raises(ValueError, match="did you mean iterator_train__shuffle"):
        net.set_params(iterator_train_shuffle=False)
    assert "iterator_train_shuffle" not in net.get_params()
    assert "iterator_train_shuffle" not in net._params_to_validate


def test_refused_callback_param_keeps_the_callbacks_state(images):
    from skorch.callbacks import EpochScoring

    score = EpochScoring("accuracy", lower_is_better=False, on_train=True, name="acc")
    net = make(amp_enabled=True, amp_dtype="bfloat16", callbacks=[("acc", score)], max_epochs=2).fit(*images)
    best = score.best_score_
    assert np.isfinite(best)
    with pytest.raises(ValueError, match="callback nope which does not exist"):
        net.set_params(callbacks__nope__x=1)  # skorch re-initializes every callback first
    assert score.best_score_ == best and dict(net.callbacks_)["acc"] is score


# ---- a misspelled name gets the close valid one ------------------------------------------------


@pytest.mark.parametrize("name, close", [
    ("amp_enable", "amp_enabled"),
    ("grad_scalar__growth_factor", "grad_scaler__growth_factor"),
    ("amp_level_", None),  # a fitted attribute's name: skorch's own rule, no hint
    ("colour", None),  # nothing close: skorch's and scikit-learn's messages as they are
])
def test_a_misspelled_name_is_refused_with_the_close_one(name, close, classifier_data):
    """At construction (skorch's "unexpected argument(s)") and by set_params
    (scikit-learn's "Invalid parameter"), which then changes nothing."""
    hint = f"Did you mean {close} (for {name})?"
    if not name.endswith("_"):
        with pytest.raises(ValueError, match="unexpected argument") as info:
            AmpNetClassifier(Logits, **{name: 4}).initialize()
        assert (hint in str(info.value)) is (close is not None)
    X, y = classifier_data[0][:64], classifier_data[1][:64]
    net = AmpNetClassifier(Logits, max_epochs=1, train_split=None, criterion=torch.nn.CrossEntropyLoss).fit(X, y)
    before = net.get_params()
    with pytest.raises(ValueError) as info:
        net.set_params(**{name: 4})
    assert (hint in str(info.value)) is (close is not None)
    assert str(info.value).count("Did you mean") == (close is not None)  # once, on a fitted net too
    assert net.get_params().keys() == before.keys() and net.grad_scaler_.get_growth_factor() == 2.0
    if "__" in name:  # a net not initialized yet keeps a prefixed name, as skorch's does: initialize() refuses it
        fresh = AmpNetClassifier(Logits).set_params(**{name: 4})
        with pytest.raises(ValueError, match="unexpected argument") as info:
            fresh.initialize()
        assert (hint in str(info.value)) is (close is not None)


def test_a_value_error_gets_no_name_hint():
    net = AmpNetClassifier(Logits).initialize()
    with pytest.raises(ValueError, match="amp_level must be one of") as info:
        net.set_params(amp_level="mixd")
    assert "Did you mean" not in str(info.value)
