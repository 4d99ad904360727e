"""The cache's folder as a user names it (``~`` is the home folder), and
``python -m ampnet cache``: which folder, its entries, and ``--clear``,
which removes ampnet's entries and nothing else."""

import json
import os

import pytest
import torch

from ampnet import AmpNetClassifier
from ampnet.auto import cache
from ampnet.auto.enabled import label

from conftest import Logits


class Timer:
    """``amp_autotune__timer``: mixed precision twice as fast as float32."""

    def __call__(self, params, seconds):
        return 0.5 if params["amp_enabled"] else 1.0


def fit(data, **extra):
    torch.manual_seed(0)
    kw = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, max_epochs=1, batch_size=8, train_split=None,
              verbose=0, amp_enabled="auto", amp_autotune__min_steps=0, amp_autotune__timer=Timer())
    kw.update(extra)
    return AmpNetClassifier(**kw).fit(*data)


@pytest.fixture
def data(classifier_data):
    return classifier_data  # 16 steps at batch 8: enough for 'auto' to measure


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home folder of the test's own, and a working folder apart from it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "home"


def test_a_tilde_in_ampnet_cache_dir_is_the_home_folder(home, monkeypatch):
    monkeypatch.setenv("AMPNET_CACHE_DIR", "~/ampnet-cache")
    assert cache.cache_dir() == str(home / "ampnet-cache")
    assert cache.cache_dir("~/mine") == str(home / "mine")  # a net's folder before the variable


def test_a_tilde_in_amp_autotune__cache_is_the_home_folder(data, home, native_bf16, tmp_path):
    net = fit(data, amp_autotune__cache="~/mine")
    assert net.amp_autotune_.source == "measured"
    assert len(list((home / "mine").glob("auto-*.json"))) == 1
    assert not (tmp_path / "work" / "~").exists()  # no literal '~' folder where the fit ran
    assert str(home / "mine") in net.amp_autotune_.cache


# ---- python -m ampnet cache -----------------------------------------------------------------


def test_the_record_names_the_entrys_file(data, native_bf16, auto_cache_dir):
    first = fit(data).amp_autotune_
    (path,) = auto_cache_dir.glob("auto-*.json")
    assert first.cache.startswith(f"stored in {path}: ") and "python -m ampnet cache --clear" in first.cache
    second = fit(data).amp_autotune_
    assert second.source == "cache" and second.cache == f"read from {path}"


def test_the_cache_command_shows_the_folder_and_its_entries(data, native_bf16, auto_cache_dir, capsys):
    from ampnet.__main__ import main

    assert main(["cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"ampnet cache folder: {auto_cache_dir} (AMPNET_CACHE_DIR)",
                   "No entries: the next fit of an amp_enabled='auto' net measures."]
    fit(data)
    (path,) = auto_cache_dir.glob("auto-*.json")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "1 entry, oldest first:"
    assert out[2].startswith(f"  {path.name}  {label(json.loads(path.read_text())['params'])}, 500.00 ms a step, ")
    assert out[3] == "Remove them with: python -m ampnet cache --clear (the next fits measure again)."


def test_clear_removes_only_ampnets_entries(data, native_bf16, tmp_path, capsys):
    from ampnet.__main__ import main

    folder = tmp_path / "mine"
    fit(data, amp_autotune__cache=folder)
    fit(data, amp_autotune__cache=folder, batch_size=4)
    ours = sorted(folder.glob("auto-*.json"))
    assert len(ours) == 2
    # the user's files: another name, and ampnet's name pattern with other content
    (folder / "notes.txt").write_text("mine")
    (folder / "auto-report-1.json").write_text("{}")
    impostor = folder / ("auto-" + "0" * 40 + ".json")
    impostor.write_text('{"results": [1, 2]}')
    assert main(["cache", "--clear", "--folder", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"ampnet cache folder: {folder} (the folder given with --folder)",
                   "Removed 2 entries; 3 other files (not ampnet's) kept."]
    assert sorted(p.name for p in folder.iterdir()) == sorted(["notes.txt", "auto-report-1.json", impostor.name])
    net = fit(data, amp_autotune__cache=folder)  # cleared: the next fit measures again
    assert net.amp_autotune_.source == "measured"


def test_clear_says_what_it_could_not_remove(tmp_path, monkeypatch, capsys):
    from ampnet.auto import cache_command

    key = {"machine": {}, "model": "m"}
    assert cache.write_entry(key, {"amp_enabled": True}, 0.1, str(tmp_path)) is None

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache_command.os, "remove", refuse)
    assert cache_command.main(["--clear", "--folder", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "Removed 0 entries."
    assert out[2] == f"Could not remove {cache.entry_path(key, str(tmp_path))}: Permission denied"


def test_the_cache_command_without_a_folder_lists_nothing(tmp_path, capsys):
    from ampnet.auto import cache_command

    assert cache_command.entries(str(tmp_path / "none")) == ([], [])
    assert cache_command.main(["--folder", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "No entries: the next fit of an amp_enabled='auto' net measures."
