"""A device the machine lacks is a clear ValueError from ampnet, AMP on or
off (also in the demo); a GradScaler instance follows the net's device."""

import importlib.util
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import ampnet
from ampnet import AmpNetClassifier
from ampnet.precision.devices import check_device
from checkpoint_helpers import tiny_net
from conftest import small_classifier


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, X):
        return torch.softmax(self.lin(X), dim=-1)


def data():
    rng = np.random.RandomState(0)
    X = rng.randn(32, 4).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
no_mps = pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")

MISSING = [
    pytest.param("cuda", "CUDA is not available on this machine", marks=no_cuda),
    pytest.param("cuda:1", "CUDA is not available on this machine", marks=no_cuda),
    pytest.param(torch.device("cuda"), "CUDA is not available on this machine", marks=no_cuda),
    pytest.param("mps", r"MPS \(Apple GPU\) is not available on this machine", marks=no_mps),
]
if importlib.util.find_spec("torch_xla") is None:
    MISSING.append(pytest.param("xla", r"XLA \(TPU\) is not available on this machine \(torch_xla is not installed\)"))


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("device, message", MISSING)
def test_missing_device_is_a_clear_error_amp_on_or_off(device, message, amp):
    net = AmpNetClassifier(Tiny, device=device, amp_enabled=amp, max_epochs=1, verbose=0)
    with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))}, but {message}.*Fix: device='cpu'"):
        net.fit(*data())
    assert not net.initialized_ and not hasattr(net, "module_")  # nothing was built


def test_device_that_is_not_a_device():
    with pytest.raises(ValueError, match=r"device must be a torch device .*got 'gpu' \(str\)"):
        AmpNetClassifier(Tiny, device="gpu", amp_enabled=True).initialize()
    # AMP off too: torch does not read it, and the module's .to() would raise at initialize()
    with pytest.raises(ValueError, match=r"device must be a torch device .*got 'foo' \(str\)"):
        check_device("foo")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_beyond_the_devices():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"this machine has {count} CUDA device"):
        check_device(f"cuda:{count}")


def test_cuda_index_beyond_the_devices_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    with pytest.raises(ValueError, match=re.escape(
        "device='cuda:3', but this machine has 2 CUDA device(s) (indices 0 to 1). Fix: "
        "device='cuda:0' or another index below 2."
    )):
        check_device("cuda:3")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_available_devices_pass(device):
    check_device(device)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_the_meta_device_is_refused(device):
    # it holds no values: a module there can be neither trained nor asked for predictions
    with pytest.raises(ValueError, match=r"device=.*meta.* is torch's device without data"):
        check_device(device)


@pytest.mark.slow
@no_cuda
@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_demo_reports_a_missing_device_without_a_traceback(device):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("MPS is available")
    proc = subprocess.run(
        [sys.executable, "-m", "ampnet", "--device", device, "--epochs", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    # the first fit (the untimed warm-up) fails with ampnet's message, not torch's
    assert proc.stdout.rstrip().endswith("... failed")
    assert "warming up (" in proc.stdout.splitlines()[-1]
    assert proc.stderr.strip().startswith(f"python -m ampnet: error: device='{device}', but ")
    assert len(proc.stderr.strip().splitlines()) == 1  # one error line
    assert "Fix: device='cpu'" in proc.stderr


# ---- GradScaler instances follow the net ------------------------------------


def test_grad_scaler_instance_works_on_a_cpu_net():
    X, y = data()
    scaler = ampnet.GradScaler(init_scale=256.0)  # torch's default device would be cuda
    net = AmpNetClassifier(Tiny, amp_enabled=True, amp_dtype="float16", grad_scaler=scaler,
                           max_epochs=1, batch_size=16, train_split=None, verbose=0)
    with pytest.warns(ampnet.AmpWarning, match="float16 autocast on CPU"):
        net.fit(X, y)
    assert net.grad_scaler_ is not scaler and net.grad_scaler_.device == "cpu"
    assert net.history[0, "batches", 0, "loss_scale"] == 256.0
    assert scaler.scale_tensor() is None  # the instance itself is never trained


def test_grad_scaler_made_for_another_device_moves_to_the_net():
    scaler = ampnet.GradScaler(init_scale=256.0)
    scaler._ampnet_device = "cuda"  # as if made on a GPU machine (its scale tensor is made lazily)
    net = AmpNetClassifier(Tiny, amp_enabled=True, amp_dtype="float16", grad_scaler=scaler,
                           max_epochs=1, batch_size=16, train_split=None, verbose=0)
    with pytest.warns(ampnet.AmpWarning, match="float16 autocast on CPU"):
        net.fit(*data())
    assert net.grad_scaler_.device == "cpu" and net.grad_scaler_.get_scale() == 256.0
    assert net.grad_scaler_.scale_tensor().device.type == "cpu"
    assert scaler.device == "cuda"  # the hyper-parameter is unchanged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_made_grad_scaler_moves_to_a_cuda_net():
    scaler = ampnet.GradScaler(device="cpu", init_scale=256.0)
    net = AmpNetClassifier(Tiny, device="cuda", amp_enabled=True, amp_dtype="float16",
                           grad_scaler=scaler, max_epochs=1, batch_size=16, train_split=None, verbose=0)
    net.fit(*data())
    assert net.grad_scaler_.scale_tensor().device.type == "cuda"
    assert net.history[0, "batches", 0, "loss_scale"] == 256.0


def test_set_params_refuses_an_unavailable_device_before_anything_changes(classifier_data):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    net = small_classifier().fit(*classifier_data)
    with pytest.raises(ValueError, match=r"device='cuda', but CUDA is not available"):
        net.set_params(device="cuda")
    assert net.device == "cpu"


@pytest.mark.parametrize("device", ["mps", "xla", "xpu", "xla:1"])
def test_unavailable_backends_get_ampnets_value_error(device):
    with pytest.raises(
        ValueError,
        match=rf"device='{device}', but .* is not available on this machine .*Fix: device='cpu'",
    ):
        tiny_net(device=device, amp_dtype="auto").initialize()


@pytest.mark.parametrize("amp_enabled", [False, True])
def test_a_string_torch_does_not_read_is_refused_amp_on_or_off(amp_enabled):
    # with AMP off it once passed the check and reached the module's .to() at initialize(), which
    # raised torch's RuntimeError (a set_params on a fitted net had taken it without a word)
    net = AmpNetClassifier(Tiny, device="gpu", amp_enabled=amp_enabled)
    with pytest.raises(ValueError, match=r"device must be a torch device such as 'cpu'.*got 'gpu' \(str\)\. Fix:"):
        net.initialize()
    fitted = AmpNetClassifier(Tiny, amp_enabled=amp_enabled, max_epochs=1, train_split=None, verbose=0).initialize()
    with pytest.raises(ValueError, match=r"device must be a torch device"):
        fitted.set_params(device="gpu", amp_enabled=False)
    assert fitted.device == "cpu"
