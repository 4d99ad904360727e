"""Regression tests for defects found in review of the 0.2 restructure."""

import warnings

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpWarning
from conftest import MLP

FP16 = dict(amp_enabled=True, amp_dtype="float16")


def make(**kw):
    base = dict(module=MLP, max_epochs=1, lr=0.05, batch_size=16, train_split=None, verbose=0)
    base.update(kw)
    return AmpNetClassifier(**base)


def test_second_fit_with_a_module_instance_keeps_the_pure_layout(classifier_data):
    X, y = classifier_data
    torch.manual_seed(0)
    net = make(module=MLP(), amp_enabled=True, amp_dtype="bfloat16", amp_level="pure")
    for _ in range(2):
        net.fit(X, y)
        assert net.amp_layout_.low_precision_params == ("hidden.weight", "hidden.bias", "out.weight", "out.bias")
        assert net.module_.hidden.weight.dtype == torch.bfloat16
        assert set(net.amp_master_params_) == set(net.amp_layout_.low_precision_params)
    net.set_params(amp_enabled=False)
    assert net.module_.hidden.weight.dtype == torch.float32 and net.amp_master_params_ is None


def test_refused_set_params_undoes_live_scaler_and_optimizer_changes(classifier_data):
    X, y = classifier_data
    net = make(optimizer=torch.optim.LBFGS, amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
               grad_scaler__growth_factor=2.0).fit(X[:32], y[:32])
    scaler, lr = net.grad_scaler_, net.optimizer_.param_groups[0]["lr"]
    params = net.get_params(deep=False)
    with pytest.raises(ValueError, match="compensated"):
        net.set_params(grad_scaler__growth_factor=4.0, lr=0.5, amp_master_weights="compensated")
    assert net.grad_scaler_ is scaler and scaler.get_settings()["growth_factor"] == 2.0
    assert net.optimizer_.param_groups[0]["lr"] == lr
    assert net.get_params(deep=False) == params


def test_set_params_refuses_an_unavailable_device_before_anything_changes(classifier_data):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    net = make().fit(*classifier_data)
    with pytest.raises(ValueError, match=r"device='cuda', but CUDA is not available"):
        net.set_params(device="cuda")
    assert net.device == "cpu"


def test_torch_scaler_with_float16_compensated_is_refused():
    with pytest.raises(ValueError, match="compensated.*torch.amp.GradScaler refuses"):
        make(**FP16, amp_level="pure", amp_master_weights="compensated", optimizer=torch.optim.SGD,
             grad_scaler=torch.amp.GradScaler).initialize()


def test_changing_amp_level_keeps_the_loss_scale(classifier_data):
    X, y = classifier_data
    net = make(**FP16, grad_scaler__init_scale=256.0, grad_scaler__growth_interval=1).fit(X[:32], y[:32])
    scale = net.grad_scaler_.get_scale()
    assert scale != 256.0
    net.set_params(amp_level="pure")
    assert net.grad_scaler_.get_scale() == scale


def test_bad_data_in_an_earlier_micro_batch_is_bad_data_not_an_overflow(classifier_data):
    X, y = classifier_data[0][:32].copy(), classifier_data[1][:32]
    X[0, 0] = np.nan  # first micro-batch of the first group
    net = make(**FP16, gradient_accumulation_steps=2, batch_size=8, grad_scaler__init_scale=256.0,
               iterator_train__shuffle=False)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    texts = [str(w.message) for w in record]
    assert any("holds NaN or inf in its input" in t for t in texts)
    assert any("non-finite training loss" in t for t in texts)  # the NaN batch's loss
    first = net.history[0, "batches"][1]
    assert first["skip_cause"] == "nonfinite_input"
    assert first["step_skipped"] and first.get("nonfinite_input")
    assert first["loss_scale"] == 256.0  # kept, not backed off


def test_auto_choice_is_probed_again_after_a_dtype_change():
    class Overflowing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 2)
            with torch.no_grad():
                self.big.weight.fill_(3e4)

        def forward(self, X):
            return torch.softmax(self.out(self.big(X) * 1e-4), dim=-1)

    rng = np.random.RandomState(0)
    X, y = rng.rand(16, 4).astype(np.float32), rng.randint(0, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        net = make(module=Overflowing, amp_enabled=True, amp_dtype="bfloat16", amp_fp32_modules="auto")
        net.fit(X, y)
        assert net.amp_layout_.auto_fp32_modules == ()  # nothing overflows bfloat16
        net.set_params(amp_dtype="float16")
        assert net.amp_layout_.auto_fp32_modules is None  # not carried over: probed at the next fit
        net.partial_fit(X, y)
        fresh = make(module=Overflowing, amp_fp32_modules="auto", **FP16).fit(X, y)
    assert net.amp_layout_.auto_fp32_modules == fresh.amp_layout_.auto_fp32_modules == ("big",)


def test_loading_parameters_alone_into_a_compensated_net_drops_stale_compensation(classifier_data, tmp_path):
    X, y = classifier_data
    kw = dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights="compensated",
              optimizer=torch.optim.SGD, lr=0.01, max_epochs=2)
    torch.manual_seed(0)
    source = make(**kw).fit(X, y)
    source.save_params(f_params=str(tmp_path / "p.pt"))
    torch.manual_seed(1)
    net = make(**kw).fit(X, y)
    assert net.memory_report()  # trained: it holds compensation buffers
    net.load_params(f_params=str(tmp_path / "p.pt"))
    saved = torch.load(tmp_path / "p.pt", weights_only=True)
    for key, value in net.module_.state_dict().items():
        assert torch.equal(value.float(), saved[key].float()), key
    exported = net.precision_.float32_weights(net.module_, [net.optimizer_])
    for key, value in exported.items():
        assert torch.equal(value, saved[key].float()), key
