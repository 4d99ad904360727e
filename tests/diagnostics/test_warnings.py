"""AmpWarnings for settings that have no effect, and every AmpWarning
attributed to the user's line (not to skorch's or ampnet's)."""

import inspect
import os
import re
import subprocess
import sys
import threading
import warnings

import joblib

import numpy as np
import pytest
import torch
from skorch.callbacks import Checkpoint as SkorchCheckpoint
from skorch.callbacks import LRScheduler
from sklearn.model_selection import GridSearchCV

import ampnet
from ampnet import AmpNetClassifier
from ampnet.callbacks.checkpoint import Checkpoint
from ampnet.exceptions import AmpWarning
from precision_helpers import DigitsCNN, ThreePart


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


def data(n=32, features=4):
    rng = np.random.RandomState(0)
    X = rng.randn(n, features).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


def make_net(module=Tiny, **kwargs):
    settings = dict(max_epochs=1, batch_size=16, train_split=None, verbose=0)
    settings.update(kwargs)
    return AmpNetClassifier(module, **settings)


class Recorder:
    """Record AmpWarnings (the suite turns them into errors) and the line
    that called into ampnet."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def amp(self, match=""):
        return [w for w in self.caught if issubclass(w.category, AmpWarning)
                and re.search(match, str(w.message))]


def here():
    """The line number of the caller's next line."""
    return inspect.currentframe().f_back.f_lineno + 1


def assert_at(warning, line):
    assert (warning.filename, warning.lineno) == (__file__, line), (
        warning.filename, warning.lineno, str(warning.message)
    )


# ---- settings that have no effect ------------------------------------------


@pytest.mark.parametrize("settings, message", [
    ({"amp_level": "pure"},
     "amp_enabled=False, so amp_level='pure' has no effect: the net trains in float32. "
     "Set amp_enabled=True to use it, or leave it at its default."),
    ({"amp_dtype": "bf16", "amp_fp32_modules": ["out"], "amp_master_weights": False},
     "amp_enabled=False, so amp_dtype='bf16', amp_master_weights=False, "
     "amp_fp32_modules=['out'] have no effect: the net trains in float32. Set amp_enabled=True to "
     "use them, or leave them at their defaults."),
    ({"amp_modules": "hidden", "grad_scaler__init_scale": 8.0},
     "amp_enabled=False, so amp_modules='hidden' has no effect"),
    ({"amp_enabled": True, "amp_dtype": "bf16", "amp_master_weights": False},
     "amp_master_weights=False has no effect with amp_level='mixed'"),
    ({"memory_format": "channels_last"},
     "memory_format='channels_last' has no effect: Tiny has no 4-D parameters or buffers"),
    ({"memory_format": "channels_last", "amp_enabled": True, "amp_dtype": "bf16"},
     "memory_format='channels_last' has no effect: Tiny has no 4-D parameters"),
])
def test_settings_without_effect_warn_once_at_initialize(settings, message):
    net = make_net(**settings)
    with Recorder() as rec:
        line = here()
        net.initialize()
    found = rec.amp("no effect")
    assert len(found) == 1 and message in str(found[0].message)
    assert_at(found[0], line)


def test_pure_without_low_precision_parameters_warns():
    net = make_net(module=ThreePart, amp_enabled=True, amp_dtype="bf16", amp_level="pure",
                   amp_fp32_modules=["embed", "block", "head"])
    with pytest.warns(AmpWarning, match="amp_level='pure' stores no parameter in low precision"):
        net.initialize()


@pytest.mark.parametrize("settings", [
    {},
    {"amp_enabled": True, "amp_dtype": "bf16", "amp_level": "pure", "amp_fp32_modules": ["out"]},
    {"amp_enabled": True, "amp_dtype": "bf16", "amp_level": "pure", "amp_master_weights": False},
    # scaler settings serve a grid's float16 branch: not reported where no scaling runs
    {"amp_enabled": True, "amp_dtype": "bf16", "grad_scaler__init_scale": 8.0},
    {"amp_enabled": False, "grad_scaler__init_scale": 8.0, "grad_scaler": ampnet.GradScaler},
    {"amp_enabled": False, "grad_scaler": torch.amp.GradScaler},
    {"amp_enabled": False, "memory_format": "preserve"},
])
def test_settings_that_act_do_not_warn(settings):
    with Recorder() as rec:
        make_net(**settings).initialize()
    assert rec.amp() == []


def test_channels_last_on_a_cnn_does_not_warn():
    with Recorder() as rec:
        make_net(module=DigitsCNN, memory_format="channels_last").initialize()
    assert rec.amp() == []


# ---- warnings point at the user's line --------------------------------------


def test_fit_warnings_point_at_the_fit_call():
    X, y = data()
    net = make_net(amp_enabled=True, amp_dtype="float16", amp_level="pure", memory_format="channels_last")
    with Recorder() as rec:
        line = here()
        net.fit(X, y)
    found = rec.amp()
    assert {str(w.message)[:30] for w in found} >= {
        "memory_format='channels_last' "[:30], "float16 autocast on CPU is cor"[:30]
    }
    for w in found:
        assert_at(w, line)


def test_selector_warning_points_at_initialize():
    net = make_net(amp_enabled=True, amp_dtype="bf16", amp_fp32_modules=["nope"])
    with Recorder() as rec:
        line = here()
        net.initialize()
    (w,) = rec.amp("matches no module")
    assert_at(w, line)


def test_training_step_warning_points_at_fit():
    X, y = data()
    X[3, 0] = np.nan
    net = make_net(amp_enabled=True, amp_dtype="bf16")
    with Recorder() as rec:
        line = here()
        net.fit(X, y)
    (w,) = rec.amp("holds NaN or inf in its input")
    assert_at(w, line)
    (end,) = rec.amp("non-finite training loss")  # the NaN batch's loss, at the end of fit
    assert_at(end, line)


def test_callback_warning_points_at_fit(tmp_path):
    X, y = data()
    cp = Checkpoint(monitor=None, dirname=str(tmp_path))
    net = make_net(callbacks=[cp, LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1)])
    with Recorder() as rec:
        line = here()
        net.fit(X, y)
    (w,) = rec.amp("comes after this Checkpoint")
    assert_at(w, line)


def test_load_warning_points_at_load_params(tmp_path):
    X, y = data()
    cp = SkorchCheckpoint(monitor=None, dirname=str(tmp_path))
    make_net(callbacks=[cp]).fit(X, y)
    net = make_net().initialize()
    with Recorder() as rec:
        line = here()
        net.load_params(checkpoint=cp)
    (w,) = rec.amp("without ampnet's resume files")
    assert_at(w, line)


def test_warning_inside_grid_search_points_at_the_search():
    X, y = data(64)
    search = GridSearchCV(make_net(), {"amp_level": ["pure"]}, cv=2, scoring="accuracy")
    with Recorder() as rec:
        line = here()
        search.fit(X, y)
    found = rec.amp("no effect")
    assert found  # one per fit: two folds and the refit
    for w in found:
        assert_at(w, line)


# ---- warnings from parallel searches point at the search --------------------


def test_warning_in_a_thread_points_at_the_line_waiting_for_it():
    """No frame of a worker thread is the user's (threading.py runs the target):
    the warning points at the user's line in the main thread."""
    X, y = data()
    net = make_net(amp_level="pure")
    with Recorder() as rec:
        worker = threading.Thread(target=net.fit, args=(X, y))
        line = here()
        worker.start(); worker.join()  # noqa: E702 (one line, so the main thread is on it when the fit warns)
    (w,) = rec.amp("no effect")
    assert_at(w, line)


def test_warning_in_a_threading_search_points_at_the_search():
    X, y = data(64)
    search = GridSearchCV(make_net(), {"amp_level": ["pure"]}, cv=2, scoring="accuracy", n_jobs=2)
    with Recorder() as rec, joblib.parallel_backend("threading"):
        line = here()
        search.fit(X, y)
    found = rec.amp("no effect")
    assert found
    for w in found:
        assert_at(w, line)


SEARCH_SCRIPT = '''
import numpy as np, torch
from sklearn.model_selection import GridSearchCV
from ampnet import AmpNetClassifier

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, X):
        return torch.softmax(self.lin(X), -1)

if __name__ == "__main__":
    X = np.random.RandomState(0).randn(64, 4).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    net = AmpNetClassifier(Tiny, max_epochs=1, train_split=None, verbose=0)
    search = GridSearchCV(net, {"amp_level": ["pure"]}, cv=2, n_jobs=2)
    search.fit(X, y)  # the user's line
'''


@pytest.mark.slow
def test_warning_in_a_loky_worker_points_at_the_search(tmp_path):
    """joblib's default backend fits in worker processes, where no frame is the
    user's: the warnings pointed at multiprocessing/process.py."""
    script = tmp_path / "search.py"
    script.write_text(SEARCH_SCRIPT)
    line = SEARCH_SCRIPT.splitlines().index("    search.fit(X, y)  # the user's line") + 1
    root = os.path.dirname(os.path.dirname(os.path.abspath(ampnet.__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    warned = [s for s in result.stderr.splitlines() if "AmpWarning:" in s]
    assert len(warned) == 3, result.stderr  # two folds in the workers, the refit here
    for s in warned:
        assert s.startswith(f"{script}:{line}: AmpWarning: amp_enabled=False, so amp_level='pure'"), s
