"""Every file a load reads is untrusted: journals stay in their directory,
RNG/scaler/optimizer/history/scheduler states are checked field by field,
a load is all or nothing, and write errors name the file.

One test (at least) per defect of issue 10; the fuzz test in
test_fuzz_checkpoint.py covers random corruptions of every file.
"""

import copy
import errno
import json
import math
import multiprocessing
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from skorch.callbacks import LRScheduler

import ampnet.io.files
from ampnet import AmpNetClassifier, GradScaler
from ampnet.io.atomic import JOURNAL_NAME, TEMP_SUFFIX, recover
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.exceptions import AmpWarning
from ampnet.io.rng import PreparedRngState, get_rng_state
from ampnet.precision.scaler import FLOAT32_MAX, FLOAT32_TINY
from resume_script import Tiny, differences, make_data

FILES = ("f_params", "f_optimizer", "f_criterion", "f_history", "f_grad_scaler", "f_rng_state")
NOTICES = "float16 autocast on CPU|this CPU has no native bfloat16"


class Wide(Tiny):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 12)
        self.out = torch.nn.Linear(12, 2)


def tiny_net(module=Tiny, precision="float16", **kwargs):
    params = dict(
        optimizer=torch.optim.Adam,
        lr=0.05,
        batch_size=16,
        max_epochs=2,
        train_split=None,
        verbose=0,
        amp_enabled=True,
        amp_dtype=precision,
        grad_scaler__init_scale=2.0**20,
        grad_scaler__growth_interval=3,
    )
    params.update(kwargs)
    return AmpNetClassifier(module, **params)


def quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NOTICES, category=AmpWarning)
        return fn(*args, **kwargs)


def plain(obj):
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def snapshot(net):
    """Everything a load may change, RNGs included (copied)."""
    return copy.deepcopy(
        {
            "params": net.module_.state_dict(),
            "optimizer": net.optimizer_.state_dict(),
            "scaler": net.grad_scaler_.state_dict(),
            "history": net.history.to_list(),
            "device": net.device,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": plain(np.random.get_state(legacy=False)),
            "python_rng": random.getstate(),
        }
    )


def paths(root, names=FILES):
    ext = {"f_history": ".json"}
    return {name: str(Path(root) / f"{name[2:]}{ext.get(name, '.pt')}") for name in names}


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def fitted(data):
    """An fp16 net fitted for two epochs (do not mutate)."""
    torch.manual_seed(0)
    net = tiny_net()
    quietly(net.fit, *data)
    return net


@pytest.fixture
def saved(tmp_path, fitted):
    files = paths(tmp_path / "ckpt")
    os.makedirs(tmp_path / "ckpt")
    fitted.save_params(**files)
    return files


def refused_unchanged(net, files, *match):
    """Load ``files`` into ``net``: a ValueError matching each of ``match``,
    and the net exactly as before."""
    before = snapshot(net)
    with pytest.raises(ValueError) as info:
        net.load_params(**files)
    for pattern in match:
        info.match(pattern)
    assert differences(snapshot(net), before) == []
    return info


# ---- 1. journals stay inside their directory -------------------------------------


def test_planted_journal_of_the_issue_touches_nothing(tmp_path, fitted):
    """The probe of issue 10: a downloaded folder with a journal that moves a
    file onto ../dot_bashrc and deletes ../victim.txt."""
    dl = tmp_path / "dl"
    dl.mkdir()
    fitted.save_params(f_params=str(dl / "model.pt"))
    (tmp_path / "victim.txt").write_text("precious")
    (tmp_path / "dot_bashrc").write_text("mine")
    (dl / "payload.txt").write_text("evil")
    journal = dl / JOURNAL_NAME
    journal.write_text(
        json.dumps(
            {
                "ampnet_journal_version": 1,
                "moves": [["payload.txt", "../dot_bashrc"]],
                "journals": ["../victim.txt"],
            }
        )
    )
    net = tiny_net().initialize()
    before = snapshot(net)
    with pytest.raises(ValueError, match=re.escape(repr(str(journal))) + " is not an ampnet journal"):
        net.load_params(f_params=str(dl / "model.pt"))
    assert (tmp_path / "victim.txt").read_text() == "precious"
    assert (tmp_path / "dot_bashrc").read_text() == "mine"
    assert (dl / "payload.txt").read_text() == "evil" and journal.exists()
    assert differences(snapshot(net), before) == []


def _entries(tmp_path):
    """Journal entries that point outside the directory or at files that are
    not ampnet temporary files, in every spelling."""
    outside = str(tmp_path / "victim.txt")
    temp = f".model.pt.0123456789ab{TEMP_SUFFIX}"
    return {
        "absolute target": {"moves": [[temp, outside]]},
        "absolute source": {"moves": [[outside, "model.pt"]]},
        "dotdot target": {"moves": [[temp, "../victim.txt"]]},
        "nested dotdot": {"moves": [[temp, "sub/../../victim.txt"]]},
        "dotdot temp name": {"moves": [[f"../.victim.txt.0123456789ab{TEMP_SUFFIX}", "../victim.txt"]]},
        "not a temp name": {"moves": [["payload.txt", "model.pt"]]},
        "temp of another file": {"moves": [[temp, "other.pt"]]},
        "short random part": {"moves": [[f".model.pt.0123{TEMP_SUFFIX}", "model.pt"]]},
        "dot target": {"moves": [[".0123456789ab" + TEMP_SUFFIX, "."]]},
        "onto the journal": {"moves": [[f".{JOURNAL_NAME}.0123456789ab{TEMP_SUFFIX}", JOURNAL_NAME]]},
        "two onto one": {"moves": [[temp, "model.pt"], [temp, "model.pt"]]},
        "journal elsewhere": {"journals": ["../victim.txt"]},
        "absolute journal": {"journals": [outside]},
        "nul byte": {"moves": [[temp + "\x00", "model.pt"]]},
    }


@pytest.mark.parametrize("case", list(_entries(Path("/x"))))
def test_journal_entries_outside_the_directory_are_refused(tmp_path, case):
    d = tmp_path / "ckpt"
    d.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (d / "model.pt").write_text("old")
    (d / "payload.txt").write_text("evil")
    temp = d / f".model.pt.0123456789ab{TEMP_SUFFIX}"
    temp.write_text("new")
    data = {"ampnet_journal_version": 1, "moves": [], "journals": [JOURNAL_NAME]}
    data.update(_entries(tmp_path)[case])
    (d / JOURNAL_NAME).write_text(json.dumps(data))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(
        ValueError, match=re.escape(repr(str(d / JOURNAL_NAME))) + " is not an ampnet journal"
    ):
        recover([str(d)])
    assert victim.read_text() == "precious"
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing touched


def test_journal_with_a_linked_temporary_file_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    temp = d / f".model.pt.0123456789ab{TEMP_SUFFIX}"
    temp.symlink_to(victim)
    (d / JOURNAL_NAME).write_text(
        json.dumps(
            {"ampnet_journal_version": 1, "moves": [[temp.name, "model.pt"]], "journals": [JOURNAL_NAME]}
        )
    )
    with pytest.raises(ValueError, match="is a symbolic link"):
        recover([str(d)])
    assert temp.is_symlink() and not (d / "model.pt").exists()
    assert victim.read_text() == "precious"


def test_journal_that_is_a_link_or_a_directory_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    outside = tmp_path / "j.json"
    outside.write_text(json.dumps({"ampnet_journal_version": 1, "moves": [], "journals": [JOURNAL_NAME]}))
    (d / JOURNAL_NAME).symlink_to(outside)
    with pytest.raises(ValueError, match="it is a symbolic link"):
        recover([str(d)])
    assert outside.exists() and (d / JOURNAL_NAME).is_symlink()
    (d / JOURNAL_NAME).unlink()
    (d / JOURNAL_NAME).mkdir()
    with pytest.raises(ValueError, match="it is not a regular file"):
        recover([str(d)])


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\xff\xfe\x00garbage", "it is not UTF-8 JSON"),
        (b"{not json", "it is not UTF-8 JSON"),
        (b"[" * 100000 + b"]" * 100000, "it is not UTF-8 JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (
            b'{"ampnet_journal_version": 1, "journals": []}',
            r"expected the keys .* found \['ampnet_journal_version', 'journals'\]",
        ),
        (b'{"ampnet_journal_version": 1, "moves": [], "journals": [], "x": 1}', "expected the keys"),
        (
            b'{"ampnet_journal_version": true, "moves": [], "journals": []}',
            "ampnet_journal_version is True",
        ),
        (b'{"ampnet_journal_version": 2, "moves": [], "journals": []}', "ampnet_journal_version is 2"),
        (b'{"ampnet_journal_version": 1, "moves": "x", "journals": []}', "must be lists"),
        (b'{"ampnet_journal_version": 1, "moves": [[1, 2]], "journals": []}', r"the move \[1, 2\]"),
        (
            b'{"ampnet_journal_version": 1, "moves": [["a"]], "journals": []}',
            "is not a .temporary, final. pair",
        ),
        (b'{"ampnet_journal_version": 1, "moves": [], "journals": [null]}', "'journals' may list only"),
        (b" " * (2 << 20), "larger than"),
    ],
)
def test_garbage_journals_raise_value_error_naming_the_journal(tmp_path, content, problem):
    (tmp_path / JOURNAL_NAME).write_bytes(content)
    with pytest.raises(ValueError, match=problem) as info:
        recover([str(tmp_path)])
    info.match(re.escape(repr(str(tmp_path / JOURNAL_NAME))))
    assert (tmp_path / JOURNAL_NAME).read_bytes() == content


def test_group_in_two_directories_writes_one_confined_journal_each(tmp_path, fitted, monkeypatch):
    """Each directory's journal lists only its own files, so a killed save
    still completes in every directory."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    files = {"f_params": str(a / "p.pt"), "f_optimizer": str(a / "o.pt"), "f_history": str(b / "h.json")}
    real_replace = os.replace

    def killed_after_journals(src, dst):
        if not dst.endswith(JOURNAL_NAME):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(ampnet.io.atomic.os, "replace", killed_after_journals)
    with pytest.raises(KeyboardInterrupt):
        fitted.save_params(**files)
    monkeypatch.undo()
    moves = {d: json.loads((d / JOURNAL_NAME).read_text())["moves"] for d in (a, b)}
    assert sorted(final for _, final in moves[a]) == ["o.pt", "p.pt"]
    assert [final for _, final in moves[b]] == ["h.json"]
    net = tiny_net().initialize()
    net.load_params(**files)  # recovers both directories first
    assert differences(net.module_.state_dict(), fitted.module_.state_dict()) == []
    assert len(net.history) == len(fitted.history)
    assert not list(a.glob("*" + TEMP_SUFFIX)) and not (b / JOURNAL_NAME).exists()


def test_formatted_file_names_cannot_leave_the_checkpoint(tmp_path, fitted):
    """A history value used in a file-name template cannot move the file
    out of the checkpoint's directory."""
    cp = Checkpoint(
        monitor=None,
        dirname=str(tmp_path / "cp"),
        f_params="params_{last_epoch[tag]}.pt",
        f_optimizer=None,
        f_criterion=None,
        f_grad_scaler=None,
        f_rng_state=None,
        f_lr_schedulers=None,
        event_name=None,
    )
    cp.initialize()
    net = copy.deepcopy(fitted)
    net.history.record("tag", "ok")
    cp.save_model(net)
    assert (tmp_path / "cp" / "params_ok.pt").exists()
    rows = json.loads((tmp_path / "cp" / "history.json").read_text())
    rows[-1]["tag"] = "x/../../../evil"  # cp/params_x/../../../evil.pt is beside cp
    (tmp_path / "cp" / "history.json").write_text(json.dumps(rows))
    net = tiny_net().initialize()
    before = snapshot(net)
    with pytest.raises(
        ValueError,
        match="turns the file name f_params='params_{last_epoch.tag.}.pt' into "
        ".*outside the checkpoint's directory",
    ):
        net.load_params(checkpoint=cp)
    assert differences(snapshot(net), before) == []


# ---- 2. RNG states: every field as its generator accepts it --------------------


def _rng_cases():
    def setitem(key, value):
        return lambda s: s.__setitem__(key, value)

    def set_word(key, index, value):
        def change(s):
            s[key] = s[key].clone()
            s[key][index] = value

        return change

    return {
        "numpy.pos out of range": (
            setitem("numpy.pos", torch.tensor(625)),
            r"numpy.pos=625 must lie in \[0, 624\]",
        ),
        "numpy.pos huge": (setitem("numpy.pos", torch.tensor(10**12)), "numpy.pos=1000000000000"),
        "numpy.pos negative": (setitem("numpy.pos", torch.tensor(-1)), "numpy.pos=-1"),
        "numpy.has_gauss": (
            setitem("numpy.has_gauss", torch.tensor(2)),
            "numpy.has_gauss=2 must be 0 or 1",
        ),
        "numpy.cached_gaussian": (
            setitem("numpy.cached_gaussian", torch.tensor(float("nan"), dtype=torch.float64)),
            "numpy.cached_gaussian=nan must be a finite number",
        ),
        "numpy.keys zero": (
            setitem("numpy.keys", torch.zeros(624, dtype=torch.int64)),
            "numpy.keys is the degenerate all-zero",
        ),
        "numpy.keys 33 bits": (
            set_word("numpy.keys", 5, 2**32),
            "numpy.keys holds values outside the 32-bit range",
        ),
        "numpy.keys shape": (
            setitem("numpy.keys", torch.zeros(623, dtype=torch.int64)),
            r"numpy.keys has shape \(623,\), expected \(624,\)",
        ),
        "python.version": (setitem("python.version", torch.tensor(99)), "python.version=99 must be 3"),
        "python.version 2": (setitem("python.version", torch.tensor(2)), "python.version=2 must be 3"),
        "python pos": (
            set_word("python.internal", 624, 100000),
            r"python.internal\[624\] \(the position\) = 100000",
        ),
        "python pos negative": (
            set_word("python.internal", 624, -1),
            r"python.internal\[624\] \(the position\) = -1",
        ),
        "python word": (
            set_word("python.internal", 0, -5),
            "python.internal holds values outside the 32-bit range",
        ),
        "python gauss flag": (setitem("python.has_gauss_next", torch.tensor(7)), "python.has_gauss_next=7"),
        "python gauss": (
            setitem("python.gauss_next", torch.tensor(float("inf"), dtype=torch.float64)),
            "python.gauss_next=inf",
        ),
        "torch all zero": (
            lambda s: s.__setitem__("torch", torch.zeros_like(s["torch"])),
            r"torch refuses the state \(Invalid mt19937 state\)",
        ),
        "torch size": (lambda s: s.__setitem__("torch", s["torch"][:-8].clone()), "torch has 5048 bytes"),
        "torch dtype": (
            lambda s: s.__setitem__("torch", s["torch"].to(torch.int64)),
            "torch must be a dense CPU torch.uint8",
        ),
        "unknown cuda key": (
            setitem("cuda.x", torch.zeros(16, dtype=torch.uint8)),
            r"unknown keys \['cuda.x'\]",
        ),
        "cuda key with zero": (
            setitem("cuda.01", torch.zeros(16, dtype=torch.uint8)),
            r"unknown keys \['cuda.01'\]",
        ),
        "unknown key": (setitem("extra", torch.zeros(1)), r"unknown keys \['extra'\]"),
        "int key": (setitem(3, torch.zeros(1)), r"unknown keys \['3'\]"),
        "cuda size": (
            setitem("cuda.0", torch.zeros(8, dtype=torch.uint8)),
            "cuda.0 has 8 bytes, expected 16",
        ),
        "cuda offset": (
            setitem("cuda.0", torch.tensor([0] * 8 + [3] + [0] * 7, dtype=torch.uint8)),
            "cuda.0 has the Philox offset 3",
        ),
        "version": (
            setitem("ampnet_rng_version", torch.tensor(2)),
            "ampnet_rng_version=2: this ampnet reads version 1; upgrade",
        ),
        "version 0": (setitem("ampnet_rng_version", torch.tensor(0)), "ampnet_rng_version=0"),
        "not a tensor": (setitem("numpy.pos", 3), "numpy.pos must be a torch.int64 tensor, got int"),
    }


@pytest.mark.parametrize("case", list(_rng_cases()))
def test_invalid_rng_field_is_refused_before_anything_changes(tmp_path, saved, case):
    change, problem = _rng_cases()[case]
    state = get_rng_state()
    change(state)
    bad = str(tmp_path / "rng.pt")
    torch.save(state, bad)
    # the RNG file comes last: params, optimizer, history and scaler would apply first
    files = {**saved, "f_rng_state": bad}
    net = tiny_net().initialize()
    info = refused_unchanged(net, files, problem, re.escape(f"f_rng_state file {bad!r}"))
    assert "No generator was changed" in str(info.value)


@pytest.mark.slow
def test_numpy_pos_out_of_range_does_not_crash_the_process(tmp_path):
    """numpy accepts pos > 624 and segfaults at the next draw; the load must
    refuse it (checked in a fresh process, whose exit code tells)."""
    state = get_rng_state()
    state["numpy.pos"] = torch.tensor(10**9)
    bad = tmp_path / "rng.pt"
    torch.save(state, bad)
    script = (
        "import sys, numpy, torch\nsys.path[:0] = [{root!r}, {tests!r}]\n"
        "from resume_script import Tiny\nfrom ampnet import AmpNetClassifier\n"
        "net = AmpNetClassifier(Tiny).initialize()\n"
        "try:\n    net.load_params(f_rng_state={bad!r})\nexcept ValueError as e:\n    print('refused', e)\n"
        "print(numpy.random.rand())\n"
    ).format(root=str(Path(__file__).parents[1]), tests=str(Path(__file__).parent), bad=str(bad))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused" in proc.stdout and "numpy.pos=1000000000 must lie in [0, 624]" in proc.stdout


def test_numpy_global_generator_of_another_kind(tmp_path, saved):
    state = np.random.get_state(legacy=False)
    try:
        np.random.set_bit_generator(np.random.PCG64(0))
        net = tiny_net().initialize()
        info = refused_unchanged(net, saved, "numpy's global generator uses 'PCG64'")
        info.match(re.escape(f"f_rng_state file {saved['f_rng_state']!r}"))
        with pytest.raises(ValueError, match="ampnet saves only numpy's default MT19937 state. Fix"):
            net.save_params(f_rng_state=str(tmp_path / "r.pt"))
        assert not (tmp_path / "r.pt").exists()
    finally:
        np.random.set_bit_generator(np.random.MT19937(0))
        np.random.set_state(state)


# ---- 3. all or nothing ------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["python.version=99", "python pos=100000", "cuda.x", "torch zero", "_overflow_streak"]
)
def test_probed_values_of_the_issue_are_refused_with_file_and_field(tmp_path, saved, case):
    """The five files that passed the checks and failed while being applied,
    after parameters, optimizer, history and scaler had changed."""
    files = dict(saved)
    if case == "_overflow_streak":
        state = torch.load(saved["f_grad_scaler"], weights_only=True)
        state["_overflow_streak"] = "x"
        key, field = "f_grad_scaler", r"'_overflow_streak' = 'x' \(str\) must be an int >= 0"
    else:
        state = get_rng_state()
        key = "f_rng_state"
        if case == "python.version=99":
            state["python.version"], field = torch.tensor(99), "python.version=99"
        elif case == "python pos=100000":
            state["python.internal"][624], field = 100000, r"python.internal\[624\]"
        elif case == "cuda.x":
            state["cuda.x"], field = torch.zeros(16, dtype=torch.uint8), "cuda.x"
        else:
            state["torch"], field = torch.zeros_like(state["torch"]), "torch refuses"
    files[key] = str(tmp_path / "bad.pt")
    torch.save(state, files[key])
    refused_unchanged(tiny_net().initialize(), files, field, re.escape(f"{key} file {files[key]!r}"))


class Boom(RuntimeError):
    pass


def _fail_partway(monkeypatch, net, where):
    """Make one apply step fail after it changed part of what it owns."""
    if where == "params":

        def load(state, *a, **k):
            with torch.no_grad():
                net.module_.hidden.weight.fill_(7.0)
            raise Boom("disk gone")

        monkeypatch.setattr(net.module_, "load_state_dict", load)
    elif where == "optimizer":

        def load(state):
            net.optimizer_.param_groups[0]["lr"] = 123.0
            raise Boom("disk gone")

        monkeypatch.setattr(net.optimizer_, "load_state_dict", load)
    elif where == "scaler":
        real = net.grad_scaler_.load_state_dict

        def load(state):
            real(state)
            raise Boom("disk gone")

        monkeypatch.setattr(net.grad_scaler_, "load_state_dict", load)
    else:  # the RNG, last of all: torch's generator already set
        real = PreparedRngState.apply

        def apply(self):
            torch.set_rng_state(self.torch_state)
            np.random.set_state(self.numpy_state)
            raise Boom("disk gone")

        monkeypatch.setattr(PreparedRngState, "apply", apply)
        return real


@pytest.mark.parametrize("where", ["params", "optimizer", "scaler", "rng"])
def test_failure_while_applying_rolls_everything_back(saved, monkeypatch, where):
    net = tiny_net().initialize()
    quietly(net.partial_fit, *make_data())  # a net with state of its own
    _fail_partway(monkeypatch, net, where)
    source = {
        "params": "f_params",
        "optimizer": "f_optimizer",
        "scaler": "f_grad_scaler",
        "rng": "f_rng_state",
    }[where]
    before = snapshot(net)
    with pytest.raises(
        ValueError,
        match="passed every check but could not be loaded .Boom: disk gone.. Everything was rolled back",
    ) as info:
        net.load_params(**saved)
    info.match(re.escape(f"{source} file {saved[source]!r}"))
    assert differences(snapshot(net), before) == []


def test_interrupt_while_applying_rolls_back_and_propagates(saved, monkeypatch):
    net = tiny_net().initialize()

    def interrupted(state):
        raise KeyboardInterrupt

    monkeypatch.setattr(net.grad_scaler_, "load_state_dict", interrupted)
    before = snapshot(net)
    with pytest.raises(KeyboardInterrupt):
        net.load_params(**saved)
    assert differences(snapshot(net), before) == []


# ---- 4. torch.amp.GradScaler is supported ----------------------------------------


def _torch_loop(init_scale, epochs, data):
    """torch's own AMP loop with torch.amp.GradScaler, on ampnet's batches."""
    torch.manual_seed(0)
    module = Tiny()
    opt = torch.optim.Adam(module.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
    X, y = (torch.as_tensor(a) for a in data)
    for _ in range(epochs):
        for i in range(0, len(X), 16):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.nll_loss(torch.log(module(X[i : i + 16]).float()), y[i : i + 16])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return module, scaler


@pytest.mark.parametrize("kind", ["class", "instance"])
def test_torch_gradscaler_trains_as_torchs_own_loop(data, kind):
    grad_scaler = (
        torch.amp.GradScaler
        if kind == "class"
        else torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    )
    kwargs = (
        dict(grad_scaler__init_scale=2.0**20, grad_scaler__growth_interval=3) if kind == "class" else {}
    )
    torch.manual_seed(0)
    net = AmpNetClassifier(
        Tiny,
        amp_enabled=True,
        amp_dtype="float16",
        grad_scaler=grad_scaler,
        optimizer=torch.optim.Adam,
        optimizer__fused=False,  # the loop's Adam: bitwise the same kernel
        lr=0.05,
        batch_size=16,
        max_epochs=3,
        train_split=None,
        verbose=0,
        criterion=torch.nn.NLLLoss,
        **kwargs,
    )
    quietly(net.fit, *data)
    module, scaler = _torch_loop(2.0**20, 3, data)
    assert type(net.grad_scaler_) is torch.amp.GradScaler
    assert any(net.history[:, "skipped_steps"])  # the scale backed off along the way
    assert net.grad_scaler_.get_scale() == scaler.get_scale()
    assert differences(net.module_.state_dict(), module.state_dict()) == []


def test_torch_gradscaler_state_round_trips(tmp_path, data):
    net = tiny_net(grad_scaler=torch.amp.GradScaler)
    quietly(net.fit, *data)
    net.save_params(f_grad_scaler=str(tmp_path / "s.pt"))
    other = tiny_net(grad_scaler=torch.amp.GradScaler).initialize()
    other.load_params(f_grad_scaler=str(tmp_path / "s.pt"))
    assert other.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()


# ---- 5. the scale stays within float32 ------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("min_scale", 1e-50),
        ("min_scale", 1e-39),
        ("max_scale", 1e39),
        ("init_scale", 1e39),
        ("init_scale", 1e-40),
        ("growth_factor", 1e39),
        ("backoff_factor", 1e-50),
    ],
)
def test_scale_settings_outside_float32_are_refused(name, value):
    bounds = {"min_scale": 1e-45, "max_scale": 1e40} if name == "init_scale" else {}
    bounds = {k: v for k, v in bounds.items() if k != name}
    expected = re.escape(f"grad_scaler__{name}={value!r} (float): must ")
    with pytest.raises(ValueError, match=expected) as info:
        tiny_net(**{f"grad_scaler__{name}": value}).initialize()
    assert "float32" in str(info.value) and "e.g." in str(info.value)
    net = tiny_net().initialize()
    with pytest.raises(ValueError, match=expected):
        net.set_params(**{f"grad_scaler__{name}": value})
    assert net.grad_scaler_.get_settings()[name] != value
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        GradScaler("cpu", **{name: value, **bounds})


def test_extreme_valid_settings_keep_the_scale_finite_and_positive():
    up = GradScaler(
        "cpu", init_scale=1e38, max_scale=FLOAT32_MAX, growth_factor=FLOAT32_MAX, growth_interval=1
    )
    down = GradScaler("cpu", init_scale=1e-30, min_scale=FLOAT32_TINY, backoff_factor=FLOAT32_TINY)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.0)
    for scaler, value in ((up, 1.0), (down, float("inf"))):
        for _ in range(5):
            opt.zero_grad()
            scaler.scale((param * value).sum()).backward()
            scaler.step(opt)
            scaler.update()
            assert 0 < scaler.get_scale() < float("inf")
    assert up.get_scale() == pytest.approx(FLOAT32_MAX, rel=1e-6)
    assert down.get_scale() == pytest.approx(FLOAT32_TINY, rel=1e-6)


# ---- 6. numpy booleans ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "amp_enabled",
        "amp_master_weights",
        "amp_skip_nonfinite",
        "grad_scaler__enabled",
        "grad_scaler__dynamic",
        "distributed",
    ],
)
@pytest.mark.parametrize("value", [np.True_, np.False_])
def test_numpy_booleans_are_accepted_for_every_bool_parameter(name, value):
    kwargs = {name: value}
    if name == "distributed" and value:  # taken as True: it needs a process group
        with pytest.raises(ValueError, match="distributed=True, but no torch.distributed process group"):
            tiny_net(**kwargs).initialize()
        return
    if name == "grad_scaler__enabled" and not value:
        ctx = pytest.warns(AmpWarning, match="float16 training without loss scaling")
    elif name == "amp_enabled" and not value:  # the net's float16 settings now do nothing
        ctx = pytest.warns(AmpWarning, match="amp_enabled=False, so .* no effect")
    elif name == "amp_master_weights" and not value:  # read as False, as Python's False is
        ctx = pytest.warns(AmpWarning, match="amp_master_weights=False has no effect with amp_level='mixed'")
    else:
        ctx = warnings.catch_warnings()
    with ctx:
        net = tiny_net(**kwargs).initialize()
    assert net.get_params()[name] is value
    if name == "amp_enabled":
        assert net.precision_policy_.enabled is bool(value)
    if name.startswith("grad_scaler__"):
        assert net.grad_scaler_.get_settings()[name.split("__")[1]] is bool(value)


@pytest.mark.parametrize(
    "name", ["amp_enabled", "amp_master_weights", "amp_skip_nonfinite", "grad_scaler__dynamic"]
)
def test_non_booleans_name_their_numpy_type(name):
    with pytest.raises((TypeError, ValueError), match=r"1 \(int64\)|np.int64\(1\) \(int64\)"):
        tiny_net(**{name: np.int64(1)}).initialize()


# ---- 7. save_params compares real paths -----------------------------------------------


@pytest.mark.parametrize("second", ["./same.pt", "sub/../same.pt", "ABS", "LINKED_DIR", "HARDLINK"])
def test_two_spellings_of_one_file_are_refused(tmp_path, fitted, monkeypatch, second):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "same.pt").write_bytes(b"old")
    if second == "ABS":
        second = str(tmp_path / "same.pt")
    elif second == "LINKED_DIR":
        os.symlink(".", "here")
        second = os.path.join("here", "same.pt")
    elif second == "HARDLINK":
        os.link("same.pt", "hard.pt")
        second = "hard.pt"
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(
        ValueError, match=re.escape(f"same file for f_params='same.pt' and f_optimizer={second!r}")
    ):
        fitted.save_params(f_params="same.pt", f_optimizer=second)
    assert (tmp_path / "same.pt").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == listing


def test_a_link_to_another_target_is_replaced_not_written_through(tmp_path, fitted, monkeypatch):
    """Issue 18: a save replaces a symbolic link by its file, so a link to
    another target of the same save is a target of its own."""
    monkeypatch.chdir(tmp_path)
    os.symlink("same.pt", "link.pt")
    fitted.save_params(f_params="same.pt", f_optimizer="link.pt")
    assert not os.path.islink("link.pt")
    assert torch.load("same.pt", weights_only=True).keys() == fitted.module_.state_dict().keys()
    assert torch.load("link.pt", weights_only=True).keys() == {"state", "param_groups"}


def test_one_file_object_for_two_files_is_refused(fitted):
    import io

    buffer = io.BytesIO()
    with pytest.raises(ValueError, match="same file for f_params=.* and f_history="):
        fitted.save_params(f_params=buffer, f_history=buffer)
    assert buffer.getvalue() == b""


# ---- 8. deep content checks ----------------------------------------------------------------


def _optimizer_cases():
    def group(key, value):
        def change(s):
            s["param_groups"][0][key] = value

        return change

    def entry(key, value):
        def change(s):
            s["state"][0][key] = value(s["state"][0][key]) if callable(value) else value

        return change

    return {
        "lr str": (group("lr", "x"), r"param_groups\[0\]\['lr'\] must be a number, got 'x' \(str\)"),
        "lr nan": (group("lr", float("nan")), r"param_groups\[0\]\['lr'\] must be a finite number"),
        "lr missing": (lambda s: s["param_groups"][0].pop("lr"), r"param_groups\[0\]\['lr'\] is missing"),
        "betas length": (group("betas", (0.9,)), r"param_groups\[0\]\['betas'\] must have 2 entries"),
        "betas refused": (
            group("betas", (1.0, 0.999)),
            r"Adam refuses these settings \(Invalid beta parameter",
        ),
        "lr too large": (
            group("lr", 1e39),
            r"Adam fails to step with the saved settings and state "
            r"\(RuntimeError: value cannot be converted to type float without overflow",
        ),
        "flag type": (group("amsgrad", "yes"), r"param_groups\[0\]\['amsgrad'\] must be True or False"),
        "initial_lr": (group("initial_lr", "x"), r"param_groups\[0\]\['initial_lr'\] must be a number"),
        "unknown group key": (group("fuzz", [1, 2]), r"param_groups\[0\]\['fuzz'\] = \[1, 2\]"),
        "param id": (lambda s: s["param_groups"][0]["params"].__setitem__(0, "a"), "is not a new int id"),
        "exp_avg shape": (
            entry("exp_avg", torch.zeros(3, 3)),
            r"state\[0\]\['exp_avg'\] has shape \(3, 3\)",
        ),
        "exp_avg broadcast": (
            entry("exp_avg", torch.zeros(1, 4)),
            r"state\[0\]\['exp_avg'\] has shape \(1, 4\), expected \(8, 4\)",
        ),
        "exp_avg str": (
            entry("exp_avg", "x"),
            r"state\[0\]\['exp_avg'\] must be a tensor like the optimizer's own",
        ),
        "exp_avg nan": (
            entry("exp_avg", lambda t: torch.full_like(t, float("nan"))),
            r"state\[0\]\['exp_avg'\] holds NaN",
        ),
        "exp_avg missing": (
            lambda s: s["state"][0].pop("exp_avg"),
            r"state\[0\] lacks 'exp_avg', which Adam needs",
        ),
        "step str": (entry("step", "x"), r"state\[0\]\['step'\] must be a number or a one-element tensor"),
        "stray state": (lambda s: s["state"].__setitem__(99, {}), r"state\[99\] belongs to no parameter"),
        "extra key": (lambda s: s.__setitem__("extra", 1), r"unknown keys \['extra'\]"),
    }


@pytest.mark.parametrize("case", list(_optimizer_cases()))
def test_invalid_optimizer_file_is_refused_naming_the_field(tmp_path, saved, case):
    change, problem = _optimizer_cases()[case]
    state = torch.load(saved["f_optimizer"], weights_only=True)
    change(state)
    bad = str(tmp_path / "opt.pt")
    torch.save(state, bad)
    refused_unchanged(
        # the single-tensor kernel: fused Adam steps with lr=1e39 (in double) without failing
        tiny_net(optimizer__fused=False).initialize(),
        {**saved, "f_optimizer": bad},
        problem,
        re.escape(f"f_optimizer file {bad!r}"),
    )


def test_optimizer_state_from_an_older_torch_loads(tmp_path, saved):
    """Flags that newer torch versions added to the groups (here removed)
    get torch's defaults; a number for 'step' is converted by torch."""
    state = torch.load(saved["f_optimizer"], weights_only=True)
    for flag in ("foreach", "maximize", "capturable", "differentiable", "fused"):
        state["param_groups"][0].pop(flag, None)
    for entry in state["state"].values():
        entry["step"] = float(entry["step"])
    older = str(tmp_path / "old.pt")
    torch.save(state, older)
    net = tiny_net().initialize()
    net.load_params(**{**saved, "f_optimizer": older})
    quietly(net.partial_fit, *make_data())


@pytest.mark.parametrize(
    "rows, problem",
    [
        (
            [{"epoch": "x"}],
            r"in row 0, 'epoch' must be an int greater than the previous row's \(0\), got 'x'",
        ),
        (
            [{"epoch": 2}, {"epoch": 2}],
            r"in row 1, 'epoch' must be an int greater than the previous row's \(2\)",
        ),
        ([{"epoch": True}], "'epoch' must be an int"),
        ([{"epoch": 1, "batches": {}}], "'batches' must be a list of dicts"),
        ([{"epoch": 1, "batches": [1]}], "'batches' must be a list of dicts"),
        ([{"epoch": 1, "train_batch_count": "x"}], r"'train_batch_count' must be an int in \[0, 2\*\*53\]"),
        ([{"epoch": 1, "valid_loss_best": 1}], "'valid_loss_best' must be true or false"),
        (
            [{"epoch": 1, "batches": [{"train_batch_size": 2, "batch_size": "x"}]}],
            r"batch 0: 'batch_size' must be an int in \[0, 2\*\*53\], got 'x'",
        ),
        ([{"epoch": 1, "dur": None}], r"'dur' must be a finite number >= 0 \(seconds\), got None"),
        # issue 18: counters and numbers in range, not only of the right type
        ([{"epoch": 2**40}], r"'epoch' must be an int greater .*, got 1099511627776 \(int\) \(epochs are numbered up to 2\*\*31 - 1\)"),
        ([{"epoch": 1, "train_batch_count": -1}], r"'train_batch_count' must be an int in \[0, 2\*\*53\], got -1"),
        ([{"epoch": 1, "valid_batch_count": 2**60}], r"'valid_batch_count' must be an int in \[0, 2\*\*53\]"),
        ([{"epoch": 1, "skipped_steps": -3}], r"'skipped_steps' must be an int in \[0, 2\*\*53\], got -3"),
        ([{"epoch": 1, "dur": float("nan")}], r"'dur' must be a finite number >= 0 \(seconds\), got nan"),
        ([{"epoch": 1, "dur": -1.0}], r"'dur' must be a finite number >= 0"),
        ([{"epoch": 1, "loss_scale": 0.0}], r"'loss_scale' must be a finite number > 0, got 0.0"),
        ([{"epoch": 1, "loss_scale": float("inf")}], r"'loss_scale' must be a finite number > 0, got inf"),
        (
            [{"epoch": 1, "batches": [{"train_batch_size": -2}]}],
            r"batch 0: 'train_batch_size' must be an int in \[0, 2\*\*53\], got -2",
        ),
        ([{"epoch": 1, "batches": [{"step_skipped": "no"}]}], "batch 0: 'step_skipped' must be true or false"),
        ({"epoch": 1}, "expected a JSON list of epoch dicts, got dict"),
    ],
)
def test_invalid_history_is_refused(tmp_path, saved, rows, problem):
    bad = tmp_path / "h.json"
    bad.write_text(json.dumps(rows))
    refused_unchanged(
        tiny_net().initialize(),
        {**saved, "f_history": str(bad)},
        problem,
        re.escape(f"f_history file {str(bad)!r}"),
    )


@pytest.mark.parametrize("depth", [70, 100000])
def test_deeply_nested_history_raises_value_error_not_recursion_error(tmp_path, saved, depth):
    bad = tmp_path / "h.json"
    bad.write_text("[" * depth + "]" * depth)
    refused_unchanged(
        tiny_net().initialize(),
        {**saved, "f_history": str(bad)},
        "is not a JSON history.*nested",
        re.escape(str(bad)),
    )


@pytest.mark.parametrize(
    "case, problem",
    [
        ("nan weight", "parameter hidden.weight holds NaN or inf values"),
        ("inf bias", "parameter out.bias holds NaN or inf values"),
        ("int weight", r"hidden.weight holds torch.int64 values, the net torch.float32 \(floating\)"),
        ("not a tensor", "hidden.weight is a list instead of a tensor"),
        ("sparse", "hidden.weight is a torch.sparse_coo tensor instead of a dense one"),
    ],
)
def test_invalid_parameters_are_refused(tmp_path, saved, case, problem):
    state = torch.load(saved["f_params"], weights_only=True)
    if case == "nan weight":
        state["hidden.weight"][0, 0] = float("nan")
    elif case == "inf bias":
        state["out.bias"][1] = float("inf")
    elif case == "int weight":
        state["hidden.weight"] = state["hidden.weight"].long()
    elif case == "not a tensor":
        state["hidden.weight"] = state["hidden.weight"].tolist()
    else:
        state["hidden.weight"] = state["hidden.weight"].to_sparse()
    bad = str(tmp_path / "p.pt")
    torch.save(state, bad)
    refused_unchanged(
        tiny_net().initialize(), {**saved, "f_params": bad}, problem, re.escape(f"f_params file {bad!r}")
    )


class Masked(Tiny):
    """A module with a buffer that holds -inf by design, and a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.norm(self.hidden(X)))) + self.mask * 0, dim=-1)


def test_buffers_may_hold_inf_where_the_module_does(tmp_path):
    net = tiny_net(Masked).initialize()
    net.save_params(f_params=str(tmp_path / "p.pt"))
    other = tiny_net(Masked).initialize()
    other.load_params(f_params=str(tmp_path / "p.pt"))  # the -inf mask loads
    state = torch.load(tmp_path / "p.pt", weights_only=True)
    state["norm.running_var"][0] = float("nan")
    torch.save(state, tmp_path / "bad.pt")
    refused_unchanged(
        other, {"f_params": str(tmp_path / "bad.pt")}, "buffer norm.running_var holds NaN or inf"
    )


def _step_lr():
    return LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)


def _scheduler_net(callbacks=None, **kwargs):
    return tiny_net(callbacks=callbacks or [_step_lr()], **kwargs)


@pytest.fixture
def scheduler_checkpoint(tmp_path, data):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    torch.manual_seed(0)
    quietly(_scheduler_net(callbacks=[_step_lr(), cp]).fit, *data)
    return cp


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda st: st.__setitem__("last_epoch", "x"), r"\['last_epoch'\] must be a number, got 'x'"),
        (lambda st: st.__setitem__("base_lrs", [0.1, 0.2]), r"\['base_lrs'\] must have 1 entries"),
        (lambda st: st.__setitem__("step", 5), r"holds keys \['step'\] that the scheduler does not have"),
        (lambda st: st.__setitem__("optimizer", 5), r"the keys \['optimizer'\] are not scheduler state"),
    ],
)
@pytest.mark.parametrize("path", ["LoadInitState", "load_params"])
def test_invalid_scheduler_state_is_refused_before_anything_loads(
    scheduler_checkpoint, change, problem, path
):
    target = os.path.join(scheduler_checkpoint.dirname, "lr_schedulers.json")
    data = json.loads(Path(target).read_text())
    change(data["schedulers"]["LRScheduler"]["state"])
    Path(target).write_text(json.dumps(data))
    net = _scheduler_net().initialize()
    if path == "load_params":
        for _, cb in net.callbacks_:
            if isinstance(cb, LRScheduler):
                cb.on_train_begin(net)  # running, as during training
    before = snapshot(net)
    with pytest.raises(ValueError, match=problem) as info:
        if path == "load_params":
            net.load_params(checkpoint=scheduler_checkpoint)
        else:
            LoadInitState(scheduler_checkpoint).initialize().on_train_begin(net)
    info.match(re.escape(f"f_lr_schedulers file {target!r}"))
    assert differences(snapshot(net), before) == []


def test_checkpoint_without_scheduler_resumes_with_one(tmp_path, data):
    """A checkpoint saved without an LRScheduler (no 'initial_lr' in the
    optimizer) resumes in a net that has one, instead of torch's KeyError."""
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    quietly(tiny_net(callbacks=[cp], max_epochs=1).fit, *data)
    cp2 = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    net = _scheduler_net(max_epochs=3, callbacks=[LoadInitState(cp2), _step_lr()])
    with pytest.warns(
        AmpWarning, match="it does not save|does not exist|Learning-rate schedulers not restored"
    ):
        quietly(net.fit, *data)
    assert len(net.history) == 4  # one loaded epoch, three new ones
    assert net.optimizer_.param_groups[0]["initial_lr"] == 0.05
    assert net.history[-1, "event_lr"] < net.history[1, "event_lr"] <= 0.05  # the schedule runs


# ---- the fault test: files from another run ---------------------------------------------


@pytest.mark.parametrize("swapped", ["f_params", "f_optimizer", "f_grad_scaler", "all"])
def test_files_swapped_from_another_run_are_refused_before_anything_changes(tmp_path, data, swapped):
    """A checkpoint directory whose files were replaced by those of another
    run (a wider module, trained in bfloat16): refused, nothing changes."""
    ours = Checkpoint(monitor=None, dirname=str(tmp_path / "ours"))
    theirs = Checkpoint(monitor=None, dirname=str(tmp_path / "theirs"))
    torch.manual_seed(0)
    quietly(tiny_net(callbacks=[ours]).fit, *data)
    quietly(tiny_net(Wide, "bfloat16", callbacks=[theirs]).fit, *data)
    names = {"f_params": "params.pt", "f_optimizer": "optimizer.pt", "f_grad_scaler": "grad_scaler.pt"}
    for key, name in names.items():
        if swapped in (key, "all"):
            (tmp_path / "ours" / name).write_bytes((tmp_path / "theirs" / name).read_bytes())
    net = tiny_net().initialize()
    quietly(net.partial_fit, *data)
    before = snapshot(net)
    problems = {
        "f_params": r"does not match net.module_: shape mismatch hidden.weight: "
        r"\(12, 4\) in the file, \(8, 4\)",
        "f_optimizer": r"does not match net.optimizer_: state\[0\]\['exp_avg'\] has shape \(12, 4\)",
        "f_grad_scaler": "holds an empty loss-scaler state",
    }
    with pytest.raises(ValueError) as info:
        net.load_params(checkpoint=ours)
    refused = [key for key in names if key in str(info.value)]
    assert refused == ([swapped] if swapped != "all" else refused) and len(refused) == 1
    info.match(problems[refused[0]])
    info.match(re.escape(f"{refused[0]} file {str(tmp_path / 'ours' / names[refused[0]])!r}"))
    assert differences(snapshot(net), before) == []


# ---- 9. report, devices, full disks ------------------------------------------------------------


def test_precision_report_of_an_empty_x(fitted, data):
    X, y = data
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="precision_report needs at least one sample, but X holds none"):
        fitted.precision_report(X[:0], y[:0])
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("device", ["mps", "xla", "xpu", "xla:1"])
def test_unavailable_backends_get_ampnets_value_error(device):
    with pytest.raises(
        ValueError,
        match=rf"device='{device}', but .* is not available on this machine .*Fix: device='cpu'",
    ):
        tiny_net(device=device, amp_dtype="auto").initialize()


class FullDisk:
    """A file that reports a full disk after ``room`` bytes."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _checkpoint_bytes(dirname):
    return {p.name: p.read_bytes() for p in Path(dirname).iterdir()}


@pytest.mark.parametrize("room", [0, 1000])
def test_disk_full_during_a_checkpoint_names_the_file_and_keeps_the_old_one(
    tmp_path, fitted, monkeypatch, room
):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    old = _checkpoint_bytes(tmp_path)
    changed = copy.deepcopy(fitted)
    with torch.no_grad():
        changed.module_.hidden.weight.fill_(0.5)

    def full_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return FullDisk(f, room) if "w" in mode and "params.pt" in os.fspath(path) else f

    monkeypatch.setattr(ampnet.io.files, "open", full_open, raising=False)
    with pytest.raises(OSError, match="the disk is full") as info:
        cp.save_model(changed)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    info.match(re.escape(f"Could not write {str(tmp_path / 'params.pt')!r}"))
    assert _checkpoint_bytes(tmp_path) == old  # the old checkpoint is whole, no temporary files
    net = tiny_net().initialize()
    net.load_params(checkpoint=cp)
    assert differences(net.module_.state_dict(), fitted.module_.state_dict()) == []


def _save_with_file_size_limit(net, cp, limit, out):  # runs in a forked child
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        cp.save_model(net)
        out.put(("saved", None, ""))
    except OSError as exc:
        out.put((type(exc).__name__, exc.errno, str(exc)))


@pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(signal, "SIGXFSZ"), reason="needs fork and RLIMIT_FSIZE"
)
def test_a_real_write_error_names_the_file(tmp_path, fitted):
    """The kernel refuses to grow a file beyond RLIMIT_FSIZE (EFBIG), as it
    refuses to write on a full disk (ENOSPC)."""
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    old = _checkpoint_bytes(tmp_path)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_save_with_file_size_limit, args=(fitted, cp, 1200, out))
    child.start()
    kind, code, text = out.get(timeout=120)
    child.join()
    assert child.exitcode == 0
    assert kind == "OSError" and code == errno.EFBIG
    assert re.search(r"Could not write '.*\.(pt|json)': File too large", text)
    assert "the previous files are unchanged" in text
    assert _checkpoint_bytes(tmp_path) == old


# ---- the trust model of the README ------------------------------------------------------


class _RunsCode:
    """A pickle that creates a file when it is unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("key", ["f_optimizer", "f_criterion", "f_lr_schedulers"])
def test_malicious_optimizer_criterion_and_scheduler_files_run_no_code(tmp_path, key):
    marker = tmp_path / "code-ran"
    bad = str(tmp_path / "evil.pt")
    torch.save({"state": _RunsCode(marker), "param_groups": []}, bad)
    problem = (
        "is not a JSON file of scheduler states"
        if key == "f_lr_schedulers"
        else "which a safe load refuses"
    )
    refused_unchanged(tiny_net().initialize(), {key: bad}, problem, re.escape(bad))
    assert not marker.exists()


def test_weights_only_false_is_the_users_own_risk(tmp_path):
    """With torch_load_kwargs={'weights_only': False} a parameter file runs
    code while it is read, as the README warns."""
    marker = tmp_path / "code-ran"
    bad = str(tmp_path / "evil.pt")
    torch.save({"hidden.weight": _RunsCode(marker)}, bad)
    net = tiny_net(torch_load_kwargs={"weights_only": False}).initialize()
    with pytest.raises(ValueError, match="does not match net.module_"):
        net.load_params(f_params=bad)
    assert marker.exists()


def test_f_pickle_is_never_read_by_a_load(tmp_path, fitted):
    cp = Checkpoint(monitor=None, dirname=str(tmp_path), f_pickle="net.pkl", event_name=None)
    cp.initialize()
    cp.save_model(fitted)
    marker = tmp_path / "code-ran"
    with open(tmp_path / "net.pkl", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    net = tiny_net().initialize()
    net.load_params(checkpoint=cp)
    LoadInitState(cp).initialize().on_train_begin(tiny_net().initialize())
    assert not marker.exists()
    assert differences(net.module_.state_dict(), fitted.module_.state_dict()) == []
    with open(tmp_path / "net.pkl", "rb") as f:
        pickle.load(f)  # unpickling it yourself runs its code
    assert marker.exists()


def test_plausible_weights_of_the_right_shape_load_as_they_are(tmp_path, saved, data):
    """Values of the right type, shape and range are not judged: the weights
    of another run of the same model load."""
    torch.manual_seed(1)
    other = tiny_net(max_epochs=1)
    quietly(other.fit, *data)
    other.save_params(f_params=str(tmp_path / "other.pt"))
    net = tiny_net().initialize()
    net.load_params(**{**saved, "f_params": str(tmp_path / "other.pt")})
    assert differences(net.module_.state_dict(), other.module_.state_dict()) == []


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("scale", 1e39, r"'scale' = 1e\+39 lies outside float32's normal positive range"),
        (
            "min_scale",
            1e-50,
            r"'min_scale' = 1e-50 \(float\): must lie within float32's normal positive range",
        ),
        ("growth_interval", 2.5, r"'growth_interval' = 2.5 \(float\): must be an int >= 1"),
        ("backoff_factor", "x", r"'backoff_factor' = 'x' \(str\): must be a number in \(0, 1\)"),
        ("dynamic", 1, r"'dynamic' = 1 \(int\): must be True or False"),
        (
            "_growth_tracker",
            2**40,
            r"'_growth_tracker' = 1099511627776 \(int\) must be an int in \[0, 2\*\*31 - 1\]",
        ),
        ("ampnet_scaler_version", 7, "format version 7 is newer than this ampnet reads"),
        (3, 1, r"keys \['3'\] are not strings"),
    ],
)
def test_invalid_scaler_field_is_refused(tmp_path, saved, field, value, problem):
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state[field] = value
    bad = str(tmp_path / "s.pt")
    torch.save(state, bad)
    refused_unchanged(
        tiny_net().initialize(),
        {**saved, "f_grad_scaler": bad},
        problem,
        re.escape(f"f_grad_scaler file {bad!r}"),
    )


def test_failure_while_restoring_schedulers_rolls_everything_back(scheduler_checkpoint, monkeypatch):
    net = _scheduler_net().initialize()
    cb = dict(net.callbacks_)["LRScheduler"]
    cb.on_train_begin(net)  # running, as during training
    scheduler = cb.lr_scheduler_
    real = scheduler.load_state_dict

    def load(state):
        real(state)
        raise Boom("disk gone")

    monkeypatch.setattr(scheduler, "load_state_dict", load)
    before = snapshot(net), copy.deepcopy(scheduler.state_dict()), cb.batch_idx_
    with pytest.raises(
        ValueError,
        match="f_lr_schedulers file .* could not be loaded .Boom: disk gone.. Everything was rolled back",
    ):
        net.load_params(checkpoint=scheduler_checkpoint)
    after = snapshot(net), scheduler.state_dict(), cb.batch_idx_
    assert differences(after, before) == []


@pytest.mark.parametrize("key", ["f_grad_scaler", "f_rng_state"])
def test_scaler_and_rng_files_are_always_read_safely(tmp_path, key):
    """Even with torch_load_kwargs={'weights_only': False}."""
    marker = tmp_path / "code-ran"
    bad = str(tmp_path / "evil.pt")
    torch.save({"scale": _RunsCode(marker)}, bad)
    net = tiny_net(torch_load_kwargs={"weights_only": False}).initialize()
    refused_unchanged(net, {key: bad}, "which a safe load refuses")
    assert not marker.exists()


class CountingAdam(torch.optim.Adam):
    """A user's optimizer class (outside torch.optim) that counts its instances."""

    made = 0

    def __init__(self, *args, **kwargs):
        type(self).made += 1
        super().__init__(*args, **kwargs)


def test_checks_never_build_a_users_optimizer(scheduler_checkpoint):
    """The scheduler check builds its scratch scheduler on an SGD, and the
    optimizer check steps no scratch copy of a class outside torch.optim;
    both still refuse what they check."""
    target = os.path.join(scheduler_checkpoint.dirname, "lr_schedulers.json")
    data = json.loads(Path(target).read_text())
    data["schedulers"]["LRScheduler"]["state"]["last_epoch"] = "x"
    Path(target).write_text(json.dumps(data))
    net = _scheduler_net(optimizer=CountingAdam).initialize()
    made = CountingAdam.made
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"\['last_epoch'\] must be a number, got 'x'"):
        LoadInitState(scheduler_checkpoint).initialize().on_train_begin(net)
    assert differences(snapshot(net), before) == []
    state = torch.load(os.path.join(scheduler_checkpoint.dirname, "optimizer.pt"), weights_only=True)
    state["param_groups"][0]["lr"] = "x"
    torch.save(state, os.path.join(scheduler_checkpoint.dirname, "optimizer.pt"))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] must be a number"):
        net.load_params(f_optimizer=os.path.join(scheduler_checkpoint.dirname, "optimizer.pt"))
    assert CountingAdam.made == made


# ---- issue 18 --------------------------------------------------------------------
# Special files, planted links, values that pass type checks, export debris and a
# second writer. One section per item of the issue.


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory, data):
    """The folder of a Checkpoint(monitor=None) after a two-epoch fp16 fit
    with an LRScheduler (do not change it: copy it with _checkpoint_folder)."""
    dirname = str(tmp_path_factory.mktemp("pristine") / "ckpt")
    torch.manual_seed(0)
    net = _scheduler_net(callbacks=[_step_lr(), Checkpoint(monitor=None, dirname=dirname)])
    quietly(net.fit, *data)
    return dirname


def _checkpoint_folder(tmp_path, pristine, name="ckpt"):
    """A fresh copy of the ``pristine`` checkpoint folder; returns its path."""
    import shutil

    dirname = str(tmp_path / name)
    shutil.copytree(pristine, dirname)
    return dirname


# ---- 18.1 special files never hang the loader or exhaust memory ------------------

_SPECIAL_FILE_CHILD = r"""
import json, os, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))  # a runaway read fails fast
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
warnings.simplefilter("ignore")
import torch
from ampnet import AmpNetClassifier
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from resume_script import Tiny

for line in sys.stdin:
    case = json.loads(line)
    print("START", case["name"], flush=True)
    net = AmpNetClassifier(Tiny, amp_enabled=True, amp_dtype="float16", optimizer=torch.optim.Adam,
                           train_split=None, verbose=0).initialize()
    try:
        if case["how"] == "checkpoint":
            net.load_params(checkpoint=Checkpoint(monitor=None, dirname=case["dirname"]))
        elif case["how"] == "LoadInitState":
            LoadInitState(Checkpoint(monitor=None, dirname=case["dirname"])).initialize().on_train_begin(net)
        else:
            net.load_params(**{case["how"]: case["path"]})
        outcome = {"outcome": "loaded"}
    except (ValueError, OSError) as exc:
        outcome = {"outcome": type(exc).__name__, "message": str(exc)}
    except BaseException as exc:
        outcome = {"outcome": "crash " + type(exc).__name__, "message": str(exc)[:500]}
    print("RESULT", json.dumps({"name": case["name"], **outcome}), flush=True)
"""


def _run_special_file_cases(cases):
    """Load each case in one child process with a 2 GiB data limit and a
    timeout; return {name: result}. A hang or a runaway read fails the test."""
    lines = "".join(json.dumps(c) + "\n" for c in cases)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _SPECIAL_FILE_CHILD, root],
            input=lines, capture_output=True, text=True, timeout=120, env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        started = [line for line in out.splitlines() if line.startswith("START")]
        pytest.fail(f"the load hung at {started[-1:]}")
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            results[result["name"]] = result
    assert proc.returncode == 0, proc.stderr[-2000:]
    return results


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/zero are POSIX")
def test_special_files_are_refused_without_hanging_or_reading_forever(tmp_path, pristine_checkpoint):
    """The probes of issue 18: history.json and lr_schedulers.json linked to
    /dev/zero (json.load read without end), history.json and params.pt
    replaced by a FIFO (the load blocked forever), plus a socket, a
    directory and /dev/zero named directly."""
    import socket

    cases, expected = [], {}

    def case(name, filename, make, how, problem):
        dirname = _checkpoint_folder(tmp_path, pristine_checkpoint, name)
        path = os.path.join(dirname, filename)
        os.remove(path)
        make(path)
        cases.append({"name": name, "dirname": dirname, "how": how, "path": path})
        expected[name] = (path, problem)

    def dev_zero(path):
        os.symlink("/dev/zero", path)

    def bind_socket(path):
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        sock.close()

    case("history-zero", "history.json", dev_zero, "checkpoint", "symbolic link to '/dev/zero'")
    case("schedulers-zero", "lr_schedulers.json", dev_zero, "LoadInitState",
         "symbolic link to '/dev/zero'")
    case("history-fifo", "history.json", os.mkfifo, "LoadInitState", "is a FIFO")
    case("params-fifo", "params.pt", os.mkfifo, "checkpoint", "is a FIFO")
    case("rng-socket", "rng_state.pt", bind_socket, "checkpoint", "is a socket")
    case("scaler-directory", "grad_scaler.pt", os.mkdir, "f_grad_scaler", "is a directory")
    cases.append({"name": "dev-zero-named", "how": "f_history", "path": "/dev/zero"})
    expected["dev-zero-named"] = ("/dev/zero", "is a character device")
    results = _run_special_file_cases(cases)
    for name, (path, problem) in expected.items():
        result = results.get(name)
        assert result is not None and result["outcome"] == "ValueError", (name, result)
        assert repr(path) in result["message"] and problem in result["message"], (name, result)
        assert "not a regular file" in result["message"] or "outside its folder" in result["message"]


@pytest.mark.parametrize("key", ["f_history", "f_grad_scaler", "f_rng_state"])
def test_a_file_larger_than_its_kinds_limit_is_refused_unread(tmp_path, saved, key):
    """A (sparse) regular file one byte over its kind's limit is refused
    before a byte of it is read."""
    from ampnet.io.untrusted import opening as kinds

    big = str(tmp_path / os.path.basename(saved[key]))
    limit = kinds.max_bytes(key)
    with open(big, "wb") as f:
        f.truncate(limit + 1)
    refused_unchanged(
        tiny_net().initialize(), {**saved, key: big}, re.escape(f"{key} file {big!r} is {limit + 1} bytes"),
        f"more than the {limit} bytes that ampnet reads from this kind of file",
    )
    assert kinds.max_bytes("f_anything_else") == kinds.TENSOR_FILE_MAX_BYTES


def test_a_compressed_torch_file_is_refused_before_it_expands(tmp_path, saved):
    """torch.load reads deflated zip records (a zip bomb could expand without
    bound); torch.save never writes them, so they are refused."""
    import zipfile

    bomb = str(tmp_path / "params.pt")
    with zipfile.ZipFile(saved["f_params"]) as src, zipfile.ZipFile(bomb, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
    assert torch.load(bomb, weights_only=True).keys()  # torch itself reads it
    refused_unchanged(
        tiny_net().initialize(), {**saved, "f_params": bomb},
        re.escape(f"f_params file {bomb!r} cannot be read as a torch file"), "compressed records",
    )


# ---- 18.2 planted links never redirect a load or a save out of the folder ----------


def test_planted_history_link_of_the_issue_redirects_neither_load_nor_save(
    tmp_path, pristine_checkpoint, data
):
    """The probe of issue 18: history.json links to ../outside.txt (valid
    content). The README's resume pattern refuses to load it, and a save
    into the folder replaces the link instead of writing through it."""
    dirname = _checkpoint_folder(tmp_path, pristine_checkpoint)
    outside = tmp_path / "outside.txt"
    history = os.path.join(dirname, "history.json")
    os.replace(history, outside)
    os.symlink(os.path.join("..", "outside.txt"), history)
    precious = outside.read_bytes()
    cp = Checkpoint(monitor=None, dirname=dirname)
    net = _scheduler_net(callbacks=[LoadInitState(cp), _step_lr(), cp], max_epochs=1)
    with pytest.raises(ValueError, match=re.escape(f"f_history file {history!r} is a symbolic link to ")) as info:
        quietly(net.fit, *data)
    info.match("outside its folder")
    # a save (a fresh run into that folder) replaces the links, whatever they point to
    for name in ("params.pt", "optimizer.pt", "grad_scaler.pt", "lr_schedulers.json"):
        os.remove(os.path.join(dirname, name))
        os.symlink(str(outside), os.path.join(dirname, name))
    cp = Checkpoint(monitor=None, dirname=dirname)
    quietly(_scheduler_net(callbacks=[_step_lr(), cp], max_epochs=1).fit, *data)
    assert outside.read_bytes() == precious
    for name in ("history.json", "params.pt", "optimizer.pt", "grad_scaler.pt", "lr_schedulers.json"):
        assert not os.path.islink(os.path.join(dirname, name)) and os.path.isfile(os.path.join(dirname, name))
    assert len(json.loads(Path(history).read_text())) == 1  # the new run's history


def test_links_inside_the_folder_are_followed(tmp_path, pristine_checkpoint):
    """A link to another file of the same folder (or below it) is fine."""
    dirname = _checkpoint_folder(tmp_path, pristine_checkpoint)
    os.mkdir(os.path.join(dirname, "real"))
    for name in ("params.pt", "history.json"):
        os.replace(os.path.join(dirname, name), os.path.join(dirname, "real", name))
        os.symlink(os.path.join("real", name), os.path.join(dirname, name))
    net = _scheduler_net().initialize()
    net.load_params(checkpoint=Checkpoint(monitor=None, dirname=dirname, f_lr_schedulers=None))
    assert len(net.history) == 2


def test_a_link_to_a_file_outside_is_refused_for_every_kind(tmp_path, saved):
    net = tiny_net().initialize()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for key, path in saved.items():
        os.replace(path, outside / os.path.basename(path))
        os.symlink(outside / os.path.basename(path), path)
        refused_unchanged(net, saved, re.escape(f"{key} file {path!r} is a symbolic link to"))
        os.remove(path)
        os.replace(outside / os.path.basename(path), path)
    net.load_params(**saved)  # the files themselves load


def test_export_to_a_linked_name_replaces_the_link(tmp_path, fitted, data):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "model.pt2"
    os.symlink(victim, target)
    assert fitted.export(str(target), data[0][:4], format="torch.export") == str(target)
    assert victim.read_text() == "precious"
    assert not target.is_symlink()
    program = torch.export.load(str(target))
    expected = fitted.predict_proba(data[0][:4])
    assert np.allclose(program.module()(torch.as_tensor(data[0][:4])).numpy(), expected, atol=5e-3)


# ---- 18.3 / 18.4 int32 step counters of the loss scaler --------------------------


def _scaler_steps(scaler, grads):
    """Run the scaler over steps whose gradient is each of ``grads``; return
    the scale after each step."""
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scales = []
    for grad in grads:
        optimizer.zero_grad()
        scaler.scale((weight * grad).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("name", ["growth_interval", "hysteresis"])
@pytest.mark.parametrize("value", [2**31, 2**40])
def test_int32_counters_beyond_their_range_are_refused_everywhere(name, value):
    """Issue 18: growth_interval=2**31 made the scale grow every step and
    hysteresis=2**31 backed off on every overflow (int32 wrap-around)."""
    problem = re.escape(f"{name}={value} (int): must be an int >= 1 and at most 2**31 - 1")
    with pytest.raises(ValueError, match=problem):
        GradScaler(device="cpu", **{name: value})
    with pytest.raises(ValueError, match="grad_scaler__" + problem):
        tiny_net(**{f"grad_scaler__{name}": value}).initialize()
    net = tiny_net().initialize()
    before = net.grad_scaler_.get_settings()
    with pytest.raises(ValueError, match="grad_scaler__" + problem):
        net.set_params(**{f"grad_scaler__{name}": value})
    assert net.grad_scaler_.get_settings() == before


def test_the_largest_int32_counters_behave_as_huge_not_as_negative():
    grow = GradScaler(device="cpu", init_scale=8.0, growth_interval=2**31 - 1)
    assert _scaler_steps(grow, [1.0] * 4) == [8.0] * 4  # never reaches the interval
    wait = GradScaler(device="cpu", init_scale=8.0, hysteresis=2**31 - 1)
    assert _scaler_steps(wait, [float("inf")] * 4) == [8.0] * 4  # never backs off
    assert wait._overflow_streak == 4


@pytest.mark.parametrize("field, value", [("_overflow_streak", 2**40), ("_overflow_streak", 2**31),
                                          ("hysteresis", 2**31), ("growth_interval", 2**40)])
def test_scaler_file_with_a_counter_beyond_int32_is_refused(tmp_path, saved, field, value):
    """Issue 18: _overflow_streak = 2**40 passed every check, then partial_fit
    crashed ('value cannot be converted to type int without overflow')."""
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state[field] = value
    bad = str(tmp_path / "s.pt")
    torch.save(state, bad)
    refused_unchanged(
        tiny_net().initialize(), {**saved, "f_grad_scaler": bad},
        re.escape(f"f_grad_scaler file {bad!r} holds an invalid loss-scaler state"),
        re.escape(f"'{field}' = {value} (int)"), re.escape("at most 2**31 - 1"),
    )


def test_scaler_file_with_the_largest_streak_loads_and_trains(tmp_path, saved, data):
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state["_overflow_streak"] = 2**31 - 2
    state["hysteresis"] = 2**31 - 1
    path = str(tmp_path / "s.pt")
    torch.save(state, path)
    net = tiny_net(grad_scaler__hysteresis=2**31 - 1).initialize()
    net.load_params(**{**saved, "f_grad_scaler": path})
    assert net.grad_scaler_._overflow_streak == 2**31 - 2
    quietly(net.partial_fit, *data)
    assert math.isfinite(net.grad_scaler_.get_scale())


# ---- 18.5 scheduler states are range-checked, not only type-checked --------------

_SCHEDULERS = {
    "StepLR": dict(step_size=1, gamma=0.5),
    "MultiStepLR": dict(milestones=[1, 3], gamma=0.5),
    "ExponentialLR": dict(gamma=0.9),
    "LinearLR": dict(start_factor=0.5, total_iters=3),
    "PolynomialLR": dict(total_iters=4, power=2.0),
    "CosineAnnealingLR": dict(T_max=4),
    "ReduceLROnPlateau": dict(monitor="train_loss", factor=0.5),
    "OneCycleLR": dict(max_lr=0.1, total_steps=40),
}


def _policy_checkpoint(tmp_path, data, policy):
    """A checkpoint after one epoch with an LRScheduler of ``policy``."""
    cb = LRScheduler(getattr(torch.optim.lr_scheduler, policy), **_SCHEDULERS[policy])
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / policy))
    torch.manual_seed(0)
    quietly(tiny_net(callbacks=[cb, cp], max_epochs=1).fit, *data)
    return cp


def _policy_net(policy):
    cb = LRScheduler(getattr(torch.optim.lr_scheduler, policy), **_SCHEDULERS[policy])
    return tiny_net(callbacks=[cb]).initialize()


def _edit_scheduler_state(cp, edit):
    path = os.path.join(cp.dirname, "lr_schedulers.json")
    data = json.loads(Path(path).read_text())
    edit(data["schedulers"]["LRScheduler"]["state"])
    Path(path).write_text(json.dumps(data))
    return path


def _set(key, value):
    def edit(state):
        state[key] = value
    return edit


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "policy, edit, problem",
    [
        ("StepLR", _set("step_size", 0), r"\['step_size'\] = 0 \(int\) must be an int in \[1, 2\*\*53\]"),
        ("StepLR", _set("gamma", _NAN), r"\['gamma'\] = nan \(float\) must be a finite number in \(0, 1000\]"),
        ("StepLR", _set("gamma", -1e300), r"\['gamma'\] = -1e\+300 \(float\) must be a finite number in \(0,"),
        ("StepLR", _set("gamma", 1e300), r"\['gamma'\] = 1e\+300 \(float\) must be a finite number in \(0,"),
        ("StepLR", _set("last_epoch", -5), r"\['last_epoch'\] = -5 \(int\) must be an int in \[-1, 2\*\*53\]"),
        ("StepLR", _set("_step_count", 2**60), r"\['_step_count'\] = 1152921504606846976 \(int\) must be an int"),
        ("StepLR", _set("base_lrs", [-0.1]), r"\['base_lrs'\] = \[-0.1\] \(list\) must be a list of finite numbers >= 0"),
        ("StepLR", _set("_last_lr", [_INF]), r"\['_last_lr'\] = \[inf\] \(list\) must be a list of finite"),
        ("MultiStepLR", _set("milestones", {"x": 1}), r"\['milestones'\] = \{'x': 1\} \(dict\) must map epochs"),
        ("MultiStepLR", _set("milestones", {"2": -1}), r"\['milestones'\] = Counter\(\{2: -1\}\) \(Counter\) must map"),
        ("MultiStepLR", _set("gamma", _NAN), r"\['gamma'\] = nan \(float\) must be a finite number"),
        ("ExponentialLR", _set("gamma", 0.0), r"\['gamma'\] = 0.0 \(float\) must be a finite number in \(0, 1000\]"),
        ("LinearLR", _set("start_factor", 0.0), r"\['start_factor'\] = 0.0 \(float\) must be a finite number in \(0, 1\]"),
        ("LinearLR", _set("end_factor", 2.0), r"\['end_factor'\] = 2.0 \(float\) must be a finite number in \[0, 1\]"),
        ("PolynomialLR", _set("total_iters", 0), r"\['total_iters'\] = 0 \(int\) must be an int in \[1, 2\*\*53\]"),
        ("PolynomialLR", _set("power", -1.0), r"\['power'\] = -1.0 \(float\) must be a finite number in \[0, 1000\]"),
        ("CosineAnnealingLR", _set("T_max", 0), r"\['T_max'\] = 0 \(int\) must be a finite number in \(0, "),
        ("CosineAnnealingLR", _set("eta_min", -1.0), r"\['eta_min'\] = -1.0 \(float\) must be a finite number in \[0, inf\]"),
        ("ReduceLROnPlateau", _set("factor", 1.5), r"\['factor'\] = 1.5 \(float\) must be a finite number in \[0, 1\)"),
        ("ReduceLROnPlateau", _set("patience", -1), r"\['patience'\] = -1 \(int\) must be an int in \[0, 2\*\*53\]"),
        ("ReduceLROnPlateau", _set("best", _NAN), r"\['best'\] = nan \(float\) must be a number \(not NaN\)"),
        ("ReduceLROnPlateau", _set("mode", "up"), r"\['mode'\] = 'up' \(str\) must be one of 'min', 'max'"),
        ("OneCycleLR", _set("total_steps", 0), r"\['total_steps'\] = 0 \(int\) must be an int in \[1, 2\*\*53\]"),
        (
            "OneCycleLR",
            lambda s: s["_schedule_phases"][0].update(start_lr="lr"),
            r"\['_schedule_phases'\]\[0\]\['start_lr'\] = 'lr' \(str\) must be one of",
        ),
        (   # every field in range, but the phases end on the same step: the trial step divides by zero
            "OneCycleLR",
            lambda s: [p.update(end_step=2.0) for p in s["_schedule_phases"]],
            r"makes the scheduler fail to step \(ZeroDivisionError",
        ),
    ],
)
@pytest.mark.parametrize("path", ["LoadInitState", "load_params"])
def test_scheduler_fields_out_of_range_are_refused(tmp_path, data, policy, edit, problem, path):
    """Issue 18: step_size 0 crashed the resumed fit (ZeroDivisionError);
    gamma NaN or -1e300 loaded and made the learning rate NaN or -3.6e298."""
    cp = _policy_checkpoint(tmp_path, data, policy)
    target = _edit_scheduler_state(cp, edit)
    net = _policy_net(policy)
    cb = dict(net.callbacks_)["LRScheduler"]
    if path == "load_params":
        cb.on_train_begin(net)  # running, as during training
    scheduler_before = copy.deepcopy(cb.lr_scheduler_.state_dict()) if cb.lr_scheduler_ else None
    before = snapshot(net)
    with pytest.raises(ValueError, match=problem) as info:
        if path == "LoadInitState":
            LoadInitState(cp).initialize().on_train_begin(net)
        else:
            net.load_params(checkpoint=cp)
    info.match(re.escape(f"f_lr_schedulers file {target!r} holds an invalid state for scheduler 'LRScheduler'"))
    info.match(re.escape("schedulers['LRScheduler']['state']"))
    assert differences(snapshot(net), before) == []
    if path == "load_params":
        assert differences(cb.lr_scheduler_.state_dict(), scheduler_before) == []


@pytest.mark.parametrize("policy", sorted(_SCHEDULERS))
def test_every_stock_scheduler_resumes_as_saved(tmp_path, data, policy):
    """The range checks accept what the schedulers save; MultiStepLR's
    milestones (a Counter, whose int keys JSON turns into strings) resume
    as ints (before issue 18 a MultiStepLR checkpoint could not be loaded)."""
    cp = _policy_checkpoint(tmp_path, data, policy)
    saved = json.loads(Path(cp.dirname, "lr_schedulers.json").read_text())["schedulers"]["LRScheduler"]
    net = _policy_net(policy)
    cb = dict(net.callbacks_)["LRScheduler"]
    lis = LoadInitState(cp).initialize()
    lis.on_train_begin(net)
    cb.on_train_begin(net)
    lis.on_epoch_begin(net)  # restores the saved scheduler state
    state = cb.lr_scheduler_.state_dict()
    assert json.loads(json.dumps(state)) == saved["state"]
    if policy == "MultiStepLR":
        assert state["milestones"] == {1: 1, 3: 1} and all(type(k) is int for k in state["milestones"])
    assert net.optimizer_.param_groups[0]["lr"] == pytest.approx(saved["state"]["_last_lr"][0])


# ---- 18.6 a rolled-back load leaves no amp_fp32_modules='auto' choice behind -------


def test_rolled_back_load_undoes_the_saved_auto_choice(tmp_path, saved, monkeypatch, data):
    """Issue 18: the parameters file's load hook recorded its saved 'auto'
    choice, and a rollback kept it: the net then trained with the saved
    layout instead of probing its own."""
    from ampnet.auto.saved import FP32_KEY

    net = tiny_net(amp_fp32_modules="auto").initialize()
    assert net.amp_layout_.auto_fp32_modules is None  # the first fit probes
    state = net.module_.state_dict()
    state._metadata[""][FP32_KEY] = ["hidden"]
    params = str(tmp_path / "auto.pt")
    torch.save(state, params)

    def fail(state):
        raise Boom("disk gone")

    monkeypatch.setattr(net.grad_scaler_, "load_state_dict", fail)
    with pytest.raises(ValueError, match="Everything was rolled back"):
        net.load_params(f_params=params, f_grad_scaler=saved["f_grad_scaler"])
    assert net.amp_layout_.auto_fp32_modules is None and net.amp_layout_.fp32_modules == ()
    monkeypatch.undo()
    quietly(net.partial_fit, *data)
    assert net.amp_layout_.auto_fp32_modules == ()  # its own probe: Tiny never overflows
    # without the failure the saved choice is taken
    other = tiny_net(amp_fp32_modules="auto").initialize()
    other.load_params(f_params=params)
    quietly(other.partial_fit, *data)
    assert other.amp_layout_.auto_fp32_modules == ("hidden",)


# ---- 18.7 export with an integer X_example -----------------------------------------


@pytest.mark.slow
def test_export_with_integer_features_is_refused_clearly(tmp_path, fitted, data):
    """Issue 18: an integer X_example wrote an ONNX file that ONNX Runtime
    could not load (Gemm bound to int64 and float)."""
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


# ---- 18.8 a failed save or export leaves no temporary file -----------------------


def _debris(*folders):
    return [
        os.path.join(folder, name) for folder in folders for name in os.listdir(folder)
        if name.endswith(TEMP_SUFFIX)
    ]


def test_export_onto_a_directory_or_an_empty_path_leaves_nothing(tmp_path, fitted, data, monkeypatch):
    """Issue 18: a failed export onto a directory left a model-sized
    .ampnet-tmp file; export('') left one in the parent of the working
    directory."""
    work = tmp_path / "work"
    (work / "model.pt2").mkdir(parents=True)
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match=r"path must name a file; got 'model.pt2', a directory"):
        fitted.export("model.pt2", data[0][:4], format="torch.export")
    with pytest.raises(ValueError, match=r"path must name a file; got '', which names no file"):
        fitted.export("", data[0][:4], format="torch.export")
    assert _debris(work, tmp_path, work / "model.pt2") == []
    assert sorted(os.listdir(work)) == ["model.pt2"] and os.listdir(work / "model.pt2") == []


def test_a_failed_rename_removes_its_temporary_file(tmp_path, fitted, monkeypatch):
    """The last step of a one-file save (the rename) fails: the temporary
    file goes, and the error names the target."""
    target = tmp_path / "params.pt"
    target.write_bytes(b"old")

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", dst)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError, match=re.escape(f"Could not write {str(target)!r}: Permission denied")):
        fitted.save_params(f_params=str(target))
    monkeypatch.undo()
    assert _debris(tmp_path) == [] and target.read_bytes() == b"old"
    with pytest.raises(IsADirectoryError, match="it is a directory. Nothing was written"):
        fitted.save_params(f_params=str(tmp_path))
    assert _debris(tmp_path, tmp_path.parent) == []


# ---- 18.9 one writer per directory ---------------------------------------------------


def _plant_lock(directory, pid, host=None, age=0.0):
    """A lock file as another writer leaves it."""
    import socket
    import time

    from ampnet.io.lock import LOCK_NAME

    path = os.path.join(directory, LOCK_NAME)
    Path(path).write_text(json.dumps({
        "ampnet_lock_version": 1, "pid": pid, "host": host or socket.gethostname(),
        "token": "f" * 32, "since": time.time() - age,
    }))
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_second_writer_is_refused_and_removes_nothing(tmp_path, fitted):
    """Issue 18: the second writer's orphan cleanup deleted the first one's
    temporary files, and the first then died with FileNotFoundError and the
    advice to free space."""
    from ampnet.exceptions import AmpStateError
    from ampnet.io.lock import DirectoryLockedError

    target = tmp_path / "params.pt"
    target.write_bytes(b"old")
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = _plant_lock(tmp_path, first.pid)
        pending = tmp_path / f".params.pt.0123456789ab{TEMP_SUFFIX}"  # the first writer's
        pending.write_bytes(b"half")
        with pytest.raises(DirectoryLockedError) as info:
            fitted.save_params(f_params=str(target), f_history=str(tmp_path / "history.json"))
        assert isinstance(info.value, OSError) and isinstance(info.value, AmpStateError)
        info.match(re.escape(f"Cannot save into {str(tmp_path)!r}: process {first.pid} on host "))
        info.match(re.escape(f"is saving there (lock file {lock!r})"))
        info.match("one writer per directory")
        assert pending.read_bytes() == b"half" and target.read_bytes() == b"old"
        assert sorted(os.listdir(tmp_path)) == sorted([".ampnet-lock", pending.name, "params.pt"])
        with pytest.raises(DirectoryLockedError):
            fitted.export(str(tmp_path / "m.pt2"), make_data()[0][:4], format="torch.export")
    finally:
        first.kill()
        first.wait()
    # the writer is gone: its lock is stale, and its temporary file an orphan
    fitted.save_params(f_params=str(target))
    assert sorted(os.listdir(tmp_path)) == ["params.pt"]


def test_a_lock_from_another_host_is_taken_over_only_when_old(tmp_path, fitted):
    from ampnet.io.lock import STALE_AFTER_S, DirectoryLockedError

    _plant_lock(tmp_path, 1, host="elsewhere", age=STALE_AFTER_S / 2)
    with pytest.raises(DirectoryLockedError, match="process 1 on host 'elsewhere'"):
        fitted.save_params(f_params=str(tmp_path / "p.pt"))
    _plant_lock(tmp_path, 1, host="elsewhere", age=STALE_AFTER_S + 60)
    fitted.save_params(f_params=str(tmp_path / "p.pt"))
    assert sorted(os.listdir(tmp_path)) == ["p.pt"]


def _save_repeatedly(dirname, seed, rounds, out):  # runs in a child process
    import warnings as w

    w.simplefilter("ignore")
    from ampnet.io.lock import DirectoryLockedError

    torch.manual_seed(seed)
    net = tiny_net().initialize()
    outcomes = []
    for _ in range(rounds):
        try:
            net.save_params(**paths(dirname))
            outcomes.append("saved")
        except DirectoryLockedError:
            outcomes.append("locked")
        except BaseException as exc:  # any other error is a finding
            outcomes.append(f"{type(exc).__name__}: {exc}")
    out.put(outcomes)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks two writers")
def test_two_processes_checkpointing_into_one_directory(tmp_path):
    """Each save either commits or gets DirectoryLockedError; the folder
    ends as one whole checkpoint without temporary files."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    writers = [ctx.Process(target=_save_repeatedly, args=(str(tmp_path), s, 25, out)) for s in (1, 2)]
    for p in writers:
        p.start()
    outcomes = [out.get(timeout=120) for _ in writers]
    for p in writers:
        p.join(timeout=60)
    assert [p.exitcode for p in writers] == [0, 0]
    flat = [o for per in outcomes for o in per]
    assert set(flat) <= {"saved", "locked"}, [o for o in flat if o not in ("saved", "locked")][:3]
    assert len(flat) == 50 and flat.count("saved") >= 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX) or n.startswith(".ampnet")]
    net = tiny_net().initialize()
    net.load_params(**paths(tmp_path))


def test_write_errors_give_advice_for_their_cause(tmp_path, fitted, monkeypatch):
    """A temporary file removed under a writer is not a full disk."""
    from ampnet.io import atomic

    real = atomic._fsync_file

    def vanish(path):
        os.remove(path)
        real(path)

    monkeypatch.setattr(atomic, "_fsync_file", vanish)
    with pytest.raises(FileNotFoundError) as info:
        fitted.save_params(f_params=str(tmp_path / "p.pt"))
    assert "free space" not in str(info.value)
    info.match("check that the directory exists and that no other program removes files in it")


# ---- 18.10 saved 'auto' names, criteria that return no tensor, float64 outputs ----


@pytest.mark.parametrize(
    "choice, problem",
    [
        (["*"], r"\['\*'\] is not a module of Tiny"),
        (["../../etc"], r"\['../../etc'\] is not a module of Tiny"),
        (["hidden", "nothere"], r"\['nothere'\] is not a module of Tiny"),
        (["hidden", "hidden"], "it names a module twice"),
        ("hidden", "expected a list of module names, got str"),
        ([f"m{i}" for i in range(10**5)], r"\['m0', 'm1', .*'m7'\]\[:8\] \(of 100000\) are not modules"),
    ],
)
def test_saved_auto_choice_must_name_the_modules(tmp_path, saved, choice, problem):
    """Issue 18: ['*'], ['../../etc'] and unknown names were taken into
    amp_layout_; a list of 10**5 names was echoed in full in a warning."""
    from ampnet.auto.saved import FP32_KEY

    net = tiny_net(amp_fp32_modules="auto").initialize()
    state = torch.load(saved["f_params"], weights_only=True)
    state._metadata[""][FP32_KEY] = choice
    bad = str(tmp_path / "p.pt")
    torch.save(state, bad)
    info = refused_unchanged(
        net, {"f_params": bad}, re.escape(f"f_params file {bad!r} holds an invalid amp_fp32_modules='auto' choice"),
        problem,
    )
    assert len(str(info.value)) < 1000
    # loaded directly into the module (not through load_params), the choice is
    # not read: the weights load as for any module, and the net keeps probing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.module_.load_state_dict(state)
    assert net.amp_layout_.auto_fp32_modules is None


def test_a_long_different_choice_is_reported_briefly(data, tmp_path):
    from ampnet.auto.saved import FP32_KEY

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
            self.out = torch.nn.Linear(4, 2)

        def forward(self, X):
            return torch.softmax(self.out(self.layers(X)), dim=-1)

    net = tiny_net(Deep, amp_fp32_modules="auto", max_epochs=1)
    quietly(net.fit, *data)
    state = net.module_.state_dict()
    state._metadata[""][FP32_KEY] = [f"layers.{i}" for i in range(30)]
    path = tmp_path / "deep.pt"
    torch.save(state, path)
    with pytest.warns(AmpWarning, match=r"keeping \['layers.0', .*'layers.7'\]\[:8\] \(of 30\) in float32") as record:
        net.load_params(f_params=path)
    assert "layers.8'" not in str(record[0].message)
    assert net.amp_layout_.auto_fp32_modules == ()  # the net keeps its own choice


class TupleLoss(torch.nn.NLLLoss):
    def forward(self, y_pred, y_true):
        loss = super().forward(torch.log(y_pred), y_true)
        return loss, {"nll": loss.detach()}


class FloatLoss(torch.nn.NLLLoss):
    def forward(self, y_pred, y_true):
        return super().forward(torch.log(y_pred), y_true).detach().item()


@pytest.mark.parametrize("criterion, what", [(TupleLoss, "a tuple of 2"), (FloatLoss, "a float")])
@pytest.mark.parametrize("amp", [True, False])
def test_a_criterion_that_returns_no_tensor_gets_a_clear_type_error(data, criterion, what, amp):
    """Issue 18: AttributeError: 'tuple' object has no attribute 'backward'."""
    net = tiny_net(criterion=criterion, **({} if amp else {"amp_enabled": False, "amp_dtype": "auto"}))
    with pytest.raises(TypeError, match=f"The criterion {criterion.__name__} returned {what} ") as info:
        quietly(net.fit, *data)
    info.match("get_loss must return the loss as a floating tensor")
    info.match("Fix: make the criterion's forward return the loss tensor")


class Float64Out(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, X):
        return torch.softmax(self.lin(X).double(), dim=-1)


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_predict_proba_is_float32_with_amp_whatever_the_module_returns(data, precision):
    """Issue 18: a module returning float64 made predict_proba float64 with
    AMP on, although the README says float32."""
    net = tiny_net(Float64Out, precision=precision, max_epochs=1)
    quietly(net.fit, *data)
    proba = net.predict_proba(data[0][:8])
    assert proba.dtype == np.float32
    assert net.forward(data[0][:8]).dtype == torch.float32
    assert np.allclose(proba.sum(1), 1.0, atol=1e-3)
    off = tiny_net(Float64Out, amp_enabled=False, amp_dtype="auto", max_epochs=1)
    quietly(off.fit, *data)
    assert off.predict_proba(data[0][:8]).dtype == np.float64  # AMP off: skorch's behaviour
