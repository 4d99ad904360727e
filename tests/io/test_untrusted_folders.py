"""Where a load and a save may go: a checkpoint folder's files are untrusted. A journal names only
files inside its folder, a planted link never redirects a load or a save out of the folder (links inside
it are followed), two spellings of one file are one file, and one writer at a time holds a folder."""

import copy
import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ampnet.io.state_files
from ampnet.io.atomic import JOURNAL_NAME, TEMP_SUFFIX, recover
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    tiny_net,
    quietly,
    snapshot,
    paths,
    data,
    fitted,
    saved,
    refused_unchanged,
    _step_lr,
    _scheduler_net,
    pristine_checkpoint,
    _checkpoint_folder,
)
from resume_script import differences, make_data


# ---- journals stay inside their directory --------------------------------------------------------


def test_a_planted_journal_touches_nothing_outside_its_folder(tmp_path, fitted):
    """A downloaded folder with a journal that moves a file onto ../dot_bashrc and deletes
    ../victim.txt: the load refuses it and both files outside are left as they were."""
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


# ---- save_params compares real paths -------------------------------------------------------------


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
    """A save replaces a symbolic link by its file, so a link to
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


# ---- planted links never redirect a load or a save out of the folder -----------------------------


def test_a_planted_history_link_redirects_neither_load_nor_save(
    tmp_path, pristine_checkpoint, data
):
    """history.json links to ../outside.txt (valid
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


# ---- one writer per directory --------------------------------------------------------------------


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
    """A second writer of a folder is refused before it removes anything: its orphan cleanup
    once deleted the first writer's temporary files, which then died with FileNotFoundError and
    the advice to free space."""
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
