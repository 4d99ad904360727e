"""The net's AMP parameters are parsed once, by initialize() and set_params, into one read-only object that
every later reader reads; the lists and defaults that describe them come from the parameter table and the
scaler's own signature."""

import inspect
import pickle

import pytest

import ampnet.config.params as params
from ampnet import AmpNetClassifier, GradScaler
from ampnet.config.params import MODULE_PARAMS, PARAMS, ParsedParams, pending_params
from ampnet.precision import AMP_LEVELS, LIVE_SETTINGS, SCALER_DEFAULTS

from conftest import MLP


@pytest.fixture
def data(classifier_data):
    X, y = classifier_data
    return X[:64], y[:64]


def test_initialize_parses_once_in_canonical_spelling(data):
    net = AmpNetClassifier(MLP, amp_enabled=" TRUE ".strip().lower() == "true", amp_level=" Mixed ",
                           memory_format="PRESERVE", max_epochs=1, train_split=None, verbose=0)
    assert "amp_params_" not in vars(net)
    net.initialize()
    held = net.amp_params_
    assert isinstance(held, ParsedParams)
    assert held["amp_level"] == "mixed" and held["memory_format"] == "preserve" and held["amp_enabled"] is True
    assert net.amp_level == " Mixed "  # the raw value stays what the user set (get_params, clone)
    with pytest.raises(AttributeError, match="read-only"):
        held.amp_level = "pure"
    assert pickle.loads(pickle.dumps(held)) == held


def test_a_fit_reads_the_parse_and_checks_nothing_again(data, monkeypatch):
    X, y = data
    net = AmpNetClassifier(MLP, amp_enabled="auto", amp_autotune__cache=False, max_epochs=1, batch_size=16,
                           train_split=None, verbose=0).initialize()
    calls = []
    original = params.check
    monkeypatch.setattr(params, "check", lambda name, value: calls.append(name) or original(name, value))
    net.fit(X, y)  # initialize() parses again (the user may have set values since): count after it
    calls.clear()
    net.partial_fit(X, y)
    assert calls == []


def test_set_params_updates_the_parse_all_or_nothing(data):
    X, y = data
    net = AmpNetClassifier(MLP, amp_enabled=True, max_epochs=1, batch_size=32, train_split=None,
                           verbose=0).fit(X, y)
    net.set_params(memory_format="Channels_Last ".strip().lower(), grad_scaler__growth_factor=4.0)
    assert net.amp_params_["memory_format"] == "channels_last"
    assert net.amp_params_["grad_scaler__growth_factor"] == 4.0
    before = net.amp_params_
    with pytest.raises(ValueError, match="amp_level"):
        net.set_params(amp_level="fastest", memory_format="preserve")
    assert net.amp_params_ is before and net.memory_format == "channels_last"


def test_lists_and_defaults_come_from_one_place():
    signature = inspect.signature(GradScaler.__init__).parameters
    assert {k: signature[k].default for k in SCALER_DEFAULTS} == SCALER_DEFAULTS
    for name, default in SCALER_DEFAULTS.items():
        row = PARAMS[f"grad_scaler__{name}"]
        assert row.default == default
        assert (params.LIVE_SCALER in row.rebuilds) == (name in LIVE_SETTINGS)
    assert PARAMS["amp_level"].check("PURE") == "pure" and set(AMP_LEVELS) == {"mixed", "pure"}
    assert pending_params("channels_last") == {
        "amp_enabled": False, "amp_dtype": PARAMS["amp_dtype"].default, "amp_level": PARAMS["amp_level"].default,
        "amp_master_weights": PARAMS["amp_master_weights"].default, "memory_format": "channels_last"}
    assert all(params.LAYOUT in PARAMS[name].rebuilds for name in MODULE_PARAMS)


def test_a_parameter_assigned_directly_is_parsed_afresh(data):
    # scikit-learn allows net.amp_dtype = ...; the next set_params builds from it, not from an old parse
    X, y = data
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="bfloat16", max_epochs=1, train_split=None,
                           verbose=0).fit(X, y)
    assert net.amp_params_["amp_dtype"] == "bfloat16"
    net.amp_dtype = "float16"
    assert "amp_params_" not in vars(net)
    net.set_params(amp_enabled=True)
    assert net.get_params()["amp_dtype"] == "float16" and net.precision_policy_.name == "float16 (mixed)"
    assert net.amp_params_["amp_dtype"] == "float16"
    net.lr = 0.3  # not an AMP parameter: the parse stands
    assert net.amp_params_["amp_dtype"] == "float16"


def test_build_settings_names_what_it_is_missing():
    from ampnet.precision import build_settings

    with pytest.raises(TypeError, match=r"needs every precision parameter of a net; 'amp_skip_nonfinite' is missing"):
        build_settings({"amp_enabled": True, "amp_dtype": "bfloat16"})
