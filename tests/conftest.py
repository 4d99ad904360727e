"""Shared fixtures: tiny modules and data. Tests run with one torch thread
(fastest for tiny models, and bitwise reproducible).

The tests sit in sub-folders by subject (``net/``, ``precision/``, ``auto/``, ``io/``,
``diagnostics/``, ``ecosystem/``), without ``__init__.py``: each test file's basename is unique.
The shared helpers stay here, at ``tests/``, which this file puts on ``sys.path`` so that every
test file imports them by name (``from resume_script import Tiny``, ``from repo_paths import ROOT``).
A few test files import a neighbour in their own folder (``from test_fused import Recorder``):
pytest's default import mode ("prepend") puts each test file's folder on ``sys.path`` for that."""

import contextlib
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch


torch.set_num_threads(1)

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    """Deselect the tests marked ``gpu`` unless ``-m`` names the mark (``-m gpu``,
    ``-m "gpu and not slow"``, ``-m "not gpu"``): ``python -m pytest -m "not slow"`` still
    leaves them out, as ``python -m pytest`` does."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


class MLP(torch.nn.Module):
    """A small classifier that returns probabilities (skorch's default NLLLoss)."""

    def __init__(self, n_in=20, n_hidden=16, n_out=2):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, n_hidden)
        self.out = torch.nn.Linear(n_hidden, n_out)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


class Regressor(torch.nn.Module):
    def __init__(self, n_in=20):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, 1)

    def forward(self, X):
        return self.lin(X)


class Logits(torch.nn.Module):
    """Linear model, optionally turning inf on chosen training forward calls
    (``bad_calls``: the loss is not finite, a forward-pass overflow) or in the
    gradients of chosen calls (``bad_grad_calls``: a finite loss whose
    backward pass overflows)."""

    def __init__(self, bad_calls=(), n_in=20, bad_grad_calls=()):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, 8)
        self.out = torch.nn.Linear(8, 2)
        self.bad_calls = set(bad_calls)
        self.bad_grad_calls = set(bad_grad_calls)
        self.calls = 0

    def forward(self, X):
        out = self.out(torch.tanh(self.hidden(X)))
        if self.training:
            self.calls += 1
            if self.calls in self.bad_calls:
                out = out * float("inf")
            if self.calls in self.bad_grad_calls:
                out = out.clone()
                out.register_hook(lambda g: g * float("inf"))
        return out


def net_kw(**kw):
    base = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, max_epochs=1, lr=0.1,
                batch_size=8, train_split=None, verbose=0, iterator_train__shuffle=False)
    base.update(kw)
    return base


@pytest.fixture(scope="session")
def classifier_data():
    rng = np.random.RandomState(0)
    X = rng.randn(128, 20).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(np.int64)
    return X, y


@pytest.fixture(scope="session")
def regression_data():
    rng = np.random.RandomState(1)
    X = rng.randn(96, 20).astype(np.float32)
    y = (X[:, :3].sum(1, keepdims=True)).astype(np.float32)
    return X, y


@pytest.fixture
def mlp():
    return MLP


def small_classifier(**kwargs):
    """An ``AmpNetClassifier`` over :class:`MLP` for one quiet epoch of batches of 16, without a
    validation split (``kwargs`` override)."""
    from ampnet import AmpNetClassifier

    params = dict(module=MLP, max_epochs=1, lr=0.05, batch_size=16, train_split=None, verbose=0)
    params.update(kwargs)
    return AmpNetClassifier(**params)


def params_equal(net_a, net_b):
    """Whether two nets' module parameters are bitwise equal."""
    pa = dict(net_a.module_.named_parameters())
    pb = dict(net_b.module_.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


# ---- the device x dtype x level matrix ------------------------------------------------

_HAS_CUDA = torch.cuda.is_available()
_GPU = pytest.mark.gpu
_NO_CUDA = pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device")


def _case(device, dtype, level):
    marks = [_GPU, _NO_CUDA] if device == "cuda" else []
    name = f"{device}-{dtype or 'off'}-{level}"
    kwargs = dict(device=device, amp_enabled=dtype is not None, amp_level=level)
    if dtype is not None:
        kwargs["amp_dtype"] = dtype
    return pytest.param(kwargs, id=name, marks=marks)


#: cpu and cuda x {off, bfloat16, float16} x {mixed, pure}; AMP off has no
#: levels (amp_level only acts with AMP on), so it appears once per device.
PRECISION_CASES = [
    _case(device, dtype, level)
    for device in ("cpu", "cuda")
    for dtype in (None, "bfloat16", "float16")
    for level in (("mixed",) if dtype is None else ("mixed", "pure"))
]


@pytest.fixture(params=PRECISION_CASES)
def precision_case(request):
    """Net keyword arguments for one device x dtype x level case."""
    return dict(request.param)


# ---- the device x dtype fixture -------------------------------------------------------


class DeviceDtype:
    """One device and the dtype a net computes in there: float32 (AMP off),
    bfloat16 or float16 (AMP on, mixed)."""

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype

    @property
    def low(self):
        """Whether the dtype is a low-precision one (AMP on)."""
        return self.dtype != torch.float32

    @property
    def scaled(self):
        """Whether loss scaling runs (float16 only)."""
        return self.dtype == torch.float16

    @property
    def net_kwargs(self):
        """Net keyword arguments: the device, and AMP with the dtype (none with AMP off, where
        an ``amp_dtype`` would have no effect)."""
        if not self.low:
            return dict(device=self.device, amp_enabled=False)
        return dict(device=self.device, amp_enabled=True, amp_dtype=str(self.dtype)[len("torch."):])

    @property
    def atol(self):
        """What a float32 result may differ by when computed in this dtype (tiny models)."""
        return {torch.float32: 1e-6, torch.bfloat16: 3e-2, torch.float16: 5e-3}[self.dtype]

    def __repr__(self):
        return f"{self.device}-{str(self.dtype)[len('torch.'):]}"


DEVICE_DTYPES = [
    pytest.param(DeviceDtype(device, dtype), id=f"{device}-{str(dtype)[len('torch.'):]}",
                 marks=[_GPU, _NO_CUDA] if device == "cuda" else [])
    for device in ("cpu", "cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
]


@pytest.fixture(params=DEVICE_DTYPES)
def device_dtype(request):
    """cpu and cuda (marked ``gpu``) x {float32, bfloat16, float16}: a :class:`DeviceDtype`."""
    return request.param


# ---- amp_enabled="auto": its cache, and both sides of its choice on any CPU -------------------


@pytest.fixture(autouse=True)
def auto_cache_dir(tmp_path_factory, monkeypatch):
    """Every test has a cache folder of its own for ``amp_enabled="auto"``
    (``AMPNET_CACHE_DIR``): no test reads another's choice or the user's cache."""
    folder = tmp_path_factory.mktemp("ampnet-cache")
    monkeypatch.setenv("AMPNET_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def native_bf16(monkeypatch):
    """``amp_enabled="auto"`` takes this CPU for one that computes bfloat16
    natively, so that it measures mixed precision on any CI machine (the
    tests give it a timer, ``amp_autotune__timer``, for the other machine's
    timings)."""
    import ampnet.auto.enabled

    monkeypatch.setattr(ampnet.auto.enabled, "cpu_has_native_bf16", lambda: True)
