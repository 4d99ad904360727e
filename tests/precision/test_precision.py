"""The precision policy: dtype parsing, device rules, output conversion."""

import collections
import re

import pytest
import torch

from ampnet.precision import policy as precision
from ampnet.precision.policy import PrecisionPolicy, parse_amp_dtype, resolve_precision


@pytest.mark.parametrize(
    "value, expected",
    [
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("FP16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("auto", None),
    ],
)
def test_parse_amp_dtype_aliases(value, expected):
    assert parse_amp_dtype(value) == expected


@pytest.mark.parametrize(
    "value, match",
    [
        ("float32", r"got 'float32' \(str\).*set amp_enabled=False"),
        ("int8", r"amp_dtype must be one of 'auto', 'float16'.*got 'int8'"),
        ("bfloat61", r"Did you mean 'bfloat16'\?"),
        ("fp8", r"got 'fp8' \(str\)\. Fix: amp_dtype='auto' \(the dtype that suits the device\), 'bfloat16' or "
                r"'float16'; float8 training is not supported\."),
        (torch.float32, r"got torch.float32 \(dtype\).*amp_enabled=False"),
        (torch.float64, r"amp_dtype must be one of"),
    ],
)
def test_parse_amp_dtype_rejects_with_choices_and_fix(value, match):
    with pytest.raises(ValueError, match=match):
        parse_amp_dtype(value)


def test_parse_amp_dtype_wrong_type():
    with pytest.raises(TypeError, match=r"amp_dtype must be a str or a torch.dtype.*got 16 \(int\)"):
        parse_amp_dtype(16)


def test_amp_enabled_must_be_bool():
    with pytest.raises(TypeError, match=r"amp_enabled must be True or False; got 'yes' \(str\)"):
        resolve_precision("yes", "auto", "cpu")


def test_amp_level_validated():
    with pytest.raises(ValueError, match=r"amp_level must be one of 'mixed', 'pure'; got 'full'"):
        resolve_precision(True, "auto", "cpu", "full")


def test_invalid_device_named():
    with pytest.raises(ValueError, match=r"device must be a torch device.*got 'gpu' \(str\)"):
        resolve_precision(True, "auto", "gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda")])
def test_cuda_without_cuda_is_an_error_not_a_fallback(device):
    with pytest.raises(ValueError, match="CUDA is not available.*never falls back"):
        resolve_precision(True, "auto", device)


def _component(policy):
    """The precision component of a net with this policy (default settings otherwise)."""
    from ampnet.precision.component import Precision
    from ampnet.precision.settings import PrecisionSettings

    return Precision.build(PrecisionSettings(policy=policy), {})


def test_disabled_policy_is_a_no_op():
    policy = resolve_precision(False, "bf16", "cpu")
    assert not policy.enabled and policy.compute_dtype is None and not policy.uses_scaler
    x = torch.ones(2, dtype=torch.bfloat16)
    prec = _component(policy)
    assert prec.convert_output(x) is x
    with prec.forward_context():
        assert not torch.is_autocast_enabled("cpu")


def test_disabled_policy_leaves_outer_autocast_alone():
    policy = resolve_precision(False, "auto", "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _component(policy).forward_context():
            assert torch.is_autocast_enabled("cpu")


def test_cpu_auto_is_bf16_without_scaler(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    policy = resolve_precision(True, "auto", "cpu")
    assert policy.compute_dtype == torch.bfloat16
    assert not policy.uses_scaler
    assert policy.notices == ()
    assert policy.name == "bfloat16 (mixed)"
    with _component(policy).forward_context():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_cpu_without_native_bf16_gets_a_notice(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    policy = resolve_precision(True, "auto", "cpu")
    assert policy.compute_dtype == torch.bfloat16
    assert len(policy.notices) == 1 and "no native bfloat16" in policy.notices[0]


def test_fp16_on_cpu_uses_scaler_and_warns_it_is_slow():
    policy = resolve_precision(True, "fp16", "cpu")
    assert policy.compute_dtype == torch.float16 and policy.uses_scaler
    (notice,) = [n for n in policy.notices if n.startswith("float16 autocast on CPU")]
    assert "often slower than float32, by a factor that depends on the model and the CPU" in notice
    # no speed figure that no benchmark measured (the demo measured 1.65x where it said 10-60x)
    assert not re.search(r"\d+\s*x\b", notice), notice


def _fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "FakeGPU")


def test_cuda_auto_picks_by_compute_capability(monkeypatch):
    _fake_cuda(monkeypatch, (8, 0))
    assert resolve_precision(True, "auto", "cuda").compute_dtype == torch.bfloat16
    _fake_cuda(monkeypatch, (7, 5))
    policy = resolve_precision(True, "auto", "cuda:0")
    assert policy.compute_dtype == torch.float16 and policy.uses_scaler
    assert policy.device_type == "cuda"


def test_bf16_on_old_gpu_is_an_error(monkeypatch):
    _fake_cuda(monkeypatch, (7, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.0.*FakeGPU.*Fix: amp_dtype='float16'"):
        resolve_precision(True, "bf16", "cuda")


def test_convert_output_walks_containers():
    policy = PrecisionPolicy(True, "cpu", torch.bfloat16, False)
    Pair = collections.namedtuple("Pair", "a b")
    out = _component(policy).convert_output(
        {
            "x": torch.ones(2, dtype=torch.bfloat16),
            "y": [torch.ones(1, dtype=torch.float16), torch.ones(1, dtype=torch.int64)],
            "z": Pair(torch.ones(1, dtype=torch.bfloat16), "label"),
        }
    )
    assert out["x"].dtype == torch.float32
    assert out["y"][0].dtype == torch.float32 and out["y"][1].dtype == torch.int64
    assert isinstance(out["z"], Pair) and out["z"].a.dtype == torch.float32 and out["z"].b == "label"


def test_precision_policy_is_a_read_only_view_of_the_component(classifier_data):
    from ampnet import AmpNetClassifier
    from conftest import MLP

    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="bf16", max_epochs=1, verbose=0).initialize()
    policy = net.precision_policy_
    # Python >= 3.10 names the property; 3.9 says "can't set attribute"
    with pytest.raises(AttributeError, match="precision_policy_|can't set attribute"):
        net.precision_policy_ = resolve_precision(False, "auto", "cpu")
    assert net.precision_policy_ is policy is net.precision_.policy
    assert (policy.enabled, policy.compute_dtype, policy.uses_scaler) == (True, torch.bfloat16, False)
    assert net.grad_scaler_ is net.precision_.scaler and not net.grad_scaler_.is_enabled()
