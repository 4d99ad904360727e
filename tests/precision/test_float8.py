"""float8 training (ampnet.precision.kinds.float8) through torchao's CPU
emulation: which layers run it, training as bf16 does, set_params on and
off, pickle, save/load into a plain net, clone; and the errors: torchao
missing (hidden here), amp_level='pure', a recipe typo."""

from __future__ import annotations

import pickle
import sys
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone

from ampnet import AmpNetRegressor
from ampnet.precision.kinds import Float8Precision, MixedPrecision
from ampnet.precision.kinds.float8 import float8_layers

FLOAT8 = dict(amp_enabled=True, amp_dtype="float8")


class MLP(torch.nn.Module):
    """The benchmark MLP's shape (256-512-256-16), every dimension divisible by 16."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.randn(512, 256).astype(np.float32)
    w = rng.randn(256, 16).astype(np.float32) / 16
    return X, (X @ w + 0.1 * rng.randn(512, 16)).astype(np.float32)


def net(**kw):
    torch.manual_seed(0)
    params = dict(max_epochs=1, batch_size=32, train_split=None, verbose=0, optimizer=torch.optim.Adam, lr=1e-3)
    return AmpNetRegressor(MLP, **{**params, **kw})


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def float8_linear():
    return pytest.importorskip("torchao.float8.float8_linear").Float8Linear


def test_which_layers_run_float8_and_why_the_others_do_not():
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 24), torch.nn.Linear(24, 256),
                                 torch.nn.Linear(256, 16))
    assert float8_layers(module, keep_first_last=True) == {
        "0": "kept in bfloat16: the first linear layer",
        "1": "kept in bfloat16: 512x24 is not divisible by 16 (torchao's float8 matmul needs it)",
        "2": "kept in bfloat16: 24x256 is not divisible by 16 (torchao's float8 matmul needs it)",
        "3": "kept in bfloat16: the last linear layer",
    }
    assert float8_layers(module, keep_first_last=False)["0"] == "float8"


def test_the_layers_passing_the_filter_run_float8_the_rest_bf16(data):
    Float8Linear = float8_linear()
    with pytest.warns(Warning, match="float8' on a CPU runs torchao's emulation: the numerics"):
        warnings.simplefilter("always")
        n = net(**FLOAT8).fit(*data)
    assert type(n.precision_) is Float8Precision
    assert [type(m) is Float8Linear for m in (n.module_.a, n.module_.b, n.module_.c)] == [False, True, False]
    n2 = net(**FLOAT8, amp_float8__keep_first_last=False, amp_float8__recipe="rowwise").initialize()
    assert all(type(m) is Float8Linear for m in (n2.module_.a, n2.module_.b, n2.module_.c))
    assert n2.precision_.recipe == "rowwise"


def test_float8_trains_within_2_percent_of_bf16_over_an_epoch(data):
    float8_linear()
    bf16 = net(amp_enabled=True, amp_dtype="bfloat16").fit(*data)
    f8 = net(**FLOAT8, amp_float8__keep_first_last=False).fit(*data)
    loss_bf16, loss_f8 = bf16.history[-1, "train_loss"], f8.history[-1, "train_loss"]
    assert abs(loss_f8 - loss_bf16) <= 0.02 * loss_bf16, (loss_f8, loss_bf16)


def test_set_params_off_and_on_converts_the_module_and_keeps_the_weights(data):
    Float8Linear = float8_linear()
    n = net(**FLOAT8).fit(*data)
    weight = n.module_.b.weight
    before = n.predict(data[0][:64])
    n.set_params(amp_enabled=False)
    assert type(n.module_.b) is torch.nn.Linear and n.module_.b.weight is weight
    assert n.module_.b.weight.dtype == torch.float32
    n.set_params(amp_enabled=True)
    assert type(n.module_.b) is Float8Linear and n.module_.b.weight is weight
    np.testing.assert_array_equal(n.predict(data[0][:64]), before)
    n.set_params(amp_dtype="bfloat16")
    assert type(n.precision_) is MixedPrecision and type(n.module_.b) is torch.nn.Linear
    n.partial_fit(*data)
    assert np.isfinite(n.history[-1, "train_loss"])


def test_pickle_clone_and_save_params_into_a_plain_net(data, tmp_path):
    Float8Linear = float8_linear()
    n = net(**FLOAT8, amp_float8__recipe="rowwise").fit(*data)
    copy = pickle.loads(pickle.dumps(n))
    assert type(copy.precision_) is Float8Precision and type(copy.module_.b) is Float8Linear
    np.testing.assert_array_equal(copy.predict(data[0]), n.predict(data[0]))
    params = clone(n).get_params()
    assert params["amp_dtype"] == "float8" and params["amp_float8__recipe"] == "rowwise"
    n.save_params(f_params=tmp_path / "p.pt")
    plain = net(amp_enabled=False).initialize()
    plain.load_params(f_params=tmp_path / "p.pt")
    for name, value in n.module_.state_dict().items():
        assert torch.equal(plain.module_.state_dict()[name], value), name


def test_float8_needs_amp_level_mixed_and_a_known_recipe():
    with pytest.raises(ValueError, match="amp_dtype='float8' needs amp_level='mixed'.*Fix: amp_level='mixed'"):
        net(**FLOAT8, amp_level="pure").initialize()
    with pytest.raises(ValueError, match="amp_float8__recipe.*'tensorwise'.*'rowwise'"):
        net(**FLOAT8, amp_float8__recipe="colwise").initialize()
    with pytest.raises(ValueError, match="amp_float8__recipee"):
        net(**FLOAT8, amp_float8__recipee="rowwise").initialize()


def test_without_torchao_float8_says_which_extra_and_changes_nothing(data, monkeypatch):
    n = net(amp_enabled=True, amp_dtype="bfloat16").fit(*data)
    weights = {k: v.clone() for k, v in n.module_.state_dict().items()}
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(ImportError, match=r"amp_dtype='float8' trains through torchao.*pip install \"ampnet\[fp8\]\""):
        n.set_params(amp_dtype="float8")
    assert n.amp_dtype == "bfloat16" and type(n.precision_) is MixedPrecision
    assert all(torch.equal(n.module_.state_dict()[k], v) for k, v in weights.items())
    with pytest.raises(ImportError, match=r"ampnet\[fp8\]"):
        net(**FLOAT8).initialize()
