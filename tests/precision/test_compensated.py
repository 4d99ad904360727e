"""amp_master_weights='compensated': pure low-precision weights with a
low-precision compensation buffer (Kahan summation) stepped by torch's own
optimizers."""

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from skorch.callbacks import Callback, GradientNormClipping

from ampnet import AmpNetClassifier, AmpNetRegressor, AmpWarning
from ampnet_bench.workloads import MLP as BenchMLP
from ampnet_bench.workloads import _cluster_data
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.precision.compensated import KEY

from conftest import MLP, small_classifier
from precision_helpers import COMP, PURE, compensation, true_weights
from test_fused import fused_sgd_updates_bfloat16



# ---- updates below half an ulp --------------------------------------------------------


class Weights(torch.nn.Module):
    """y = X @ w with w of several magnitudes (bfloat16-representable)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0, 0.015625]))

    def forward(self, X):
        return X @ self.w.unsqueeze(1)


class MeanLoss(torch.nn.Module):
    """The mean prediction: its gradient does not depend on the weights, so
    the float64 reference sees the same gradients."""

    def forward(self, y_pred, y_true):
        return y_pred.float().mean()


X_CONST = np.tile(np.array([[0.5, 1.0, -1.0, 2.0, 0.25]], dtype=np.float32), (4, 1))
Y_CONST = np.zeros((4, 1), dtype=np.float32)
STEPS = 30

OPTIMIZERS = [
    pytest.param(torch.optim.SGD, dict(lr=1e-4), id="sgd"),
    pytest.param(torch.optim.SGD, dict(lr=1e-4, momentum=0.9, weight_decay=0.5), id="sgd-momentum-l2"),
    pytest.param(torch.optim.SGD, dict(lr=1e-4, weight_decay=0.5, maximize=True), id="sgd-maximize-l2"),
    pytest.param(torch.optim.Adam, dict(lr=1e-4, weight_decay=0.5), id="adam-l2"),
    pytest.param(torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.5), id="adamw"),
    pytest.param(torch.optim.NAdam, dict(lr=1e-4, weight_decay=0.5, decoupled_weight_decay=True), id="nadamw"),
    pytest.param(torch.optim.RMSprop, dict(lr=1e-5, weight_decay=0.5), id="rmsprop-l2"),
    pytest.param(torch.optim.Adagrad, dict(lr=1e-4), id="adagrad"),
]


def reference_weights(opt_cls, kwargs, impl):
    """The same optimizer on float64 weights with the same gradients."""
    w = torch.nn.Parameter(Weights().w.detach().double())
    opt = opt_cls([w], **kwargs, **impl)
    grad = torch.as_tensor(X_CONST[:1], dtype=torch.float64)[0]
    for _ in range(STEPS):
        w.grad = grad.clone()
        opt.step()
    return w.detach()


def train_weights(opt_cls, kwargs, impl, **precision):
    options = {"optimizer__" + k: v for k, v in {**kwargs, **impl}.items() if k != "lr"}
    net = AmpNetRegressor(
        Weights, criterion=MeanLoss, optimizer=opt_cls, lr=kwargs["lr"], max_epochs=STEPS,
        batch_size=4, train_split=None, verbose=0, **options, **precision,
    )
    return net.fit(X_CONST, Y_CONST)


FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
IMPLS = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
CASES = [
    pytest.param(p.values[0], p.values[1], impl, id=f"{p.id}-{name}")
    for p in OPTIMIZERS
    for name, impl in IMPLS.items()
    if name != "fused" or p.values[0] in FUSED  # torch has fused kernels for these only
]


@pytest.mark.parametrize("opt_cls, kwargs, impl", CASES)
def test_updates_below_half_an_ulp_are_kept(opt_cls, kwargs, impl):
    if opt_cls is torch.optim.SGD and impl.get("fused") and not fused_sgd_updates_bfloat16():
        with pytest.raises(ValueError, match=r"pytorch/pytorch#191763"):
            train_weights(opt_cls, kwargs, impl, **COMP)
        return
    ref = reference_weights(opt_cls, kwargs, impl)
    start = Weights().w.detach().double()
    moved = (ref - start).abs()
    net = train_weights(opt_cls, kwargs, impl, **COMP)
    w = true_weights(net)["w"]
    assert net.module_.w.dtype == torch.bfloat16 and compensation(net)["w"].dtype == torch.bfloat16
    # each step adds at most half an ulp of the bfloat16 compensation (|c| <= half an
    # ulp of the weight): 2**-17 of the weight; the low-precision optimizer state
    # (momentum, moments) adds a small relative error to the updates
    assert ((w - ref).abs() <= STEPS * 2.0**-16 * ref.abs() + 0.02 * moved).all(), (w - ref, moved)
    # the stored weight is the true weight rounded to bfloat16
    assert ((net.module_.w.double() - w).abs() <= w.abs() * 2.0**-8).all()
    # without compensation the same updates are rounded away
    plain = train_weights(opt_cls, kwargs, impl, **PURE, amp_dtype="bfloat16", amp_master_weights=False)
    assert ((plain.module_.w.double() - ref).abs() > 0.1 * moved).any()


# ---- pure bfloat16 training that stalls without compensation, small ---------------------


def _final_loss(**kw):
    sizes = (128, 256, 256, 10)
    data = _cluster_data(0, 1024, 0, sizes[0], sizes[-1])
    torch.manual_seed(0)
    net = AmpNetClassifier(
        BenchMLP, module__sizes=sizes, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.SGD,
        optimizer__momentum=0.9, lr=0.01, max_epochs=8, batch_size=64, train_split=None, verbose=0, **kw,
    )
    return net.fit(data.X.numpy(), data.y.numpy()).history[-1, "train_loss"]


@pytest.mark.slow
def test_final_loss_within_2_percent_of_float32_where_plain_pure_is_not():
    fp32 = _final_loss()
    comp = _final_loss(**COMP)
    plain = _final_loss(**PURE, amp_dtype="bfloat16", amp_master_weights=False)
    assert abs(comp / fp32 - 1) < 0.02, (comp, fp32)
    assert plain / fp32 - 1 > 0.10, (plain, fp32)  # measured +42%


# ---- settings --------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(amp_enabled=True, amp_master_weights="compensated"),
     r"amp_master_weights='compensated' needs amp_enabled=True and amp_level='pure' \(got "
     r"amp_enabled=True, amp_level='mixed'\).*Fix"),
    (dict(amp_level="pure", amp_master_weights="compensated"),
     r"needs amp_enabled=True and amp_level='pure' \(got amp_enabled=False"),
])
def test_compensated_needs_amp_and_pure(kw, match):
    net = AmpNetClassifier(MLP, **kw)
    with pytest.raises(ValueError, match=match):
        net.initialize()
    assert not net.initialized_


@pytest.mark.parametrize("opt_cls", [torch.optim.LBFGS, torch.optim.ASGD])
def test_optimizers_that_read_the_weight_are_refused(opt_cls):
    net = AmpNetClassifier(MLP, optimizer=opt_cls, **COMP)
    with pytest.raises(ValueError, match=rf"got optimizer=torch\.optim\.\w+\.{opt_cls.__name__}\. Fix: "
                                         r"use one of these optimizers, or amp_master_weights=True"):
        net.initialize()
    assert not net.initialized_


def test_switching_an_asgd_net_to_compensated_is_refused_and_changes_nothing(classifier_data):
    net = AmpNetClassifier(MLP, optimizer=torch.optim.ASGD, max_epochs=1, train_split=None, verbose=0,
                           **PURE, amp_dtype="bfloat16").fit(*classifier_data)
    optimizer, masters = net.optimizer_, net.amp_master_params_
    before = {k: v.clone() for k, v in net.module_.state_dict().items()}
    with pytest.raises(ValueError, match="amp_master_weights='compensated' steps the compensation"):
        net.set_params(amp_master_weights="compensated")
    assert net.amp_master_weights is True and net.optimizer_ is optimizer and net.amp_master_params_ is masters
    assert net.module_.hidden.weight.dtype == torch.bfloat16
    after = net.module_.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_float16_compensated_unscales_float16_gradients(classifier_data):
    seen = []

    class Grads(Callback):
        def on_grad_computed(self, net, named_parameters, **kw):
            seen.append({n: p.grad.clone() for n, p in named_parameters})

    torch.manual_seed(0)
    with pytest.warns(AmpWarning, match="float16 autocast on CPU"):
        net = AmpNetClassifier(MLP, max_epochs=2, lr=0.05, batch_size=64, train_split=None, verbose=0,
                               callbacks=[Grads()], **{**COMP, "amp_dtype": "float16"}).fit(*classifier_data)
    assert net.grad_scaler_.is_enabled() and net.module_.hidden.weight.dtype == torch.float16
    assert compensation(net)["hidden.weight"].dtype == torch.float16
    assert net.history[-1, "skipped_steps"] == 0
    # gradients the callbacks see are unscaled (the scale is 65536)
    ref = AmpNetClassifier(MLP, max_epochs=1, batch_size=64, train_split=None, verbose=0,
                           callbacks=[Grads()])
    first = len(seen)
    torch.manual_seed(0)
    ref.fit(*classifier_data)
    torch.testing.assert_close(seen[0]["hidden.weight"].float(), seen[first]["hidden.weight"], atol=2e-3, rtol=0.05)


# ---- skipped steps, accumulation, clipping ----------------------------------------------


class Poisoned(MLP):
    """Non-finite output at the third training forward."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, X):
        out = super().forward(X)
        if self.training:
            self.calls += 1
            if self.calls == 3:
                out = out * float("nan")
        return out


class Snapshots(Callback):
    def initialize(self):
        self.states = []
        return self

    def on_batch_end(self, net, training=False, **kw):
        if training:
            self.states.append((copy.deepcopy(dict(net.module_.named_parameters())), copy.deepcopy(compensation(net))))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_skipped_step_changes_neither_weights_nor_compensation(dtype, classifier_data):
    snaps = Snapshots()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)  # fp16 on CPU; the skipped step
        net = AmpNetClassifier(Poisoned, max_epochs=1, lr=0.05, batch_size=16, train_split=None, verbose=0,
                               callbacks=[snaps], **{**COMP, "amp_dtype": dtype}).fit(*classifier_data)
    skipped = [b["step_skipped"] for b in net.history[-1, "batches"]]
    assert skipped[2] is True and sum(skipped) == 1
    (p_before, c_before), (p_after, c_after) = snaps.states[1], snaps.states[2]
    assert all(torch.equal(p_before[n], p_after[n]) for n in p_before)
    assert c_before.keys() == c_after.keys() and len(c_before) == 4
    assert all(torch.equal(c_before[n], c_after[n]) for n in c_before)
    (_, c_next) = snaps.states[3]
    assert any(not torch.equal(c_after[n], c_next[n]) for n in c_after)  # the next step moves on


def test_gradient_accumulation_matches_the_large_batch(classifier_data):
    def fit(**kw):
        torch.manual_seed(0)
        return AmpNetClassifier(MLP, max_epochs=3, lr=0.05, train_split=None, verbose=0, **COMP, **kw).fit(
            *classifier_data)

    big = fit(batch_size=32)
    small = fit(batch_size=16, gradient_accumulation_steps=2)
    assert small.module_.hidden.weight.grad.dtype == torch.bfloat16  # accumulated in bfloat16
    for name, w in true_weights(big).items():
        torch.testing.assert_close(true_weights(small)[name], w, atol=1e-2, rtol=1e-2)
    assert len(compensation(small)) == 4


def test_clipping_callback_clips_the_updates(classifier_data):
    def fit(**kw):
        torch.manual_seed(0)
        return AmpNetClassifier(MLP, max_epochs=1, lr=0.5, batch_size=32, train_split=None, verbose=0,
                                **COMP, **kw).fit(*classifier_data)

    torch.manual_seed(0)
    init = {n: p.detach().bfloat16().double() for n, p in MLP().named_parameters()}
    free, clipped = fit(), fit(callbacks=[GradientNormClipping(gradient_clip_value=1e-3)])
    step_free = sum(float((w - init[n]).norm() ** 2) for n, w in true_weights(free).items()) ** 0.5
    step_clip = sum(float((w - init[n]).norm() ** 2) for n, w in true_weights(clipped).items()) ** 0.5
    # 4 steps of lr 0.5 on a gradient of norm <= 1e-3: the weights move by at most 2e-3
    assert step_clip <= 4 * 0.5 * 1e-3 * 1.05 < step_free


# ---- state: checkpoints, pickles, clone, conversion ----------------------------------------


def _net(**kw):
    torch.manual_seed(0)
    return AmpNetClassifier(MLP, optimizer=torch.optim.Adam, lr=0.01, batch_size=16, train_split=None,
                            verbose=0, iterator_train__shuffle=True, **COMP, **kw)


def test_checkpoint_resume_is_bitexact(tmp_path, classifier_data):
    X, y = classifier_data
    torch.manual_seed(1)
    whole = _net(max_epochs=4).fit(X, y)
    torch.manual_seed(1)
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    _net(max_epochs=2, callbacks=[cp]).fit(X, y)
    torch.manual_seed(123)  # a different process state: the checkpoint restores it
    resumed = _net(max_epochs=2, callbacks=[LoadInitState(cp), cp]).fit(X, y)
    assert len(resumed.history) == 4
    for name, p in whole.module_.named_parameters():
        assert torch.equal(dict(resumed.module_.named_parameters())[name], p), name
    comps = compensation(whole)
    assert len(comps) == 4
    assert all(torch.equal(compensation(resumed)[n], c) for n, c in comps.items())


def test_save_and_load_params_restore_the_compensation(tmp_path, classifier_data):
    net = _net(max_epochs=2).fit(*classifier_data)
    net.save_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    fresh = _net().initialize()
    assert compensation(fresh) == {}
    fresh.load_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    for name, c in compensation(net).items():
        assert torch.equal(compensation(fresh)[name], c) and c.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(fresh.module_.parameters(), net.module_.parameters()))


def test_pickle_and_deepcopy_keep_training_identically(classifier_data):
    X, y = classifier_data
    net = _net(max_epochs=1).fit(X, y)
    copies = [pickle.loads(pickle.dumps(net)), copy.deepcopy(net)]
    torch.manual_seed(5)
    net.partial_fit(X, y)
    for other in copies:
        assert other.optimizer_.state[other.module_.hidden.weight][KEY] is compensation(other)["hidden.weight"]
        torch.manual_seed(5)
        other.partial_fit(X, y)
        assert all(torch.equal(a, b) for a, b in zip(other.module_.parameters(), net.module_.parameters()))
        assert all(torch.equal(compensation(other)[n], c) for n, c in compensation(net).items())


def test_clone_keeps_the_setting(classifier_data):
    net = _net(max_epochs=1).fit(*classifier_data)
    fresh = clone(net)
    assert fresh.amp_master_weights == "compensated" and not fresh.initialized_
    fresh.fit(*classifier_data)
    assert len(compensation(fresh)) == 4


def test_convert_for_inference_uses_the_compensated_weights(classifier_data):
    X, _ = classifier_data
    net = _net(max_epochs=2).fit(*classifier_data)
    same = net.convert_for_inference()
    assert same.amp_master_weights == "compensated" and same.module_.hidden.weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(same.predict_proba(X), net.predict_proba(X))
    wide = true_weights(net)
    fp16 = net.convert_for_inference("float16")
    assert fp16.amp_master_weights is True and fp16.module_.hidden.weight.dtype == torch.float16
    # the float32 masters are the weights plus their compensation
    for name, master in fp16.amp_master_params_.items():
        assert torch.equal(master.double(), wide[name]), name
    assert compensation(fp16) == {}
    assert len(compensation(net)) == 4  # the original net is unchanged


def test_switching_to_master_weights_keeps_the_compensated_weights(classifier_data):
    net = _net(max_epochs=2).fit(*classifier_data)
    wide = true_weights(net)
    net.set_params(amp_master_weights=True)
    for name, master in net.amp_master_params_.items():
        assert torch.equal(master.double(), wide[name]), name
    assert all(KEY not in s for s in net.optimizer_.state.values())
    net.partial_fit(*classifier_data)  # trains on


def test_export_uses_the_compensated_weights(tmp_path, classifier_data):
    pytest.importorskip("onnx")
    from ampnet.serving.export import _float32_copy

    net = _net(max_epochs=2).fit(*classifier_data)
    module = _float32_copy(net)  # no AmpWarning: nothing is lost
    wide = true_weights(net)
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.double(), wide[name]), name


def test_float16_compensated_refuses_optimizers_with_second_moments():
    net = AmpNetClassifier(MLP, optimizer=torch.optim.Adam, **{**COMP, "amp_dtype": "float16"})
    with pytest.raises(ValueError, match=r"with amp_dtype='float16' keeps the optimizer state in float16, "
                                         r"where Adam's eps .* Fix: amp_dtype='bfloat16'"):
        net.initialize()
    assert not net.initialized_


def test_torch_scaler_with_float16_compensated_is_refused():
    with pytest.raises(ValueError, match="compensated.*torch.amp.GradScaler refuses"):
        small_classifier(amp_enabled=True, amp_dtype="float16", amp_level="pure", amp_master_weights="compensated", optimizer=torch.optim.SGD,
             grad_scaler=torch.amp.GradScaler).initialize()


def test_loading_parameters_alone_into_a_compensated_net_drops_stale_compensation(classifier_data, tmp_path):
    X, y = classifier_data
    kw = dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights="compensated",
              optimizer=torch.optim.SGD, lr=0.01, max_epochs=2)
    torch.manual_seed(0)
    source = small_classifier(**kw).fit(X, y)
    source.save_params(f_params=str(tmp_path / "p.pt"))
    torch.manual_seed(1)
    net = small_classifier(**kw).fit(X, y)
    assert net.memory_report()  # trained: it holds compensation buffers
    net.load_params(f_params=str(tmp_path / "p.pt"))
    saved = torch.load(tmp_path / "p.pt", weights_only=True)
    for key, value in net.module_.state_dict().items():
        assert torch.equal(value.float(), saved[key].float()), key
    exported = net.precision_.float32_weights(net.module_, [net.optimizer_])
    for key, value in exported.items():
        assert torch.equal(value, saved[key].float()), key
