"""The flight recorder: why each skipped step was skipped (``skip_cause``),
the first non-finite module (``first_nonfinite``, with ``AmpMonitor``),
``grad_norm`` and ``lost_updates`` per epoch, ``plot_precision`` and the
warning at the end of a fit whose loss is non-finite."""

import math
import threading

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback, GradientNormClipping

import ampnet
from ampnet import AmpNetClassifier, AmpWarning
from ampnet.callbacks import AmpMonitor
from ampnet.diagnostics.flight import SAMPLE_PER_TENSOR

from test_report import Overflowing


class Inject(torch.autograd.Function):
    """Identity forward; a backward that turns the gradient into inf."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Boom(torch.nn.Module):
    """Goes non-finite on batches whose marker is set: in its forward output
    (``mode='forward'``) or in the gradient it passes back (``'backward'``).
    The marker travels with the batch, so a replay reproduces it."""

    def __init__(self, mode=None):
        super().__init__()
        self.mode = mode

    def forward(self, x, marked):
        if self.mode is None or not marked:
            return x
        return x * float("inf") if self.mode == "forward" else Inject.apply(x)


class Net3(torch.nn.Module):
    """Features in the first 20 columns, the marker in the last."""

    def __init__(self, mode=None, dropout=0.0):
        super().__init__()
        self.inp = torch.nn.Linear(20, 16)
        self.boom = Boom(mode)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, X):
        marked = bool(X[:, 20].any()) and self.training
        return self.out(self.drop(self.boom(torch.relu(self.inp(X[:, :20])), marked)))


def data(n=64, seed=0, marked=(), batch_size=16):
    """``n`` rows, 20 features and the marker column, set in the ``marked`` batches (from 0)."""
    rng = np.random.RandomState(seed)
    X = np.zeros((n, 21), dtype=np.float32)
    X[:, :20] = rng.randn(n, 20)
    for b in marked:
        X[b * batch_size, 20] = 1.0
    return X, (X[:, 0] > 0).astype(np.int64)


def make_net(monitor=True, **kw):
    torch.manual_seed(0)
    base = dict(module=Net3, criterion=torch.nn.CrossEntropyLoss, amp_enabled=True, amp_dtype="bfloat16",
                max_epochs=1, lr=0.05, batch_size=16, train_split=None, verbose=0,
                iterator_train__shuffle=False,
                callbacks=[AmpMonitor(sink=lambda line: None)] if monitor else None)
    base.update(kw)
    return AmpNetClassifier(**base)


def skipped_rows(net, epoch=-1):
    return [(i, b) for i, b in enumerate(net.history[epoch, "batches"]) if b.get("step_skipped")]


fp16_quiet = pytest.mark.filterwarnings("ignore:float16 autocast on CPU:ampnet.exceptions.AmpWarning")


# ---- skip_cause and first_nonfinite -----------------------------------------------------------


@fp16_quiet
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode, cause", [("forward", "nonfinite_loss"), ("backward", "overflow")])
def test_injected_nonfinite_named_at_its_module(dtype, mode, cause):
    X, y = data(marked=(1,))
    net = make_net(module__mode=mode, amp_dtype=dtype)
    with pytest.warns(AmpWarning, match="non-finite training loss") if mode == "forward" else _none():
        net.fit(X, y)
    rows = net.history[-1, "batches"]
    assert [i for i, _ in skipped_rows(net)] == [1]
    assert rows[1]["skip_cause"] == cause
    assert rows[1]["first_nonfinite"] == "boom"
    for good in (rows[0], rows[2], rows[3]):  # good steps carry no cause and no replay
        assert "skip_cause" not in good and "first_nonfinite" not in good


@fp16_quiet
def test_skip_cause_without_monitor_and_no_extra_columns():
    X, y = data(marked=(1, 2))
    net = make_net(monitor=False, module__mode="backward", amp_dtype="float16")
    net.fit(X, y)
    rows = net.history[-1, "batches"]
    assert [b.get("skip_cause") for b in rows] == [None, "overflow", "overflow", None]
    assert not any("first_nonfinite" in b for b in rows)
    for column in ("grad_norm", "lost_updates", "scale_changes"):
        assert column not in net.history[-1]


def test_nonfinite_input_is_bad_data_not_replayed():
    X, y = data()
    X[20, 3] = np.nan  # the second batch
    net = make_net(module__mode=None)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    rows = net.history[-1, "batches"]
    assert rows[1]["skip_cause"] == "nonfinite_input" and rows[1]["nonfinite_input"] is True
    assert "first_nonfinite" not in rows[1]  # bad data needs no replay
    texts = [str(w.message) for w in record]
    assert any("holds NaN or inf in its input" in t for t in texts)
    end = [t for t in texts if "non-finite training loss" in t]
    assert len(end) == 1 and "bad data" in end[0] and "clean or impute" in end[0]


class ZeroProb(torch.nn.Module):
    """Probabilities with an exact 0 on marked batches: NLLLoss of log(0) is
    inf while every module's output is finite."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 2)

    def forward(self, X):
        p = torch.softmax(self.lin(X[:, :20]), dim=-1)
        if self.training and bool(X[:, 20].any()):
            p = p * torch.tensor([0.0, 1.0])
        return p


class NaiveNLL(torch.nn.Module):
    """-log(p) of the true class, without skorch's epsilon for NLLLoss."""

    def forward(self, p, y):
        return -torch.log(p.gather(1, y[:, None])).mean()


def test_nonfinite_loss_from_finite_modules():
    X, y = data(marked=(1,))
    net = make_net(module=ZeroProb, criterion=NaiveNLL, amp_enabled=False, amp_dtype="auto")
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    rows = net.history[-1, "batches"]
    assert [i for i, _ in skipped_rows(net)] == [1]
    assert rows[1]["skip_cause"] == "nonfinite_loss"
    # the replay's modules all stay finite: only the loss is not
    assert rows[1]["first_nonfinite"] is None
    # the skipped batch keeps its own loss; the epoch's is the mean over the applied steps
    assert not math.isfinite(rows[1]["train_loss"]) and math.isfinite(net.history[-1, "train_loss"])
    end = [str(w.message) for w in record if "non-finite training loss" in str(w.message)]
    assert len(end) == 1 and "lower the learning rate" in end[0]
    assert end[0].startswith("Training ended with a non-finite training loss in 1 of the last epoch's 4 "
                             "training batches (train_loss=")


def test_cause_of_an_earlier_micro_batch_in_an_accumulation_group():
    X, y = data(marked=(2,), batch_size=8)
    net = make_net(module__mode="forward", gradient_accumulation_steps=2, batch_size=8)
    with pytest.warns(AmpWarning, match="non-finite training loss"):
        net.fit(X, y)
    rows = net.history[-1, "batches"]
    assert [i for i, _ in skipped_rows(net)] == [3]  # the step at the end of the group (batches 2, 3)
    assert rows[3]["skip_cause"] == "nonfinite_loss"  # the loss of batch 2, not that of batch 3
    assert rows[3]["first_nonfinite"] is None  # the replay runs the last micro-batch, which is clean


def test_replay_changes_nothing_and_is_bounded():
    X, y = data(96, marked=(1, 2, 4))
    runs = {}
    for replays in (0, 2):
        net = make_net(module__mode="backward", module__dropout=0.3,
                       amp_max_consecutive_skips=None, max_epochs=2,
                       callbacks=[AmpMonitor(sink=lambda line: None, max_replays=replays)])
        net.fit(X, y)
        runs[replays] = (net, torch.get_rng_state(), net.optimizer_.state_dict())
    (plain, rng0, opt0), (replayed, rng2, opt2) = runs[0], runs[2]
    assert torch.equal(rng0, rng2)
    for a, b in zip(plain.module_.parameters(), replayed.module_.parameters()):
        assert torch.equal(a, b)
    for sa, sb in zip(opt0["state"].values(), opt2["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    named = [[b.get("first_nonfinite") for _, b in skipped_rows(replayed, e)] for e in (0, 1)]
    assert named == [["boom", "boom", None]] * 2  # at most 2 replays per epoch
    strip = lambda net: [[{k: v for k, v in b.items() if k != "first_nonfinite"}
                          for b in row["batches"]] for row in net.history]
    assert strip(plain) == strip(replayed)
    assert not any("first_nonfinite" in b for row in plain.history for b in row["batches"])


class Uncopyable(Net3):
    def __init__(self, mode=None):
        super().__init__(mode)
        self.lock = threading.Lock()


def test_a_module_that_cannot_be_copied_is_recorded_without_replay():
    X, y = data(32, marked=(1,))
    net = make_net(module=Uncopyable, module__mode="backward")
    with pytest.warns(AmpWarning, match=r"could not be copied for the replay \(TypeError.*max_replays=0"):
        net.fit(X, y)
    row = net.history[-1, "batches", 1]
    assert row["skip_cause"] == "overflow" and row["first_nonfinite"] is None


def test_max_replays_is_checked():
    net = make_net(callbacks=[AmpMonitor(max_replays=-1)])
    with pytest.raises(ValueError, match=r"max_replays must be an int >= 0; got -1 \(int\)"):
        net.initialize()


@fp16_quiet
def test_first_nonfinite_is_flagged_by_precision_report(classifier_data):
    """A known overflowing layer (``big``, activations ~1e5) in float16: the
    recorder names it, and the precision report flags it for the same batch."""
    X, y = classifier_data[0][:32], classifier_data[1][:32]
    torch.manual_seed(0)
    net = AmpNetClassifier(Overflowing, amp_enabled=True, amp_dtype="float16", max_epochs=1, batch_size=16,
                           train_split=None, verbose=0, iterator_train__shuffle=False,
                           callbacks=[AmpMonitor(sink=lambda line: None)])
    with pytest.warns(AmpWarning, match=r"float16 overflow in module 'big'.*amp_fp32_modules=\['big'\]"):
        net.fit(X, y)
    row = net.history[-1, "batches", 0]
    assert row["skip_cause"] == "nonfinite_loss" and row["first_nonfinite"] == "big"
    report = net.precision_report(X[:16], y[:16])
    flagged = {r.module for r in report.rows if r.flags}
    assert row["first_nonfinite"] in flagged
    assert row["first_nonfinite"] in report.recommended_fp32_modules


# ---- grad_norm and lost_updates ---------------------------------------------------------------


class ReferenceNorm(Callback):
    """The norm a GradientNormClipping callback computes, averaged over the applied steps."""

    def initialize(self):
        self.epochs, self.current = [], []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        grads = [p.grad for _, p in named_parameters if p.grad is not None]
        self.current.append(float(torch.nn.utils.get_total_norm(grads, 2.0)))

    def on_batch_end(self, net, training=False, **kwargs):
        if training and net.history[-1, "batches", -1].get("step_skipped"):
            self.current.pop()

    def on_epoch_end(self, net, **kwargs):
        self.epochs.append(sum(self.current) / len(self.current))
        self.current = []


@fp16_quiet
def test_grad_norm_matches_reference_before_clipping():
    X, y = data(96, marked=(1,))
    reference = ReferenceNorm()
    net = make_net(amp_dtype="float16", module__mode="backward", max_epochs=2,
                   grad_scaler__init_scale=2.0 ** 12,
                   callbacks=[reference, GradientNormClipping(0.01), AmpMonitor(sink=lambda line: None)])
    net.fit(X, y)
    assert len(skipped_rows(net, 0)) == 1  # the skipped step is left out of the mean
    ours = net.history[:, "grad_norm"]
    assert len(ours) == 2 and min(ours) > 0.01  # the norm before clipping to 0.01
    np.testing.assert_allclose(ours, reference.epochs, rtol=0.01)


def test_no_applied_step_gives_nan_grad_norm():
    X, y = data(32, marked=(0, 1))
    net = make_net(module__mode="backward", amp_max_consecutive_skips=None,
                   callbacks=[AmpMonitor(sink=lambda line: None, max_replays=0)])
    net.fit(X, y)
    assert math.isnan(net.history[-1, "grad_norm"])


@pytest.mark.parametrize("masters, lost", [(False, "most"), (True, "none"), ("compensated", "none")])
def test_lost_updates_in_pure_bfloat16(masters, lost):
    # SGD with lr 1e-4: updates of about 1e-5 on weights of about 0.1 are far
    # below half a bfloat16 ulp (about 2e-4 there)
    X, y = data(64)
    net = make_net(amp_level="pure", amp_master_weights=masters, optimizer=torch.optim.SGD, lr=1e-4,
                   max_epochs=2)
    net.fit(X, y)
    values = net.history[:, "lost_updates"]
    assert len(values) == 2
    if lost == "most":
        assert all(v > 0.9 for v in values), values
    else:  # only updates below float32's resolution (or the compensation's) are lost
        assert all(0 <= v < 0.01 for v in values), values
    assert net.history[-1, "grad_norm"] > 0


def test_lost_updates_only_for_pure_and_sampled():
    X, y = data(32)
    mixed = make_net(optimizer=torch.optim.SGD, lr=1e-4).fit(X, y)
    assert "lost_updates" not in mixed.history[-1] and mixed.history[-1, "grad_norm"] > 0
    assert SAMPLE_PER_TENSOR >= 1024  # every parameter of these tests is measured whole


# ---- the end of a fit ------------------------------------------------------------------------


@fp16_quiet
@pytest.mark.parametrize("limit", [None, 50])
def test_nonfinite_loss_warning_names_cause(limit):
    """Float16 and inputs around 1e6: the warning names the overflow as the cause."""
    X, y = data(32)
    X[:, :20] *= 1e6
    net = make_net(amp_dtype="float16", amp_max_consecutive_skips=limit)
    with pytest.warns(AmpWarning) as record:
        net.fit(X, y)
    end = [str(w.message) for w in record if "non-finite training loss" in str(w.message)]
    assert len(end) == 1
    assert [b["skip_cause"] for b in net.history[-1, "batches"]] == ["nonfinite_loss"] * 2
    assert "2 nonfinite_loss" in end[0]
    assert "float16 overflow in module 'inp'" in end[0] and "amp_dtype='bfloat16'" in end[0]
    assert "amp_fp32_modules=['inp']" in end[0]


def test_finite_run_does_not_warn():
    X, y = data(32)
    make_net().fit(X, y)  # AmpWarning is an error in the tests: none was raised


# ---- the plot and TensorBoard ----------------------------------------------------------------


def test_plot_precision_axes():
    pytest.importorskip("matplotlib")
    X, y = data(64, marked=(1,))
    net = make_net(amp_level="pure", amp_master_weights=False, module__mode="backward", max_epochs=2,
                   optimizer=torch.optim.SGD, lr=1e-3)
    net.fit(X, y)
    fig = ampnet.plot_precision(net)
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    assert fig._repr_png_().startswith(b"\x89PNG")  # a notebook shows it as a cell's value
    titles = [ax.get_title() for ax in fig.axes]
    # bfloat16 has no loss scale: no flat panel at 1.0
    assert [t.split(" ")[0] for t in titles] == ["Loss", "Skipped", "Gradient", "Updates"]
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    labels = fig.axes[1].get_legend_handles_labels()[1]
    assert labels == ["overflow"]


@fp16_quiet
def test_plot_precision_draws_the_loss_scale_of_float16_only():
    pytest.importorskip("matplotlib")
    X, y = data(64, marked=(1,))
    fp16 = make_net(amp_dtype="float16", module__mode="backward", max_epochs=2).fit(X, y)
    titles = [ax.get_title() for ax in ampnet.plot_precision(fp16).axes]
    assert titles[1] == "Loss scale after each step"
    assert ampnet.plot_precision(fp16).axes[1].get_yscale() == "log"
    for kw in (dict(amp_dtype="bfloat16"), dict(amp_enabled=False, amp_dtype="auto")):
        net = make_net(max_epochs=2, **kw).fit(X, y)
        assert all(b.get("loss_scale", 1.0) == 1.0 for b in net.history[-1, "batches"])  # flat, if recorded
        titles = [ax.get_title() for ax in ampnet.plot_precision(net).axes]
        assert not any(t.startswith("Loss scale") for t in titles), (kw, titles)


def test_plot_without_monitor_and_errors():
    pytest.importorskip("matplotlib")
    X, y = data(32)
    net = make_net(monitor=False, amp_enabled=False, amp_dtype="auto").fit(X, y)
    fig = ampnet.plot_precision(net)
    assert [ax.get_title() for ax in fig.axes] == ["Loss", "Skipped optimizer steps by cause"]
    with pytest.raises(ValueError, match="plot_precision needs a fitted net"):
        ampnet.plot_precision(make_net())


def test_tensorboard_gets_the_series(tmp_path):
    pytest.importorskip("tensorboard")
    from skorch.callbacks import TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    X, y = data(64, marked=(1,))
    writer = SummaryWriter(log_dir=str(tmp_path))
    net = make_net(amp_level="pure", amp_master_weights=False, module__mode="backward", max_epochs=2,
                   callbacks=[TensorBoard(writer), AmpMonitor(sink=lambda line: None)])
    net.fit(X, y)
    writer.flush()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"amp/grad_norm", "amp/lost_updates", "amp/skipped/overflow", "amp/loss_scale",
            "Loss/train_loss"} <= tags
    assert [e.value for e in acc.Scalars("amp/skipped/overflow")] == [1.0, 1.0]
    assert [e.value for e in acc.Scalars("amp/skipped/nonfinite_loss")] == [0.0, 0.0]
    assert [e.value for e in acc.Scalars("amp/grad_norm")] == pytest.approx(net.history[:, "grad_norm"])


class _none:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plot_extra_is_declared_and_in_dev():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from repo_paths import ROOT

    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["plot"] == ["matplotlib"]
    assert "ampnet[plot]" in extras["dev"]


class Probabilities(torch.nn.Module):
    """The docs' MyModule (docs/getting_started.md)."""

    def __init__(self, hidden_units=32):
        super().__init__()
        self.hidden = torch.nn.Linear(20, hidden_units)
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Linear(hidden_units, 2)
        self.softmax = torch.nn.Softmax(dim=-1)

    def forward(self, X):
        return self.softmax(self.head(self.act(self.hidden(X))))


@fp16_quiet
def test_the_readme_example_record():
    """README "Why was a step skipped?": the record it shows."""
    from sklearn.datasets import make_classification

    X, y = make_classification(n_samples=256, n_features=20, n_informative=10, random_state=0)
    X, y = X.astype("float32"), y.astype("int64")
    X[96:104] *= 3e3
    torch.manual_seed(0)
    net = AmpNetClassifier(Probabilities, amp_enabled=True, amp_dtype="float16", batch_size=32, max_epochs=2,
                           train_split=None, iterator_train__shuffle=False, verbose=0,
                           callbacks=[AmpMonitor(sink=lambda line: None)])
    net.fit(X, y)
    row = net.history[-1, "batches", 3]
    assert {k: row[k] for k in ("skip_cause", "first_nonfinite", "step_skipped", "loss_scale")} == {
        "skip_cause": "overflow", "first_nonfinite": "softmax", "step_skipped": True, "loss_scale": 16384.0}
    assert [i for i, _ in skipped_rows(net)] == [3]
    assert all(0 < v < 10 for v in net.history[:, "grad_norm"])


# ---- the replay keeps numpy's and Python's global streams ---------------------------------------


class GlobalNoise(Net3):
    """Net3 that adds noise drawn from numpy's or Python's global generator in
    its training forward pass (as augmentation code written with
    ``np.random`` or ``random`` does)."""

    def __init__(self, mode=None, source="numpy"):
        super().__init__(mode)
        self.source = source

    def forward(self, X):
        if self.training:
            if self.source == "numpy":
                noise = torch.from_numpy(np.random.standard_normal(X.shape).astype(np.float32))
            else:
                import random

                noise = torch.full(X.shape, random.random() - 0.5)
            X = torch.cat([X[:, :20] + 0.1 * noise[:, :20], X[:, 20:]], dim=1)
        return super().forward(X)


@fp16_quiet
@pytest.mark.parametrize("source", ["numpy", "random"])
def test_replay_keeps_numpy_and_python_random_streams(source):
    """A module drawing noise from np.random (or random) in forward trains
    bitwise the same with and without AmpMonitor: the replay of the skipped
    step draws too, and must put the global streams back."""
    import random

    X, y = data(64, marked=(1,))
    weights, states = {}, {}
    for monitor in (False, True):
        np.random.seed(0)
        random.seed(0)
        net = make_net(monitor=monitor, module=GlobalNoise, module__mode="backward", module__source=source,
                       amp_dtype="float16", max_epochs=3, grad_scaler__init_scale=2.0 ** 8)
        net.fit(X, y)
        assert [[i for i, _ in skipped_rows(net, e)] for e in range(3)] == [[1]] * 3  # one skip per epoch
        if monitor:
            assert [net.history[e, "batches", 1]["first_nonfinite"] for e in range(3)] == ["boom"] * 3
        weights[monitor] = [p.detach().clone() for p in net.module_.parameters()]
        states[monitor] = (np.random.get_state()[1].copy(), random.getstate())
    for a, b in zip(weights[False], weights[True]):
        assert torch.equal(a, b)
    assert np.array_equal(states[False][0], states[True][0])
    assert states[False][1] == states[True][1]


# ---- the loss scale's settling spends no replays -------------------------------------------------


class Regress(torch.nn.Module):
    """One linear layer and a Boom on marked batches (marker in column 20)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(20, 1)
        self.boom = Boom("backward")

    def forward(self, X):
        marked = bool(X[:, 20].any()) and self.training
        return self.boom(self.inp(X[:, :20]), marked)


def settling_data(marked, n=16 * 12, batch_size=16):
    """Targets near 4: with float16 and the initial scale 2**16, the first four
    steps overflow while the scale falls to 4096 (rows 0-3), then steps apply."""
    X, _ = data(n, marked=marked, batch_size=batch_size)
    return X, (4 + X[:, :1]).astype(np.float32)


def settling_net(max_replays, scaler):
    torch.manual_seed(0)
    return ampnet.AmpNetRegressor(
        Regress, amp_enabled=True, amp_dtype="float16", batch_size=16, max_epochs=1, lr=1e-4,
        train_split=None, iterator_train__shuffle=False, verbose=0, grad_scaler=scaler("cpu"),
        callbacks=[AmpMonitor(sink=lambda line: None, max_replays=max_replays)])


@fp16_quiet
@pytest.mark.parametrize("scaler", [ampnet.GradScaler, torch.amp.GradScaler])
def test_the_scale_settling_spends_no_replays(scaler):
    X, y = settling_data(marked=(2, 6, 9))
    net = settling_net(1, scaler)
    net.fit(X, y)
    rows = net.history[-1, "batches"]
    settling = [i for i, _ in skipped_rows(net)][:4]
    assert settling == [0, 1, 2, 3]  # the scale falls from 2**16 before the first applied step
    assert [rows[i]["loss_scale"] for i in settling] == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13, 2.0 ** 12]
    assert not rows[4]["step_skipped"]
    assert all("first_nonfinite" in rows[i] for i in settling)  # replayed, without spending the budget
    assert rows[2]["first_nonfinite"] == "boom"  # the data's overflow among them is named
    # the one replay of the epoch goes to the first overflow after the scale settled
    assert rows[6]["skip_cause"] == "overflow" and rows[6]["first_nonfinite"] == "boom"
    assert rows[9]["step_skipped"] and "first_nonfinite" not in rows[9]  # beyond max_replays=1

    # partial_fit carries the settled scale on: its first skip is the data's and spends the replay
    net.partial_fit(X, y)
    rows = net.history[-1, "batches"]
    assert [i for i, _ in skipped_rows(net)] == [2, 6, 9]
    assert rows[2]["first_nonfinite"] == "boom" and "first_nonfinite" not in rows[6]

    # max_replays=0 replays nothing, the settling included
    off = settling_net(0, scaler)
    off.fit(X, y)
    assert not any("first_nonfinite" in b for b in off.history[-1, "batches"])
