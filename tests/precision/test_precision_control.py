"""amp_fp32_modules, amp_modules, memory_format, compile and parameter
validation, checked from inside the model with probes."""

import pickle
import re

import numpy as np
import pytest
import torch
from sklearn.base import clone

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.precision.regions import AutocastRegion, regions_of
from precision_helpers import CL, Head, Probe, ThreePart, image_data

pytestmark = pytest.mark.filterwarnings(
    "ignore:this CPU has no native bfloat16:ampnet.exceptions.AmpWarning"
)

BF16, FP32 = torch.bfloat16, torch.float32


def make_net(**kwargs):
    torch.manual_seed(0)
    defaults = dict(
        module=ThreePart, amp_enabled=True, amp_dtype="bfloat16", max_epochs=2,
        lr=0.1, batch_size=32, train_split=None, verbose=0,
    )
    defaults.update(kwargs)
    return AmpNetClassifier(**defaults)


# ---- amp_fp32_modules ------------------------------------------------------


@pytest.mark.parametrize("level", ["mixed", "pure"])
def test_fp32_module_computes_in_fp32(level, classifier_data):
    X, y = classifier_data
    net = make_net(amp_level=level, amp_fp32_modules=["head"]).initialize()
    probe = Probe(net.module_, ["embed", "head", "head.lin"])
    net.partial_fit(X, y)
    net.predict_proba(X)

    # the head and everything inside it: autocast off, float32 in and out
    assert probe.seen("head", "autocast") == {False}
    assert probe.seen("head", "inputs") == {FP32}
    assert probe.seen("head.lin", "outputs") == {FP32}
    assert probe.seen("head.lin", "params") == {FP32}
    # the rest of the model still computes in bfloat16
    assert probe.seen("embed", "autocast") == {True}
    assert probe.seen("embed", "outputs") == {BF16}
    assert probe.seen("embed", "params") == ({BF16} if level == "pure" else {FP32})
    assert net.amp_layout_.fp32_modules == ("head",)


def test_fp32_module_gets_low_precision_input_cast_up(classifier_data):
    # in 'pure' the block hands a bfloat16 activation to the head
    X, y = classifier_data
    net = make_net(amp_level="pure", amp_fp32_modules=[Head]).initialize()
    probe = Probe(net.module_, ["block", "head"])
    net.predict_proba(X[:8])
    assert probe.seen("block", "outputs") == {BF16}
    assert probe.seen("head", "inputs") == {FP32}


@pytest.mark.parametrize(
    "selector, expected",
    [
        (Head, ("head",)),
        ("block.*", ("block.0", "block.1")),
        ([re.compile(r"emb\w+"), "head.lin"], ("embed", "head.lin")),
        (["head", "head.lin"], ("head",)),  # nested matches: the outer one
        (torch.nn.Linear, ("embed", "block.0", "head.lin")),
    ],
)
def test_selector_kinds(selector, expected):
    net = make_net(amp_fp32_modules=selector).initialize()
    assert net.amp_layout_.fp32_modules == expected
    assert tuple(regions_of(net.module_)) == expected


@pytest.mark.parametrize(
    "param, value, match",
    [
        (
            "amp_fp32_modules", 3,
            r"amp_fp32_modules must be None, a selector or a list of selectors; "
            r"got invalid item\(s\) 3 \(int\)",
        ),
        ("amp_modules", ["block", int], r"amp_modules .* invalid item\(s\) <class 'int'> \(type\)"),
        ("amp_fp32_modules", [None], r"A selector is a torch.nn.Module subclass"),
    ],
)
def test_selector_wrong_type_raises_at_initialize(param, value, match):
    net = make_net(**{param: value})  # constructing is fine (sklearn contract)
    with pytest.raises(TypeError, match=match):
        net.initialize()


def test_selector_without_match_warns():
    net = make_net(amp_fp32_modules=["heda"], amp_modules=[re.compile("nothing")])
    with pytest.warns(AmpWarning) as record:
        net.initialize()
    messages = [str(w.message) for w in record]
    assert any(
        re.search(r"amp_fp32_modules selector 'heda' matches no module of ThreePart.*Did you mean 'head'", m)
        for m in messages
    )
    assert any("amp_modules selector re:nothing matches no module" in m for m in messages)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(memory_format="nhwc"), ValueError,
            r"memory_format must be one of 'preserve', 'channels_last'; got 'nhwc' \(str\)",
        ),
        (
            dict(amp_master_weights="yes"), TypeError,
            r"amp_master_weights must be True, False or 'compensated'; got 'yes' \(str\)",
        ),
        (
            dict(amp_level="pure", amp_dtype="float16", amp_master_weights=False),
            ValueError,
            r"amp_master_weights=False and float16 loss scaling.*Fix: keep amp_master_weights=True",
        ),
    ],
)
def test_parameter_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_net(**kwargs).initialize()


def test_controls_are_inert_without_amp(classifier_data):
    X, y = classifier_data
    net = make_net(amp_enabled=False, amp_level="pure", amp_fp32_modules=["head"])
    with pytest.warns(AmpWarning, match=re.escape(
        "amp_enabled=False, so amp_dtype='bfloat16', amp_level='pure', amp_fp32_modules=['head'] "
        "have no effect: the net trains in float32. Set amp_enabled=True to use them"
    )):
        net.fit(X, y)
    assert {p.dtype for p in net.module_.parameters()} == {FP32}
    assert regions_of(net.module_) == {}
    assert net.amp_master_params_ is None


# ---- amp_modules -----------------------------------------------------------


@pytest.mark.parametrize("level", ["mixed", "pure"])
def test_amp_modules_only_selected_run_low_precision(level, classifier_data):
    X, y = classifier_data
    net = make_net(amp_level=level, amp_modules=["block"]).initialize()
    probe = Probe(net.module_, ["", "embed", "block.0", "head"])
    loss_autocast = []
    net.criterion_.register_forward_pre_hook(
        lambda m, a: loss_autocast.append(torch.is_autocast_enabled("cpu"))
    )
    net.partial_fit(X, y)
    net.predict(X)

    assert probe.seen("", "autocast") == {False}  # global autocast off
    assert probe.seen("embed", "outputs") == {FP32}
    assert probe.seen("block.0", "autocast") == {True}
    assert probe.seen("block.0", "outputs") == {BF16}
    assert probe.seen("head", "inputs") == {FP32}  # block output cast back
    assert probe.seen("head", "outputs") == {FP32}
    assert set(loss_autocast) == {False}
    dtypes = {n: p.dtype for n, p in net.module_.named_parameters()}
    low = BF16 if level == "pure" else FP32
    assert dtypes == {
        "embed.weight": FP32, "embed.bias": FP32, "block.0.weight": low,
        "block.0.bias": low, "head.lin.weight": FP32, "head.lin.bias": FP32,
    }


def test_fp32_modules_win_over_amp_modules(classifier_data):
    X, y = classifier_data
    net = make_net(amp_level="pure", amp_modules=["block", "block.0"], amp_fp32_modules=["block.0"])
    with pytest.warns(AmpWarning, match="amp_level='pure' stores no parameter in low precision"):
        net.initialize()
    assert net.amp_layout_.amp_modules == ("block",)
    probe = Probe(net.module_, ["block.0"])
    net.predict(X[:8])
    assert probe.seen("block.0", "autocast") == {False}
    assert net.module_.block[0].weight.dtype == FP32
    assert net.amp_layout_.low_precision_params == ()


def test_region_restores_autocast_when_forward_raises():
    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    root = torch.nn.Sequential(torch.nn.Linear(2, 2), Boom())
    for region in (AutocastRegion("cpu"), AutocastRegion("cpu", BF16)):
        root[1]._forward_pre_hooks.clear()
        root[1]._forward_hooks.clear()
        root[1].register_forward_pre_hook(region.pre_hook, with_kwargs=True)
        root[1].register_forward_hook(region.post_hook, with_kwargs=True, always_call=True)
        with torch.autocast("cpu", dtype=torch.float16):
            with pytest.raises(RuntimeError, match="boom"):
                root(torch.ones(1, 2))
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.float16
        assert not torch.is_autocast_enabled("cpu")


# ---- pickling, clone, no patching -----------------------------------------


def test_pickle_and_clone_keep_the_regions(classifier_data):
    X, y = classifier_data
    net = make_net(amp_level="pure", amp_fp32_modules=[Head], amp_modules=["block", "head"])
    net.fit(X, y)
    for module in net.module_.modules():
        assert "forward" not in vars(module)  # forward is never patched
    assert type(net.module_).forward is ThreePart.forward

    loaded = pickle.loads(pickle.dumps(net))
    np.testing.assert_array_equal(loaded.predict_proba(X), net.predict_proba(X))
    probe = Probe(loaded.module_, ["head", "block.0"])
    loaded.predict(X[:8])
    assert probe.seen("head", "autocast") == {False}
    assert probe.seen("block.0", "outputs") == {BF16}

    cloned = clone(net)
    assert cloned.get_params()["amp_fp32_modules"] == [Head]
    assert not hasattr(cloned, "amp_layout_")
    cloned.fit(X, y)
    assert cloned.amp_layout_ == net.amp_layout_


def test_unpickled_regions_follow_the_device():
    net = make_net(amp_fp32_modules=["head"]).initialize()
    regions_of(net.module_)["head"].device_type = "cuda"  # as if pickled on a GPU
    loaded = pickle.loads(pickle.dumps(net))
    assert regions_of(loaded.module_)["head"].device_type == "cpu"


def test_set_params_rebuilds_the_layout_and_keeps_weights(classifier_data):
    X, y = classifier_data
    net = make_net(optimizer=torch.optim.Adam, lr=0.01).fit(X, y)
    weights = {n: p.detach().clone() for n, p in net.module_.named_parameters()}
    proba = net.predict_proba(X)
    steps = net.optimizer_.state_dict()["state"][0]["step"]

    net.set_params(amp_level="pure", amp_fp32_modules=["head"])
    params = dict(net.module_.named_parameters())
    assert params["embed.weight"].dtype == BF16 and params["head.lin.weight"].dtype == FP32
    for name, master in net.amp_master_params_.items():
        assert torch.equal(master, weights[name])  # masters are the old fp32 weights
    opt_params = [p for g in net.optimizer_.param_groups for p in g["params"]]
    assert all(p.dtype == FP32 for p in opt_params)
    assert net.optimizer_.state_dict()["state"][0]["step"] == steps  # state carried over
    np.testing.assert_allclose(net.predict_proba(X), proba, atol=2e-2)

    net.set_params(amp_level="mixed")
    for name, p in net.module_.named_parameters():
        assert p.dtype == FP32 and torch.equal(p, weights[name])


# ---- memory_format ----------------------------------------------------------


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        h = torch.relu(self.conv2(torch.relu(self.conv1(X))))
        return torch.softmax(self.out(h.mean((2, 3))), dim=-1)


@pytest.mark.parametrize("amp", [False, True])
def test_channels_last_strides_and_values(amp):
    X, y = image_data()
    nets = {}
    for fmt in ("preserve", "channels_last"):
        net = make_net(module=SmallCNN, memory_format=fmt, amp_enabled=amp,
                       amp_dtype="bfloat16" if amp else "auto").initialize()
        probe = Probe(net.module_, ["conv1", "conv2"])
        net.partial_fit(X, y)
        net.predict_proba(X)
        nets[fmt] = (net, probe)

    net, probe = nets["channels_last"]
    assert net.module_.conv1.weight.is_contiguous(memory_format=CL)
    for name in ("conv1", "conv2"):
        assert probe.seen(name, "channels_last") == {True}  # training and prediction
    base, base_probe = nets["preserve"]
    assert base_probe.seen("conv2", "channels_last") == {False}
    assert not base.module_.conv1.weight.is_contiguous(memory_format=CL)
    np.testing.assert_allclose(
        net.predict_proba(X), base.predict_proba(X), rtol=0, atol=1e-2 if amp else 1e-5
    )


# ---- compile ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("level", ["mixed", "pure"])
def test_compile_runs_autocast_inside_the_compiled_region(level, classifier_data):
    from torch._dynamo.utils import counters

    X, y = classifier_data
    torch._dynamo.reset()
    counters.clear()
    net = make_net(
        amp_level=level, amp_fp32_modules=["head"], compile=True,
        compile__backend="aot_eager", compile__dynamic=False,
    ).initialize()
    assert isinstance(net.module_, torch._dynamo.eval_frame.OptimizedModule)
    probe = Probe(net.module_._orig_mod, ["embed", "head"])
    net.partial_fit(X, y)
    proba = net.predict_proba(X)

    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"]  # the regions trace without graph breaks
    assert probe.seen("embed", "outputs") == {BF16}
    assert probe.seen("head", "outputs") == {FP32}
    expected_embed = BF16 if level == "pure" else FP32
    assert net.module_._orig_mod.embed.weight.dtype == expected_embed

    eager = make_net(amp_level=level, amp_fp32_modules=["head"]).initialize()
    eager.module_.load_state_dict(net.module_._orig_mod.state_dict())
    np.testing.assert_allclose(eager.predict_proba(X), proba, atol=1e-2)
    torch._dynamo.reset()
