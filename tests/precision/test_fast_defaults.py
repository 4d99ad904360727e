"""Fast optimizer kernels by default with AMP on (ampnet.precision.kernels):
fused where torch's fused kernel works for the optimizer, device and dtype,
else foreach; the user's choice is kept; AMP off builds skorch's optimizer."""

import warnings

import pytest
import torch
from skorch.callbacks import GradientNormClipping, LRScheduler
from torch.optim.lr_scheduler import StepLR

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.precision.kernels import fused_works, keep_kernels, kernel_defaults

from test_fused import Recorder
from conftest import Logits, net_kw

BF16 = dict(amp_enabled=True, amp_dtype="bfloat16")
CPU = torch.device("cpu")


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_amp_uses_the_fused_kernel_where_torch_has_one(optimizer):
    net = AmpNetClassifier(Logits, optimizer=optimizer, **BF16).initialize()
    assert net.optimizer_.defaults["fused"] is True
    assert all(group["fused"] is True for group in net.optimizer_.param_groups)


@pytest.mark.parametrize("optimizer", [torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam])
def test_amp_uses_foreach_without_a_fused_kernel(optimizer):
    net = AmpNetClassifier(Logits, optimizer=optimizer, **BF16).initialize()
    assert net.optimizer_.defaults["foreach"] is True
    assert "fused" not in net.optimizer_.defaults or not net.optimizer_.defaults["fused"]


@pytest.mark.parametrize("optimizer", [torch.optim.RMSprop, torch.optim.NAdam])
def test_low_precision_weights_on_the_cpu_get_no_foreach(optimizer):
    """torch's CPU foreach kernels round their scalars (momentum, betas) to
    bfloat16: SGD's momentum buffer ends 1.6% short. Pure bfloat16 weights on
    the CPU keep the single-tensor kernel; their float32 masters get foreach."""
    pure = dict(BF16, amp_level="pure")
    net = AmpNetClassifier(Logits, optimizer=optimizer, **pure, amp_master_weights=False).initialize()
    assert net.module_.hidden.weight.dtype == torch.bfloat16
    assert net.optimizer_.defaults["foreach"] is None
    net = AmpNetClassifier(Logits, optimizer=optimizer, **pure, amp_master_weights=True).initialize()
    assert net.optimizer_.defaults["foreach"] is True


def test_amp_off_builds_the_optimizer_as_skorch_does():
    net = AmpNetClassifier(Logits, optimizer=torch.optim.Adam).initialize()
    assert net.optimizer_.defaults["fused"] is None and net.optimizer_.defaults["foreach"] is None


@pytest.mark.parametrize("explicit", [dict(optimizer__fused=False), dict(optimizer__foreach=False),
                                      dict(optimizer__foreach=True), dict(optimizer__differentiable=True)])
def test_an_explicit_kernel_choice_is_kept(explicit):
    net = AmpNetClassifier(Logits, optimizer=torch.optim.Adam, **BF16, **explicit).initialize()
    defaults = net.optimizer_.defaults
    for key in ("fused", "foreach"):
        expected = explicit.get("optimizer__" + key)
        assert defaults[key] == expected


def torch_fused_sgd_updates(dtype):
    """Ground truth from torch itself: does its CPU fused SGD update ``dtype``
    weights? (torch 2.12 and 2.13 skip them: pytorch/pytorch#191763.)"""
    p = torch.nn.Parameter(torch.ones(64, dtype=dtype))
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.5, momentum=0.9, fused=True).step()
    return bool((p != 1).all())


def test_pure_low_precision_weights_get_the_fused_kernel_in_their_dtype():
    # Adam: torch 2.12 and 2.13's fused CPU SGD skips bfloat16 updates (pytorch#191763), which
    # ampnet detects and avoids; this test is about the kernel's dtype, on any torch release
    net = AmpNetClassifier(Logits, optimizer=torch.optim.Adam, amp_level="pure", amp_master_weights=False,
                           **BF16).initialize()
    assert net.module_.hidden.weight.dtype == torch.bfloat16
    assert net.optimizer_.defaults["fused"] is True


class BrokenFusedSGD(torch.optim.SGD):
    """A fused kernel that skips every update (as torch's CPU fused SGD did for
    bfloat16, pytorch/pytorch#191763)."""

    def step(self, closure=None):
        if self.defaults.get("fused"):
            return None
        return super().step(closure)


def test_a_fused_kernel_that_does_not_update_is_found():
    assert fused_works(torch.optim.SGD, {"momentum": 0.9}, [(CPU, torch.bfloat16), (CPU, torch.float32)]) is (
        torch_fused_sgd_updates(torch.bfloat16))
    assert not fused_works(BrokenFusedSGD, {}, [(CPU, torch.bfloat16)])
    # integer parameters: no fused kernel
    assert not fused_works(torch.optim.SGD, {}, [(CPU, torch.int64)])


def test_kernel_defaults_leave_custom_and_closure_optimizers_alone():
    params = [torch.zeros(3)]
    assert kernel_defaults(BrokenFusedSGD, {}, params) == {}  # outside torch.optim
    assert kernel_defaults(torch.optim.LBFGS, {}, params) == {}
    assert kernel_defaults(torch.optim.Adam, {"fused": False}, params) == {}
    assert kernel_defaults(torch.optim.Adam, {}, params) == {"fused": True}


def test_float16_default_fused_gets_found_inf_and_records_the_skipped_step(classifier_data):
    X, y = classifier_data
    recorder = Recorder()
    net = AmpNetClassifier(**net_kw(module__bad_calls=(3,), optimizer=torch.optim.Adam, max_epochs=1,
                                    batch_size=16, callbacks=[recorder]),
                           amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "A training batch holds NaN", AmpWarning)
        warnings.filterwarnings("ignore", "Training ended with a non-finite training loss", AmpWarning)
        net.fit(X[:64], y[:64])
    assert net.optimizer_.defaults["fused"] is True
    skipped = [b["step_skipped"] for b in net.history[-1, "batches"]]
    assert skipped == [False, False, True, False]
    # the fused kernel got the overflow flag on the device, three times (one step skipped)
    assert len(recorder.calls) == 3
    assert all(isinstance(found, torch.Tensor) and float(found) == 0.0 for _, found in recorder.calls)


def test_default_fused_trains_with_clipping_and_scheduler(classifier_data):
    X, y = classifier_data
    sched = LRScheduler(StepLR, step_size=1, gamma=0.5, step_every="batch")
    kw = net_kw(optimizer=torch.optim.AdamW, batch_size=32, callbacks=[GradientNormClipping(0.5), sched])
    torch.manual_seed(0)
    default = AmpNetClassifier(**kw, **BF16).fit(X, y)
    torch.manual_seed(0)
    explicit = AmpNetClassifier(**kw, **BF16, optimizer__fused=True).fit(X, y)
    assert default.optimizer_.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    for a, b in zip(default.module_.parameters(), explicit.module_.parameters()):
        assert torch.equal(a, b)  # the default is the fused kernel, bitwise


def test_compensated_weights_take_the_fused_kernel(classifier_data):
    X, y = classifier_data
    kw = net_kw(optimizer=torch.optim.Adam, batch_size=32, max_epochs=2)
    amp = dict(BF16, amp_level="pure", amp_master_weights="compensated")
    torch.manual_seed(0)
    default = AmpNetClassifier(**kw, **amp).fit(X, y)
    torch.manual_seed(0)
    explicit = AmpNetClassifier(**kw, **amp, optimizer__fused=True).fit(X, y)
    assert default.optimizer_.defaults["fused"] is True
    assert default.history[-1, "train_loss"] < default.history[0, "train_loss"]
    for a, b in zip(default.module_.parameters(), explicit.module_.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saver, loader", [({}, BF16), (BF16, {})])
def test_optimizer_state_loads_across_kernels(tmp_path, classifier_data, saver, loader):
    """A state saved by an AMP-off net (fused=None) loads into a fused AMP net
    and the other way round; each keeps its own kernel."""
    X, y = classifier_data
    kw = net_kw(optimizer=torch.optim.Adam, batch_size=32)
    source = AmpNetClassifier(**kw, **saver).fit(X, y)
    source.save_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    target = AmpNetClassifier(**kw, **loader).initialize()
    kernel = target.optimizer_.param_groups[0]["fused"]
    target.load_params(f_params=tmp_path / "p.pt", f_optimizer=tmp_path / "o.pt")
    assert target.optimizer_.param_groups[0]["fused"] == kernel
    steps = {float(s["step"]) for s in target.optimizer_.state.values()}
    assert steps == {4.0}
    target.partial_fit(X, y)  # and it steps with the loaded state
    assert {float(s["step"]) for s in target.optimizer_.state.values()} == {8.0}


def test_keep_kernels_replaces_only_the_kernel_keys():
    opt = torch.optim.Adam([torch.zeros(2, requires_grad=True)], fused=True)
    state = {"state": {}, "param_groups": [{"params": [0], "lr": 0.5, "fused": None, "foreach": True}]}
    kept = keep_kernels(opt, state)
    assert kept["param_groups"][0] == {"params": [0], "lr": 0.5, "fused": True, "foreach": None}
    assert state["param_groups"][0]["fused"] is None  # the argument is unchanged


# ---- a kernel ampnet chose follows the precision; the user's is kept ---------------------------

FP16_PURE = dict(amp_dtype="float16", amp_level="pure", amp_master_weights=False, grad_scaler__enabled=False)


def kernel(net):
    return {key: net.optimizer_.defaults.get(key) for key in ("fused", "foreach")}


def like_torch_2_13(cls, kwargs, kinds):
    """fused_works as on torch 2.12-2.13, whose CPU fused SGD skips float16
    updates (pytorch#191763), on any torch release."""
    return all(dtype != torch.float16 for _, dtype in kinds)


def refuse_like_torch_2_13(optimizer, name, dtype):
    """ampnet's check of a fused SGD as it refuses on torch 2.12-2.13, on any
    torch release."""
    if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("fused") and dtype == torch.float16:
        raise ValueError(f"{name}=torch.optim.SGD(fused=True) does not update float16 parameters (simulated "
                         "pytorch/pytorch#191763). Fix: optimizer__fused=False")


@pytest.fixture
def torch_2_13(monkeypatch):
    """Kernel choice and check as on torch 2.12-2.13 (fused CPU SGD skips float16)."""
    monkeypatch.setattr("ampnet.precision.kernels.fused_works", like_torch_2_13)
    monkeypatch.setattr("ampnet.precision.compensated.check_fused_sgd", refuse_like_torch_2_13)


def optimizer_state(net):
    return [{k: v.clone() for k, v in s.items()} for s in net.optimizer_.state.values()]


def assert_same_state(net, before):
    after = optimizer_state(net)
    assert len(after) == len(before) > 0
    for a, b in zip(after, before):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key].to(a[key].dtype)), key  # float16 weights: their dtype


def test_switch_to_float16_weights_rechooses_the_kernel_ampnet_chose(torch_2_13, classifier_data):
    """A fitted net whose fused SGD was ampnet's own default switches to pure
    float16 weights where the fused kernel skips float16 updates: the rebuilt
    optimizer takes the single-tensor kernel (not refused; no foreach for
    16-bit weights on the CPU), keeps its momentum, and trains; back to
    bfloat16 mixed, it is fused again."""
    X, y = classifier_data
    net = AmpNetClassifier(**net_kw(optimizer=torch.optim.SGD, optimizer__momentum=0.9), **BF16).fit(X, y)
    assert kernel(net) == {"fused": True, "foreach": None}
    before = optimizer_state(net)
    with pytest.warns(AmpWarning, match="float16 training without loss scaling"):
        net.set_params(**FP16_PURE)
    assert net.module_.hidden.weight.dtype == torch.float16
    assert kernel(net) == {"fused": None, "foreach": None}
    assert_same_state(net, before)  # the momentum buffers, now in float16
    weight = net.module_.hidden.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        net.partial_fit(X[:32], y[:32])
    assert not torch.equal(net.module_.hidden.weight, weight)
    net.set_params(amp_dtype="bfloat16", amp_level="mixed", amp_master_weights=True, grad_scaler__enabled=True)
    assert net.module_.hidden.weight.dtype == torch.float32
    assert kernel(net) == {"fused": True, "foreach": None}
    net.partial_fit(X[:32], y[:32])


def test_a_fused_kernel_the_user_set_is_still_refused_for_float16_weights(torch_2_13, classifier_data):
    X, y = classifier_data
    net = AmpNetClassifier(**net_kw(optimizer=torch.optim.SGD, optimizer__momentum=0.9, optimizer__fused=True),
                           **BF16).fit(X, y)
    weight, state = net.module_.hidden.weight, optimizer_state(net)
    params = net.get_params(deep=False)
    with pytest.raises(ValueError, match=r"SGD\(fused=True\) does not update float16 .*#191763.*optimizer__fused=False"):
        net.set_params(**FP16_PURE)
    assert net.get_params(deep=False) == params and net.precision_policy_.compute_dtype == torch.bfloat16
    assert net.module_.hidden.weight is weight and weight.dtype == torch.float32
    assert kernel(net) == {"fused": True, "foreach": None}
    assert_same_state(net, state)


@pytest.mark.parametrize("explicit", [{}, dict(optimizer__fused=True), dict(optimizer__fused=False),
                                      dict(optimizer__foreach=True)])
def test_amp_off_trains_with_skorchs_kernel_and_back_on_with_ampnets(classifier_data, explicit):
    """AMP off trains as skorch does. A fitted AMP net turned off
    ends with the kernel an AMP-off net gets (a user's setting is kept);
    turned on again, ampnet's kernel is back. The optimizer's state (step,
    moments) is carried over each time and training goes on."""
    X, y = classifier_data
    kw = net_kw(optimizer=torch.optim.Adam, batch_size=32, **explicit)
    skorchs = kernel(AmpNetClassifier(**kw).initialize())
    ampnets = kernel(AmpNetClassifier(**kw, **BF16).initialize())
    assert ampnets == ({"fused": True, "foreach": None} if not explicit else skorchs)
    net = AmpNetClassifier(**kw, **BF16).fit(X, y)
    assert kernel(net) == ampnets
    before = optimizer_state(net)
    assert {float(s["step"]) for s in before} == {4.0}
    net.set_params(amp_enabled=False)
    assert not net.precision_policy_.enabled and kernel(net) == skorchs
    assert_same_state(net, before)
    net.partial_fit(X, y)
    assert {float(s["step"]) for s in net.optimizer_.state.values()} == {8.0}
    before = optimizer_state(net)
    net.set_params(amp_enabled=True)
    assert net.precision_policy_.enabled and kernel(net) == ampnets
    assert_same_state(net, before)
    net.partial_fit(X, y)
    assert {float(s["step"]) for s in net.optimizer_.state.values()} == {12.0}


# ---- the probe's answer is remembered -----------------------------------------------------------


@pytest.fixture
def probes(monkeypatch):
    """Count the probes of fused_works (its memo starts empty)."""
    import ampnet.precision.kernels as kernels

    calls = []
    real = kernels._probe

    def counting(cls, settings, kinds):
        calls.append((cls, dict(settings), tuple(kinds)))
        return real(cls, settings, kinds)

    kernels._remembered_probe.cache_clear()
    monkeypatch.setattr(kernels, "_probe", counting)
    yield calls
    kernels._remembered_probe.cache_clear()


def test_the_probe_runs_once_for_nets_with_the_same_settings(probes):
    kw = dict(optimizer=torch.optim.SGD, optimizer__momentum=0.9, **BF16)
    first = AmpNetClassifier(Logits, **kw).initialize()
    second = AmpNetClassifier(Logits, **kw, lr=0.5).initialize()  # lr plays no part
    assert kernel(first) == kernel(second) == {"fused": True, "foreach": None}
    assert probes == [(torch.optim.SGD, {"momentum": 0.9}, ((CPU, torch.float32),))]
    # other hyper-parameters, optimizer or parameter dtype: probed again
    AmpNetClassifier(Logits, **{**kw, "optimizer__momentum": 0.5}).initialize()
    AmpNetClassifier(Logits, optimizer=torch.optim.Adam, **BF16).initialize()
    AmpNetClassifier(Logits, **kw, amp_level="pure", amp_master_weights=False).initialize()
    assert probes[1:] == [(torch.optim.SGD, {"momentum": 0.5}, ((CPU, torch.float32),)),
                          (torch.optim.Adam, {}, ((CPU, torch.float32),)),
                          (torch.optim.SGD, {"momentum": 0.9}, ((CPU, torch.bfloat16),))]
    AmpNetClassifier(Logits, **kw).initialize()
    assert len(probes) == 4


def test_unhashable_or_tensor_hyper_parameters_are_probed_every_time(probes):
    for _ in range(2):
        assert fused_works(torch.optim.Adam, {"betas": [0.9, 0.99]}, [(CPU, torch.float32)])
        assert fused_works(torch.optim.Adam, {"weight_decay": torch.tensor(0.01)}, [(CPU, torch.float32)])
    assert len(probes) == 4
    for _ in range(2):
        assert fused_works(torch.optim.Adam, {"betas": (0.9, 0.99)}, [(CPU, torch.float32)])
    assert len(probes) == 5
