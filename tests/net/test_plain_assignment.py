"""A parameter set by plain assignment on a fitted net (``net.amp_dtype =
'float16'``, as scikit-learn allows) is built as ``set_params`` builds it:
the next ``set_params`` (of anything) or ``partial_fit`` gives the net the
components a fresh build with the same parameters gives, or refuses the
value with the parameter's error, leaving the net as it was."""

import warnings

import pytest
import torch

from ampnet import AmpNetClassifier

from conftest import MLP

BF16 = dict(amp_enabled=True, amp_dtype="bfloat16")
FP16 = dict(amp_enabled=True, amp_dtype="float16")


@pytest.fixture
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


def fitted(data, **start):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on a CPU says it is slow there
        return AmpNetClassifier(MLP, max_epochs=1, batch_size=16, train_split=None, verbose=0, lr=0.05,
                                **start).fit(*data)


def components(net):
    """What a net trains with: its precision, scaler, layout, optimizer kernel and step path."""
    prec, opt = net.precision_, net.optimizer_
    scaler = prec.scaler
    return {
        "policy": net.precision_policy_.name, "scaling": prec.scaling,
        "scaler": (type(scaler).__name__, scaler.is_enabled(),
                   scaler.get_settings() if hasattr(scaler, "get_settings") else None, scaler.get_scale()),
        "dtypes": sorted({str(p.dtype) for p in net.module_.parameters()}),
        "layout": repr(net.amp_layout_),
        "parse": dict(net.amp_params_),
        "optimizer": {k: v for k, v in opt.param_groups[0].items() if k in ("fused", "foreach", "lr")},
        "closure": net.amp_step_state_.closure,
        "masters": None if net.amp_master_params_ is None else sorted(net.amp_master_params_),
    }


def fresh(net):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AmpNetClassifier(**net.get_params()).initialize()


ASSIGNMENTS = [
    (BF16, "amp_dtype", "float16"),  # scaling on (a float16 policy kept the disabled scaler and bf16 layout)
    (BF16, "amp_enabled", False),
    ({"amp_enabled": False}, "amp_enabled", True),
    (BF16, "amp_level", "pure"),
    ({**BF16, "amp_level": "pure"}, "amp_master_weights", False),
    (BF16, "amp_fp32_modules", ["out"]),
    (BF16, "amp_modules", ["out"]),
    (BF16, "memory_format", "channels_last"),
    (FP16, "grad_scaler__init_scale", 256.0),
    (FP16, "grad_scaler", torch.amp.GradScaler),
]


@pytest.mark.parametrize("start, name, value", ASSIGNMENTS, ids=[a[1] for a in ASSIGNMENTS])
def test_set_params_after_a_plain_assignment_builds_what_a_fresh_net_builds(data, start, name, value):
    net = fitted(data, **start)
    before = components(net)
    setattr(net, name, value)
    net.set_params(lr=0.1)
    assert components(net) == components(fresh(net)) != before
    net.partial_fit(*data)  # and it trains with them


@pytest.mark.parametrize("start, name, value", ASSIGNMENTS[:4], ids=[a[1] for a in ASSIGNMENTS[:4]])
def test_partial_fit_after_a_plain_assignment_trains_with_what_a_fresh_net_builds(data, start, name, value):
    net = fitted(data, **start)
    setattr(net, name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net.partial_fit(*data)
        expected = AmpNetClassifier(**net.get_params()).fit(*data)
    got, want = components(net), components(expected)
    got["scaler"], want["scaler"] = got["scaler"][:3], want["scaler"][:3]  # the scale moves with training
    assert got == want


def test_auto_assigned_on_a_fitted_float16_net_trains_what_it_records(data, native_bf16, auto_cache_dir):
    net = fitted(data, **FP16)
    net.amp_enabled = "auto"
    net.partial_fit(*data)  # 4 steps: too short to measure, it decides without a training step
    result = net.amp_autotune_
    assert result.source == "device"
    # the record said "float32 (AMP off)" while the net kept training float16
    assert net.precision_policy_.enabled == result.params["amp_enabled"]
    assert net.precision_policy_.name != "float16 (mixed)"


def test_an_invalid_assigned_value_is_refused_and_the_net_kept(data):
    net = fitted(data, **BF16)
    before = components(net)
    net.amp_level = "fastest"
    with pytest.raises(ValueError, match=r"amp_level.*'fastest'"):
        net.set_params(lr=0.1)
    with pytest.raises(ValueError, match=r"amp_level.*'fastest'"):
        net.partial_fit(*data)
    net.amp_level = "mixed"
    assert net.optimizer_.param_groups[0]["lr"] == 0.05
    net.set_params(lr=0.05)
    assert components(net) == before


def test_an_assignment_that_changes_nothing_rebuilds_nothing(data):
    net = fitted(data, **BF16)
    precision, optimizer = net.precision_, net.optimizer_
    net.amp_dtype = "bfloat16"
    net.lr = 0.3  # not an AMP parameter
    net.partial_fit(*data)
    assert net.precision_ is precision and net.optimizer_ is optimizer
    assert "amp_params_built_" not in vars(net)
