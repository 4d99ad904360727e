"""amp_level='pure': parameter dtypes, float32 master weights, loss scaling,
persistence, accuracy on digits, and convert_for_inference."""

import copy
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback

from ampnet import AmpNetClassifier, AmpNetRegressor, AmpWarning
from ampnet.callbacks.checkpoint import Checkpoint
from ampnet.precision.plan import NORM_LAYERS
from precision_helpers import (
    DigitsCNN,
    DigitsMLP,
    Head,
    NormZoo,
    Probe,
    ThreePart,
    digits_split,
    image_data,
)
from conftest import MLP, small_classifier

pytestmark = pytest.mark.filterwarnings(
    "ignore:this CPU has no native bfloat16:ampnet.exceptions.AmpWarning"
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FP16_CPU = "float16 autocast on CPU"


def make_net(**kwargs):
    torch.manual_seed(0)
    defaults = dict(
        module=ThreePart, amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
        max_epochs=2, lr=0.1, batch_size=32, train_split=None, verbose=0,
    )
    defaults.update(kwargs)
    return AmpNetClassifier(**defaults)


def optimizer_params(net):
    return [p for g in net.optimizer_.param_groups for p in g["params"]]


def assert_module_follows_masters(net):
    params = dict(net.module_.named_parameters())
    assert net.amp_master_params_
    for name, master in net.amp_master_params_.items():
        assert master.dtype == FP32
        assert torch.equal(params[name], master.detach().to(params[name].dtype))


# ---- dtypes --------------------------------------------------------------------


def test_pure_dtypes_norm_layers_fp32_rest_low_precision():
    X, y = image_data()
    net = make_net(module=NormZoo, criterion=torch.nn.CrossEntropyLoss).initialize()
    probe = Probe(net.module_, ["conv", "bn", "ln", "out"])
    net.partial_fit(X, y)

    for name, module in net.module_.named_modules():
        for p in module.parameters(recurse=False):
            assert p.dtype == (FP32 if isinstance(module, NORM_LAYERS) else BF16), name
    assert net.module_.bn.running_mean.dtype == FP32  # buffers are not cast
    # the optimizer updates float32 masters of exactly the low-precision params
    low = {n for n, p in net.module_.named_parameters() if p.dtype == BF16}
    assert set(net.amp_master_params_) == low == set(net.amp_layout_.low_precision_params)
    masters = {id(m) for m in net.amp_master_params_.values()}
    assert all(p.dtype == FP32 for p in optimizer_params(net))
    assert masters <= {id(p) for p in optimizer_params(net)}
    assert_module_follows_masters(net)
    # inside the model: low-precision compute, norm layers take and give bf16
    assert probe.seen("conv", "params") == {BF16} and probe.seen("conv", "outputs") == {BF16}
    assert probe.seen("bn", "params") == {FP32}
    assert probe.seen("bn", "inputs") == {BF16} and probe.seen("bn", "outputs") == {BF16}
    assert probe.seen("out", "params") == {BF16}


def test_pure_fp16_uses_loss_scaling_and_fp32_master_grads(classifier_data):
    X, y = classifier_data

    class GradDtypes(Callback):
        def on_grad_computed(self, net, named_parameters, **kwargs):
            self.seen = [(p.dtype, p.grad.dtype) for _, p in named_parameters]
            self.module_grads = [p.grad for p in net.module_.parameters()]

    cb = GradDtypes()
    net = make_net(amp_dtype="float16", optimizer=torch.optim.Adam, lr=0.01, callbacks=[cb])
    with pytest.warns(AmpWarning, match=FP16_CPU):
        net.fit(X, y)
    assert {p.dtype for p in net.module_.parameters()} == {FP16}
    assert net.grad_scaler_.is_enabled()
    assert net.history[-1, "loss_scale"] > 1
    assert net.history[-1, "train_loss"] < net.history[0, "train_loss"]
    # on_grad_computed (e.g. gradient clipping) sees fp32 masters with fp32 grads
    assert set(cb.seen) == {(FP32, FP32)}
    assert cb.module_grads == [None] * len(cb.module_grads)
    state = net.optimizer_.state_dict()["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {FP32}
    assert_module_follows_masters(net)


def test_gradients_accumulate_in_fp32_on_the_masters(classifier_data):
    X, y = classifier_data

    class AfterMicroBatch(Callback):
        def __init__(self):
            self.seen = []

        def on_batch_end(self, net, training=False, **kwargs):
            if training:
                master = net.amp_master_params_["embed.weight"]
                self.seen.append((master.grad.dtype, net.module_.embed.weight.grad))

    cb = AfterMicroBatch()
    net = make_net(gradient_accumulation_steps=2, batch_size=16, max_epochs=1, callbacks=[cb])
    net.fit(X, y)
    assert len(cb.seen) == 8
    assert all(dtype == FP32 and module_grad is None for dtype, module_grad in cb.seen)
    assert_module_follows_masters(net)


def test_master_weights_false_updates_low_precision_weights(classifier_data):
    X, y = classifier_data
    net = make_net(amp_master_weights=False, max_epochs=5).fit(X, y)
    assert net.amp_master_params_ is None
    assert {p.dtype for p in optimizer_params(net)} == {BF16}
    assert {id(p) for p in optimizer_params(net)} == {id(p) for p in net.module_.parameters()}
    assert net.history[-1, "train_loss"] < net.history[0, "train_loss"]


def test_closure_optimizer_sees_synced_weights(regression_data):
    X, y = regression_data
    torch.manual_seed(0)
    net = AmpNetRegressor(
        torch.nn.Linear, module__in_features=20, module__out_features=1,
        optimizer=torch.optim.LBFGS, lr=0.5, max_epochs=3, batch_size=96,
        train_split=None, verbose=0, amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
    ).fit(X, y)
    assert net.history[-1, "train_loss"] < 0.1 * net.history[0, "train_loss"]
    assert_module_follows_masters(net)


# ---- persistence --------------------------------------------------------------


def test_save_params_writes_fp32_unless_asked_for_low_precision(classifier_data):
    X, y = classifier_data
    net = make_net(amp_fp32_modules=["head"]).fit(X, y)
    f = io.BytesIO()
    net.save_params(f_params=f)
    saved = torch.load(io.BytesIO(f.getvalue()))
    assert {v.dtype for v in saved.values()} == {FP32}
    for name, master in net.amp_master_params_.items():
        assert torch.equal(saved[name], master)

    f = io.BytesIO()
    with net.low_precision_state():
        net.save_params(f_params=f)
    saved = torch.load(io.BytesIO(f.getvalue()))
    assert saved["embed.weight"].dtype == BF16 and saved["head.lin.weight"].dtype == FP32
    assert net.module_.state_dict()["embed.weight"].dtype == FP32  # back to float32


def test_load_params_refreshes_masters_at_full_precision(classifier_data):
    X, y = classifier_data
    source = make_net().fit(X, y)
    f = io.BytesIO()
    source.save_params(f_params=f)

    torch.manual_seed(1)
    target = make_net().initialize()
    target.load_params(f_params=io.BytesIO(f.getvalue()))
    for name, master in source.amp_master_params_.items():
        assert torch.equal(target.amp_master_params_[name], master)  # not rounded
    assert_module_follows_masters(target)
    np.testing.assert_array_equal(target.predict_proba(X), source.predict_proba(X))

    mixed = make_net(amp_level="mixed").initialize()
    mixed.load_params(f_params=io.BytesIO(f.getvalue()))
    for name, master in source.amp_master_params_.items():
        assert torch.equal(mixed.module_.get_parameter(name), master)


def test_checkpoint_resume_matches_uninterrupted_training(classifier_data, tmp_path):
    X, y = classifier_data
    kwargs = dict(optimizer=torch.optim.Adam, lr=0.01, iterator_train__shuffle=False)
    straight = make_net(max_epochs=4, **kwargs).fit(X, y)

    cp = Checkpoint(monitor=None, dirname=str(tmp_path))
    make_net(max_epochs=2, callbacks=[cp], **kwargs).fit(X, y)
    resumed = make_net(max_epochs=2, **kwargs).initialize()
    torch.manual_seed(123)  # a different fresh init, overwritten by the checkpoint
    resumed.load_params(checkpoint=cp)
    resumed.partial_fit(X, y)

    for name, master in straight.amp_master_params_.items():
        assert torch.equal(resumed.amp_master_params_[name], master)
    assert_module_follows_masters(resumed)


def test_pickle_and_deepcopy_keep_masters_tied_to_the_optimizer(classifier_data):
    X, y = classifier_data
    net = make_net(optimizer=torch.optim.Adam, lr=0.01).fit(X, y)
    before = {n: p.detach().clone() for n, p in net.module_.named_parameters()}
    for copied in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        opt_ids = {id(p) for p in optimizer_params(copied)}
        assert {id(m) for m in copied.amp_master_params_.values()} <= opt_ids
        copied.partial_fit(X, y)
        assert_module_follows_masters(copied)
        assert not torch.equal(copied.module_.embed.weight, before["embed.weight"])
    for name, p in net.module_.named_parameters():
        assert torch.equal(p, before[name])  # the original is untouched


def test_trim_for_prediction_drops_masters(classifier_data):
    X, y = classifier_data
    net = make_net().fit(X, y)
    proba = net.predict_proba(X)
    net.trim_for_prediction()
    assert net.amp_master_params_ is None
    np.testing.assert_array_equal(net.predict_proba(X), proba)
    assert net.module_.state_dict()["embed.weight"].dtype == FP32


# ---- accuracy on digits -----------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return digits_split()


def fit_digits(module, digits, **kwargs):
    Xtr, Xte, ytr, yte = digits
    torch.manual_seed(0)
    net = AmpNetClassifier(
        module, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.Adam, lr=3e-3,
        max_epochs=20 if module is DigitsMLP else 10, batch_size=64, train_split=None,
        verbose=0, **kwargs,
    ).fit(Xtr, ytr)
    return net, float((net.predict(Xte) == yte).mean())


@pytest.fixture(scope="module")
def fp32_digits(digits):
    return {m: fit_digits(m, digits) for m in (DigitsMLP, DigitsCNN)}


@pytest.mark.slow
@pytest.mark.parametrize("module", [DigitsMLP, DigitsCNN], ids=["mlp", "cnn"])
@pytest.mark.parametrize("level", ["mixed", "pure"])
def test_digits_accuracy_within_one_point_of_fp32(module, level, digits, fp32_digits):
    net, acc = fit_digits(module, digits, amp_enabled=True, amp_dtype="bfloat16", amp_level=level)
    baseline = fp32_digits[module][1]
    assert baseline > 0.95
    assert abs(acc - baseline) <= 0.01
    expected = {BF16, FP32} if module is DigitsCNN else {BF16}  # BatchNorm stays fp32
    assert {p.dtype for p in net.module_.parameters()} == (expected if level == "pure" else {FP32})


# ---- convert_for_inference ------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_convert_for_inference_agrees_with_fp32(dtype, tol, digits, fp32_digits):
    _, Xte, _, _ = digits
    net = fp32_digits[DigitsCNN][0]
    before = {n: p.detach().clone() for n, p in net.module_.named_parameters()}
    expected = net.predict_proba(Xte)

    converted = net.convert_for_inference(dtype)
    low = getattr(torch, dtype)
    for name, module in converted.module_.named_modules():
        for p in module.parameters(recurse=False):
            assert p.dtype == (FP32 if isinstance(module, NORM_LAYERS) else low), name
    probe = Probe(converted.module_, ["features.0"])
    proba = converted.predict_proba(Xte)
    assert probe.seen("features.0", "outputs") == {low}
    assert np.abs(proba - expected).max() <= tol
    assert (proba.argmax(1) == expected.argmax(1)).mean() >= 0.99
    # the original is unchanged
    assert not net.amp_enabled and net.amp_level == "mixed"
    for name, p in net.module_.named_parameters():
        assert p.dtype == FP32 and torch.equal(p, before[name])
    # the converted net pickles
    loaded = pickle.loads(pickle.dumps(converted))
    np.testing.assert_array_equal(loaded.predict_proba(Xte), proba)


def test_convert_for_inference_respects_lists_and_defaults_to_the_net_dtype(classifier_data):
    X, y = classifier_data
    net = make_net(amp_level="mixed", amp_fp32_modules=[Head], amp_modules=["block", "head"])
    net.fit(X, y)
    converted = net.convert_for_inference()
    assert converted.precision_policy_.compute_dtype == BF16
    dtypes = {n: p.dtype for n, p in converted.module_.named_parameters()}
    assert dtypes["block.0.weight"] == BF16
    assert dtypes["embed.weight"] == FP32 and dtypes["head.lin.weight"] == FP32
    with pytest.raises(ValueError, match="amp_dtype must be one of"):
        net.convert_for_inference("int8")


def test_fit_on_converted_net_trains_pure(classifier_data):
    X, y = classifier_data
    net = make_net(amp_enabled=False, amp_level="mixed", amp_dtype="auto").fit(X, y)
    converted = net.convert_for_inference("bfloat16")
    weights = {n: p.detach().clone() for n, p in net.module_.named_parameters()}
    for name, master in converted.amp_master_params_.items():
        assert torch.equal(master, weights[name])  # masters start at the fp32 weights
    converted.partial_fit(X, y)  # continues as 'pure'
    assert_module_follows_masters(converted)
    assert not torch.equal(converted.amp_master_params_["embed.weight"], weights["embed.weight"])
    converted.fit(X, y)  # re-initializes, as skorch's fit does, and trains 'pure'
    assert converted.module_.embed.weight.dtype == BF16
    assert_module_follows_masters(converted)


def test_convert_fp16_tiny(classifier_data):
    X, y = classifier_data
    net = make_net(amp_enabled=False, amp_level="mixed", amp_dtype="auto").fit(X, y)
    converted = net.convert_for_inference("float16")
    assert {p.dtype for p in converted.module_.parameters()} == {FP16}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proba = converted.predict_proba(X)
    assert np.abs(proba - net.predict_proba(X)).max() <= 5e-3


def test_convert_a_trimmed_net_keeps_no_masters(classifier_data):
    X, y = classifier_data
    net = make_net(amp_enabled=False, amp_level="mixed", amp_dtype="auto").fit(X, y)
    net.trim_for_prediction()
    converted = net.convert_for_inference("bfloat16")
    assert converted.amp_master_params_ is None and converted.optimizer_ is None
    assert converted.module_.embed.weight.dtype == BF16
    assert np.abs(converted.predict_proba(X) - net.predict_proba(X)).max() <= 2e-2


def test_second_fit_with_a_module_instance_keeps_the_pure_layout(classifier_data):
    X, y = classifier_data
    torch.manual_seed(0)
    net = small_classifier(module=MLP(), amp_enabled=True, amp_dtype="bfloat16", amp_level="pure")
    for _ in range(2):
        net.fit(X, y)
        assert net.amp_layout_.low_precision_params == ("hidden.weight", "hidden.bias", "out.weight", "out.bias")
        assert net.module_.hidden.weight.dtype == torch.bfloat16
        assert set(net.amp_master_params_) == set(net.amp_layout_.low_precision_params)
    net.set_params(amp_enabled=False)
    assert net.module_.hidden.weight.dtype == torch.float32 and net.amp_master_params_ is None
