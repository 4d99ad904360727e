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
    kw = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, max_epochs=1, batch_size=16, train_split=None,
              verbose=0, amp_enabled="auto", amp_autotune__min_steps=0, amp_autotune__timer=Timer())
    kw.update(extra)
    return AmpNetClassifier(**kw).fit(*data)


@pytest.fixture
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


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
