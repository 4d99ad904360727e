"""Hostile parameter values: each is refused with a
ValueError or TypeError naming the parameter, at ``initialize()`` and by
``set_params`` on a fitted net, which is then left exactly as it was.

- ``device`` values that are no device (``-1``, ``True``, ``0.5``, NaN,
  ``'meta'``, ``10**30``);
- ints too large for a float or a tensor (``10**400``);
- values whose own methods raise (``__repr__``, a ``str`` subclass's
  ``strip``, ``__float__``), whatever they raise;
- ``distributed=True`` without a process group, refused the same way by the
  constructor's ``initialize()`` and by ``set_params`` on a fitted net.
"""

import math
import re

import numpy as np
import pytest
import torch
from sklearn.model_selection import GridSearchCV

from ampnet.config.params import PARAMS, check
from ampnet.precision import validate_scaler_settings
from ampnet.utils.values import describe, exception_text
from conftest import small_classifier

NOT_DEVICES = [-1, True, np.True_, 0.5, float("nan"), "meta", torch.device("meta"), 10**30, [0], object()]


def _data():
    rng = np.random.RandomState(0)
    X = rng.randn(32, 20).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


@pytest.fixture(scope="module")
def fitted_state():
    """A fitted net and a record of it: get_params, parameter tensors and the loss scale."""
    return small_classifier(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0).fit(*_data())


def _record(net):
    params = {k: v for k, v in net.get_params().items() if not k.startswith("callbacks")}
    weights = {k: v.detach().clone() for k, v in net.module_.named_parameters()}
    return params, weights, net.grad_scaler_.get_scale(), net.precision_, net.parallel_


def _assert_unchanged(net, before):
    params, weights, scale, precision, parallel = _record(net)
    assert params.keys() == before[0].keys()
    for key, value in params.items():
        assert value is before[0][key] or value == before[0][key], key
    assert all(torch.equal(weights[k], before[1][k]) for k in weights)
    assert scale == before[2] and precision is before[3] and parallel is before[4]


# ---- device ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", NOT_DEVICES, ids=repr)
def test_a_value_that_is_no_device_is_refused_at_initialize(device):
    net = small_classifier(device=device)
    with pytest.raises(ValueError, match=r"^device.*" + re.escape(describe(device)) + r".*Fix: device='cpu'"):
        net.fit(*_data())
    assert not net.initialized_


@pytest.mark.parametrize("device", NOT_DEVICES, ids=repr)
def test_set_params_refuses_a_value_that_is_no_device_and_the_net_trains_on(fitted_state, device):
    net = fitted_state
    before = _record(net)
    with pytest.raises(ValueError, match=r"^device"):
        net.set_params(device=device)
    _assert_unchanged(net, before)
    assert net.device == "cpu"


def test_device_messages_say_what_a_device_is():
    with pytest.raises(ValueError, match=re.escape(
            "device must be None, a device string such as 'cpu', 'cuda', 'cuda:0' or 'mps', a torch.device, "
            "or an int >= 0 (an accelerator index, as torch.device(0) reads it); got 0.5 (float).")):
        check("device", 0.5)
    with pytest.raises(ValueError, match=r"got -1 \(int\), which is not a device index \(an int in \[0, 2\*\*63 - 1\]\)"):
        check("device", -1)
    with pytest.raises(ValueError, match=r"device='meta' \(str\) is torch's device without data"):
        check("device", "meta")


@pytest.mark.parametrize("device", ["cpu", "CPU".lower(), torch.device("cpu"), None, "cpu:0"])
def test_devices_still_accepted(device):
    assert check("device", device) is device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", [0, np.int64(0)])
def test_an_index_is_an_accelerator_that_the_machine_lacks(device):
    # torch.device(0) is cuda:0: the missing device's own error, as for 'cuda:0'
    with pytest.raises(ValueError, match=r"device=0, but CUDA is not available on this machine"):
        check("device", device)


# ---- ints beyond float range -----------------------------------------------------------------


@pytest.mark.parametrize("name, fix", [
    ("gradient_accumulation_steps", r"an int >= 1 and at most 2\*\*63 - 1"),
    ("amp_max_consecutive_skips", r"None or an int >= 1 and at most 2\*\*63 - 1"),
    ("amp_autotune__margin", r"a number in \[0, 1\)"),
])
def test_an_int_beyond_float_range_is_a_value_error_naming_the_parameter(fitted_state, name, fix):
    with pytest.raises(ValueError, match=rf"^{name} must be {fix}; got 1000.*\.\.\. \(int\)"):
        small_classifier(**{name: 10**400}).fit(*_data())
    net = fitted_state
    before = _record(net)
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        net.set_params(**{name: 10**400})
    _assert_unchanged(net, before)


@pytest.mark.parametrize("name", ["gradient_accumulation_steps", "amp_autotune__margin"])
def test_an_int_beyond_float_range_in_a_grid_search(name):
    X, y = _data()
    search = GridSearchCV(small_classifier(), {name: [10**400]}, cv=2, error_score="raise")
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        search.fit(X, y)


def test_the_largest_accepted_int_trains():
    net = small_classifier(gradient_accumulation_steps=2**63 - 1, amp_max_consecutive_skips=2**63 - 1)
    net.fit(*_data())  # one step at the epoch's end: the remainder group
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())


# ---- values whose own methods raise ---------------------------------------------------------------


class BadRepr:
    def __repr__(self):
        raise RuntimeError("repr boom")


class BadStr(str):
    def strip(self, *args):
        raise RuntimeError("strip boom")

    def lower(self):
        raise RuntimeError("lower boom")

    def __repr__(self):
        raise RuntimeError("repr boom")


class BadFloat(float):
    def __float__(self):
        raise ZeroDivisionError("float boom")


class BadCompare(float):
    def __gt__(self, other):
        raise RuntimeError("gt boom")

    __lt__ = __le__ = __ge__ = __gt__


HOSTILE = [BadRepr(), BadStr("no such choice"), BadFloat(0.5), BadCompare(0.5)]


def test_describe_never_raises_and_is_bounded():
    assert describe(BadRepr()) == "<a BadRepr whose repr raised RuntimeError> (BadRepr)"
    assert describe("x" * 1000).startswith("'xxx") and len(describe("x" * 1000)) == 80 + len(" (str)")
    assert describe(10**5000) == "<an int of 16610 bits> (int)"

    class Meta(type):
        @property
        def __name__(cls):
            raise RuntimeError

    class Odd(metaclass=Meta):
        def __repr__(self):
            return "odd"

    assert describe(Odd()) == "odd (Odd)"
    assert exception_text(RuntimeError("a\nb")) == "RuntimeError: a b"


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: type(v).__name__)
def test_a_hostile_value_is_refused_with_the_parameters_name(name, value):
    try:
        check(name, value)
    except (ValueError, TypeError) as exc:
        assert name in str(exc)
        return
    if isinstance(value, BadStr):
        # accepted: a glob pattern of a selector parameter, a device string
        # that skorch hands to .to() with AMP off, or auto's cache folder (as the plain str it holds)
        assert name in ("amp_fp32_modules", "amp_modules", "amp_float8__modules", "device", "amp_autotune__cache")
        if name == "amp_autotune__cache":
            assert type(check(name, value)) is str
    else:  # the number a float subclass holds, read as a plain float
        assert isinstance(value, BadCompare) and name.startswith("amp_autotune__")
        assert type(check(name, value)) is float and check(name, value) == 0.5


@pytest.mark.parametrize("name", ["amp_enabled", "amp_level", "gradient_accumulation_steps", "device",
                                  "grad_scaler__min_scale", "amp_autotune__margin"])
@pytest.mark.parametrize("value", [BadRepr(), BadStr("zzz")], ids=lambda v: type(v).__name__)
def test_hostile_values_at_initialize_and_on_a_fitted_net(fitted_state, name, value):
    if name == "device" and isinstance(value, str):
        pytest.skip("a string that is no torch device goes to .to() with AMP off, as in skorch")
    with pytest.raises((ValueError, TypeError), match=name):
        small_classifier(**{name: value}).initialize()
    net = fitted_state
    before = _record(net)
    with pytest.raises((ValueError, TypeError), match=name):
        net.set_params(**{name: value})
    _assert_unchanged(net, before)


def test_a_value_that_raises_when_read_names_the_parameter_and_what_it_raised():
    with pytest.raises(ValueError, match=re.escape(
            "amp_autotune__margin got 0.5 (BadFloat), which raised ZeroDivisionError: float boom when ampnet "
            "read it. amp_autotune__margin: 'auto': how much faster than float32 mixed precision must be. Fix: pass a "
            "plain "
            "value (a bool, int, float, str or None) such as the default amp_autotune__margin=0.05.")) as info:
        check("amp_autotune__margin", BadFloat(0.5))
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    # a value whose repr raises gets the check's own refusal, shown by its type
    with pytest.raises(ValueError, match=re.escape(
            "amp_autotune__margin must be a number in [0, 1); got <a BadRepr whose repr raised RuntimeError> "
            "(BadRepr). Fix: leave it at 0.05")):
        check("amp_autotune__margin", BadRepr())


def test_a_str_subclass_is_read_as_the_str_it_holds():
    assert check("amp_level", BadStr(" Pure ")) == "pure"
    assert check("amp_enabled", BadStr("AUTO")) == "auto"
    with pytest.raises(ValueError, match=r"amp_level must be one of 'mixed', 'pure'; got "
                                         r"<a BadStr whose repr raised RuntimeError> \(BadStr\)"):
        check("amp_level", BadStr("full"))


# ---- loss-scaler settings whose conversion raises (all or nothing) -------------------------------


@pytest.mark.parametrize("setting, value", [("min_scale", 2.0), ("backoff_factor", 0.25), ("init_scale", 512.0),
                                            ("max_scale", 2.0**20), ("growth_factor", 3.0)])
def test_a_scaler_setting_whose_float_raises_is_refused_and_not_stored(fitted_state, setting, value):
    net = fitted_state
    before = _record(net)
    with pytest.raises(ValueError, match=rf"grad_scaler__{setting}={value!r} \(BadFloat\): could not be read as a "
                                         r"number \(it raised ZeroDivisionError: float boom\)"):
        net.set_params(**{f"grad_scaler__{setting}": BadFloat(value)})
    _assert_unchanged(net, before)
    assert not isinstance(net.get_params().get(f"grad_scaler__{setting}"), BadFloat)


def test_a_scaler_setting_is_checked_as_the_number_the_scaler_keeps():
    class Lies(float):  # in range as a float, out of range as float() gives it
        def __float__(self):
            return 1e300

    with pytest.raises(ValueError, match=r"grad_scaler__max_scale=65536.0 \(Lies\): is 1e\+300") as info:
        validate_scaler_settings(max_scale=Lies(65536.0))
    assert "float32's normal positive range" in str(info.value)


def test_a_live_setting_that_fails_in_the_scaler_leaves_the_net_as_it_was(fitted_state, monkeypatch):
    net = fitted_state
    before = _record(net)

    def fails(**settings):
        raise ZeroDivisionError("inside the scaler")

    monkeypatch.setattr(net.grad_scaler_, "apply_settings", fails)
    with pytest.raises(ZeroDivisionError):
        net.set_params(grad_scaler__min_scale=2.0)
    monkeypatch.undo()
    _assert_unchanged(net, before)
    assert net.get_params().get("grad_scaler__min_scale") != 2.0


# ---- distributed=True without a process group ----------------------------------------------------


@pytest.mark.parametrize("value", [True, np.True_, " TRUE"[1:].lower() == "true"])
def test_distributed_true_without_a_process_group_is_refused_both_ways(fitted_state, value):
    message = r"distributed=True, but no torch.distributed process group is initialized"
    with pytest.raises(ValueError, match=message):
        small_classifier(distributed=value).fit(*_data())
    net = fitted_state
    before = _record(net)
    with pytest.raises(ValueError, match=message):
        net.set_params(distributed=value)
    _assert_unchanged(net, before)
    assert net.distributed == "auto"


def test_distributed_false_and_auto_are_accepted_on_a_fitted_net():
    net = small_classifier().fit(*_data())
    parallel = net.parallel_
    net.set_params(distributed=False)
    assert type(net.parallel_) is type(parallel)
    net.set_params(distributed="auto")
    net.partial_fit(*_data())
    assert math.isfinite(net.history[-1, "train_loss"])


def test_set_params_distributed_builds_the_component_at_once_or_keeps_it(monkeypatch):
    import torch.distributed as dist

    import ampnet.training.parallel as ampdist

    built = []

    def fake_init(self, net):  # DistributedDataParallel needs a real process group
        built.append(net)

    monkeypatch.setattr(ampdist.DataParallel, "__init__", fake_init)
    net = small_classifier().fit(*_data())
    assert type(net.parallel_) is ampdist.Parallel  # 'auto' without a process group
    monkeypatch.setattr(ampdist, "_process_group_ready", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    net.set_params(distributed=True)  # built now, as initialize() builds it
    assert isinstance(net.parallel_, ampdist.DataParallel) and built == [net]
    current = net.parallel_
    net.set_params(distributed="auto")  # still on: kept, the module is not wrapped again
    assert net.parallel_ is current and len(built) == 1
    net.set_params(distributed=False)
    assert type(net.parallel_) is ampdist.Parallel
