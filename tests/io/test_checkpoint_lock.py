"""A Checkpoint holds its folder's lock for the
whole fit, so that a second run sharing the folder is refused before it
trains; a pending journal in a folder that cannot be written refuses the
load with the journal named and the fix (not a raw OSError).
"""

import copy
import errno
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from skorch.callbacks import Callback

import ampnet.io.atomic as atomic
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.exceptions import DirectoryLockedError
from ampnet.io.lock import LOCK_NAME
from checkpoint_helpers import data, quietly, snapshot, tiny_net  # noqa: F401  (fixtures)
from resume_script import differences


def _lock(dirname):
    path = os.path.join(dirname, LOCK_NAME)
    return json.loads(open(path).read()) if os.path.exists(path) else None


def _plant_lock(dirname, pid, host=None, scope="fit", age=0.0):
    os.makedirs(dirname, exist_ok=True)
    path = os.path.join(dirname, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"ampnet_lock_version": 1, "pid": pid, "host": host or socket.gethostname(),
                   "token": "f" * 32, "since": time.time(), "scope": scope}, f)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


class Spy(Callback):
    """Records the lock file at the start of every epoch (between saves)."""

    def __init__(self, dirname):
        self.dirname = dirname

    def initialize(self):
        self.seen_ = []
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.seen_.append(_lock(self.dirname))


@pytest.fixture
def other_process():
    """A live process of this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_lock_is_held_for_the_whole_fit_and_released_at_the_end(tmp_path, data):
    dirname = str(tmp_path / "cp")
    spy, copies = Spy(dirname), PickleCheckpoint()
    net = tiny_net(max_epochs=3, callbacks=[Checkpoint(monitor=None, dirname=dirname), spy, copies])
    quietly(net.fit, *data)
    assert len(spy.seen_) == 3
    for cp in copies.copies_:  # a pickled or copied Checkpoint holds no lock
        assert "fit_lock_" not in cp.__dict__
    for holder in spy.seen_:  # also between the saves of epochs 1 and 2
        assert holder is not None and holder["pid"] == os.getpid() and holder["scope"] == "fit"
    assert _lock(dirname) is None  # released by on_train_end
    assert os.path.exists(os.path.join(dirname, "params.pt"))


def test_a_second_run_sharing_the_folder_is_refused_before_it_trains(tmp_path, data, other_process):
    dirname = str(tmp_path / "cp")
    lock = _plant_lock(dirname, other_process)  # the first run, training in another process
    net = tiny_net(max_epochs=2, callbacks=[Checkpoint(monitor=None, dirname=dirname)])
    with pytest.raises(DirectoryLockedError) as info:
        quietly(net.fit, *data)
    message = str(info.value)
    assert f"process {other_process}" in message and "training with a Checkpoint" in message
    assert repr(lock) in message and "Fix:" in message and "dirname" in message
    assert len(net.history) == 0  # refused at on_train_begin, not after an epoch
    assert sorted(os.listdir(dirname)) == [LOCK_NAME]  # nothing of the second run written
    assert _lock(dirname)["pid"] == other_process


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path, data):
    dirname = str(tmp_path / "cp")
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    _plant_lock(dirname, int(proc.stdout))  # that process is gone
    spy = Spy(dirname)
    net = tiny_net(max_epochs=1, callbacks=[Checkpoint(monitor=None, dirname=dirname), spy])
    quietly(net.fit, *data)
    assert len(net.history) == 1 and _lock(dirname) is None
    assert spy.seen_[0]["pid"] == os.getpid()  # taken over for the fit


def test_a_live_lock_of_another_host_is_refused_and_a_stale_one_taken_over(tmp_path, data):
    dirname = str(tmp_path / "cp")
    _plant_lock(dirname, 1, host="elsewhere.example")
    net = tiny_net(max_epochs=1, callbacks=[Checkpoint(monitor=None, dirname=dirname)])
    with pytest.raises(DirectoryLockedError, match="elsewhere.example"):
        quietly(net.fit, *data)
    assert len(net.history) == 0
    _plant_lock(dirname, 1, host="elsewhere.example", age=3600)
    quietly(net.fit, *data)
    assert _lock(dirname) is None


class Fail(Callback):
    def on_epoch_end(self, net, **kwargs):
        raise RuntimeError("boom")


def test_a_fit_that_raised_leaves_the_folder_to_the_next_fit_of_the_process(tmp_path, data):
    """skorch does not call on_train_end when fit raises: the lock stays
    (this process is alive) and the next fit of this process takes it."""
    dirname = str(tmp_path / "cp")
    net = tiny_net(max_epochs=2, callbacks=[Checkpoint(monitor=None, dirname=dirname), Fail()])
    with pytest.raises(RuntimeError, match="boom"):
        quietly(net.fit, *data)
    assert _lock(dirname)["pid"] == os.getpid()
    again = tiny_net(max_epochs=2, callbacks=[Checkpoint(monitor=None, dirname=dirname)])
    quietly(again.fit, *data)
    assert len(again.history) == 2 and _lock(dirname) is None
    # the same net fits again too (its Checkpoint still held the lock)
    quietly(net.set_params(callbacks__Fail=None).fit, *data)
    assert _lock(dirname) is None


class PickleCheckpoint(Callback):
    def initialize(self):
        self.copies_ = []
        return self

    def on_epoch_end(self, net, **kwargs):
        cp = dict(net.callbacks_)["Checkpoint"]
        self.copies_ += [pickle.loads(pickle.dumps(cp)), copy.deepcopy(cp)]


# ---- a pending journal in a folder that cannot be written ---------------------------


def _pending_save(tmp_path, data):
    """A checkpoint whose second save was committed (journal written) but
    not renamed into place, as a process killed at that point leaves it."""
    dirname = str(tmp_path / "cp")
    cp = Checkpoint(monitor=None, dirname=dirname)
    torch.manual_seed(0)
    net = tiny_net(max_epochs=1, callbacks=[cp])
    quietly(net.fit, *data)
    moves = []
    for name in ("params.pt", "optimizer.pt", "history.json"):
        temp = f".{name}.{'a' * 12}{atomic.TEMP_SUFFIX}"
        shutil.copy(os.path.join(dirname, name), os.path.join(dirname, temp))
        moves.append((os.path.join(dirname, temp), os.path.join(dirname, name)))
    atomic._write_journal(dirname, moves)
    return cp, os.path.join(dirname, atomic.JOURNAL_NAME)


def _read_only(monkeypatch):
    def replace(src, dst):
        raise PermissionError(errno.EROFS, "Read-only file system", dst)

    monkeypatch.setattr(atomic.os, "replace", replace)


@pytest.mark.parametrize("path", ["load_params", "LoadInitState"])
def test_a_pending_journal_in_a_read_only_folder_is_refused_naming_it(tmp_path, data, monkeypatch, path):
    cp, journal = _pending_save(tmp_path, data)
    net = tiny_net(max_epochs=1).initialize()
    before = snapshot(net)
    _read_only(monkeypatch)
    with pytest.raises(ValueError) as info:
        if path == "load_params":
            net.load_params(checkpoint=cp)
        else:
            LoadInitState(cp).initialize().on_train_begin(net)
    message = str(info.value)
    assert repr(journal) in message and "params.pt" in message
    assert "Read-only" in message and "Fix:" in message and "writable" in message
    assert differences(snapshot(net), before) == []
    assert os.path.exists(journal)  # nothing changed in the folder
    monkeypatch.undo()  # writable again: the pending save is completed and loads
    net.load_params(checkpoint=cp)
    assert not os.path.exists(journal) and len(net.history) == 1
