"""A lock file (``.ampnet-lock``) is untrusted like every file of a folder:
out-of-range fields make the lock stale or held, as documented in
ampnet.io.lock, never a crash of ``fit`` or of a save."""

import json
import os
import socket
import time

import pytest

from ampnet.callbacks.checkpoint import Checkpoint
from ampnet.exceptions import DirectoryLockedError
from ampnet.io.lock import LOCK_NAME, DirectoryLock
from checkpoint_helpers import data, quietly, tiny_net  # noqa: F401  (fixtures)


def plant(dirname, text):
    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, LOCK_NAME), "w") as f:
        f.write(text)


def lock_text(pid=1, host=None, since=None, scope="fit"):
    since = time.time() if since is None else since
    return (
        '{"ampnet_lock_version": 1, "pid": %s, "host": %s, "token": "%s", "since": %s, "scope": "%s"}'
        % (pid, json.dumps(host or socket.gethostname()), "f" * 32, since, scope)
    )


@pytest.mark.parametrize("pid", [str(2**70), str(2**31)])
def test_a_lock_of_this_host_naming_no_possible_process_is_stale(tmp_path, data, pid):
    """The probe of item 4: pid=2**70 made fit raise OverflowError."""
    dirname = str(tmp_path / "cp")
    plant(dirname, lock_text(pid=pid))
    net = tiny_net(max_epochs=1, callbacks=[Checkpoint(monitor=None, dirname=dirname)])
    quietly(net.fit, *data)
    assert len(net.history) == 1
    assert not os.path.exists(os.path.join(dirname, LOCK_NAME))  # taken over, then released


@pytest.mark.parametrize("since", ["NaN", "Infinity", "-Infinity", "1e300", "-1e300", str(10**400)])
def test_a_held_lock_with_any_since_gives_the_locked_error(tmp_path, data, since):
    """since=NaN raised ValueError, since=1e300 OverflowError from the time module."""
    dirname = str(tmp_path / "cp")
    plant(dirname, lock_text(host="elsewhere.example", since=since))  # fresh: held
    net = tiny_net(max_epochs=1, callbacks=[Checkpoint(monitor=None, dirname=dirname)])
    with pytest.raises(DirectoryLockedError) as info:
        quietly(net.fit, *data)
    message = str(info.value)
    assert "process 1 on host 'elsewhere.example' is training" in message and "since" not in message
    assert len(net.history) == 0


def test_a_held_lock_with_a_huge_pid_of_another_host_gives_the_locked_error(tmp_path):
    dirname = str(tmp_path / "cp")
    plant(dirname, lock_text(pid=2**70, host="elsewhere.example", scope="save"))
    with pytest.raises(DirectoryLockedError, match=f"process {2**70} on host 'elsewhere.example'"):
        DirectoryLock(dirname).acquire()


def test_a_valid_since_is_shown(tmp_path):
    dirname = str(tmp_path / "cp")
    plant(dirname, lock_text(host="elsewhere.example", since=time.time()))
    with pytest.raises(DirectoryLockedError, match=r"since \d\d:\d\d:\d\d"):
        DirectoryLock(dirname).acquire()
