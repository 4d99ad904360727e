"""Writes the ampnet 0.4 fixtures of tests/precision/test_kinds.py, with the 0.4 code.

Run with a copy of 0.4.0 (commit 5fcfbc5) first on the path::

    mkdir /tmp/v04 && git archive 5fcfbc5 ampnet | tar -x -C /tmp/v04
    PYTHONPATH=/tmp/v04 python tests/data/v0.4/make.py tests/data/v0.4

In 0.4 one class, ``ampnet.precision.component.Precision``, served every
precision (auto's ``float32_step`` flag was set on it during a trial step). For each
of four precisions (float32, bfloat16 mixed, bfloat16 pure with float32
masters, bfloat16 pure compensated) it trains a tiny net on the CPU for one
epoch and writes

- ``<name>.pkl``: the pickled fitted net;
- ``expected.json``: per net, its ``predict_proba`` on the data as 0.4 computed it.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import warnings
from typing import Any

import numpy as np
import torch

from ampnet import AmpNetClassifier

#: The precision settings of each fixture net, by name.
NETS: dict[str, dict[str, Any]] = {
    "float32": dict(amp_enabled=False),
    "mixed": dict(amp_enabled=True, amp_dtype="bfloat16"),
    "pure": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure"),
    "compensated": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
                        amp_master_weights="compensated"),
}

#: The settings every fixture net trains with.
NET_KWARGS: dict[str, Any] = dict(criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.SGD, lr=0.05,
                                  max_epochs=1, batch_size=16, train_split=None, verbose=0)


def make_module() -> torch.nn.Module:
    """A tiny MLP built from torch classes only, so that a pickle names no test module."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """48 rows (3 batches), 20 features; the first feature's sign is the class."""
    rng = np.random.RandomState(0)
    X = rng.randn(48, 20).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64)


def main(folder: str) -> None:
    X, y = make_data()
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, kwargs in NETS.items():
            net = AmpNetClassifier(make_module(), **NET_KWARGS, **kwargs).fit(X, y)
            with open(os.path.join(folder, f"{name}.pkl"), "wb") as f:
                pickle.dump(net, f)
            expected[name] = net.predict_proba(X).tolist()
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main(sys.argv[1])
