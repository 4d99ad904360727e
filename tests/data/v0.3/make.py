"""Writes the ampnet 0.3 fixtures of tests/test_compat_0_3.py, with the 0.3 code.

Run from a checkout of 0.3 (commit c32c79a)::

    git worktree add /tmp/v03 c32c79a
    PYTHONPATH=/tmp/v03 python tests/data/v0.3/make.py tests/data/v0.3

It trains a tiny fp16 net on the CPU with ``ampnet.GradScaler`` for 9 steps
(growth interval 2 and hysteresis 2: the scale grows until float16
overflows, steps 5, 6 and 9 are skipped, and the net is saved with an
overflow streak of 1), then writes

- ``net.pkl``: the pickled fitted net;
- ``params/``: ``save_params`` files (``f_params``, ``f_optimizer``,
  ``f_history``, ``f_grad_scaler``);
- ``checkpoint/``: an ``ampnet.checkpoint.Checkpoint`` folder;
- ``torch_scaler_net.pkl``: the same net trained with ``torch.amp.GradScaler``;
- ``scaler_mid_step.pkl``: a bare ``ampnet.GradScaler`` pickled between
  ``unscale_`` and ``update`` (its overflow streak at 1);
- ``expected.json``: what 0.3 reads from each of them (loss scale, growth
  tracker, overflow streak, a hash of the weights) and what it gets when it
  trains each on for one epoch (the same hash and scaler state afterwards).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import warnings
from typing import Any

import numpy as np
import torch

import ampnet
from ampnet import AmpNetClassifier
from ampnet.checkpoint import Checkpoint

#: The settings every fixture net trains with.
NET_KWARGS: dict[str, Any] = dict(
    amp_enabled=True, amp_dtype="float16", optimizer=torch.optim.SGD, lr=0.05, max_epochs=3,
    batch_size=16, train_split=None, verbose=0, criterion=torch.nn.CrossEntropyLoss,
    grad_scaler__init_scale=2.0**16, grad_scaler__growth_interval=2,
)

#: ampnet.GradScaler's own setting on top (torch.amp.GradScaler has no hysteresis).
AMPNET_SCALER_KWARGS: dict[str, Any] = dict(grad_scaler__hysteresis=2)


def make_module() -> torch.nn.Module:
    """A tiny MLP built from torch classes only, so that a pickle names no test module."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """48 rows (3 batches), 20 features; the first feature's sign is the class."""
    rng = np.random.RandomState(0)
    X = (rng.randn(48, 20) * 4).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


def weights_hash(net: Any) -> str:
    """sha256 over the module's state, in key order, as raw bytes."""
    digest = hashlib.sha256()
    for key, value in net.module_.state_dict().items():
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def scaler_facts(scaler: Any) -> dict[str, Any]:
    """The loss scale, growth tracker and (ampnet's scaler) overflow streak."""
    state = scaler.state_dict()
    return {"scale": state["scale"], "growth_tracker": state["_growth_tracker"],
            "overflow_streak": state.get("_overflow_streak")}


def net_facts(net: Any) -> dict[str, Any]:
    """What a test compares: the weights' hash, the scaler's state, the skips."""
    return {"weights": weights_hash(net), **scaler_facts(net.grad_scaler_),
            "skipped": [bool(b["step_skipped"]) for row in net.history for b in row["batches"]]}


def train_on(net: Any) -> dict[str, Any]:
    """One more epoch (``partial_fit``) from a fixed seed; the facts afterwards."""
    torch.manual_seed(1)
    net.partial_fit(*make_data(), epochs=1)
    return net_facts(net)


#: Overflows of the steps that a bare scaler takes after it was loaded.
SCALER_PATTERN = (True, False, False, False, True, True, False)


def scaler_steps(scaler: Any, param: torch.nn.Parameter, opt: Any, pattern: tuple[bool, ...]) -> list[Any]:
    """Whole scaled SGD steps of ``param`` (``opt``: its optimizer, None for
    a new one), an inf in the loss where ``pattern`` says; after each: the
    scale, the growth tracker, the overflow streak and the parameter."""
    opt = opt if opt is not None else torch.optim.SGD([param], lr=0.1)
    out = []
    for overflow in pattern:
        opt.zero_grad()
        scaler.scale((param * 2.0).sum() * (float("inf") if overflow else 1.0)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        out.append([*scaler_facts(scaler).values(), param.detach().tolist()])
    return out


def loaders(out: str) -> dict[str, Any]:
    """``load_params`` calls for the ``params/`` files and the ``checkpoint/`` folder in ``out``."""
    params = os.path.join(out, "params")
    return {
        "params": lambda net: net.load_params(
            f_params=os.path.join(params, "params.pt"), f_optimizer=os.path.join(params, "optimizer.pt"),
            f_history=os.path.join(params, "history.json"),
            f_grad_scaler=os.path.join(params, "grad_scaler.pt")),
        "checkpoint": lambda net: net.load_params(
            checkpoint=Checkpoint(monitor=None, dirname=os.path.join(out, "checkpoint"))),
    }


def main(out: str) -> None:
    """Write every fixture into ``out`` (see the module docstring)."""
    assert ampnet.__version__ == "0.3.0", ampnet.__version__
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    X, y = make_data()
    expected: dict[str, Any] = {"torch": torch.__version__}

    net = AmpNetClassifier(make_module(), **NET_KWARGS, **AMPNET_SCALER_KWARGS).fit(X, y)
    assert any(b["step_skipped"] for row in net.history for b in row["batches"]), "no skipped step"
    with open(os.path.join(out, "net.pkl"), "wb") as f:
        pickle.dump(net, f)
    params = os.path.join(out, "params")
    os.makedirs(params, exist_ok=True)
    net.save_params(
        f_params=os.path.join(params, "params.pt"), f_optimizer=os.path.join(params, "optimizer.pt"),
        f_history=os.path.join(params, "history.json"), f_grad_scaler=os.path.join(params, "grad_scaler.pt"),
    )
    # the same training again, with a Checkpoint callback that saves at every epoch's end
    cp = Checkpoint(monitor=None, dirname=os.path.join(out, "checkpoint"))
    again = AmpNetClassifier(make_module(), **NET_KWARGS, **AMPNET_SCALER_KWARGS, callbacks=[cp]).fit(X, y)
    assert net_facts(again) == net_facts(net)
    expected["saved"] = net_facts(net)
    expected["trained_on"] = train_on(pickle.loads(pickle.dumps(net)))
    for name, load in loaders(out).items():
        loaded = AmpNetClassifier(make_module(), **NET_KWARGS, **AMPNET_SCALER_KWARGS).initialize()
        load(loaded)
        expected[f"{name}_loaded"] = net_facts(loaded)
        expected[f"{name}_trained_on"] = train_on(loaded)

    theirs = AmpNetClassifier(make_module(), grad_scaler=torch.amp.GradScaler, **NET_KWARGS).fit(X, y)
    with open(os.path.join(out, "torch_scaler_net.pkl"), "wb") as f:
        pickle.dump(theirs, f)
    expected["torch_scaler_saved"] = net_facts(theirs)
    expected["torch_scaler_trained_on"] = train_on(pickle.loads(pickle.dumps(theirs)))

    scaler = ampnet.GradScaler("cpu", init_scale=1024.0, growth_interval=3, hysteresis=2)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler_steps(scaler, param, opt, (False, True))
    opt.zero_grad()
    scaler.scale((param * 2.0).sum() * float("inf")).backward()
    scaler.unscale_(opt)  # the step is still open: pickled between unscale_ and update
    with open(os.path.join(out, "scaler_mid_step.pkl"), "wb") as f:
        pickle.dump(scaler, f)
    expected["scaler_mid_step"] = {**scaler_facts(scaler), "settings": scaler.get_settings()}
    copy = pickle.loads(pickle.dumps(scaler))
    expected["scaler_mid_step_trained_on"] = scaler_steps(copy, param.detach().clone().requires_grad_(), None,
                                                          SCALER_PATTERN)

    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print(json.dumps(expected, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
