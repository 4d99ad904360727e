"""net.export: ONNX (checked with ONNX Runtime on the CPU) and torch.export.

The ONNX tests need the ``onnx`` extra (in ``dev``, so CI runs them); the
``importorskip`` only spares users who installed ampnet without it.
"""

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from skorch.exceptions import NotInitializedError

from ampnet import AmpNet, AmpNetBinaryClassifier, AmpNetClassifier, AmpNetRegressor, AmpWarning
from ampnet.serving.export import EXPORT_FORMATS
from checkpoint_helpers import data, fitted  # noqa: F401  (fixtures)


class DigitsMLP(torch.nn.Module):
    """Logits (CrossEntropyLoss), a LayerNorm and a head that can be selected."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 10)

    def forward(self, X):
        return self.head(self.body(X))


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)

    def forward(self, X):
        if X.sum() > 0:  # Python branching on a tensor value: not traceable
            return self.lin(X)
        return -self.lin(X)


class Unsupported(torch.nn.Module):
    """Traceable by torch.export, but aten.searchsorted has no ONNX translation."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)
        self.register_buffer("edges", torch.tensor([-0.5, 0.5]))

    def forward(self, X):
        return torch.searchsorted(self.edges, self.lin(X).contiguous()).float()


def _digits_net(**kwargs):
    torch.manual_seed(0)
    return AmpNetClassifier(
        DigitsMLP, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.SGD,
        optimizer__momentum=0.9, lr=0.1, batch_size=64, train_split=None, verbose=0, **kwargs,
    )


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    return (X / 16).astype(np.float32), y.astype(np.int64)


@pytest.fixture(scope="module")
def trained(digits):
    """Trained with bf16 AMP; ``reference`` is predict_proba with AMP off."""
    X, y = digits
    net = _digits_net(amp_enabled=True, amp_dtype="bfloat16", max_epochs=10).fit(X, y)
    reference = copy.deepcopy(net).set_params(amp_enabled=False).predict_proba(X)
    assert (reference.argmax(1) == y).mean() > 0.95
    return net, reference


@pytest.fixture
def ort():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    return pytest.importorskip("onnxruntime")


def _run_onnx(ort, path, X):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, session.run(None, {"input": X})[0]


def _state(net):
    return {k: v.clone() for k, v in net.module_.state_dict().items()}


# ---- ONNX -----------------------------------------------------------------


@pytest.mark.slow
def test_onnx_float32_matches_predict_proba(trained, digits, ort, tmp_path):
    net, reference = trained
    X, _ = digits
    before = _state(net)
    path = tmp_path / "digits.onnx"
    assert net.export(path, X[:5]) == str(path)
    assert os.listdir(tmp_path) == ["digits.onnx"]  # no temporary file left
    session, proba = _run_onnx(ort, path, X)  # 1797 rows, the example had 5
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("input", "tensor(float)", ["batch", 64])
    assert (out.name, out.type, out.shape) == ("output", "tensor(float)", ["batch", 10])
    assert proba.dtype == np.float32 and proba.shape == (len(X), 10)
    assert np.abs(proba - reference).max() <= 1e-4  # softmax applied, as predict_proba does
    np.testing.assert_allclose(proba.sum(1), 1, atol=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in net.module_.state_dict().items())
    assert all(p.requires_grad for p in net.module_.parameters())  # export works on a copy


@pytest.mark.slow
def test_onnx_float16_within_1e_2_and_same_classes(trained, digits, ort, tmp_path):
    import onnx

    net, reference = trained
    X, _ = digits
    path = net.export(tmp_path / "digits16.onnx", X[:7].astype(np.float64), dtype="float16")
    weights = {t.name: t.data_type for t in onnx.load(path).graph.initializer}
    linear = [n for n in weights if n.endswith(("body.0.weight", "head.weight"))]
    norm = [n for n in weights if n.endswith("body.1.weight")]
    assert len(linear) == 2 and len(norm) == 1
    assert {weights[n] for n in linear} == {onnx.TensorProto.FLOAT16}
    assert weights[norm[0]] == onnx.TensorProto.FLOAT  # LayerNorm stays float32
    session, proba = _run_onnx(ort, path, X)
    assert [i.type for i in session.get_inputs()] == ["tensor(float)"]  # float64 example: float32 input
    assert proba.dtype == np.float32
    assert np.abs(proba - reference).max() <= 1e-2
    assert (proba.argmax(1) == reference.argmax(1)).mean() >= 0.99


def test_onnx_bfloat16_is_refused_with_the_reason(trained, digits, tmp_path):
    net, _ = trained
    with pytest.raises(ValueError, match="ONNX Runtime's CPU provider has no bfloat16 kernels.*"
                       "format='torch.export'"):
        net.export(tmp_path / "m.onnx", digits[0][:4], dtype="bfloat16")
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_onnx_operator_without_translation(digits, ort, tmp_path):
    net = AmpNetClassifier(Unsupported, verbose=0).initialize()
    with pytest.raises(ValueError, match=r"torch.onnx could not translate Unsupported to ONNX "
                       r"\(DispatchError: .*aten.searchsorted.*Fix: format='torch.export'"):
        net.export(tmp_path / "m.onnx", digits[0][:4])
    assert not os.listdir(tmp_path)
    net.export(tmp_path / "m.pt2", digits[0][:4], format="torch.export")  # the fix works


def test_onnx_without_the_extra_says_what_to_install(trained, digits, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxscript" else real(name, *a))
    with pytest.raises(ImportError, match=r'onnxscript\. Fix: pip install "ampnet\[onnx\]"'):
        trained[0].export(tmp_path / "m.onnx", digits[0][:4])


# ---- torch.export -----------------------------------------------------------


def test_torch_export_float32_and_bfloat16(trained, digits, tmp_path):
    net, reference = trained
    X, _ = digits
    x = torch.from_numpy(X)
    program = torch.export.load(net.export(tmp_path / "m.pt2", X[:3], format="torch.export"))
    assert np.abs(program.module()(x).numpy() - reference).max() <= 1e-5
    program = torch.export.load(
        net.export(tmp_path / "bf16.pt2", X[:3], format="torch.export", dtype="bfloat16")
    )
    dtypes = {k.split("module.", 1)[1]: v.dtype for k, v in program.state_dict.items()}
    assert dtypes == {"body.0.weight": torch.bfloat16, "body.0.bias": torch.bfloat16,
                      "body.1.weight": torch.float32, "body.1.bias": torch.float32,
                      "head.weight": torch.bfloat16, "head.bias": torch.bfloat16}
    proba = program.module()(x)
    assert proba.dtype == torch.float32
    proba = proba.numpy()
    # what the net's own bf16 prediction gives, against float32
    assert np.abs(proba - reference).max() <= 0.05
    assert (proba.argmax(1) == reference.argmax(1)).mean() >= 0.99
    pure = net.convert_for_inference("bfloat16").predict_proba(X)
    assert np.abs(proba - pure).max() <= 0.05
    assert (proba.argmax(1) == pure.argmax(1)).mean() >= 0.99


def test_batch_size_is_dynamic_from_a_one_row_example(trained, digits, tmp_path):
    net, reference = trained
    X, _ = digits
    module = torch.export.load(net.export(tmp_path / "m.pt2", X[:1], format="torch.export")).module()
    for n in (1, 3, 1797):
        np.testing.assert_allclose(module(torch.from_numpy(X[:n])).numpy(), reference[:n], atol=1e-5)


@pytest.mark.slow
def test_exported_files_run_without_ampnet_or_skorch_and_onnx_without_torch(trained, digits, ort, tmp_path):
    net, reference = trained
    X, _ = digits
    net.export(tmp_path / "m.onnx", X[:4])
    net.export(tmp_path / "m.pt2", X[:4], format="torch.export")
    np.save(tmp_path / "X.npy", X)
    script = textwrap.dedent(f"""
        import sys
        blocked = ("ampnet", "skorch", "torch")
        for name in blocked:
            sys.modules[name] = None  # any import of them fails
        import numpy as np, onnxruntime
        X = np.load({str(tmp_path / "X.npy")!r})
        session = onnxruntime.InferenceSession({str(tmp_path / "m.onnx")!r},
                                               providers=["CPUExecutionProvider"])
        np.save({str(tmp_path / "onnx.npy")!r}, session.run(None, {{"input": X}})[0])
        del sys.modules["torch"]  # the .pt2 file needs torch, still not ampnet or skorch
        import torch
        module = torch.export.load({str(tmp_path / "m.pt2")!r}).module()
        np.save({str(tmp_path / "pt2.npy")!r}, module(torch.from_numpy(X)).numpy())
        assert not [m for m in sys.modules if m.startswith(blocked[:2]) and sys.modules[m]]
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    for name in ("onnx.npy", "pt2.npy"):
        assert np.abs(np.load(tmp_path / name) - reference).max() <= 1e-4


# ---- what is exported ---------------------------------------------------------


@pytest.mark.parametrize("cls, criterion, n_out, check", [
    (AmpNetBinaryClassifier, None, 1, "binary"),              # sigmoid, as two columns
    (AmpNetRegressor, None, 1, "identity"),                   # what predict returns
    (AmpNetClassifier, torch.nn.NLLLoss, 3, "identity"),      # the module's own output
    (AmpNet, torch.nn.CrossEntropyLoss, 3, "softmax"),
])
def test_output_is_what_predict_proba_returns(cls, criterion, n_out, check, tmp_path, device_dtype):
    torch.manual_seed(0)
    kwargs = {"criterion": criterion} if criterion else {}
    net = cls(torch.nn.Linear, module__in_features=5, module__out_features=n_out, verbose=0,
              **device_dtype.net_kwargs, **kwargs).initialize()
    X = np.random.RandomState(0).randn(9, 5).astype(np.float32)
    expected = copy.deepcopy(net).set_params(amp_enabled=False).predict_proba(X)
    # the net itself predicts in its dtype: float32 values near the float32 computation
    proba = net.predict_proba(X)
    assert proba.dtype == np.float32
    np.testing.assert_allclose(proba, expected, atol=device_dtype.atol)
    with torch.no_grad():
        logits = net.module_(torch.from_numpy(X).to(net.device)).cpu()
    if check == "binary":
        assert expected.shape == (9, 2)
        np.testing.assert_allclose(expected[:, 1], torch.sigmoid(logits[:, 0]).numpy(), atol=1e-6)
    elif check == "softmax":
        np.testing.assert_allclose(expected, torch.softmax(logits, -1).numpy(), atol=1e-6)
    else:
        np.testing.assert_allclose(expected, logits.numpy(), atol=1e-6)
    # the file is exported from the float32 weights and computes in float32, whatever the net's
    # precision, on the CPU whatever the net's device
    module = torch.export.load(net.export(tmp_path / "m.pt2", X[:2], format="torch.export")).module()
    out = module(torch.from_numpy(X))
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("params, low", [
    ({}, {"body.0", "head"}),
    ({"amp_fp32_modules": ["head"]}, {"body.0"}),
    ({"amp_modules": [torch.nn.Sequential]}, {"body.0"}),
    ({"amp_modules": ["body", "head"], "amp_fp32_modules": "body.0"}, {"head"}),
])
def test_low_precision_layout_follows_the_net(params, low, digits, tmp_path):
    X, _ = digits
    if params:  # AMP off: the selectors do nothing in training, but say what the export keeps float32
        with pytest.warns(AmpWarning, match="no effect"):
            net = _digits_net(**params).initialize()
    else:
        net = _digits_net().initialize()
    reference = net.predict_proba(X)
    path = net.export(tmp_path / "m.pt2", X[:4], format="torch.export", dtype="float16")
    program = torch.export.load(path)
    dtypes = {k.split("module.", 1)[1].rsplit(".", 1)[0]: v.dtype for k, v in program.state_dict.items()}
    assert {name for name, dtype in dtypes.items() if dtype == torch.float16} == low
    assert dtypes["body.1"] == torch.float32
    proba = program.module()(torch.from_numpy(X[:64])).numpy()
    assert np.abs(proba - reference[:64]).max() <= 1e-2


def test_pure_net_exports_its_float32_masters(trained, digits, tmp_path):
    net, reference = trained
    X, _ = digits
    converted = net.convert_for_inference("bfloat16")
    before = converted.predict_proba(X)
    assert np.abs(before - reference).max() > 1e-4  # bf16 weights predict differently
    path = converted.export(tmp_path / "m.pt2", X[:4], format="torch.export")
    proba = torch.export.load(path).module()(torch.from_numpy(X)).numpy()
    assert np.abs(proba - reference).max() <= 1e-5  # the float32 weights, not the bf16 ones
    assert converted.module_.head.weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(converted.predict_proba(X), before)  # the net is unchanged


def test_pure_net_without_masters_warns(digits, tmp_path):
    net = _digits_net(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
                      amp_master_weights=False).initialize()
    with pytest.warns(AmpWarning, match="amp_master_weights=False, or trim_for_prediction"):
        path = net.export(tmp_path / "m.pt2", digits[0][:4], format="torch.export")
    state = torch.export.load(path).state_dict
    assert torch.equal(state["module.head.weight"], net.module_.head.weight.float())


def test_trimmed_pure_net_warns_that_only_low_precision_weights_remain(trained, digits, tmp_path):
    net, _ = trained
    X, _ = digits
    converted = net.convert_for_inference("bfloat16")
    converted.trim_for_prediction()
    with pytest.warns(AmpWarning, match="4 parameter.*bfloat16 without float32 master copies"):
        path = converted.export(tmp_path / "m.pt2", X[:4], format="torch.export")
    state = torch.export.load(path).state_dict
    assert state["module.head.weight"].dtype == torch.float32
    assert torch.equal(state["module.head.weight"], converted.module_.head.weight.float())


def _run_export(net, path, X):
    """The exported model's output on X: ONNX Runtime where the onnx extra is
    installed, else the torch.export program."""
    try:
        import onnx, onnxscript  # noqa: F401
        import onnxruntime
    except ImportError:
        program = torch.export.load(net.export(path.with_suffix(".pt2"), X[:3], format="torch.export"))
        return program.module()(torch.from_numpy(X)).numpy()
    return _run_onnx(onnxruntime, net.export(path.with_suffix(".onnx"), X[:3]), X)[1]


@pytest.mark.parametrize("cls, kwargs, columns", [
    (AmpNetClassifier, {"criterion": torch.nn.CrossEntropyLoss, "module__out_features": 3}, 3),
    (AmpNetBinaryClassifier, {"module__out_features": 1}, 2),
])
def test_trim_for_prediction_keeps_the_nonlinearity_of_predict_proba_and_export(cls, kwargs, columns,
                                                                                 tmp_path):
    torch.manual_seed(0)
    X = np.random.RandomState(0).randn(16, 5).astype(np.float32)
    net = cls(torch.nn.Linear, module__in_features=5, amp_enabled=True, amp_dtype="bfloat16",
              verbose=0, **kwargs).initialize()
    expected = net.predict_proba(X)
    net.trim_for_prediction()
    assert net.criterion_ is None
    trimmed = net.predict_proba(X)
    assert trimmed.shape == (16, columns)
    np.testing.assert_allclose(trimmed, expected, atol=1e-6)
    np.testing.assert_allclose(trimmed.sum(1), 1, atol=1e-5)
    exported = _run_export(net, tmp_path / "trimmed", X)
    np.testing.assert_allclose(exported.sum(1), 1, atol=1e-5)  # probabilities, not logits
    np.testing.assert_allclose(exported, net.set_params(amp_enabled=False).predict_proba(X), atol=1e-5)
    net.trim_for_prediction()  # a second trim changes nothing
    np.testing.assert_allclose(net.predict_proba(X), exported, atol=1e-5)
    np.testing.assert_allclose(pickle.loads(pickle.dumps(net)).predict_proba(X), exported, atol=1e-5)


# ---- errors -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"format": "tflite"}, ValueError,
     r"format must be one of 'onnx', 'torch.export'; got 'tflite' \(str\)\. Fix: format='onnx'"),
    ({"dtype": "int8"}, ValueError,
     r"dtype must be None \(float32\), 'float16'.*got 'int8' \(str\)\. Fix: dtype=None"),
    ({"dtype": torch.float64}, ValueError, r"dtype must be .*got torch.float64"),
    ({"X_example": {"X": np.zeros((2, 64), np.float32)}}, TypeError,
     r"X_example must be one array .*got dict.*Fix: pass e\.g\. X\[:8\]"),
    ({"X_example": np.zeros((0, 64), np.float32)}, ValueError, r"at least one row; got shape \(0, 64\)"),
    ({"path": 3}, TypeError, r"path must be a file name \(str or os.PathLike\); got int"),
])
def test_bad_arguments(trained, kwargs, exc, match, tmp_path):
    args = {"path": tmp_path / "m.pt2", "X_example": np.zeros((2, 64), np.float32),
            "format": "torch.export", **kwargs}
    with pytest.raises(exc, match=match):
        trained[0].export(**args)
    assert not os.listdir(tmp_path)


def test_export_formats_constant():
    assert EXPORT_FORMATS == ("onnx", "torch.export")


def test_dev_extra_installs_the_onnx_and_dask_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from repo_paths import ROOT

    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["onnx"] == ["onnx", "onnxruntime", "onnxscript"]
    assert extras["dask"] == ["dask[distributed]"]
    assert "ampnet[onnx,dask]" in extras["dev"]


def test_uninitialized_net(tmp_path):
    net = AmpNetClassifier(DigitsMLP)
    with pytest.raises(NotInitializedError, match="not initialized yet"):
        net.export(tmp_path / "m.pt2", np.zeros((2, 64), np.float32), format="torch.export")
    assert issubclass(NotInitializedError, ValueError)


def test_net_without_module_(tmp_path):
    class TwoModules(AmpNetClassifier):
        def initialize_module(self):
            self.encoder_ = torch.nn.Linear(64, 10)
            return self

        def infer(self, x, **fit_params):
            return self.encoder_(x)

    net = TwoModules(torch.nn.Linear, verbose=0).initialize()
    with pytest.raises(ValueError, match=r"does not have \(its modules: encoder_\)\. Fix: name"):
        net.export(tmp_path / "m.pt2", np.zeros((2, 64), np.float32), format="torch.export")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_export_from_a_cuda_net_runs_on_the_cpu(digits, tmp_path):
    X, _ = digits
    net = _digits_net(device="cuda", amp_enabled=True, amp_dtype="float16").initialize()
    reference = copy.deepcopy(net).set_params(amp_enabled=False).predict_proba(X)
    program = torch.export.load(net.export(tmp_path / "m.pt2", X[:4], format="torch.export"))
    assert {t.device.type for t in program.state_dict.values()} == {"cpu"}
    np.testing.assert_allclose(program.module()(torch.from_numpy(X)).numpy(), reference, atol=1e-4)


def test_untraceable_module_names_it_and_keeps_the_old_file(digits, tmp_path, capfd):
    net = AmpNetClassifier(Branchy, verbose=0).initialize()
    target = tmp_path / "m.pt2"
    target.write_bytes(b"previous model")
    capfd.readouterr()
    with pytest.raises(ValueError, match=r"torch.export could not trace Branchy with X_example of "
                       r"shape \(4, 64\) and dtype float32 \(GuardOnDataDependentSymNode.*Fix: "):
        net.export(target, digits[0][:4], format="torch.export")
    # torch printed its partial FX graph twice, and a shape warning, before this error
    assert capfd.readouterr().err == ""
    assert target.read_bytes() == b"previous model"
    assert os.listdir(tmp_path) == ["m.pt2"]


class Chatty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)

    def forward(self, X):
        print("Chatty traced", file=sys.stderr)
        return self.lin(X)


def test_what_a_successful_trace_prints_is_passed_on(digits, tmp_path, capfd):
    net = AmpNetClassifier(Chatty, verbose=0).initialize()
    capfd.readouterr()
    net.export(tmp_path / "m.pt2", digits[0][:4], format="torch.export")
    assert "Chatty traced" in capfd.readouterr().err


def test_export_replaces_an_existing_file(trained, digits, tmp_path):
    target = tmp_path / "m.pt2"
    target.write_bytes(b"previous model")
    trained[0].export(target, digits[0][:4], format="torch.export")
    assert torch.export.load(target).module()(torch.from_numpy(digits[0][:2])).shape == (2, 10)
    assert os.listdir(tmp_path) == ["m.pt2"]


@pytest.mark.slow
def test_export_with_integer_features_is_refused_clearly(tmp_path, fitted, data):
    """An integer X_example for a module that fails on integers is refused before anything is
    written (it once wrote an ONNX file that ONNX Runtime could not load: Gemm bound to int64 and
    float), with the fix; the float version exports and runs in ONNX Runtime."""
    pytest.importorskip("onnxscript")
    X = np.round(data[0][:4] * 10).astype(np.int64)
    for fmt, name in (("onnx", "m.onnx"), ("torch.export", "m.pt2")):
        with pytest.raises(ValueError, match=r"X_example holds int64 values, but Tiny fails on them \(RuntimeError") as info:
            fitted.export(str(tmp_path / name), X, format=fmt)
        info.match(r"Fix: pass X_example.astype\(numpy.float32\)")
        assert os.listdir(tmp_path) == []
    # the float version exports and runs in ONNX Runtime
    ort = pytest.importorskip("onnxruntime")
    path = fitted.export(str(tmp_path / "m.onnx"), X.astype(np.float32))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    out = session.run(None, {"input": X.astype(np.float32)})[0]
    assert out.dtype == np.float32
    assert np.allclose(out, fitted.predict_proba(X.astype(np.float32)), atol=5e-3)


class Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, X):
        return torch.softmax(self.out(self.emb(X).mean(1)), dim=-1)


def test_export_keeps_integer_input_for_an_embedding(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    X = np.random.RandomState(0).randint(0, 10, size=(32, 3)).astype(np.int64)
    y = (X[:, 0] > 4).astype(np.int64)
    torch.manual_seed(0)
    net = AmpNetClassifier(Embedded, max_epochs=1, train_split=None, verbose=0).fit(X, y)
    path = net.export(str(tmp_path / "e.onnx"), X[:4])
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(int64)"
    assert np.allclose(session.run(None, {"input": X[:8]})[0], net.predict_proba(X[:8]), atol=1e-5)
