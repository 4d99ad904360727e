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
from ampnet.exceptions import AmpWarning
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
    assert "i:dyn_ten_e4m3" in str(n.module_.b) and "go:dyn_ten_e5m2" in str(n.module_.b)  # e4m3 forward, e5m2 grads
    held = {id(p) for group in n.optimizer_.param_groups for p in group["params"]}
    assert id(n.module_.b.weight) in held and n.module_.b.weight.dtype == torch.float32
    n2 = net(**FLOAT8, amp_float8__keep_first_last=False, amp_float8__recipe="rowwise").initialize()
    assert all(type(m) is Float8Linear for m in (n2.module_.a, n2.module_.b, n2.module_.c))
    assert n2.precision_.recipe == "rowwise"


def test_the_benchmark_mlp_trains_in_float8_within_2_percent_of_bf16_over_an_epoch():
    """ampnet_bench's MLP (1024-2048-2048-10): its first two linear layers run float8, the last
    (2048x10, not divisible by 16) bfloat16; the epoch's training loss within 2% of bf16's."""
    float8_linear()
    from ampnet import AmpNetClassifier
    from ampnet_bench.workloads import MLP as BenchmarkMLP

    rng = np.random.RandomState(0)
    X = rng.randn(1024, 1024).astype(np.float32)
    y = (X @ rng.randn(1024, 10).astype(np.float32)).argmax(1).astype(np.int64)
    losses, layers = {}, {}
    for dtype, extra in (("bfloat16", {}), ("float8", {"amp_float8__keep_first_last": False})):
        torch.manual_seed(0)
        n = AmpNetClassifier(BenchmarkMLP, criterion=torch.nn.CrossEntropyLoss, amp_enabled=True, amp_dtype=dtype,
                             max_epochs=1, batch_size=128, train_split=None, verbose=0, optimizer=torch.optim.Adam,
                             lr=1e-3, **extra).fit(X, y)
        losses[dtype] = n.history[-1, "train_loss"]
        layers[dtype] = [type(m).__name__ for m in n.module_.layers if "Linear" in type(m).__name__]
    assert layers["float8"] == ["Float8Linear", "Float8Linear", "Linear"]
    assert abs(losses["float8"] - losses["bfloat16"]) <= 0.02 * losses["bfloat16"], losses


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


def test_a_gpu_below_compute_capability_8_9_is_refused_with_the_fix(monkeypatch):
    float8_linear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .*NVIDIA A100 has 8.0\. "
                                         r"Fix: amp_dtype='bfloat16'"):
        Float8Precision.check_machine("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    Float8Precision.check_machine("cuda")  # Hopper: accepted


def test_auto_never_chooses_float8():
    with pytest.raises(ValueError, match="amp_enabled='auto' chooses .* never float8.*Fix: pin it, with "
                                         "amp_enabled=True and amp_dtype='float8'"):
        net(amp_enabled="auto", amp_dtype="float8").initialize()


def test_the_precision_report_says_which_layers_run_float8_and_why_not(data):
    float8_linear()
    n = net(**FLOAT8).fit(*data)
    report = n.precision_report(data[0][:32], data[1][:32])
    flags = {row.module: row.flags for row in report.rows}
    assert flags["a"] == ["bf16: the first linear layer"] and flags["b"] == ["float8"]
    assert flags["c"] == ["bf16: the last linear layer"]
    assert report.net_precision == "float8 (tensorwise; bfloat16 autocast elsewhere)"
    assert "b       Float8Linear" in str(report) and "float8" in str(report)


def test_export_writes_plain_float32_linears(data, tmp_path):
    float8_linear()
    n = net(**FLOAT8, amp_float8__keep_first_last=False).fit(*data)
    path = n.export(tmp_path / "m.pt2", data[0][:4], format="torch.export")
    program = torch.export.load(path)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any("linear" in t or "addmm" in t for t in targets), targets
    assert not any("float8" in t or "scaled_mm" in t for t in targets), targets
    assert type(n.module_.b).__name__ == "Float8Linear"  # the net's own module is untouched
    out = program.module()(torch.as_tensor(data[0][:4]))
    out = out[0] if isinstance(out, (tuple, list)) else out
    n.set_params(amp_enabled=False)  # float32, the same weights: what the export computes
    np.testing.assert_allclose(out.detach().numpy(), n.predict(data[0][:4]), rtol=1e-5, atol=1e-6)


def test_grid_search_over_float8(data):
    float8_linear()
    from sklearn.model_selection import GridSearchCV

    search = GridSearchCV(net(amp_enabled=True), {"amp_dtype": ["bfloat16", "float8"]}, cv=2,
                          scoring="neg_mean_squared_error").fit(*data)
    assert {p["amp_dtype"] for p in search.cv_results_["params"]} == {"bfloat16", "float8"}
    assert np.isfinite(search.cv_results_["mean_test_score"]).all()


class Spiky(MLP):
    """The MLP whose output is inf in the chosen training forward calls (a non-finite loss)."""

    def __init__(self, bad_calls=()) -> None:
        super().__init__()
        self.bad_calls, self.calls = set(bad_calls), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls in self.bad_calls:
                out = out * float("inf")
        return out


def test_checkpoint_and_bitwise_resume(data, tmp_path):
    float8_linear()
    from ampnet.checkpoint import Checkpoint, LoadInitState

    whole = net(**FLOAT8, max_epochs=3).fit(*data)
    cp = Checkpoint(dirname=str(tmp_path / "cp"), monitor=None)
    net(**FLOAT8, max_epochs=2, callbacks=[cp]).fit(*data)
    cp = Checkpoint(dirname=str(tmp_path / "cp"), monitor=None)
    resumed = net(**FLOAT8, max_epochs=1, callbacks=[cp, LoadInitState(cp)]).fit(*data)
    assert len(resumed.history) == 3
    assert type(resumed.module_.b).__name__ == "Float8Linear"
    for (name, a), b in zip(whole.module_.state_dict().items(), resumed.module_.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_flight_recorder_watches_a_float8_fit(data):
    float8_linear()
    from ampnet.callbacks import AmpMonitor

    lines = []
    n = AmpNetRegressor(Spiky, module__bad_calls=(3, 4, 5), **FLOAT8, callbacks=[AmpMonitor(burst=3, sink=lines.append)],
                        max_epochs=1, batch_size=32, train_split=None, verbose=0)
    n.fit(*data)
    assert n.history[-1, "skipped_steps"] == 3
    assert any("3 optimizer steps in a row were skipped" in line for line in lines)


def test_unpickling_a_float8_net_without_torchao_names_the_extra(data, monkeypatch):
    float8_linear()
    blob = pickle.dumps(net(**FLOAT8).fit(*data))
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ImportError, match=r"pickled with amp_dtype='float8'.*pip install \"ampnet\[fp8\]\""):
        pickle.loads(blob)


def test_a_conversion_that_fails_half_way_leaves_the_net_as_it_was(data, monkeypatch):
    float8_linear()
    import torchao.float8 as ao

    n = net(amp_enabled=True, amp_dtype="bfloat16", amp_float8__keep_first_last=False).fit(*data)
    weights = {k: v.clone() for k, v in n.module_.state_dict().items()}
    real = ao.convert_to_float8_training

    def fails_after_one_layer(module, config=None, module_filter_fn=None):
        real(module, config=config, module_filter_fn=lambda m, fqn: fqn == "a")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(ao, "convert_to_float8_training", fails_after_one_layer)
    with pytest.raises(RuntimeError, match="conversion failed"):
        n.set_params(amp_dtype="float8")
    assert n.amp_dtype == "bfloat16" and type(n.precision_) is MixedPrecision
    assert all(type(m) is torch.nn.Linear for m in (n.module_.a, n.module_.b, n.module_.c))
    assert all(torch.equal(n.module_.state_dict()[k], v) for k, v in weights.items())
    n.partial_fit(*data)  # and trains on
    assert np.isfinite(n.history[-1, "train_loss"])


def test_float8_settings_without_amp_dtype_float8_say_they_do_nothing():
    with pytest.warns(Warning, match=r"amp_float8__recipe='rowwise' has no effect with amp_dtype='bfloat16': it "
                                     r"sets float8 training\. Set amp_dtype='float8' to use it, or drop it\."):
        warnings.simplefilter("always")
        net(amp_enabled=True, amp_dtype="bfloat16", amp_float8__recipe="rowwise").initialize()
    with pytest.warns(Warning, match=r"amp_enabled=False, so amp_float8__keep_first_last=False has no effect"):
        warnings.simplefilter("always")
        net(amp_enabled=False, amp_float8__keep_first_last=False).initialize()


def test_amp_float8_modules_limits_the_float8_layers(data):
    Float8Linear = float8_linear()
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 16))
    assert float8_layers(module, keep_first_last=False, modules=["1"]) == {
        "0": "kept in bfloat16: not in amp_float8__modules", "1": "float8",
        "2": "kept in bfloat16: not in amp_float8__modules"}
    n = net(**FLOAT8, amp_float8__keep_first_last=False, amp_float8__modules=["c"]).initialize()
    assert [type(m) is Float8Linear for m in (n.module_.a, n.module_.b, n.module_.c)] == [False, False, True]
    with pytest.raises((TypeError, ValueError), match="amp_float8__modules"):
        net(**FLOAT8, amp_float8__modules=3.5).initialize()


def test_convert_for_inference_gives_plain_low_precision_linears(data):
    float8_linear()
    n = net(**FLOAT8, amp_float8__keep_first_last=False).fit(*data)
    converted = n.convert_for_inference("bfloat16")
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16
               for m in (converted.module_.a, converted.module_.b, converted.module_.c))
    assert type(n.module_.b).__name__ == "Float8Linear"  # the net itself is unchanged
    np.testing.assert_allclose(converted.predict(data[0][:64]), n.predict(data[0][:64]), atol=0.05)


def test_onnx_export_writes_plain_float32_linears(data, tmp_path):
    float8_linear()
    onnx = pytest.importorskip("onnx")  # the onnx extra (in dev)
    ort = pytest.importorskip("onnxruntime")
    n = net(**FLOAT8, amp_float8__keep_first_last=False).fit(*data)
    path = n.export(tmp_path / "m.onnx", data[0][:4])
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert ops & {"Gemm", "MatMul"} and not any("8" in op or "Cast" == op for op in ops), ops
    assert type(n.module_.b).__name__ == "Float8Linear"  # the net's own module is untouched
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: data[0][:4]})
    n.set_params(amp_enabled=False)  # float32, the same weights: what the export computes
    np.testing.assert_allclose(out, n.predict(data[0][:4]), rtol=1e-5, atol=1e-5)


def test_a_module_with_no_layer_in_float8_says_so(data):
    """A new user's 20-16-2 MLP: its two linear layers are the first and the last, kept in bfloat16; the
    net said nothing and trained as bfloat16 under the name float8."""
    float8_linear()
    small = torch.nn.Sequential(torch.nn.Linear(data[0].shape[1], 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with pytest.warns(AmpWarning, match=r"runs no layer of this module in float8 \(0: kept in bfloat16: the first "
                                        r"linear layer; 2: kept in bfloat16: the last linear layer\)"):
        n = AmpNetRegressor(small, max_epochs=1, verbose=0, **FLOAT8).initialize()
    assert not any(type(m).__name__ == "Float8Linear" for m in n.module_.modules())
