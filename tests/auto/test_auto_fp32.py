"""amp_fp32_modules='auto': one probe at the start of the first fit keeps
the modules that overflow the low-precision range in float32."""

import pickle
import warnings

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.auto.fp32_modules import resolve_fp32_modules
from ampnet.auto.saved import FP32_KEY
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.diagnostics.report import build_report
from conftest import small_classifier


class Scaled(torch.nn.Linear):
    """A linear layer whose outputs are ~1e5: beyond float16's 65504."""

    def forward(self, x):
        return super().forward(x) * 1e5


class Overflowing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = Scaled(20, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, 2)

    def forward(self, X):
        return self.out(torch.relu(self.norm(self.big(X))))


FP16 = dict(amp_enabled=True, amp_dtype="float16")


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.randn(400, 20).astype(np.float32)
    return X, (X[:, 0] + X[:, 1] > 0).astype(np.int64)


def make(**kw):
    torch.manual_seed(0)
    base = dict(module=Overflowing, criterion=torch.nn.CrossEntropyLoss, max_epochs=4, lr=0.1, batch_size=50,
                train_split=None, verbose=0)
    return AmpNetClassifier(**{**base, **kw})


#: What a verbose net prints once per probe (and only when it probes).
PROBED = "amp_fp32_modules='auto': modules kept in float32"


class Probes:
    """How many times the verbose nets of a test probed so far, from what they printed."""

    def __init__(self, capsys):
        self.capsys, self.count = capsys, 0

    def __len__(self):
        self.count += self.capsys.readouterr().out.count(PROBED)
        return self.count


@pytest.fixture
def probes(capsys):
    """The probes of the test's nets, counted by the line each prints (make them with ``verbose=1``)."""
    return Probes(capsys)


def test_auto_keeps_the_overflowing_layer_in_float32(data):
    X, y = data
    fp32 = make().fit(X, y)
    auto = make(**FP16, amp_fp32_modules="auto").fit(X, y)
    assert auto.amp_layout_.fp32_modules == ("big",) and auto.amp_layout_.auto_fp32_modules == ("big",)
    assert auto.history[:, "skipped_steps"][1:] == [0, 0, 0]
    accuracy = (auto.predict(X) == y).mean()
    assert abs(accuracy - (fp32.predict(X) == y).mean()) <= 0.005 and accuracy > 0.9
    # without it, every forward pass overflows and every step is skipped; the loss scale, which
    # cannot fix a forward overflow, is kept
    plain = make(**FP16, amp_max_consecutive_skips=None, grad_scaler__init_scale=256.0)
    with pytest.warns(AmpWarning, match=r"non-finite training loss.*float16 overflow.*amp_fp32_modules"):
        plain.fit(X, y)
    assert plain.history[:, "skipped_steps"] == [8, 8, 8, 8]
    assert {b["skip_cause"] for b in plain.history[-1, "batches"]} == {"nonfinite_loss"}
    assert plain.history[:, "loss_scale"] == [256.0] * 4


def test_the_probe_changes_nothing(data):
    X, y = data
    auto = make(**FP16, amp_fp32_modules="auto", max_epochs=2, iterator_train__shuffle=True).fit(X, y)
    fixed = make(**FP16, amp_fp32_modules=["big"], max_epochs=2, iterator_train__shuffle=True).fit(X, y)
    for a, b in zip(auto.module_.parameters(), fixed.module_.parameters()):
        assert torch.equal(a, b)  # same weights, same shuffling: no weight or RNG change
    assert auto.history[:, "train_loss"] == fixed.history[:, "train_loss"]
    assert [set(row) for row in auto.history] == [set(row) for row in fixed.history]


def test_choice_is_printed_once_and_not_reprobed(data, capsys):
    X, y = data
    net = make(**FP16, amp_fp32_modules="auto", max_epochs=1, verbose=1).fit(X, y)
    out = capsys.readouterr().out
    assert out.count(PROBED) == 1 and "'big'" in out
    net.partial_fit(X, y)
    assert "amp_fp32_modules='auto'" not in capsys.readouterr().out
    assert net.amp_layout_.auto_fp32_modules == ("big",)
    net.fit(X, y)  # fit re-initializes the module: a new first fit
    assert capsys.readouterr().out.count(PROBED) == 1


def test_the_probe_is_an_explicit_argument_and_a_saved_choice_skips_it(data):
    """resolve_fp32_modules keeps what ``probe`` recommends (build_report unless given), and
    calls no probe for a saved choice."""
    X, y = data
    calls = []

    def probe(*args):
        calls.append(args[0])
        return build_report(*args)

    net = make(**FP16, amp_fp32_modules="auto").initialize()
    resolve_fp32_modules(net, X, y, probe)
    assert calls == [net] and net.amp_layout_.auto_fp32_modules == ("big",)
    other = make(**FP16, amp_fp32_modules="auto").initialize()
    resolve_fp32_modules(other, X, y, probe, saved=("out",))
    assert calls == [net] and other.amp_layout_.auto_fp32_modules == ("out",)


def test_auto_in_a_list_with_selectors(data):
    net = make(**FP16, amp_fp32_modules=["out", "auto"], max_epochs=1).fit(*data)
    assert net.amp_layout_.fp32_modules == ("out", "big") and net.amp_layout_.auto_fp32_modules == ("big",)
    assert net.history[-1, "skipped_steps"] == 0


def test_bfloat16_has_the_range_nothing_is_kept(data):
    net = make(amp_enabled=True, amp_dtype="bfloat16", amp_fp32_modules="auto", max_epochs=1).fit(*data)
    assert net.amp_layout_.auto_fp32_modules == () and net.amp_layout_.fp32_modules == ()


def test_amp_off_does_not_probe(data, probes):
    with pytest.warns(AmpWarning, match="amp_fp32_modules='auto' has no effect"):
        net = make(amp_fp32_modules="auto", max_epochs=1, verbose=1).fit(*data)
    assert len(probes) == 0 and net.amp_layout_.auto_fp32_modules is None


def test_pure_level_stores_the_kept_layer_in_float32(data):
    net = make(**FP16, amp_level="pure", amp_fp32_modules="auto", max_epochs=2).fit(*data)
    dtypes = {n: p.dtype for n, p in net.module_.named_parameters()}
    assert dtypes["big.weight"] == torch.float32 and dtypes["out.weight"] == torch.float16
    assert set(net.amp_master_params_) == {"out.weight", "out.bias"}
    # the optimizer steps the float32 layer and the masters
    params = {id(p) for g in net.optimizer_.param_groups for p in g["params"]}
    assert id(net.module_.big.weight) in params and id(net.amp_master_params_["out.weight"]) in params
    assert net.history[-1, "skipped_steps"] == 0


def test_pickle_keeps_the_choice(data, probes):
    net = make(**FP16, amp_fp32_modules="auto", max_epochs=1, verbose=1).fit(*data)
    copy_ = pickle.loads(pickle.dumps(net))
    assert copy_.amp_layout_ == net.amp_layout_
    copy_.partial_fit(*data)
    assert len(probes) == 1 and copy_.history[-1, "skipped_steps"] == 0


def test_saved_parameters_carry_the_choice_into_a_fresh_net(data, probes, tmp_path):
    net = make(**FP16, amp_fp32_modules="auto", max_epochs=1, verbose=1).fit(*data)
    net.save_params(f_params=tmp_path / "params.pt")
    saved = torch.load(tmp_path / "params.pt", weights_only=True)
    assert saved._metadata[""][FP32_KEY] == ["big"]
    fresh = make(**FP16, amp_fp32_modules="auto", max_epochs=1, verbose=1).initialize()
    assert fresh.amp_layout_.auto_fp32_modules is None
    fresh.load_params(f_params=tmp_path / "params.pt")
    fresh.partial_fit(*data)
    assert len(probes) == 1 and fresh.amp_layout_ == net.amp_layout_
    # the plain module loads the file as usual
    plain = Overflowing()
    plain.load_state_dict(saved)


def test_a_different_saved_choice_is_reported_by_load_params(data, tmp_path):
    net = make(**FP16, amp_fp32_modules="auto", max_epochs=1).fit(*data)
    state = net.module_.state_dict()
    state._metadata[""][FP32_KEY] = ["out"]
    torch.save(state, tmp_path / "other.pt")
    with pytest.warns(AmpWarning) as record:
        net.load_params(f_params=tmp_path / "other.pt")
    message = " ".join(str(w.message) for w in record if issubclass(w.category, AmpWarning))
    for fact in ("other.pt", "['out']", "['big']", "amp_fp32_modules=['out']"):
        assert fact in message, fact
    assert net.amp_layout_.fp32_modules == ("big",)


def test_a_direct_module_load_neither_fails_nor_adopts_the_choice(data, probes, tmp_path):
    """The choice travels through save_params and load_params (and checkpoints)
    only: the module's own load_state_dict of a file that holds it loads the
    weights as for any module, silently, and the net's layout stays its own."""
    net = make(**FP16, amp_fp32_modules="auto", max_epochs=1, verbose=1).fit(*data)
    net.save_params(f_params=tmp_path / "params.pt")
    saved = torch.load(tmp_path / "params.pt", weights_only=True)
    assert saved._metadata[""][FP32_KEY] == ["big"]
    other = {k: v.clone() for k, v in saved.items()}
    other = type(saved)(other)
    other._metadata = {k: dict(v) for k, v in saved._metadata.items()}
    other._metadata[""][FP32_KEY] = ["out"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.module_.load_state_dict(other)  # another choice: not adopted, not reported
    assert net.amp_layout_.fp32_modules == ("big",)
    fresh = make(**FP16, amp_fp32_modules="auto", max_epochs=1, verbose=1).initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.module_.load_state_dict(saved)
    assert fresh.amp_layout_.auto_fp32_modules is None  # not adopted: the next fit probes
    for a, b in zip(net.module_.parameters(), fresh.module_.parameters()):
        assert torch.equal(a, b)
    assert len(probes) == 1
    fresh.partial_fit(*data)
    assert len(probes) == 2 and fresh.amp_layout_.auto_fp32_modules == ("big",)


def test_checkpoint_resume_is_bitexact(data, tmp_path):
    X, y = data
    X, y = X[:200], y[:200]
    kw = dict(FP16, amp_fp32_modules="auto", iterator_train__shuffle=True)
    whole = make(max_epochs=3, **kw).fit(X, y)
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    make(max_epochs=2, callbacks=[cp], **kw).fit(X, y)
    resumed = make(max_epochs=1, callbacks=[LoadInitState(cp), cp], **kw).fit(X, y)
    assert resumed.amp_layout_ == whole.amp_layout_ and len(resumed.history) == 3
    for a, b in zip(whole.module_.parameters(), resumed.module_.parameters()):
        assert torch.equal(a, b)
    assert resumed.history[:, "train_loss"] == whole.history[:, "train_loss"]


def test_a_resume_takes_the_checkpoint_s_choice_without_probing(data, probes, tmp_path):
    X, y = data
    X, y = X[:200], y[:200]
    kw = dict(FP16, amp_fp32_modules="auto", verbose=1)
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    first = make(max_epochs=1, callbacks=[cp], **kw).fit(X, y)
    assert len(probes) == 1 and first.amp_layout_.auto_fp32_modules
    resumed = make(max_epochs=1, callbacks=[LoadInitState(cp), cp], **kw).fit(X, y)
    assert len(probes) == 1  # read from the checkpoint's parameters file, not probed again
    assert resumed.amp_layout_.auto_fp32_modules == first.amp_layout_.auto_fp32_modules


class FirstInput(Overflowing):
    """Records the first input it computes on, and what callbacks saw."""

    seen = None

    def forward(self, X):
        if FirstInput.seen is None:
            FirstInput.seen = X.detach().clone()
        return super().forward(X)


def test_probe_runs_on_the_first_training_rows_before_any_callback(data):
    from skorch.callbacks import Callback

    layouts = []

    class AtStart(Callback):
        def on_train_begin(self, net, **kwargs):
            layouts.append(net.amp_layout_.auto_fp32_modules)

    X, y = data
    FirstInput.seen = None
    make(module=FirstInput, **FP16, amp_fp32_modules="auto", max_epochs=1, iterator_train__shuffle=True,
         callbacks=[AtStart()]).fit(X, y)
    torch.testing.assert_close(FirstInput.seen, torch.as_tensor(X[:50]))
    assert layouts == [("big",)]


def test_auto_choice_is_probed_again_after_a_dtype_change():
    class Overflowing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 2)
            with torch.no_grad():
                self.big.weight.fill_(3e4)

        def forward(self, X):
            return torch.softmax(self.out(self.big(X) * 1e-4), dim=-1)

    rng = np.random.RandomState(0)
    X, y = rng.rand(16, 4).astype(np.float32), rng.randint(0, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        net = small_classifier(module=Overflowing, amp_enabled=True, amp_dtype="bfloat16", amp_fp32_modules="auto")
        net.fit(X, y)
        assert net.amp_layout_.auto_fp32_modules == ()  # nothing overflows bfloat16
        net.set_params(amp_dtype="float16")
        assert net.amp_layout_.auto_fp32_modules is None  # not carried over: probed at the next fit
        net.partial_fit(X, y)
        fresh = small_classifier(module=Overflowing, amp_fp32_modules="auto", amp_enabled=True, amp_dtype="float16").fit(X, y)
    assert net.amp_layout_.auto_fp32_modules == fresh.amp_layout_.auto_fp32_modules == ("big",)


# ---- with skorch's default train_split (ValidSplit) ---------------------------------------


def default_split(**kw):
    """``make`` with skorch's default ``train_split`` (``ValidSplit(5)``)."""
    net = make(**kw)
    net.set_params(train_split=AmpNetClassifier(Overflowing).train_split)
    return net


def test_default_valid_split_probes_the_training_part(data):
    X, y = data
    FirstInput.seen = None
    net = default_split(module=FirstInput, **FP16, amp_fp32_modules="auto", max_epochs=1)
    net.fit(X, y)  # skorch 1.4 passes _routing_method: not a train_split argument
    assert net.amp_layout_.auto_fp32_modules == ("big",)
    assert net.history[-1, "skipped_steps"] == 0 and np.isfinite(net.history[-1, "valid_loss"])
    train, valid = net.get_split_datasets(X, y)
    assert len(valid) == 80
    first = torch.as_tensor(np.stack([train[i][0] for i in range(50)]))
    torch.testing.assert_close(FirstInput.seen, first)  # the probe's batch: the training part's first rows


@pytest.mark.skipif(not hasattr(__import__("sklearn").utils, "metadata_routing"),
                    reason="scikit-learn < 1.3 has no metadata routing")
def test_default_valid_split_with_metadata_routing(data):
    import sklearn

    X, y = data
    with sklearn.config_context(enable_metadata_routing=True):
        net = default_split(**FP16, amp_fp32_modules="auto", max_epochs=1).fit(X[:200], y[:200])
    assert net.amp_layout_.auto_fp32_modules == ("big",)


def test_auto_in_grid_search_over_a_pipeline_with_the_default_split(data):
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = data
    net = default_split(**FP16, amp_fp32_modules="auto", max_epochs=1)
    pipe = Pipeline([("scale", StandardScaler()), ("net", net)])
    search = GridSearchCV(pipe, {"net__lr": [0.05, 0.1]}, cv=2, error_score="raise").fit(X[:200], y[:200])
    fitted = search.best_estimator_.named_steps["net"]
    assert fitted.amp_layout_.auto_fp32_modules == ("big",)
    assert np.isfinite(search.cv_results_["mean_test_score"]).all()
