"""No file of a folder is renamed by a process that does not hold its lock:
a load (``load_params``, ``LoadInitState``, and the read-ahead of
``amp_enabled='auto'`` through ``checkpoint_files``/``read_params_file``)
completes a pending journal only under the folder's lock, and leaves a
journal alone while another writer holds it."""

import json
import os
import subprocess
import sys

import pytest

import ampnet.io.atomic as atomic
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.exceptions import DirectoryLockedError
from ampnet.io.layout import checkpoint_files
from ampnet.io.lock import LOCK_NAME
from checkpoint_helpers import data, quietly, snapshot, tiny_net  # noqa: F401  (fixtures)
from resume_script import differences
from test_checkpoint_lock import _pending_save, _plant_lock


@pytest.fixture
def other_process():
    """A live process of this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _listing(dirname):
    return {n: open(os.path.join(dirname, n), "rb").read() for n in sorted(os.listdir(dirname))}


@pytest.mark.parametrize("reader", ["load_params", "LoadInitState", "checkpoint_files"])
def test_a_load_renames_nothing_while_another_writer_holds_the_lock(
        tmp_path, data, monkeypatch, other_process, reader):
    """A writer of another process is committing (its journal is there and it
    holds the lock): the load waits, then refuses, and renames nothing."""
    cp, journal = _pending_save(tmp_path, data)
    dirname = os.path.dirname(journal)
    _plant_lock(dirname, other_process, scope="save")
    monkeypatch.setattr(atomic, "RECOVER_WAIT_S", 0.2)
    before_files = _listing(dirname)
    net = tiny_net(max_epochs=1).initialize()
    before = snapshot(net)
    with pytest.raises(DirectoryLockedError) as info:
        if reader == "load_params":
            net.load_params(checkpoint=cp)
        elif reader == "LoadInitState":
            LoadInitState(cp).initialize().on_train_begin(net)
        else:
            checkpoint_files(cp, net)
    message = str(info.value)
    assert f"Cannot load from {dirname!r}" in message and repr(journal) in message
    assert f"process {other_process}" in message and "load again once that save is done" in message
    assert _listing(dirname) == before_files  # nothing renamed, the journal still there
    assert differences(snapshot(net), before) == []


def test_a_load_completes_a_pending_save_holding_the_lock(tmp_path, data, monkeypatch):
    """Each rename of a recovery happens while this process holds the lock."""
    cp, journal = _pending_save(tmp_path, data)
    dirname = os.path.dirname(journal)
    holders = []
    replace = os.replace

    def spy(src, dst):
        path = os.path.join(dirname, LOCK_NAME)
        holders.append(json.loads(open(path).read())["pid"] if os.path.exists(path) else None)
        return replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", spy)
    net = tiny_net(max_epochs=1).initialize()
    net.load_params(checkpoint=cp)
    assert holders == [os.getpid()] * 3
    assert not os.path.exists(journal) and not os.path.exists(os.path.join(dirname, LOCK_NAME))
    assert len(net.history) == 1


def test_a_resume_under_the_fit_s_own_lock_completes_the_pending_save(tmp_path, data):
    """The Checkpoint of the resuming fit holds the folder's lock: its
    LoadInitState borrows it to complete the journal."""
    cp, journal = _pending_save(tmp_path, data)
    net = tiny_net(max_epochs=2, callbacks=[Checkpoint(monitor=None, dirname=cp.dirname),
                                             LoadInitState(cp)])
    quietly(net.fit, *data)
    assert not os.path.exists(journal) and len(net.history) == 3  # the loaded epoch, then two more
