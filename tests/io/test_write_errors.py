"""Write errors: a full disk during a checkpoint or a real write error names the file and keeps the
previous checkpoint, the error says what to do for its cause, and a failed save or export leaves no
temporary file behind."""

import copy
import errno
import multiprocessing
import os
import re
import signal
from pathlib import Path

import pytest
import torch

import ampnet.io.writers
from ampnet.io.atomic import TEMP_SUFFIX
from ampnet.callbacks.checkpoint import Checkpoint
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    tiny_net,
    data,
    fitted,
)
from resume_script import differences


# ---- full disks and write errors name the file ---------------------------------------------------


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

    monkeypatch.setattr(ampnet.io.writers, "open", full_open, raising=False)
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


# ---- a failed save or export leaves no temporary file --------------------------------------------


def _debris(*folders):
    return [
        os.path.join(folder, name) for folder in folders for name in os.listdir(folder)
        if name.endswith(TEMP_SUFFIX)
    ]


def test_export_onto_a_directory_or_an_empty_path_leaves_nothing(tmp_path, fitted, data, monkeypatch):
    """A failed export onto a directory, or export(''), leaves no .ampnet-tmp file (one the size
    of the model was left behind, in the parent of the working directory for export(''))."""
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
