"""Fused optimizers (``optimizer__fused=True``) as first-class citizens: they
get torch's ``grad_scale``/``found_inf`` protocol under float16, skipped
steps are recorded and hold LR schedulers, clipping callbacks see unscaled
gradients, and results equal the unfused optimizer within float tolerance,
for every precision level."""

import warnings

import pytest
import torch
from skorch.callbacks import Callback, GradientNormClipping, LRScheduler
from torch.optim.lr_scheduler import StepLR

from ampnet import AmpNetClassifier, AmpWarning

from conftest import Logits

PRECISIONS = {
    "fp16": dict(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0),
    "fp16-pure": dict(amp_enabled=True, amp_dtype="float16", amp_level="pure", grad_scaler__init_scale=256.0),
    "fp16-compensated": dict(amp_enabled=True, amp_dtype="float16", amp_level="pure",
                             amp_master_weights="compensated", grad_scaler__init_scale=256.0),
    "bf16": dict(amp_enabled=True, amp_dtype="bfloat16"),
    "bf16-pure": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure"),
    "bf16-compensated": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
                             amp_master_weights="compensated"),
}

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(momentum=0.9, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, dict(weight_decay=0.1)),
}


class Seen(Callback):
    """What the optimizer and the callbacks see in each step."""

    def initialize(self):
        self.grad_norms, self.lrs = [], []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        grads = [p.grad.float() for _, p in named_parameters if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.lrs.append(net.optimizer_.param_groups[0]["lr"])


class Recorder(Callback):
    """Records, at each optimizer step, the attributes of torch's scaler protocol."""

    def initialize(self):
        self.calls = []
        return self

    def on_train_begin(self, net, **kwargs):
        def hook(optimizer, args, kwargs):
            self.calls.append((getattr(optimizer, "grad_scale", "unset"), getattr(optimizer, "found_inf", None)))

        net.optimizer_.register_step_pre_hook(hook)


def fit(precision, optimizer, fused, bad_calls=(3,), **kw):
    cls, options = OPTIMIZERS[optimizer]
    seen = Seen()
    recorder = Recorder()
    torch.manual_seed(0)
    net = AmpNetClassifier(
        Logits, module__bad_calls=bad_calls, criterion=torch.nn.CrossEntropyLoss,
        optimizer=cls, optimizer__fused=fused,
        **{"optimizer__" + k: v for k, v in options.items()}, lr=0.01, max_epochs=2, batch_size=16,
        train_split=None, verbose=0, iterator_train__shuffle=False, callbacks=[seen, recorder, *kw.pop("callbacks", [])],
        **PRECISIONS[precision], **kw,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float16 autocast on CPU", AmpWarning)
        warnings.filterwarnings("ignore", "A training batch holds NaN", AmpWarning)
        warnings.filterwarnings("ignore", "Non-finite gradients", AmpWarning)
        net.fit(X64, Y64)
    seen.calls = recorder.calls
    return net, seen


@pytest.fixture(scope="module", autouse=True)
def data(classifier_data):
    global X64, Y64
    X64, Y64 = classifier_data[0][:64], classifier_data[1][:64]


def fused_sgd_updates_bfloat16():
    """Whether this torch's CPU fused SGD updates bfloat16 tensors (pytorch/pytorch#191763)."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=1.0, fused=True).step()
    return bool((p.detach() == -1).all())


def refusal(precision, optimizer):
    """The error a fused optimizer gets under ``precision``, or None."""
    if precision == "fp16-compensated" and optimizer != "sgd":
        return "keeps the optimizer state in float16"
    if precision.endswith("compensated") and optimizer == "sgd" and not fused_sgd_updates_bfloat16():
        return r"does not update \w+ parameters on cpu .*pytorch/pytorch#191763.*optimizer__fused=False"
    return None


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_fused_equals_unfused_with_the_same_skips(precision, optimizer):
    refused = refusal(precision, optimizer)
    if refused:
        with pytest.raises(ValueError, match=refused):
            fit(precision, optimizer, fused=True)
        return
    plain, seen_plain = fit(precision, optimizer, fused=False, callbacks=[GradientNormClipping(0.5)])
    fused, seen_fused = fit(precision, optimizer, fused=True, callbacks=[GradientNormClipping(0.5)])
    assert fused.optimizer_.defaults["fused"] and not plain.optimizer_.defaults["fused"]
    skipped = [b["step_skipped"] for row in fused.history for b in row["batches"]]
    assert skipped == [b["step_skipped"] for row in plain.history for b in row["batches"]]
    assert skipped[2] is True and sum(skipped) == 1  # the third forward is non-finite
    low = fused.module_.hidden.weight.dtype != torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if low else dict(atol=1e-5, rtol=1e-4)
    for (name, a), b in zip(plain.module_.named_parameters(), fused.module_.parameters()):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    # clipping callbacks saw the same (unscaled) gradient norms
    assert seen_fused.grad_norms == pytest.approx(seen_plain.grad_norms, rel=2e-2, nan_ok=True)


def test_fused_sgd_over_bfloat16_weights_without_masters_is_refused_where_torch_skips_updates():
    kw = dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights=False)
    net = AmpNetClassifier(Logits, optimizer=torch.optim.SGD, optimizer__fused=True, **kw)
    if fused_sgd_updates_bfloat16():
        assert net.initialize().optimizer_.defaults["fused"]
        return
    with pytest.raises(ValueError, match=r"SGD\(fused=True\) does not update bfloat16 parameters on cpu"):
        net.initialize()
    # with float32 masters the fused kernel steps float32 and is fine
    assert AmpNetClassifier(Logits, optimizer=torch.optim.SGD, optimizer__fused=True,
                            **{**kw, "amp_master_weights": True}).initialize().initialized_


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure"])
def test_float16_fused_gets_found_inf_on_the_device_and_no_grad_scale(precision):
    net, seen = fit(precision, "adam", fused=True)
    calls = seen.calls
    assert len(calls) == 7  # 8 steps, one skipped: never stepped
    for grad_scale, found_inf in calls:
        assert grad_scale is None  # already unscaled: the kernel must not unscale again
        assert isinstance(found_inf, torch.Tensor) and found_inf.device.type == "cpu"
        assert float(found_inf) == 0.0
    assert not hasattr(net.optimizer_, "found_inf") and not hasattr(net.optimizer_, "grad_scale")
    steps = {float(s["step"]) for s in net.optimizer_.state.values()}
    assert steps == {7.0}


def test_bfloat16_fused_skips_on_the_device():
    # no loss scaling: no grad_scale; the non-finite flag as found_inf, so that the kernel skips a step
    # with NaN/inf gradients without a host read (ampnet.training.records reads the outcome later)
    net, seen = fit("bf16", "adam", fused=True)
    assert len(seen.calls) == 8  # every step reaches the optimizer
    assert all(grad_scale is None and isinstance(found, torch.Tensor) for grad_scale, found in seen.calls)
    assert [float(found) for _, found in seen.calls] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert not hasattr(net.optimizer_, "found_inf") and not hasattr(net.optimizer_, "grad_scale")
    assert {float(s["step"]) for s in net.optimizer_.state.values()} == {7.0}  # the third never stepped
    assert [b["step_skipped"] for epoch in net.history[:, "batches"] for b in epoch] == [False, False, True] + [False] * 5


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure", "bf16-compensated"])
def test_fused_skipped_step_holds_the_batch_scheduler(precision):
    sched = LRScheduler(StepLR, step_size=1, gamma=0.5, step_every="batch")
    net, seen = fit(precision, "adamw", fused=True, callbacks=[sched])
    skipped = [b["step_skipped"] for row in net.history for b in row["batches"]]
    expected, lr = [], 0.01
    for s in skipped:  # recorded before the scheduler's own on_batch_end
        expected.append(lr)
        lr = lr if s else lr * 0.5
    assert seen.lrs == pytest.approx(expected)


def test_fused_float16_clipping_sees_unscaled_gradients():
    _, fp16 = fit("fp16", "adam", fused=True, bad_calls=())
    plain = Seen()
    torch.manual_seed(0)
    ref = AmpNetClassifier(Logits, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.Adam,
                           optimizer__fused=True, lr=0.01, max_epochs=1, batch_size=16, train_split=None,
                           verbose=0, iterator_train__shuffle=False, callbacks=[plain]).fit(X64, Y64)
    assert ref.optimizer_.defaults["fused"]
    # the loss scale is 256: scaled gradients would be 256 times larger
    assert fp16.grad_norms[0] == pytest.approx(plain.grad_norms[0], rel=1e-2)
