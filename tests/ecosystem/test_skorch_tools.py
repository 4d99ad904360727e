"""skorch's own tools on AMP nets, bfloat16 and float16 (CPU loss scaling):
SkorchDoctor (fit, every record, every plot) and the stock callbacks
PrintLog, EpochScoring, TensorBoard, ProgressBar and Checkpoint."""

import functools
import re

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback, Checkpoint, EpochScoring, ProgressBar, TensorBoard
from skorch.dataset import Dataset
from skorch.helper import SkorchDoctor, predefined_split
from sklearn.metrics import roc_auc_score

from ampnet import AmpNetClassifier
from ampnet.exceptions import AmpWarning

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import tqdm as tqdm_module  # noqa: E402
from tqdm import tqdm  # noqa: E402

LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SETTINGS = [("bfloat16", "mixed"), ("float16", "mixed"), ("bfloat16", "pure")]


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        return torch.softmax(self.out(self.act(self.hidden(X))), dim=-1)


class TrueGrads(Callback):
    """Records the gradients ``on_grad_computed`` sees (unscaled, per README)."""

    def initialize(self):
        self.grads_ = []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        self.grads_.append({n: p.grad.detach().float().clone() for n, p in named_parameters})


def data(n=32):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 4).astype(np.float32)
    return X, (X[:, 0] + X[:, 1] > 0).astype(np.int64)


def make_net(dtype, level="mixed", **kwargs):
    settings = dict(module=Tiny, max_epochs=2, batch_size=16, lr=0.1, verbose=0, train_split=None)
    settings.update(kwargs)
    return AmpNetClassifier(amp_enabled=True, amp_dtype=dtype, amp_level=level, **settings)


# ---- SkorchDoctor -----------------------------------------------------------


@pytest.fixture(scope="module", params=SETTINGS, ids=lambda s: "-".join(s))
def doctored(request):
    """(dtype, level, doctor, net fitted without the doctor)."""
    dtype, level = request.param
    X, y = data()
    torch.manual_seed(0)
    doctor = SkorchDoctor(make_net(dtype, level, callbacks=[TrueGrads()])).fit(X, y)
    torch.manual_seed(0)
    plain = make_net(dtype, level, callbacks=[TrueGrads()]).initialize()
    plain.partial_fit(X, y)
    return dtype, level, doctor, plain


def test_doctor_leaves_training_bitwise_unchanged(doctored):
    _, _, doctor, plain = doctored
    net = doctor.net
    losses = [b["train_loss"] for row in net.history for b in row["batches"]]
    assert losses == [b["train_loss"] for row in plain.history for b in row["batches"]]
    for (name, a), (_, b) in zip(net.module_.state_dict().items(), plain.module_.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert sum(net.history[:, "skipped_steps"]) == 0  # the comparison below needs finite steps
    # the doctor removed its hooks (wrapped or not) after fit
    assert not any(m._forward_hooks for m in net.module_.modules())
    assert not any(p._backward_hooks for p in net.module_.parameters())


def test_doctor_records_activations_as_float32_low_precision_values(doctored):
    dtype, _, doctor, _ = doctored
    assert doctor.num_steps_ == 4  # 2 epochs x 2 batches, training batches only
    assert doctor.get_layer_names()["module"] == ["hidden", "act", "out"]
    for step in doctor.activation_recs_["module"]:
        for name, act in step.items():
            assert isinstance(act, np.ndarray) and act.dtype == np.float32, name
            assert act.shape == ((16, 8) if name != "out" else (16, 2))
            # the values the net computed in low precision, written exactly in float32
            t = torch.from_numpy(act)
            assert torch.equal(t.to(LOW[dtype]).float(), t), name


def test_doctor_records_true_gradients_as_float32(doctored):
    dtype, level, doctor, _ = doctored
    recs = doctor.gradient_recs_["module"]
    true = dict(doctor.net.callbacks_)["TrueGrads"].grads_
    assert len(recs) == len(true) == 4
    for step, (rec, ref) in enumerate(zip(recs, true)):
        assert sorted(rec) == sorted(ref) == sorted(n for n, _ in doctor.net.module_.named_parameters())
        for name, grad in rec.items():
            assert grad.dtype == np.float32, name
            # float16: the scaled gradient divided by the (power-of-2) scale, which is
            # exactly what the optimizer steps with; pure: the module's bf16 gradient,
            # which its float32 master receives unchanged
            np.testing.assert_array_equal(grad, ref[name].numpy(), err_msg=f"step {step} {name}")
    updates = doctor.param_update_recs_["module"]
    assert len(updates) == 4
    assert all(np.isfinite(v) and v > 0 for step in updates for v in step.values())


def _drawn(axes):
    """The axes in ``axes`` (one or an array) that hold something drawn."""
    flat = axes.flatten() if isinstance(axes, np.ndarray) else [axes]
    return [ax for ax in flat if ax.lines or ax.patches or ax.collections]


def test_doctor_every_plot(doctored):
    _, _, doctor, _ = doctored
    try:
        axes = doctor.plot_loss()
        np.testing.assert_allclose(axes.lines[0].get_ydata(), doctor.net.history[:, "train_loss"])
        plots = {
            "plot_activations": doctor.plot_activations(),
            "plot_gradients": doctor.plot_gradients(),
            "plot_param_updates": doctor.plot_param_updates(),
            "plot_activations_over_time": doctor.plot_activations_over_time("hidden"),
            "plot_gradient_over_time": doctor.plot_gradient_over_time("hidden.weight"),
        }
        assert {n for n in dir(doctor) if n.startswith("plot_")} == {"plot_loss", *plots}
        for name, axes in plots.items():
            assert _drawn(axes), name
        # the gradient histogram spans the recorded (unscaled) gradients of the last step
        last = doctor.gradient_recs_["module"][-1]
        lo = min(g.min() for g in last.values())
        hi = max(g.max() for g in last.values())
        edges = [p.get_xy()[:, 0] for p in plots["plot_gradients"].flatten()[0].patches]
        assert min(e.min() for e in edges) == pytest.approx(lo)
        assert max(e.max() for e in edges) == pytest.approx(hi)
    finally:
        plt.close("all")


class NormedOutOfOrder(torch.nn.Module):
    """Layers defined out of their order of use, a LayerNorm (kept float32 by
    autocast: not cast) and a weight used twice."""

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(8, 2)
        self.norm = torch.nn.LayerNorm(8)
        self.inp = torch.nn.Linear(4, 8)

    def forward(self, X):
        h = self.norm(self.inp(X))
        return torch.softmax(self.out(h + torch.relu(self.inp(X))), dim=-1)


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 2)
        self.bn = torch.nn.BatchNorm2d(3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, X):
        h = torch.relu(self.bn(self.conv(X.reshape(-1, 1, 2, 2))))
        return torch.softmax(self.head(h.flatten(1)), dim=-1)


@pytest.mark.parametrize("module", [Tiny, NormedOutOfOrder, ConvBN])
@pytest.mark.parametrize("dtype, level", SETTINGS, ids=["-".join(s) for s in SETTINGS])
def test_doctor_lists_parameters_in_skorchs_order(module, dtype, level):
    """skorch's own test_get_parameter_names failed with AMP on: autocast's casts
    changed the order in which the doctor recorded the gradients."""
    from skorch import NeuralNetClassifier

    X, y = data()
    settings = dict(max_epochs=1, batch_size=16, train_split=None, verbose=0)
    torch.manual_seed(0)
    reference = SkorchDoctor(NeuralNetClassifier(module, **settings)).fit(X, y)
    torch.manual_seed(0)
    doctor = SkorchDoctor(AmpNetClassifier(module, amp_enabled=True, amp_dtype=dtype, amp_level=level,
                                           **settings)).fit(X, y)
    assert doctor.get_param_names() == reference.get_param_names()
    for recs in ("gradient_recs_", "param_update_recs_"):
        got, expected = getattr(doctor, recs)["module"], getattr(reference, recs)["module"]
        assert [list(step) for step in got] == [list(step) for step in expected], recs
    assert not any(m._forward_hooks for m in doctor.net.module_.modules())  # the order hook is gone


class Overflowing(Tiny):
    """Its output is inf on the training batch ``bad``: the float16 step overflows."""

    def __init__(self, bad=2):
        super().__init__()
        self.bad, self.calls = bad, 0

    def forward(self, X):
        out = super().forward(X)
        if self.training:
            self.calls += 1
            if self.calls == self.bad:
                out = out * float("inf")
        return out


def test_doctor_records_the_overflowed_step():
    X, y = data()
    net = make_net("float16", module=Overflowing)
    doctor = SkorchDoctor(net).fit(X, y)
    skipped = [b["step_skipped"] for row in net.history for b in row["batches"]]
    assert skipped == [False, True, False, False]
    finite = [all(np.isfinite(g).all() for g in step.values()) for step in doctor.gradient_recs_["module"]]
    assert finite == [True, False, True, True]


class HookTypes(Callback):
    """Records the types of the forward hooks on the module during training."""

    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            self.types_ = {type(h) for m in net.module_.modules() for h in m._forward_hooks.values()}


def test_doctor_hooks_are_left_alone_with_amp_off():
    X, y = data()
    torch.manual_seed(0)
    doctor = SkorchDoctor(AmpNetClassifier(Tiny, max_epochs=1, batch_size=16, train_split=None,
                                           verbose=0, callbacks=[HookTypes()]))
    doctor.fit(X, y)
    assert dict(doctor.net.callbacks_)["HookTypes"].types_ == {functools.partial}
    torch.manual_seed(0)
    from skorch import NeuralNetClassifier

    reference = SkorchDoctor(NeuralNetClassifier(Tiny, max_epochs=1, batch_size=16, train_split=None,
                                                 verbose=0)).fit(X, y)
    for a, b in zip(doctor.gradient_recs_["module"], reference.gradient_recs_["module"]):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- stock skorch callbacks -------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class EagerTqdm(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("mininterval", 0)
        super().__init__(*args, **kwargs)


@pytest.fixture(params=["bfloat16", "float16"])
def fitted_with_callbacks(request, tmp_path, monkeypatch, capsys):
    """A net fitted with PrintLog, EpochScoring, ProgressBar, TensorBoard and
    skorch's Checkpoint; its captured stdout and stderr."""
    # draw the bar at every batch (tqdm redraws at most every 0.1 s by default)
    monkeypatch.setattr(tqdm_module, "tqdm", EagerTqdm)
    X, y = data(64)
    Xv, yv = data(96)
    Xv, yv = Xv[64:], yv[64:]
    cp = Checkpoint(dirname=str(tmp_path / "cp"), monitor="valid_loss_best")
    # TensorBoard only where it is installed (the dev extra has it; the lean test extra
    # does not): the other callbacks' tests run either way
    board = []
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        pass
    else:
        board = [TensorBoard(SummaryWriter(str(tmp_path / "tb")))]
    torch.manual_seed(0)
    net = make_net(
        request.param, max_epochs=3, verbose=1, train_split=predefined_split(Dataset(Xv, yv)),
        callbacks=[EpochScoring("roc_auc", lower_is_better=False), ProgressBar(), *board, cp],
    )
    net.fit(X, y)
    out, err = capsys.readouterr()
    return request.param, net, cp, (Xv, yv), ANSI.sub("", out), err, tmp_path


def test_printlog_epochscoring_and_progressbar(fitted_with_callbacks):
    dtype, net, _, (Xv, yv), out, err, _ = fitted_with_callbacks
    history = net.history
    assert len(history) == 3
    # PrintLog: a table with the AMP columns, one row per epoch with the history's values
    lines = [line for line in out.splitlines() if line.strip()]
    header = lines[0].split()
    assert header == ["epoch", "loss_scale", "roc_auc", "skipped_steps", "train_loss",
                      "valid_acc", "valid_loss", "cp", "dur"]
    rows = [line.split() for line in lines[2:5]]
    for row, epoch in zip(rows, history):
        assert row[0] == str(epoch["epoch"])
        assert row[1] == f"{epoch['loss_scale']:.4f}"
        assert row[1] == ("65536.0000" if dtype == "float16" else "1.0000")
        assert row[2] == f"{epoch['roc_auc']:.4f}"
        assert row[3] == str(epoch["skipped_steps"]) == "0"
        assert row[4] == f"{epoch['train_loss']:.4f}" and row[6] == f"{epoch['valid_loss']:.4f}"
        assert row[5] == f"{epoch['valid_acc']:.4f}"
    # EpochScoring scored the float32 probabilities of the last epoch's weights
    proba = net.predict_proba(Xv)
    assert proba.dtype == np.float32
    assert history[-1, "roc_auc"] == pytest.approx(roc_auc_score(yv, proba[:, 1]), abs=1e-12)
    # ProgressBar: every batch of every epoch, with the batch losses of the history
    frames = [f for f in err.split("\r") if "it/s" in f or "?it" in f]
    n_batches = len(history[0, "batches"])
    for k in range(1, n_batches + 1):
        assert sum(f"| {k}/{n_batches} [" in f for f in frames) == 3, k
    for key in ("train_loss", "valid_loss"):
        shown = re.findall(key + r"=([0-9.e+-]+)", err)
        expected = [tqdm.format_num(b[key]) for row in history for b in row["batches"] if key in b]
        assert shown == expected, key
    assert "Traceback" not in err


def test_tensorboard_and_checkpoint(fitted_with_callbacks):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    dtype, net, cp, (Xv, _), _, _, tmp_path = fitted_with_callbacks
    history = net.history
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Loss/train_loss", "Loss/valid_loss", "roc_auc", "skipped_steps"} <= tags
    for tag, key in [("Loss/train_loss", "train_loss"), ("Loss/valid_loss", "valid_loss"),
                     ("roc_auc", "roc_auc")]:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3]
        np.testing.assert_allclose([e.value for e in events], history[:, key], rtol=1e-6)
    scale_tag = next(t for t in tags if t.endswith("loss_scale"))
    assert [e.value for e in acc.Scalars(scale_tag)] == history[:, "loss_scale"]
    # skorch's own Checkpoint saved the best epoch; it loads (with ampnet's note that
    # a skorch checkpoint holds no loss-scaler or RNG state) and predicts the same
    best = [i for i, row in enumerate(history) if row["event_cp"]][-1]
    assert history[best, "valid_loss_best"]
    saved = torch.load(str(tmp_path / "cp" / "params.pt"), weights_only=True)
    loaded = make_net(dtype, train_split=None).initialize()
    with pytest.warns(AmpWarning, match="without ampnet's resume files") as caught:
        loaded.load_params(checkpoint=cp)
    assert any("Fix: save checkpoints to resume from with ampnet.checkpoint.Checkpoint and load them "
               "with ampnet.checkpoint.LoadInitState" in str(w.message) for w in caught)
    assert len(loaded.history) == best + 1
    for name, value in loaded.module_.state_dict().items():
        assert torch.equal(value, saved[name]), name
    if best == len(history) - 1:
        np.testing.assert_array_equal(loaded.predict_proba(Xv), net.predict_proba(Xv))
