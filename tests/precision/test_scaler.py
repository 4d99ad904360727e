"""ampnet.GradScaler: settings validation, scale policy, state and pickling.

Steps are driven with synthetic gradients on CPU (the keras style): a
parameter, a loss whose gradient we control, and SGD.
"""

import copy
import math
import pickle
import re

import pytest
import torch

from ampnet import GradScaler
from ampnet.precision.scaler import validate_scaler_state
from conftest import small_classifier


def make_step(scaler, overflow, param=None, opt=None, device="cpu", dtype=torch.float32):
    """One scaled step; ``overflow`` puts an inf into the gradient."""
    if param is None:
        param = torch.nn.Parameter(torch.ones(3, device=device, dtype=dtype))
        opt = torch.optim.SGD([param], lr=0.1)
    opt.zero_grad()
    loss = (param * 2.0).sum()
    if overflow:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.unscale_(opt, allow_fp16=param.dtype == torch.float16)  # as pure float16 training does
    skipped = scaler.found_inf(opt)  # the method, which reads the device
    scaler.step(opt)
    scaler.update()
    return skipped, param, opt


def cpu_scaler(**kw):
    return GradScaler("cpu", **kw)


# ---- settings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"init_scale": 0.0}, r"init_scale=0.0 \(float\): must be a finite number > 0"),
        ({"init_scale": -4.0}, r"init_scale=-4.0"),
        ({"init_scale": float("nan")}, r"init_scale=nan"),
        ({"init_scale": float("inf")}, r"init_scale=inf"),
        ({"growth_factor": 1.0}, r"growth_factor=1.0 \(float\): must be a finite number > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor=1.0 \(float\): must be a number in \(0, 1\)"),
        ({"backoff_factor": 0}, r"backoff_factor=0 \(int\)"),
        ({"growth_interval": 0}, r"growth_interval=0 \(int\): must be an int >= 1"),
        ({"growth_interval": 2.5}, r"growth_interval=2.5"),
        ({"hysteresis": 0}, r"hysteresis=0"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, r"min_scale=8.0.*must not exceed max_scale"),
        ({"init_scale": 2.0**30}, r"init_scale=1073741824.0.*must lie within \[min_scale, max_scale\]"),
        ({"dynamic": "no"}, r"dynamic='no' \(str\): must be True or False"),
    ],
)
def test_invalid_settings_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        cpu_scaler(**kw)


def test_all_problems_reported_at_once():
    with pytest.raises(ValueError) as exc:
        cpu_scaler(growth_factor=0.5, backoff_factor=2.0)
    assert "growth_factor=0.5" in str(exc.value) and "backoff_factor=2.0" in str(exc.value)


def test_disabled_scaler_still_validates_and_reports_settings():
    with pytest.raises(ValueError, match="growth_factor"):
        GradScaler("cpu", enabled=False, growth_factor=0.5)
    scaler = GradScaler("cpu", enabled=False, growth_factor=3.0)
    assert scaler.get_settings()["growth_factor"] == 3.0
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}


def test_cuda_scaler_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError, match="CUDA is not available; torch would silently disable it"):
        GradScaler(device="cuda")


def test_scaler_device_defaults_to_what_the_machine_has():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    scaler = GradScaler(init_scale=256.0)
    assert scaler.device == expected and scaler.is_enabled()
    assert repr(scaler) == f"GradScaler(device='{expected}', init_scale=256.0)"


# ---- the scale policy ----------------------------------------------------------


def test_growth_after_growth_interval(device_dtype):
    # the parameter (and so its gradient) in each dtype: pure training unscales those in place
    scaler = GradScaler(device_dtype.device, init_scale=2.0, growth_interval=2)
    param = opt = None
    for _ in range(8):
        skipped, param, opt = make_step(scaler, False, param, opt, device_dtype.device, device_dtype.dtype)
        assert not skipped
    assert scaler.get_scale() == 32.0
    assert param.dtype == param.grad.dtype == device_dtype.dtype
    # the gradient was unscaled before each step: the same weights as 8 unscaled steps
    assert torch.equal(param.grad, torch.full_like(param, 2.0))
    ref = torch.nn.Parameter(torch.ones_like(param))
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    for _ in range(8):
        ref_opt.zero_grad()
        (ref * 2.0).sum().backward()
        ref_opt.step()
    assert torch.equal(param.detach(), ref.detach())


def test_backoff_and_skip_leave_weights_bitwise_unchanged(device_dtype):
    scaler = GradScaler(device_dtype.device, init_scale=400.0)
    param = torch.nn.Parameter(torch.ones(3, device=device_dtype.device, dtype=device_dtype.dtype))
    opt = torch.optim.SGD([param], lr=0.1)
    before = param.detach().clone()
    for _ in range(4):
        skipped, _, _ = make_step(scaler, True, param, opt)
        assert skipped
    assert torch.equal(param.detach(), before)
    assert scaler.get_scale() == 25.0


def test_tracker_resets_after_skip():
    scaler = cpu_scaler(init_scale=8.0, growth_interval=3)
    param = opt = None
    for overflow in (False, False, True, False, False):
        _, param, opt = make_step(scaler, overflow, param, opt)
    # 2 good steps, a skip (8 -> 4, tracker 0), 2 good steps: no growth yet
    assert scaler.get_scale() == 4.0
    make_step(scaler, False, param, opt)
    assert scaler.get_scale() == 8.0


def test_matches_torch_gradscaler_trajectory_within_bounds():
    pattern = [False, True, False, False, False, True, True, False, False, False, False, False]
    ours = cpu_scaler(init_scale=1024.0, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p1 = torch.nn.Parameter(torch.ones(3))
    o1 = torch.optim.SGD([p1], lr=0.1)
    p2 = torch.nn.Parameter(torch.ones(3))
    o2 = torch.optim.SGD([p2], lr=0.1)
    for overflow in pattern:
        make_step(ours, overflow, p1, o1)
        # same sequence on torch's scaler
        o2.zero_grad()
        loss = (p2 * 2.0).sum() * (float("inf") if overflow else 1.0)
        theirs.scale(loss).backward()
        theirs.step(o2)
        theirs.update()
        assert ours.get_scale() == theirs.get_scale()
    assert torch.equal(p1, p2)


def test_500_overflows_stop_at_min_scale_with_finite_weights():
    scaler = cpu_scaler(init_scale=2.0**16)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    for _ in range(500):
        make_step(scaler, True, param, opt)
    assert scaler.get_scale() == 1.0
    make_step(scaler, False, param, opt)
    assert torch.isfinite(param).all()
    assert not torch.equal(param.detach(), torch.ones(3))


def test_growth_stops_at_max_scale():
    scaler = cpu_scaler(init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    param = opt = None
    for _ in range(5):
        _, param, opt = make_step(scaler, False, param, opt)
    assert scaler.get_scale() == 2.0**24


def test_hysteresis_backs_off_only_after_n_overflows_in_a_row():
    scaler = cpu_scaler(init_scale=64.0, hysteresis=3)
    param = opt = None
    scales = []
    for overflow in (True, True, False, True, True, True):
        skipped, param, opt = make_step(scaler, overflow, param, opt)
        assert skipped == overflow  # every overflowing step is still skipped
        scales.append(scaler.get_scale())
    # a good step resets the run; the third overflow in a row halves
    assert scales == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]


def test_static_scale_never_changes_but_still_skips():
    scaler = cpu_scaler(init_scale=128.0, dynamic=False, growth_interval=1)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    for overflow in (False, True, False, True):
        before = param.detach().clone()
        skipped, _, _ = make_step(scaler, overflow, param, opt)
        assert skipped == overflow
        assert torch.equal(param.detach(), before) == overflow
        assert scaler.get_scale() == 128.0


def test_set_settings_live_and_validated():
    scaler = cpu_scaler(init_scale=8.0, growth_interval=100)
    make_step(scaler, False)
    scaler.set_settings(growth_factor=4.0, growth_interval=1)
    make_step(scaler, False)
    assert scaler.get_scale() == 32.0
    with pytest.raises(ValueError, match=r"growth_factor=0.5"):
        scaler.set_settings(growth_factor=0.5)
    with pytest.raises(ValueError, match=r"\['init_scale'\] cannot be changed on a live scaler"):
        scaler.set_settings(init_scale=2.0)
    scaler.set_settings(max_scale=16.0)
    assert scaler.get_scale() == 16.0


# ---- state ------------------------------------------------------------------


def test_state_dict_round_trip_is_exact():
    scaler = cpu_scaler(init_scale=1024.0, growth_interval=3, hysteresis=2)
    param = opt = None
    for overflow in (False, True, False):
        _, param, opt = make_step(scaler, overflow, param, opt)
    state = scaler.state_dict()
    assert state["scale"] == scaler.get_scale()
    assert state["_overflow_streak"] == 0 and state["hysteresis"] == 2
    other = cpu_scaler()
    other.load_state_dict(state)
    assert other.state_dict() == state


@pytest.mark.parametrize(
    "state, match",
    [
        ({}, "saved from a disabled scaler"),
        ({"state": {}, "param_groups": []}, r"keys \['scale'.*are missing.*another file"),
        ([1, 2], "expected a dict, got list"),
    ],
)
def test_invalid_state_rejected(state, match):
    with pytest.raises(ValueError, match=match):
        validate_scaler_state(state, "ckpt.pt")


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_invalid_scale_rejected_and_scaler_unchanged(bad):
    scaler = cpu_scaler(init_scale=64.0)
    make_step(scaler, False)
    state = scaler.state_dict()
    state["scale"] = bad
    with pytest.raises(ValueError, match="invalid loss scale"):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == 64.0


def test_torch_gradscaler_state_loads():
    theirs = torch.amp.GradScaler("cpu", init_scale=256.0)
    ours = cpu_scaler(hysteresis=2)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 256.0
    assert ours.get_settings()["hysteresis"] == 2


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))])
def test_pickle_and_deepcopy_mid_step(copier):
    scaler = cpu_scaler(init_scale=512.0)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    make_step(scaler, True, param, opt)
    opt.zero_grad()
    scaler.scale((param * 2).sum()).backward()
    scaler.unscale_(opt)  # torch's own scaler refuses to pickle here
    clone = copier(scaler)
    assert clone.get_scale() == 256.0
    assert clone.state_dict() == scaler.state_dict()
    scaler.step(opt)
    scaler.update()  # the original's step is intact
    assert math.isfinite(scaler.get_scale())


def test_changing_amp_level_keeps_the_loss_scale(classifier_data):
    X, y = classifier_data
    net = small_classifier(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0, grad_scaler__growth_interval=1).fit(X[:32], y[:32])
    scale = net.grad_scaler_.get_scale()
    assert scale != 256.0
    net.set_params(amp_level="pure")
    assert net.grad_scaler_.get_scale() == scale


# ---- scaler instances and classes on a net -----------------------------------------


def _net_data():
    import numpy as np

    rng = np.random.RandomState(0)
    X = rng.randn(48, 6).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


def _net(**kw):
    from ampnet import AmpNetClassifier

    torch.manual_seed(0)
    base = dict(module=torch.nn.Linear, module__in_features=6, module__out_features=2,
                criterion=torch.nn.CrossEntropyLoss, max_epochs=1, batch_size=16, train_split=None, verbose=0)
    return AmpNetClassifier(**{**base, **kw})


@pytest.mark.parametrize("amp", [dict(amp_enabled=False), dict(amp_enabled=True, amp_dtype="bfloat16")])
def test_scaler_instance_is_kept_quietly_where_no_loss_scaling_runs(amp):
    scaler = GradScaler(init_scale=256.0, growth_interval=3)
    net = _net(grad_scaler=scaler, **amp).fit(*_net_data())  # an AmpWarning would fail the test
    assert not net.grad_scaler_.is_enabled() and net.grad_scaler_ is not scaler
    assert net.grad_scaler_.get_settings()["init_scale"] == 256.0  # the instance's settings, disabled
    assert net.grad_scaler_.get_settings()["growth_interval"] == 3
    assert net.get_params()["grad_scaler"] is scaler and scaler.is_enabled() and scaler.scale_tensor() is None
    # the same net switched to float16 scales with the instance's settings
    net.set_params(amp_enabled=True, amp_dtype="float16")
    assert net.grad_scaler_.is_enabled() and net.grad_scaler_.get_scale() == 256.0
    net.partial_fit(*_net_data())
    assert net.history[-1, "batches", 0, "loss_scale"] == 256.0


def test_scaler_instance_forced_on_under_bfloat16():
    net = _net(grad_scaler=GradScaler(init_scale=256.0), grad_scaler__enabled=True, amp_enabled=True,
               amp_dtype="bfloat16").fit(*_net_data())
    assert net.grad_scaler_.is_enabled() and net.history[0, "batches", 0, "loss_scale"] == 256.0


def test_scaler_instance_serves_a_grid_over_amp_enabled_and_amp_dtype():
    from sklearn.model_selection import GridSearchCV

    net = _net(grad_scaler=GradScaler(init_scale=256.0))
    grid = [{"amp_enabled": [False]}, {"amp_enabled": [True], "amp_dtype": ["bfloat16", "float16"]}]
    search = GridSearchCV(net, grid, cv=2, error_score="raise", refit=False).fit(*_net_data())
    assert len(search.cv_results_["mean_test_score"]) == 3
    for params in search.cv_results_["params"]:
        fitted = _net(grad_scaler=GradScaler(init_scale=256.0), **params).fit(*_net_data())
        fp16 = params.get("amp_dtype") == "float16"
        assert fitted.grad_scaler_.is_enabled() == fp16
        assert fitted.grad_scaler_.get_settings()["init_scale"] == 256.0


def test_disabled_scaler_instance_under_float16_says_so():
    from ampnet import AmpWarning

    net = _net(grad_scaler=GradScaler("cpu", enabled=False), amp_enabled=True, amp_dtype="float16")
    with pytest.warns(AmpWarning, match=r"without loss scaling \(the grad_scaler instance passed is disabled\)"):
        net.initialize()
    net = _net(grad_scaler__enabled=False, amp_enabled=True, amp_dtype="float16")
    with pytest.warns(AmpWarning, match=r"without loss scaling \(grad_scaler__enabled=False\)"):
        net.initialize()


def test_torch_scaler_made_for_cuda_on_a_cpu_float16_net():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "CUDA is not available. Disabling."
        scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
    net = _net(grad_scaler=scaler, amp_enabled=True, amp_dtype="float16")
    if torch.cuda.is_available():  # an enabled instance follows the net's device
        net.fit(*_net_data())
        assert net.grad_scaler_.is_enabled() and type(net.grad_scaler_) is torch.amp.GradScaler
        assert net.history[0, "batches", 0, "loss_scale"] == 256.0
        return
    with pytest.raises(ValueError, match=re.escape("grad_scaler=torch.amp.GradScaler('cuda')")) as info:
        net.initialize()
    for part in ("without CUDA", "Fix: grad_scaler=ampnet.GradScaler", "torch.amp.GradScaler('cpu', ...)",
                 "grad_scaler__enabled=False"):
        assert part in str(info.value), part
    assert not net.initialized_
    # where no loss scaling runs, the disabled instance is kept quietly; forced off, float16 trains unscaled
    _net(grad_scaler=scaler).fit(*_net_data())
    from ampnet import AmpWarning

    with pytest.warns(AmpWarning, match=r"grad_scaler__enabled=False"):
        _net(grad_scaler=scaler, grad_scaler__enabled=False, amp_enabled=True, amp_dtype="float16").initialize()


def test_torch_cuda_amp_gradscaler_class():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the class
        net = _net(grad_scaler=torch.cuda.amp.GradScaler, amp_enabled=True, amp_dtype="float16")
        with pytest.raises(ValueError, match=r"grad_scaler=torch.cuda.amp.GradScaler scales on CUDA only") as info:
            net.initialize()
        assert "float16 on 'cpu'" in str(info.value) and "Fix: grad_scaler=ampnet.GradScaler" in str(info.value)
        # no TypeError about `device` where no loss scaling runs
        off = _net(grad_scaler=torch.cuda.amp.GradScaler).fit(*_net_data())
        assert type(off.grad_scaler_) is torch.cuda.amp.GradScaler and not off.grad_scaler_.is_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_cuda_amp_gradscaler_class_on_a_cuda_net():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        net = _net(grad_scaler=torch.cuda.amp.GradScaler, grad_scaler__init_scale=256.0, device="cuda",
                   amp_enabled=True, amp_dtype="float16").fit(*_net_data())
    assert net.grad_scaler_.is_enabled() and net.history[0, "batches", 0, "loss_scale"] == 256.0


# ---- its own state: no edits of torch's private state ----------------------------


def _torch_fields(scaler):
    """torch's private fields of ``scaler``, as torch's constructor sets them."""
    return {k: v for k, v in vars(scaler).items() if k in vars(torch.amp.GradScaler("cpu"))}


def test_torchs_private_state_stays_as_its_constructor_left_it():
    scaler = cpu_scaler(init_scale=64.0, growth_interval=1, hysteresis=2)
    before = {k: copy.copy(v) for k, v in _torch_fields(scaler).items()}
    param = opt = None
    for overflow in (False, True, True, False):
        _, param, opt = make_step(scaler, overflow, param, opt)
    scaler.set_settings(growth_factor=4.0)
    scaler.load_state_dict(scaler.state_dict())
    clone = pickle.loads(pickle.dumps(scaler))
    # 64 -> 128 (growth), 128 (first overflow), 64 (second: backoff), 128 (growth)
    assert scaler.get_scale() == 128.0 and scaler.get_growth_factor() == 4.0
    for s in (scaler, clone):
        after = _torch_fields(s)
        assert after.keys() == before.keys()
        assert after["_scale"] is None and after["_growth_tracker"] is None and not after["_per_optimizer_states"]
        assert (after["_init_scale"], after["_growth_factor"]) == (64.0, 2.0)  # never written


def test_own_attributes_do_not_collide_with_torchs():
    torch_names = set(vars(torch.amp.GradScaler("cpu"))) | set(vars(torch.amp.GradScaler))
    scaler = cpu_scaler()
    make_step(scaler, False)
    own = set(vars(scaler)) - set(vars(torch.amp.GradScaler("cpu")))
    assert own and not own & torch_names
    assert not {n for n in vars(GradScaler) if not n.startswith("__")} & (
        {n for n in vars(torch.amp.GradScaler) if n.startswith("_")})


def _fused_pair():
    p1, p2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    return (p1, torch.optim.Adam([p1], lr=0.1, fused=True)), (p2, torch.optim.Adam([p2], lr=0.1, fused=True))


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_optimizer_step_matches_torchs_scaler(unscale_first):
    (p1, o1), (p2, o2) = _fused_pair()
    ours, theirs = cpu_scaler(init_scale=1024.0, growth_interval=2), torch.amp.GradScaler("cpu", init_scale=1024.0,
                                                                                             growth_interval=2)
    for overflow in (False, True, False, False, False):
        for scaler, p, o in ((ours, p1, o1), (theirs, p2, o2)):
            o.zero_grad()
            scaler.scale((p * torch.arange(4.0)).sum() * (float("inf") if overflow else 1.0)).backward()
            if unscale_first:
                scaler.unscale_(o)
            scaler.step(o)
            scaler.update()
            assert not hasattr(o, "found_inf") and not hasattr(o, "grad_scale")
        assert ours.get_scale() == theirs.get_scale()
        assert torch.equal(p1, p2)
        torch.testing.assert_close(p1.grad, p2.grad, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(p1.detach(), torch.ones(4))


def test_scale_of_several_outputs_and_sparse_unscale_match_torch():
    ours, theirs = cpu_scaler(init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)
    outputs = [torch.ones(2), (torch.full((3,), 2.0), torch.zeros(1))]
    assert repr(ours.scale(outputs)) == repr(theirs.scale(outputs))
    grads = []
    for scaler in (ours, theirs):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(5, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler.scale(emb(torch.tensor([1, 1, 3])).sum()).backward()
        scaler.unscale_(opt)
        grads.append(emb.weight.grad.to_dense())
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_step_order_errors_as_torch():
    scaler = cpu_scaler()
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) before any scale\(\)"):
        scaler.unscale_(opt)
    scaler.scale((param * 2).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"after step\(\)"):
        scaler.unscale_(opt)
    scaler.update()
    fp16 = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    fp16.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([fp16], lr=0.1))


def test_discard_step_forgets_the_step_and_keeps_the_scale():
    scaler = cpu_scaler(init_scale=32.0, growth_interval=1)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale((param * 2).sum()).backward()
    scaler.unscale_(opt)
    scaler.plan_update()
    assert scaler.step_pending and scaler.scaled_in_step
    scaler.discard_step()
    assert not scaler.step_pending and not scaler.scaled_in_step and scaler.get_scale() == 32.0
    with pytest.raises(RuntimeError, match="no inf checks were recorded"):
        scaler.update()
    make_step(scaler, False, param, opt)  # unscale_ is allowed again
    assert scaler.get_scale() == 64.0


def test_torch_style_setters_are_validated_and_live():
    scaler = cpu_scaler(init_scale=8.0, growth_interval=100)
    scaler.set_growth_interval(1)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    assert (scaler.get_growth_interval(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (1, 4.0, 0.25)
    make_step(scaler, False)
    assert scaler.get_scale() == 32.0
    make_step(scaler, True)
    assert scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match="growth_factor=0.5"):
        scaler.set_growth_factor(0.5)


def test_update_with_a_new_scale_tensor_keeps_the_tracker():
    scaler = cpu_scaler(init_scale=8.0, growth_interval=2)
    make_step(scaler, False)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale((param * 2).sum()).backward()
    scaler.unscale_(opt)
    scaler.update(new_scale=torch.tensor(4.0))
    assert scaler.get_scale() == 4.0 and scaler.state_dict()["_growth_tracker"] == 1
    assert not scaler.step_pending
    with pytest.raises(ValueError, match="1-element tensor"):
        scaler.update(new_scale=torch.ones(2))


# ---- dtypes the device's fused kernel lacks ------------------------------------


def test_unscale_through_float32_is_bitwise_the_fused_kernel():
    # CUDA's fused check-and-unscale has no bfloat16 (a pure bf16 net's gradients); the
    # float32 round trip that replaces it there must give the kernel's own result
    from ampnet.precision import checks

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(257, generator=gen) * 1e3, torch.randn(3, 5, generator=gen)]
    inv = torch.tensor(1.0 / 3.0)
    for poison in (None, float("inf"), float("nan")):
        grads = [v.to(torch.bfloat16) for v in values]
        if poison is not None:
            grads[1][2, 3] = poison
        ours = [g.clone() for g in grads]
        found_kernel, found_ours = torch.zeros(()), torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_kernel, inv)
        checks._through_float32(ours, found_ours, inv, write=True)
        assert all(o.dtype == torch.bfloat16 for o in ours)
        for a, b in zip(grads, ours):  # every value bitwise, NaN as NaN (its payload may differ)
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
        assert found_ours.item() == found_kernel.item() == (0.0 if poison is None else 1.0)
    # a check only leaves the gradients as they were
    kept = [v.to(torch.bfloat16) for v in values]
    before = [g.clone() for g in kept]
    checks._through_float32(kept, torch.zeros(()), inv, write=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, before))


def test_the_fused_kernel_is_used_where_it_takes_the_dtype():
    from ampnet.precision.checks import _kernel_takes

    assert _kernel_takes(torch.zeros(1, dtype=torch.bfloat16))  # CPU: every dtype
    meta_bf16 = torch.empty(1, dtype=torch.bfloat16, device="meta")
    assert not _kernel_takes(meta_bf16)
    assert _kernel_takes(torch.empty(1, dtype=torch.float16, device="meta"))
