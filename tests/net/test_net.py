"""AmpNet core: parity with skorch, autocast placement, output dtypes,
the grad scaler as a component, the training step order, bad input."""

import warnings

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier, NeuralNetRegressor
from skorch.callbacks import Callback, GradientNormClipping

from ampnet import (
    AmpNet,
    AmpNetBinaryClassifier,
    AmpNetClassifier,
    AmpNetRegressor,
    AmpStateError,
    AmpWarning,
    GradScaler,
)
from conftest import MLP, Regressor, params_equal


def fit_quiet(net, X, y, **kw):
    """Fit, accepting only the fp16-on-CPU AmpWarning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
        return net.fit(X, y, **kw)


class AutocastRecorder(torch.nn.Module):
    """Records, at every forward, whether autocast is on and its dtype."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 2)
        self.seen = []

    def forward(self, X):
        out = self.lin(X)
        self.seen.append(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype, self.training)
        )
        return torch.softmax(out, dim=-1)


class FailingModule(AutocastRecorder):
    def forward(self, X):
        super().forward(X)
        raise RuntimeError("boom")


# ---- parity with skorch when AMP is off -----------------------------------------


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.LBFGS, torch.optim.Adam])
def test_amp_off_is_bitwise_skorch(classifier_data, optimizer):
    X, y = classifier_data
    kw = dict(module=MLP, max_epochs=3, lr=0.1, optimizer=optimizer, verbose=0, batch_size=32)
    torch.manual_seed(0)
    ref = NeuralNetClassifier(**kw).fit(X, y)
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw).fit(X, y)
    assert params_equal(ref, net)
    for key in ("train_loss", "valid_loss", "valid_acc"):
        assert ref.history[:, key] == net.history[:, key]
    assert "loss_scale" not in net.history[-1]
    assert not net.grad_scaler_.is_enabled()


def test_amp_off_regressor_is_bitwise_skorch(regression_data):
    X, y = regression_data
    kw = dict(module=Regressor, max_epochs=2, lr=0.05, verbose=0)
    torch.manual_seed(0)
    ref = NeuralNetRegressor(**kw).fit(X, y)
    torch.manual_seed(0)
    net = AmpNetRegressor(**kw).fit(X, y)
    assert params_equal(ref, net)


@pytest.mark.parametrize("cls, base", [(AmpNet, "NeuralNet"), (AmpNetClassifier, "NeuralNetClassifier"),
                                       (AmpNetRegressor, "NeuralNetRegressor"),
                                       (AmpNetBinaryClassifier, "NeuralNetBinaryClassifier")])
def test_classes_subclass_skorch(cls, base):
    import skorch

    assert issubclass(cls, getattr(skorch, base))
    assert "amp_enabled" in cls.__doc__


# ---- autocast placement ----------------------------------------------------------


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_autocast_inside_forward_only(classifier_data, dtype, torch_dtype):
    X, y = classifier_data
    net = AmpNetClassifier(AutocastRecorder, amp_enabled=True, amp_dtype=dtype, max_epochs=1, verbose=0)
    fit_quiet(net, X[:64], y[:64])
    seen = net.module_.seen
    assert seen and all(on and d == torch_dtype and out == torch_dtype for on, d, out, _ in seen)
    assert {training for *_, training in seen} == {True, False}  # train and validation
    assert not torch.is_autocast_enabled("cpu")
    net.module_.seen.clear()
    proba = net.predict_proba(X[:10])
    assert net.module_.seen[0][:3] == (True, torch_dtype, torch_dtype)
    assert proba.dtype == np.float32
    assert not torch.is_autocast_enabled("cpu")
    # weights, gradients and optimizer state stay float32
    for p in net.module_.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_autocast_off_after_fit_raised(classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(FailingModule, amp_enabled=True, amp_dtype="bf16", max_epochs=1, verbose=0)
    with pytest.raises(RuntimeError, match="boom"):
        net.fit(X, y)
    assert net.module_.seen[0][0] is True
    assert not torch.is_autocast_enabled("cpu")


def test_backward_runs_outside_autocast(classifier_data):
    X, y = classifier_data
    seen = []

    class Probe(AmpNetClassifier):
        def backward(self, loss):
            seen.append(torch.is_autocast_enabled("cpu"))
            super().backward(loss)

    Probe(MLP, amp_enabled=True, amp_dtype="bf16", max_epochs=1, verbose=0).fit(X, y)
    assert seen and not any(seen)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_outputs_are_float32(classifier_data, dtype):
    X, y = classifier_data
    net = fit_quiet(AmpNetClassifier(MLP, amp_enabled=True, amp_dtype=dtype, max_epochs=1, verbose=0), X, y)
    assert net.predict_proba(X).dtype == np.float32
    assert net.forward(X).dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in net.forward_iter(X))
    assert net.predict(X).shape == (len(X),)


def test_regressor_and_binary_classifier_bf16(regression_data, classifier_data):
    X, y = regression_data
    reg = AmpNetRegressor(Regressor, amp_enabled=True, amp_dtype="bf16", max_epochs=2, verbose=0).fit(X, y)
    assert reg.predict(X).dtype == np.float32
    Xc, yc = classifier_data

    class Logit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(20, 1)

        def forward(self, X):
            return self.lin(X)

    binary = AmpNetBinaryClassifier(Logit, amp_enabled=True, amp_dtype="bf16", max_epochs=2, verbose=0)
    binary.fit(Xc, yc.astype(np.float32))
    assert binary.predict_proba(Xc).dtype == np.float32
    assert set(np.unique(binary.predict(Xc))) <= {0, 1}


# ---- the grad scaler as a component ----------------------------------------------


def test_grad_scaler_never_none(classifier_data):
    X, y = classifier_data
    off = AmpNetClassifier(MLP, max_epochs=1, verbose=0).initialize()
    bf16 = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="bf16").initialize()
    fp16 = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16").initialize()
    assert isinstance(off.grad_scaler_, GradScaler) and not off.grad_scaler_.is_enabled()
    assert not bf16.grad_scaler_.is_enabled()
    assert fp16.grad_scaler_.is_enabled() and fp16.grad_scaler_.get_scale() == 2.0**16


def test_live_scaler_setting_updates_scaler_params_and_clone(capsys):
    from sklearn.base import clone

    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16").initialize()
    scaler = net.grad_scaler_
    capsys.readouterr()
    net.set_params(grad_scaler__growth_factor=4, grad_scaler__growth_interval=10)
    assert net.grad_scaler_ is scaler  # live, not rebuilt
    assert scaler.get_growth_factor() == 4.0 and scaler.get_growth_interval() == 10
    assert net.get_params()["grad_scaler__growth_factor"] == 4
    assert clone(net).get_params()["grad_scaler__growth_interval"] == 10
    assert "Re-initializing" not in capsys.readouterr().out


def test_rebuilding_scaler_settings_print_reinit_message(capsys):
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16").initialize()
    old = net.grad_scaler_
    capsys.readouterr()
    net.set_params(grad_scaler__init_scale=1024.0)
    out = capsys.readouterr().out
    assert "Re-initializing grad_scaler because the following parameters were re-set: grad_scaler__init_scale." in out
    assert net.grad_scaler_ is not old and net.grad_scaler_.get_scale() == 1024.0


def test_set_params_precision_rebuilds_policy_and_scaler(capsys, classifier_data):
    X, y = classifier_data
    net = fit_quiet(AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16", max_epochs=1, verbose=0), X, y)
    assert net.grad_scaler_.is_enabled()
    net.set_params(amp_dtype="bfloat16", verbose=1)
    assert "Re-initializing grad_scaler because the following parameters were re-set: amp_dtype." in capsys.readouterr().out
    assert net.precision_policy_.compute_dtype == torch.bfloat16
    assert not net.grad_scaler_.is_enabled()  # no stale fp16 scaler
    net.set_params(verbose=0)
    net.partial_fit(X, y)
    net.set_params(amp_enabled=False)
    assert not net.precision_policy_.enabled


def test_scaler_instance_is_copied_not_trained(classifier_data):
    from sklearn.base import clone

    X, y = classifier_data
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1)
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16", grad_scaler=scaler, max_epochs=1,
                           verbose=0)
    net.fit(X, y)
    assert net.grad_scaler_ is not scaler and net.grad_scaler_.get_scale() > 8.0
    assert scaler.get_scale() == 8.0  # the hyper-parameter is unchanged
    assert clone(net).initialize().grad_scaler_.get_scale() == 8.0


def test_set_params_grad_scaler_on_fitted_net(capsys):
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16").initialize()
    capsys.readouterr()
    net.set_params(grad_scaler=GradScaler("cpu", init_scale=4.0))
    assert net.grad_scaler_.get_scale() == 4.0
    assert "Re-initializing grad_scaler because the following parameters were re-set: grad_scaler." in (
        capsys.readouterr().out
    )
    with pytest.raises(ValueError, match="grad_scaler must be a torch.amp.GradScaler"):
        net.set_params(grad_scaler="fp16")


def test_step_settings_rechecked_by_set_params():
    net = AmpNetClassifier(MLP, optimizer=torch.optim.LBFGS).initialize()
    with pytest.raises(ValueError, match=r"LBFGS\) needs a closure.*gradient_accumulation_steps=2"):
        net.set_params(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an int >= 1; got 0"):
        AmpNetClassifier(MLP).initialize().set_params(gradient_accumulation_steps=0)


def test_live_bounds_apply_before_the_first_step():
    from sklearn.base import clone

    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16").initialize()
    with pytest.raises(ValueError, match=r"init_scale=65536.0.*must lie within"):
        net.set_params(grad_scaler__max_scale=1024.0)
    net.set_params(grad_scaler__max_scale=1024.0, grad_scaler__init_scale=512.0)
    assert net.grad_scaler_.get_scale() == 512.0
    assert clone(net).initialize().grad_scaler_.get_scale() == 512.0


def test_interrupted_step_does_not_block_the_next_fit(classifier_data):
    X, y = classifier_data

    class Boom(Callback):
        def initialize(self):
            self.armed = True
            return self

        def on_grad_computed(self, net, **kwargs):
            if self.armed:
                self.armed = False
                raise RuntimeError("callback failed")

    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16", callbacks=[Boom()], max_epochs=1,
                           verbose=0)
    net.initialize()
    with pytest.raises(RuntimeError, match="callback failed"):
        net.partial_fit(X, y)
    net.partial_fit(X, y)  # torch's scaler would say "unscale_() has already been called"
    assert net.history[-1, "skipped_steps"] == 0


def test_fp16_without_scaling_warns():
    with pytest.warns(AmpWarning, match="without loss scaling"):
        AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16", grad_scaler__enabled=False).initialize()


def test_scaler_enabled_without_amp_is_an_error():
    with pytest.raises(ValueError, match="grad_scaler__enabled=True needs amp_enabled=True"):
        AmpNetClassifier(MLP, grad_scaler__enabled=True).initialize()


# ---- the training step -------------------------------------------------------------


class GradientValueClipping(Callback):
    """Clip-by-value in on_grad_computed (skorch 1.4 ships only norm clipping)."""

    def __init__(self, clip_value):
        self.clip_value = clip_value

    def on_grad_computed(self, net, named_parameters, **kwargs):
        torch.nn.utils.clip_grad_value_((p for _, p in named_parameters), self.clip_value)


class StepRecorder(Callback):
    """Records the gradient norm the callbacks see and the loss scale."""

    def initialize(self):
        self.norms = []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        grads = [p.grad for _, p in named_parameters if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def test_callbacks_see_unscaled_gradients(classifier_data):
    X, y = classifier_data[0][:64], classifier_data[1][:64]
    kw = dict(module=MLP, max_epochs=1, lr=0.1, verbose=0, batch_size=16, train_split=None)
    rec32, rec16 = StepRecorder(), StepRecorder()
    torch.manual_seed(0)
    AmpNetClassifier(callbacks=[rec32], **kw).fit(X, y)
    torch.manual_seed(0)
    fit_quiet(AmpNetClassifier(callbacks=[rec16], amp_enabled=True, amp_dtype="fp16",
                               grad_scaler__init_scale=2.0**12, **kw), X, y)
    assert len(rec16.norms) == len(rec32.norms) == 4
    np.testing.assert_allclose(rec16.norms, rec32.norms, rtol=2e-2)


@pytest.mark.parametrize("clipper", [GradientNormClipping(0.05), GradientValueClipping(0.01)])
def test_fp16_clipping_matches_fp32(classifier_data, clipper):
    X, y = classifier_data[0][:64], classifier_data[1][:64]
    kw = dict(module=MLP, max_epochs=2, lr=0.5, verbose=0, batch_size=16, train_split=None)
    torch.manual_seed(0)
    ref = AmpNetClassifier(callbacks=[clipper], **kw).fit(X, y)
    torch.manual_seed(0)
    amp = fit_quiet(AmpNetClassifier(callbacks=[clipper], amp_enabled=True, amp_dtype="fp16", **kw), X, y)
    torch.manual_seed(0)
    unclipped = AmpNetClassifier(**kw).fit(X, y)
    diff_amp = max((a - b).abs().max().item() for a, b in zip(amp.module_.parameters(), ref.module_.parameters()))
    diff_clip = max((a - b).abs().max().item() for a, b in zip(unclipped.module_.parameters(), ref.module_.parameters()))
    # fp16 rounding flips a few values around the threshold; clipping itself
    # moves the weights far more (otherwise the comparison says nothing)
    assert diff_amp < 1e-2
    assert diff_clip > 10 * diff_amp


class InfAt(torch.nn.Module):
    """MLP whose output (``backward=False``) or whose output's gradient
    (``backward=True``: a finite loss, a backward-pass overflow) becomes inf
    on chosen training forward calls."""

    def __init__(self, bad_calls=(2,), backward=False):
        super().__init__()
        self.lin = torch.nn.Linear(20, 2)
        self.bad_calls = set(bad_calls)
        self.backward = backward
        self.calls = 0

    def forward(self, X):
        out = self.lin(X)
        if self.training:
            self.calls += 1
            if self.calls in self.bad_calls and self.backward:
                out = out.clone()
                out.register_hook(lambda g: g * float("inf"))
            elif self.calls in self.bad_calls:
                out = out * float("inf")
        return torch.softmax(out, dim=-1)


class Snapshots(Callback):
    def initialize(self):
        self.params = []
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.params.append([p.detach().clone() for p in net.module_.parameters()])


def test_injected_inf_skips_step_atomically_and_halves_scale(classifier_data):
    X, y = classifier_data[0][:64], classifier_data[1][:64]
    snaps = Snapshots()
    net = AmpNetClassifier(InfAt, module__bad_calls=(3,), module__backward=True, amp_enabled=True,
                           amp_dtype="fp16", grad_scaler__init_scale=1024.0, max_epochs=1, batch_size=16, lr=0.1,
                           train_split=None, verbose=0, callbacks=[snaps])
    fit_quiet(net, X, y)  # the injected inf in the backward pass: an overflow, the scale backs off
    batches = net.history[-1, "batches"]
    assert [b["step_skipped"] for b in batches] == [False, False, True, False]
    assert [b["loss_scale"] for b in batches] == [1024.0, 1024.0, 512.0, 512.0]
    assert all(torch.equal(a, b) for a, b in zip(snaps.params[1], snaps.params[2]))
    assert not all(torch.equal(a, b) for a, b in zip(snaps.params[2], snaps.params[3]))
    assert net.history[-1, "skipped_steps"] == 1
    assert net.history[-1, "loss_scale"] == 512.0


def test_exact_scale_after_good_steps(classifier_data):
    X, y = classifier_data[0][:64], classifier_data[1][:64]
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16", grad_scaler__init_scale=2.0**8,
                           grad_scaler__growth_interval=2, max_epochs=3, batch_size=16,
                           train_split=None, verbose=0)
    fit_quiet(net, X, y)
    steps = 3 * 4
    assert net.grad_scaler_.get_scale() == 2.0**8 * 2 ** (steps // 2)
    assert net.history[:, "skipped_steps"] == [0, 0, 0]


def test_unscaled_backward_in_override_is_an_error(classifier_data):
    X, y = classifier_data

    class Careless(AmpNetClassifier):
        def train_step_single(self, batch, **fit_params):
            Xi, yi = batch
            y_pred = self.infer(Xi)
            loss = self.get_loss(y_pred, yi, X=Xi, training=True)
            loss.backward()
            return {"loss": loss, "y_pred": y_pred}

    net = Careless(MLP, amp_enabled=True, amp_dtype="fp16", max_epochs=1, verbose=0)
    with pytest.raises(AmpStateError, match=r"loss.backward\(\) directly.*self.backward\(loss\)"):
        fit_quiet(net, X, y)


def test_lbfgs_closure_rules(classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(MLP, optimizer=torch.optim.LBFGS, amp_enabled=True, amp_dtype="fp16")
    with pytest.raises(ValueError, match=r"LBFGS\) needs a closure.*amp_dtype='bfloat16'"):
        net.initialize()
    bf16 = AmpNetClassifier(MLP, optimizer=torch.optim.LBFGS, amp_enabled=True, amp_dtype="bf16",
                            max_epochs=2, lr=0.5, verbose=0).fit(X, y)
    assert bf16.history[-1, "train_loss"] < bf16.history[0, "train_loss"]


# ---- bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"amp_dtype": "float32"}, ValueError, r"amp_dtype must be one of.*got 'float32'"),
        ({"amp_enabled": "true"}, ValueError, r"amp_enabled must be True, False or 'auto'; got 'true' \(str\)"),
        ({"grad_scaler__growth_factr": 2.0}, ValueError,
         r"grad_scaler__growth_factr \(did you mean grad_scaler__growth_factor\?\)"),
        ({"grad_scaler__init_scale": 0}, ValueError, r"grad_scaler__init_scale=0 \(int\): must be a finite number > 0"),
        ({"grad_scaler__growth_factor": 1.0}, ValueError, r"grad_scaler__growth_factor=1.0"),
        ({"grad_scaler__backoff_factor": 1.5}, ValueError, r"grad_scaler__backoff_factor=1.5.*\(0, 1\)"),
        ({"grad_scaler__growth_interval": 0}, ValueError, r"grad_scaler__growth_interval=0"),
        ({"gradient_accumulation_steps": 0}, ValueError, r"gradient_accumulation_steps must be an int >= 1; got 0"),
        ({"amp_max_consecutive_skips": 0}, ValueError, r"amp_max_consecutive_skips must be None or an int >= 1"),
        ({"grad_scaler": "fp16"}, ValueError, r"grad_scaler must be a torch.amp.GradScaler subclass or instance"),
        ({"device": "gpu"}, ValueError, r"device must be a torch device.*got 'gpu'"),
    ],
)
def test_bad_input_errors_at_initialize(kw, exc, match):
    kw = {"amp_enabled": True, "amp_dtype": "fp16", **kw}
    with pytest.raises(exc, match=match):
        AmpNetClassifier(MLP, **kw).initialize()


def test_float64_input_trains_under_amp(classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="bf16", max_epochs=2, verbose=0)
    net.fit(X.astype(np.float64), y)
    assert net.predict_proba(X.astype(np.float64)).dtype == np.float32


def test_integer_input_gets_a_clear_error(classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="bf16", max_epochs=1, verbose=0)
    with pytest.raises(TypeError, match=r"input of dtype torch.int64.*X.astype\(numpy.float32\)"):
        net.fit(X.astype(np.int64), y)


def test_notice_warned_once_per_fit(classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="fp16", max_epochs=2, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.fit(X[:32], y[:32])
    slow = [w for w in caught if issubclass(w.category, AmpWarning)]
    assert len(slow) == 1 and "slower than float32" in str(slow[0].message)


class ClosureSGD(torch.optim.SGD):
    """A custom optimizer (outside torch.optim) that evaluates an optional
    closure twice, as sharpness-aware optimizers do."""

    calls = 0

    def step(self, closure=None):
        if closure is not None:
            closure()
            type(self).calls += 1
        return super().step(closure)


ClosureSGD.__module__ = "my_optimizers"


def test_custom_optional_closure_optimizer_gets_the_closure_like_skorch(classifier_data):
    X, y = classifier_data
    kw = dict(module=MLP, max_epochs=2, lr=0.1, optimizer=ClosureSGD, verbose=0, batch_size=32)
    ClosureSGD.calls = 0
    torch.manual_seed(0)
    ref = NeuralNetClassifier(**kw).fit(X, y)
    skorch_calls, ClosureSGD.calls = ClosureSGD.calls, 0
    torch.manual_seed(0)
    with pytest.warns(AmpWarning, match=r"ClosureSGD\) takes an optional closure.*guard"):
        net = AmpNetClassifier(**kw).fit(X, y)
    assert ClosureSGD.calls == skorch_calls > 0
    assert params_equal(ref, net)
    # with loss scaling the closure cannot be passed: ampnet's own step is used
    fp16 = AmpNetClassifier(**{**kw, "amp_enabled": True, "amp_dtype": "fp16"}).initialize()
    assert not fp16.amp_step_state_.closure
