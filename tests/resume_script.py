"""The tiny float16 training run of tests/test_resume.py.

Imported by the tests (uninterrupted and clean-stop runs in the test
process) and run as a script in fresh processes (resume, and the run that
is killed mid-epoch)::

    python resume_script.py CHECKPOINT_DIR OUT_DIR --stop-after 6 [--hang-epoch 4]
    python resume_script.py CHECKPOINT_DIR OUT_DIR --resume total

With ``--resume total`` the script is what the README shows: ``max_epochs``
is the length of the run and ``LoadInitState(cp, resume="total")`` makes a
rerun finish it; the environment variable ``RESUME_SCRIPT_HANG_EPOCH`` makes
a run hang (to be killed) so that the killed run and its rerun are the same
command.
"""

import argparse
import os
import random
import sys
import time

import numpy as np
import torch

torch.set_num_threads(1)

from skorch.callbacks import Callback, LRScheduler  # noqa: E402

from ampnet import AmpNetClassifier  # noqa: E402
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState  # noqa: E402

N_EPOCHS = 6
KILL_MARKER = "HANGING-NOW"


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


def make_data():
    rng = np.random.RandomState(0)
    X = rng.randn(64, 4).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(np.int64)
    return X, y


class StopAfter(Callback):
    """Stop cleanly once the history has ``epochs`` epochs (as EarlyStopping does)."""

    def __init__(self, epochs):
        self.epochs = epochs

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) >= self.epochs:
            raise KeyboardInterrupt


class HangAt(Callback):
    """In epoch ``epoch``, after training batch 2, tell the parent and wait
    to be killed (None: never)."""

    def __init__(self, epoch=None):
        self.epoch = epoch

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == self.epoch and len(net.history[-1]["batches"]) == 2:
            print(KILL_MARKER, flush=True)
            time.sleep(60)


def differences(a, b, path="state"):
    """Where ``a`` and ``b`` differ: tensors bitwise (and dtype), the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and torch.equal(a, b)
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def make_net(dirname, stop_after=N_EPOCHS, hang_epoch=None, resume=None, **checkpoint_kwargs):
    """fp16 with GradScaler('cpu') and a large init_scale (so that steps
    overflow and are skipped), Adam, StepLR, shuffling, a validation split.

    ``resume=None``: max_epochs=100 and a callback that stops the run once
    the history holds ``stop_after`` epochs; ``'more'`` or ``'total'``:
    max_epochs=N_EPOCHS and ``LoadInitState(cp, resume=resume)``, no stop.
    """
    cp = Checkpoint(monitor=None, dirname=dirname, **checkpoint_kwargs)
    if resume is not None:
        return AmpNetClassifier(
            Tiny, amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=2.0**24,
            grad_scaler__growth_interval=3, optimizer=torch.optim.Adam, lr=0.05, batch_size=16,
            max_epochs=N_EPOCHS, iterator_train__shuffle=True, verbose=0,
            callbacks=[
                LoadInitState(cp, resume=resume),
                LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
                cp,
                HangAt(hang_epoch),
            ],
        )
    return AmpNetClassifier(
        Tiny,
        amp_enabled=True,
        amp_dtype="float16",
        grad_scaler__init_scale=2.0**24,
        grad_scaler__growth_interval=3,
        optimizer=torch.optim.Adam,
        lr=0.05,
        batch_size=16,
        max_epochs=100,
        iterator_train__shuffle=True,
        verbose=0,
        callbacks=[
            LoadInitState(cp),
            LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
            cp,  # after the scheduler: it saves the state at the very end of the epoch
            StopAfter(stop_after),
            HangAt(hang_epoch),
        ],
    )


def run(dirname, out=None, stop_after=N_EPOCHS, hang_epoch=None, resume=None, **checkpoint_kwargs):
    """Seed, build, fit (resuming from ``dirname`` if it holds a
    checkpoint) and save the final state to ``out``."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    net = make_net(dirname, stop_after, hang_epoch, resume, **checkpoint_kwargs)
    net.fit(*make_data())
    if out is not None:
        os.makedirs(out, exist_ok=True)
        net.save_params(
            f_params=os.path.join(out, "params.pt"),
            f_optimizer=os.path.join(out, "optimizer.pt"),
            f_grad_scaler=os.path.join(out, "grad_scaler.pt"),
            f_history=os.path.join(out, "history.json"),
        )
    return net


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("dirname")
    parser.add_argument("out")
    parser.add_argument("--stop-after", type=int, default=N_EPOCHS)
    parser.add_argument("--hang-epoch", type=int, default=None)
    parser.add_argument("--resume", choices=["more", "total"], default=None)
    args = parser.parse_args(argv)
    hang = args.hang_epoch
    if hang is None and os.environ.get("RESUME_SCRIPT_HANG_EPOCH"):
        hang = int(os.environ["RESUME_SCRIPT_HANG_EPOCH"])
    net = run(args.dirname, args.out, args.stop_after, hang, args.resume)
    print(f"EPOCHS {len(net.history)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
