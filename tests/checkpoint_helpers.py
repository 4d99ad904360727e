"""A tiny float16 net, the files it saves and the check that a refused load leaves it unchanged:
shared by the tests of every file a load reads (``tests/io/test_untrusted_*.py``, ``test_io_*.py``,
``test_file_reads.py``, ``test_checkpoint_lock.py``). The fixtures are imported by name into the test
modules that use them."""

import copy
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from skorch.callbacks import LRScheduler

from ampnet import AmpNetClassifier
from ampnet.callbacks.checkpoint import Checkpoint
from ampnet.exceptions import AmpWarning
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
