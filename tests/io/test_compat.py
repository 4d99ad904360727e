"""Checkpoints written by ampnet 0.1.0 still load (tests/data/checkpoint-0.1.0,
written by its make.py with that version: fp16 on CPU, Adam, StepLR, 2 epochs)."""

import os
import shutil

import numpy as np
import pytest
import torch
from skorch.callbacks import LRScheduler
from torch.optim.lr_scheduler import StepLR

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.checkpoint import Checkpoint, LoadInitState
from conftest import MLP
from repo_paths import DATA

HERE = os.path.join(DATA, "checkpoint-0.1.0")


@pytest.fixture
def old_checkpoint(tmp_path):
    target = tmp_path / "run"
    shutil.copytree(HERE, target)
    return str(target)


def make_net(dirname, **kw):
    cp = Checkpoint(monitor=None, dirname=dirname)
    return AmpNetClassifier(
        MLP, amp_enabled=True, amp_dtype="float16", optimizer=torch.optim.Adam, lr=0.01,
        max_epochs=1, batch_size=16, train_split=None, verbose=0,
        grad_scaler__init_scale=1024.0, grad_scaler__growth_interval=3,
        callbacks=[LoadInitState(cp), LRScheduler(StepLR, step_size=1, gamma=0.5), cp], **kw,
    )


def test_a_0_1_0_checkpoint_resumes(old_checkpoint):
    rng = np.random.RandomState(0)
    X = rng.randn(64, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    saved = torch.load(os.path.join(old_checkpoint, "params.pt"), weights_only=True)
    net = make_net(old_checkpoint).initialize()
    with pytest.warns(AmpWarning, match="LoadInitState restores it when training starts"):
        net.load_params(checkpoint=Checkpoint(monitor=None, dirname=old_checkpoint))
    assert all(torch.equal(net.module_.state_dict()[k], v) for k, v in saved.items())
    assert net.grad_scaler_.get_scale() == 4096.0
    assert len(net.history) == 2
    net = make_net(old_checkpoint)
    net.fit(X, y)  # LoadInitState restores, then one more epoch
    assert len(net.history) == 3
    assert net.optimizer_.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)
    assert np.isfinite(net.history[-1, "train_loss"])
    assert net.history[-1, "loss_scale"] >= 4096.0
