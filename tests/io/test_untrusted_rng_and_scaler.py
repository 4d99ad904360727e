"""The random-number and loss-scaler states a load reads: every RNG field as its generator accepts
it (numpy's ``pos`` out of range would crash the process at the next draw), every scaler field and
setting within float32 and its int32 counters, numpy booleans for the boolean settings, and torch's own
``torch.amp.GradScaler`` trained and saved as torch's loop does."""

import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, GradScaler
from ampnet.exceptions import AmpWarning
from ampnet.io.rng import get_rng_state
from ampnet.precision.scaler_checks import FLOAT32_MAX, FLOAT32_TINY
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    tiny_net,
    quietly,
    data,
    fitted,
    saved,
    refused_unchanged,
)
from repo_paths import ROOT, TESTS
from resume_script import Tiny, differences


# ---- RNG states: every field as its generator accepts it -----------------------------------------


def _rng_cases():
    def setitem(key, value):
        return lambda s: s.__setitem__(key, value)

    def set_word(key, index, value):
        def change(s):
            s[key] = s[key].clone()
            s[key][index] = value

        return change

    return {
        "numpy.pos out of range": (
            setitem("numpy.pos", torch.tensor(625)),
            r"numpy.pos=625 must lie in \[0, 624\]",
        ),
        "numpy.pos huge": (setitem("numpy.pos", torch.tensor(10**12)), "numpy.pos=1000000000000"),
        "numpy.pos negative": (setitem("numpy.pos", torch.tensor(-1)), "numpy.pos=-1"),
        "numpy.has_gauss": (
            setitem("numpy.has_gauss", torch.tensor(2)),
            "numpy.has_gauss=2 must be 0 or 1",
        ),
        "numpy.cached_gaussian": (
            setitem("numpy.cached_gaussian", torch.tensor(float("nan"), dtype=torch.float64)),
            "numpy.cached_gaussian=nan must be a finite number",
        ),
        "numpy.keys zero": (
            setitem("numpy.keys", torch.zeros(624, dtype=torch.int64)),
            "numpy.keys is the degenerate all-zero",
        ),
        "numpy.keys 33 bits": (
            set_word("numpy.keys", 5, 2**32),
            "numpy.keys holds values outside the 32-bit range",
        ),
        "numpy.keys shape": (
            setitem("numpy.keys", torch.zeros(623, dtype=torch.int64)),
            r"numpy.keys has shape \(623,\), expected \(624,\)",
        ),
        "python.version": (setitem("python.version", torch.tensor(99)), "python.version=99 must be 3"),
        "python.version 2": (setitem("python.version", torch.tensor(2)), "python.version=2 must be 3"),
        "python pos": (
            set_word("python.internal", 624, 100000),
            r"python.internal\[624\] \(the position\) = 100000",
        ),
        "python pos negative": (
            set_word("python.internal", 624, -1),
            r"python.internal\[624\] \(the position\) = -1",
        ),
        "python word": (
            set_word("python.internal", 0, -5),
            "python.internal holds values outside the 32-bit range",
        ),
        "python gauss flag": (setitem("python.has_gauss_next", torch.tensor(7)), "python.has_gauss_next=7"),
        "python gauss": (
            setitem("python.gauss_next", torch.tensor(float("inf"), dtype=torch.float64)),
            "python.gauss_next=inf",
        ),
        "torch all zero": (
            lambda s: s.__setitem__("torch", torch.zeros_like(s["torch"])),
            r"torch refuses the state \(Invalid mt19937 state\)",
        ),
        "torch size": (lambda s: s.__setitem__("torch", s["torch"][:-8].clone()), "torch has 5048 bytes"),
        "torch dtype": (
            lambda s: s.__setitem__("torch", s["torch"].to(torch.int64)),
            "torch must be a dense CPU torch.uint8",
        ),
        "unknown cuda key": (
            setitem("cuda.x", torch.zeros(16, dtype=torch.uint8)),
            r"unknown keys \['cuda.x'\]",
        ),
        "cuda key with zero": (
            setitem("cuda.01", torch.zeros(16, dtype=torch.uint8)),
            r"unknown keys \['cuda.01'\]",
        ),
        "unknown key": (setitem("extra", torch.zeros(1)), r"unknown keys \['extra'\]"),
        "int key": (setitem(3, torch.zeros(1)), r"unknown keys \['3'\]"),
        "cuda size": (
            setitem("cuda.0", torch.zeros(8, dtype=torch.uint8)),
            "cuda.0 has 8 bytes, expected 16",
        ),
        "cuda offset": (
            setitem("cuda.0", torch.tensor([0] * 8 + [3] + [0] * 7, dtype=torch.uint8)),
            "cuda.0 has the Philox offset 3",
        ),
        "version": (
            setitem("ampnet_rng_version", torch.tensor(2)),
            "ampnet_rng_version=2: this ampnet reads version 1; upgrade",
        ),
        "version 0": (setitem("ampnet_rng_version", torch.tensor(0)), "ampnet_rng_version=0"),
        "not a tensor": (setitem("numpy.pos", 3), "numpy.pos must be a torch.int64 tensor, got int"),
    }


@pytest.mark.parametrize("case", list(_rng_cases()))
def test_invalid_rng_field_is_refused_before_anything_changes(tmp_path, saved, case):
    change, problem = _rng_cases()[case]
    state = get_rng_state()
    change(state)
    bad = str(tmp_path / "rng.pt")
    torch.save(state, bad)
    # the RNG file comes last: params, optimizer, history and scaler would apply first
    files = {**saved, "f_rng_state": bad}
    net = tiny_net().initialize()
    info = refused_unchanged(net, files, problem, re.escape(f"f_rng_state file {bad!r}"))
    assert "No generator was changed" in str(info.value)


@pytest.mark.slow
def test_numpy_pos_out_of_range_does_not_crash_the_process(tmp_path):
    """numpy accepts pos > 624 and segfaults at the next draw; the load must
    refuse it (checked in a fresh process, whose exit code tells)."""
    state = get_rng_state()
    state["numpy.pos"] = torch.tensor(10**9)
    bad = tmp_path / "rng.pt"
    torch.save(state, bad)
    script = (
        "import sys, numpy, torch\nsys.path[:0] = [{root!r}, {tests!r}]\n"
        "from resume_script import Tiny\nfrom ampnet import AmpNetClassifier\n"
        "net = AmpNetClassifier(Tiny).initialize()\n"
        "try:\n    net.load_params(f_rng_state={bad!r})\nexcept ValueError as e:\n    print('refused', e)\n"
        "print(numpy.random.rand())\n"
    ).format(root=str(ROOT), tests=str(TESTS), bad=str(bad))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused" in proc.stdout and "numpy.pos=1000000000 must lie in [0, 624]" in proc.stdout


def test_numpy_global_generator_of_another_kind(tmp_path, saved):
    state = np.random.get_state(legacy=False)
    try:
        np.random.set_bit_generator(np.random.PCG64(0))
        net = tiny_net().initialize()
        info = refused_unchanged(net, saved, "numpy's global generator uses 'PCG64'")
        info.match(re.escape(f"f_rng_state file {saved['f_rng_state']!r}"))
        with pytest.raises(ValueError, match="ampnet saves only numpy's default MT19937 state. Fix"):
            net.save_params(f_rng_state=str(tmp_path / "r.pt"))
        assert not (tmp_path / "r.pt").exists()
    finally:
        np.random.set_bit_generator(np.random.MT19937(0))
        np.random.set_state(state)


# ---- scaler files: every field checked -----------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("scale", 1e39, r"'scale' = 1e\+39 lies outside float32's normal positive range"),
        (
            "min_scale",
            1e-50,
            r"'min_scale' = 1e-50 \(float\): must lie within float32's normal positive range",
        ),
        ("growth_interval", 2.5, r"'growth_interval' = 2.5 \(float\): must be an int >= 1"),
        ("backoff_factor", "x", r"'backoff_factor' = 'x' \(str\): must be a number in \(0, 1\)"),
        ("dynamic", 1, r"'dynamic' = 1 \(int\): must be True or False"),
        (
            "_growth_tracker",
            2**40,
            r"'_growth_tracker' = 1099511627776 \(int\) must be an int in \[0, 2\*\*31 - 1\]",
        ),
        ("ampnet_scaler_version", 7, "format version 7 is newer than this ampnet reads"),
        (3, 1, r"keys \['3'\] are not strings"),
    ],
)
def test_invalid_scaler_field_is_refused(tmp_path, saved, field, value, problem):
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state[field] = value
    bad = str(tmp_path / "s.pt")
    torch.save(state, bad)
    refused_unchanged(
        tiny_net().initialize(),
        {**saved, "f_grad_scaler": bad},
        problem,
        re.escape(f"f_grad_scaler file {bad!r}"),
    )


# ---- torch.amp.GradScaler is supported -----------------------------------------------------------


def _torch_loop(init_scale, epochs, data):
    """torch's own AMP loop with torch.amp.GradScaler, on ampnet's batches."""
    torch.manual_seed(0)
    module = Tiny()
    opt = torch.optim.Adam(module.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
    X, y = (torch.as_tensor(a) for a in data)
    for _ in range(epochs):
        for i in range(0, len(X), 16):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.nll_loss(torch.log(module(X[i : i + 16]).float()), y[i : i + 16])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return module, scaler


@pytest.mark.parametrize("kind", ["class", "instance"])
def test_torch_gradscaler_trains_as_torchs_own_loop(data, kind):
    grad_scaler = (
        torch.amp.GradScaler
        if kind == "class"
        else torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    )
    kwargs = (
        dict(grad_scaler__init_scale=2.0**20, grad_scaler__growth_interval=3) if kind == "class" else {}
    )
    torch.manual_seed(0)
    net = AmpNetClassifier(
        Tiny,
        amp_enabled=True,
        amp_dtype="float16",
        grad_scaler=grad_scaler,
        optimizer=torch.optim.Adam,
        optimizer__fused=False,  # the loop's Adam: bitwise the same kernel
        lr=0.05,
        batch_size=16,
        max_epochs=3,
        train_split=None,
        verbose=0,
        criterion=torch.nn.NLLLoss,
        **kwargs,
    )
    quietly(net.fit, *data)
    module, scaler = _torch_loop(2.0**20, 3, data)
    assert type(net.grad_scaler_) is torch.amp.GradScaler
    assert any(net.history[:, "skipped_steps"])  # the scale backed off along the way
    assert net.grad_scaler_.get_scale() == scaler.get_scale()
    assert differences(net.module_.state_dict(), module.state_dict()) == []


def test_torch_gradscaler_state_round_trips(tmp_path, data):
    net = tiny_net(grad_scaler=torch.amp.GradScaler)
    quietly(net.fit, *data)
    net.save_params(f_grad_scaler=str(tmp_path / "s.pt"))
    other = tiny_net(grad_scaler=torch.amp.GradScaler).initialize()
    other.load_params(f_grad_scaler=str(tmp_path / "s.pt"))
    assert other.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()


# ---- the scale stays within float32 --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("min_scale", 1e-50),
        ("min_scale", 1e-39),
        ("max_scale", 1e39),
        ("init_scale", 1e39),
        ("init_scale", 1e-40),
        ("growth_factor", 1e39),
        ("backoff_factor", 1e-50),
    ],
)
def test_scale_settings_outside_float32_are_refused(name, value):
    bounds = {"min_scale": 1e-45, "max_scale": 1e40} if name == "init_scale" else {}
    bounds = {k: v for k, v in bounds.items() if k != name}
    expected = re.escape(f"grad_scaler__{name}={value!r} (float): must ")
    with pytest.raises(ValueError, match=expected) as info:
        tiny_net(**{f"grad_scaler__{name}": value}).initialize()
    assert "float32" in str(info.value) and "e.g." in str(info.value)
    net = tiny_net().initialize()
    with pytest.raises(ValueError, match=expected):
        net.set_params(**{f"grad_scaler__{name}": value})
    assert net.grad_scaler_.get_settings()[name] != value
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        GradScaler("cpu", **{name: value, **bounds})


def test_extreme_valid_settings_keep_the_scale_finite_and_positive():
    up = GradScaler(
        "cpu", init_scale=1e38, max_scale=FLOAT32_MAX, growth_factor=FLOAT32_MAX, growth_interval=1
    )
    down = GradScaler("cpu", init_scale=1e-30, min_scale=FLOAT32_TINY, backoff_factor=FLOAT32_TINY)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.0)
    for scaler, value in ((up, 1.0), (down, float("inf"))):
        for _ in range(5):
            opt.zero_grad()
            scaler.scale((param * value).sum()).backward()
            scaler.step(opt)
            scaler.update()
            assert 0 < scaler.get_scale() < float("inf")
    assert up.get_scale() == pytest.approx(FLOAT32_MAX, rel=1e-6)
    assert down.get_scale() == pytest.approx(FLOAT32_TINY, rel=1e-6)


# ---- int32 step counters of the loss scaler ------------------------------------------------------


def _scaler_steps(scaler, grads):
    """Run the scaler over steps whose gradient is each of ``grads``; return
    the scale after each step."""
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scales = []
    for grad in grads:
        optimizer.zero_grad()
        scaler.scale((weight * grad).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("name", ["growth_interval", "hysteresis"])
@pytest.mark.parametrize("value", [2**31, 2**40])
def test_int32_counters_beyond_their_range_are_refused_everywhere(name, value):
    """Counters beyond int32 are refused: torch's int32 counters wrap around, so that
    growth_interval=2**31 would grow the scale every step and hysteresis=2**31 back off on every
    overflow."""
    problem = re.escape(f"{name}={value} (int): must be an int >= 1 and at most 2**31 - 1")
    with pytest.raises(ValueError, match=problem):
        GradScaler(device="cpu", **{name: value})
    with pytest.raises(ValueError, match="grad_scaler__" + problem):
        tiny_net(**{f"grad_scaler__{name}": value}).initialize()
    net = tiny_net().initialize()
    before = net.grad_scaler_.get_settings()
    with pytest.raises(ValueError, match="grad_scaler__" + problem):
        net.set_params(**{f"grad_scaler__{name}": value})
    assert net.grad_scaler_.get_settings() == before


def test_the_largest_int32_counters_behave_as_huge_not_as_negative():
    grow = GradScaler(device="cpu", init_scale=8.0, growth_interval=2**31 - 1)
    assert _scaler_steps(grow, [1.0] * 4) == [8.0] * 4  # never reaches the interval
    wait = GradScaler(device="cpu", init_scale=8.0, hysteresis=2**31 - 1)
    assert _scaler_steps(wait, [float("inf")] * 4) == [8.0] * 4  # never backs off
    assert wait._overflow_streak == 4


@pytest.mark.parametrize("field, value", [("_overflow_streak", 2**40), ("_overflow_streak", 2**31),
                                          ("hysteresis", 2**31), ("growth_interval", 2**40)])
def test_scaler_file_with_a_counter_beyond_int32_is_refused(tmp_path, saved, field, value):
    """A saved counter beyond int32 is refused at load, not at the next partial_fit (which crashed
    with 'value cannot be converted to type int without overflow' on _overflow_streak = 2**40)."""
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state[field] = value
    bad = str(tmp_path / "s.pt")
    torch.save(state, bad)
    refused_unchanged(
        tiny_net().initialize(), {**saved, "f_grad_scaler": bad},
        re.escape(f"f_grad_scaler file {bad!r} holds an invalid loss-scaler state"),
        re.escape(f"'{field}' = {value} (int)"), re.escape("at most 2**31 - 1"),
    )


def test_scaler_file_with_the_largest_streak_loads_and_trains(tmp_path, saved, data):
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state["_overflow_streak"] = 2**31 - 2
    state["hysteresis"] = 2**31 - 1
    path = str(tmp_path / "s.pt")
    torch.save(state, path)
    net = tiny_net(grad_scaler__hysteresis=2**31 - 1).initialize()
    net.load_params(**{**saved, "f_grad_scaler": path})
    assert net.grad_scaler_._overflow_streak == 2**31 - 2
    quietly(net.partial_fit, *data)
    assert math.isfinite(net.grad_scaler_.get_scale())


# ---- numpy booleans ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "amp_enabled",
        "amp_master_weights",
        "amp_skip_nonfinite",
        "grad_scaler__enabled",
        "grad_scaler__dynamic",
        "distributed",
    ],
)
@pytest.mark.parametrize("value", [np.True_, np.False_])
def test_numpy_booleans_are_accepted_for_every_bool_parameter(name, value):
    kwargs = {name: value}
    if name == "distributed" and value:  # taken as True: it needs a process group
        with pytest.raises(ValueError, match="distributed=True, but no torch.distributed process group"):
            tiny_net(**kwargs).initialize()
        return
    if name == "grad_scaler__enabled" and not value:
        ctx = pytest.warns(AmpWarning, match="float16 training without loss scaling")
    elif name == "amp_enabled" and not value:  # the net's float16 settings now do nothing
        ctx = pytest.warns(AmpWarning, match="amp_enabled=False, so .* no effect")
    elif name == "amp_master_weights" and not value:  # read as False, as Python's False is
        ctx = pytest.warns(AmpWarning, match="amp_master_weights=False has no effect with amp_level='mixed'")
    else:
        ctx = warnings.catch_warnings()
    with ctx:
        net = tiny_net(**kwargs).initialize()
    assert net.get_params()[name] is value
    if name == "amp_enabled":
        assert net.precision_policy_.enabled is bool(value)
    if name.startswith("grad_scaler__"):
        assert net.grad_scaler_.get_settings()[name.split("__")[1]] is bool(value)


@pytest.mark.parametrize(
    "name", ["amp_enabled", "amp_master_weights", "amp_skip_nonfinite", "grad_scaler__dynamic"]
)
def test_non_booleans_name_their_numpy_type(name):
    with pytest.raises((TypeError, ValueError), match=r"1 \(int64\)|np.int64\(1\) \(int64\)"):
        tiny_net(**{name: np.int64(1)}).initialize()
