"""``python -m ampnet``: train on scikit-learn's digits in float32 and with
mixed precision, and print what each run did."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from ampnet import AmpNetClassifier
from ampnet.exceptions import AmpWarning


class DigitsMLP(torch.nn.Module):
    """A small MLP for the 8x8 digits (64 features, 10 classes)."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )

    def forward(self, X):
        return self.net(X)


def _runs() -> list[tuple[str, dict]]:
    return [
        ("float32 (AMP off)", {"amp_enabled": False}),
        ("AMP, amp_dtype='auto'", {"amp_enabled": True, "amp_dtype": "auto"}),
        ("AMP, float16 + loss scaling", {"amp_enabled": True, "amp_dtype": "float16"}),
    ]


def _train(label: str, amp: dict, args: argparse.Namespace, data: tuple) -> tuple[str, ...]:
    """Fit one net and return its table row."""
    X_train, X_test, y_train, y_test = data
    torch.manual_seed(args.seed)
    net = AmpNetClassifier(
        DigitsMLP,
        criterion=torch.nn.CrossEntropyLoss,
        optimizer=torch.optim.Adam,
        lr=1e-3,
        max_epochs=args.epochs,
        batch_size=64,
        train_split=None,
        iterator_train__shuffle=True,
        device=args.device,
        verbose=0,
        **amp,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AmpWarning)
        net.fit(X_train, y_train)
    accuracy = float((net.predict(X_test) == y_test).mean())
    history = net.history
    # the loss scale means something only where a loss scaler runs (float16)
    scaling = net.grad_scaler_.is_enabled()
    skipped = sum(history[:, "skipped_steps"]) if "skipped_steps" in history[-1] else 0
    return (
        label,
        net.precision_policy_.name,
        f"{accuracy:.3f}",
        f"{statistics.median(history[:, 'dur']) * 1000:.1f}",
        f"{history[-1, 'loss_scale']:g}" if scaling else "-",
        str(skipped),
        "; ".join(sorted({str(w.message).split(";")[0] for w in caught})),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampnet", description=__doc__)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    data = train_test_split(
        X, y.astype(np.int64), test_size=0.25, random_state=args.seed, stratify=y
    )
    print(f"ampnet demo: scikit-learn digits, {len(data[0])} train / {len(data[1])} test rows, "
          f"{args.epochs} epochs, device={args.device}, torch {torch.__version__}\n", flush=True)

    rows = []
    runs = _runs()
    for i, (label, amp) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {label}: training ...", end=" ", flush=True)
        started = time.perf_counter()
        try:
            row = _train(label, amp, args, data)
        except ValueError as exc:  # a bad setting, e.g. a device this machine lacks
            print("failed", flush=True)
            print(f"python -m ampnet: error: {exc}", file=sys.stderr)
            return 2
        rows.append(row)
        print(f"done in {time.perf_counter() - started:.1f} s (test accuracy {row[2]})", flush=True)

    header = ("run", "precision used", "test acc", "median epoch ms", "loss scale", "skipped", "notes")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\nloss scale: '-' where no loss scaling runs (float32, bfloat16). float16 on a CPU is "
          "emulated and slow; it is shown to exercise loss scaling. Run "
          "`python -m ampnet.benchmark` for speed measurements.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
