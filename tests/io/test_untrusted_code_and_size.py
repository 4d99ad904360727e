"""No file runs code and no file is read without end: pickles that run code when unpickled are
refused by every safe read (``weights_only=False`` is the user's own risk, as the README warns, and
``f_pickle`` is never read by a load); special files (FIFOs, devices, directories), files larger than
their kind's limit and compressed torch files are refused without hanging or reading them whole."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    tiny_net,
    data,
    fitted,
    saved,
    refused_unchanged,
    pristine_checkpoint,
    _checkpoint_folder,
)
from repo_paths import ROOT
from resume_script import differences


# ---- the trust model of the README: no code runs -------------------------------------------------


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


@pytest.mark.parametrize("key", ["f_grad_scaler", "f_rng_state"])
def test_scaler_and_rng_files_are_always_read_safely(tmp_path, key):
    """Even with torch_load_kwargs={'weights_only': False}."""
    marker = tmp_path / "code-ran"
    bad = str(tmp_path / "evil.pt")
    torch.save({"scale": _RunsCode(marker)}, bad)
    net = tiny_net(torch_load_kwargs={"weights_only": False}).initialize()
    refused_unchanged(net, {key: bad}, "which a safe load refuses")
    assert not marker.exists()


# ---- special files never hang the loader or exhaust memory ---------------------------------------


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
    root = str(ROOT)
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
    """history.json and lr_schedulers.json linked to
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
