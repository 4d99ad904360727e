"""``python -m ampnet``: train on scikit-learn's digits in float32, with
mixed precision, and with ``amp_enabled='auto'`` (which measures which of
them pays off on this machine), and print what each run did.
``python -m ampnet cache`` shows where ``amp_enabled='auto'`` stores its
choices, and ``python -m ampnet cache --clear`` removes them.

Each run's "done in" time is that of its ``fit`` (``amp_enabled='auto'``'s
measuring steps included), measured after an untimed warm-up; the table's "median
epoch ms" is the median of the runs' epoch times."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from ampnet import AmpNetClassifier
from ampnet.auto import duration
from ampnet.exceptions import AmpWarning
from ampnet.config.params import is_auto
from ampnet.precision import cpu_has_native_bf16


class DigitsMLP(torch.nn.Module):
    """A wide MLP for the 8x8 digits (64 features, 10 classes): wide enough
    for its matrix products to dominate a step, where AMP can pay off."""

    def __init__(self, hidden: int = 512):
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
        ("AMP on, amp_dtype='auto'", {"amp_enabled": True, "amp_dtype": "auto"}),
        # measures in its fit's first steps, or starts with the choice an earlier run stored
        ("amp_enabled='auto'", {"amp_enabled": "auto"}),
    ]


#: Rows of the untimed warm-up fits (see :func:`_warm_up`).
WARM_UP_ROWS = 256


def _net(amp: dict, args: argparse.Namespace, epochs: int) -> AmpNetClassifier:
    torch.manual_seed(args.seed)
    return AmpNetClassifier(
        DigitsMLP,
        module__hidden=args.hidden,
        criterion=torch.nn.CrossEntropyLoss,
        optimizer=torch.optim.Adam,
        lr=1e-3,
        max_epochs=epochs,
        batch_size=128,
        train_split=None,
        iterator_train__shuffle=True,
        device=args.device,
        verbose=0,
        **amp,
    )


def _warm_up(args: argparse.Namespace, data: tuple) -> float:
    """Fit a float32 and an AMP net for one epoch on a few rows, untimed,
    and return how long that took.

    The first fit of a process pays one-time costs (torch's lazy
    initialization, the allocator's first pages, oneDNN's kernels for each
    dtype): timed, they made the first run look slow (float32 "1.0 s"
    against AMP's "0.1 s", for 2x less work). Without a warm-up the demo
    compared them, not the precisions."""
    X_train, _, y_train, _ = data
    started = time.perf_counter()
    for _, amp in _runs():
        if is_auto(amp.get("amp_enabled")):
            continue  # float32 and the AMP dtype are what auto's probe runs too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AmpWarning)
            _net(amp, args, epochs=1).fit(X_train[:WARM_UP_ROWS], y_train[:WARM_UP_ROWS])
    return time.perf_counter() - started


def _train(label: str, amp: dict, args: argparse.Namespace, data: tuple) -> tuple[tuple[str, ...], Any, float]:
    """Fit one net; return its table row, the net and the seconds its
    ``fit`` took (``amp_enabled='auto'``'s measuring steps included)."""
    X_train, X_test, y_train, y_test = data
    net = _net(amp, args, epochs=args.epochs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AmpWarning)
        started = time.perf_counter()
        net.fit(X_train, y_train)
        fit_s = time.perf_counter() - started
    accuracy = float((net.predict(X_test) == y_test).mean())
    history = net.history
    skipped = sum(history[:, "skipped_steps"]) if "skipped_steps" in history[-1] else 0
    notes = sorted({str(w.message).split(";")[0].split(":")[0] for w in caught})
    tuned = getattr(net, "amp_autotune_", None)
    if tuned is not None:
        notes.insert(0, {"measured": f"measured: its measuring steps cost {duration(tuned.cost_s)}",
                         "cache": "the choice an earlier run stored", "device": "decided without measuring"}
                     .get(tuned.source, f"the choice {tuned.source}"))
    return (
        label,
        net.precision_policy_.name,
        f"{accuracy:.3f}",
        f"{statistics.median(history[:, 'dur']) * 1000:.1f}",
        str(skipped),
        "; ".join(notes),
    ), net, fit_s


def _device(value: str) -> str:
    """``--device``: a torch device string (argparse reports the error)."""
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a torch device; use cpu, cuda, cuda:<index> or mps") from None
    return value


def _positive(value: str) -> int:
    """``--epochs`` and ``--hidden``: an int >= 1 (argparse reports the error)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not >= 1") from None
    return number


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cache"]:  # python -m ampnet cache [--clear]: amp_enabled='auto''s stored choices
        from ampnet.auto import manage_cache

        return manage_cache(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m ampnet", description=__doc__.replace("``", "`"))  # reST markup reads as Markdown here
    parser.add_argument("--epochs", type=_positive, default=6, help="training epochs of each run (default: 6)")
    parser.add_argument("--hidden", type=_positive, default=512,
                        help="width of the hidden layers (wider: more room for AMP to pay off)")
    parser.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda where available, else cpu)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the train/test split and of the weights (default: 0)")
    args = parser.parse_args(argv)

    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    data = train_test_split(
        X, y.astype(np.int64), test_size=0.25, random_state=args.seed, stratify=y
    )
    print(f"ampnet demo: scikit-learn digits, {len(data[0])} train / {len(data[1])} test rows, "
          f"{args.epochs} epochs, device={args.device}, torch {torch.__version__}\n", flush=True)

    rows, nets = [], []
    runs = _runs()
    print("warming up (one epoch on a few rows per precision, untimed: a process's first fit pays "
          "one-time costs) ...", end=" ", flush=True)
    try:
        print(f"done in {_warm_up(args, data):.1f} s", flush=True)
        for i, (label, amp) in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {label}: training ...", end=" ", flush=True)
            row, net, fit_s = _train(label, amp, args, data)
            rows.append(row)
            nets.append(net)
            epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
            tuned = getattr(net, "amp_autotune_", None)
            probe = f", its {tuned.cost_s:.2f} s of measuring steps included" if tuned is not None else ""
            print(f"done in {fit_s:.2f} s (the fit: {epochs}{probe}; test accuracy {row[2]})", flush=True)
    except ValueError as exc:  # a bad setting, e.g. a device this machine lacks
        print("failed", flush=True)
        print(f"python -m ampnet: error: {exc}", file=sys.stderr)
        return 2

    header = ("run", "precision used", "test acc", "median epoch ms", "skipped", "notes")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    note = _timing_note(rows)
    if note:
        print(note)
    print()
    print(nets[-1].amp_autotune_)
    print()
    print(_verdict(nets[-1], args.device, rows))
    print("Pin the choice with AmpNetClassifier(..., **net.amp_autotune_.params). Run "
          "`python -m ampnet.benchmark` for careful speed measurements.")
    return 0


def _timing_note(rows: list[tuple[str, ...]], spread: float = 1.5) -> str | None:
    """A warning where two runs that trained in the same precision differ in
    median epoch time by more than ``spread`` times: single runs on a busy
    machine, not a difference between the settings."""
    by_precision: dict[str, list[tuple[str, float]]] = {}
    for row in rows:
        by_precision.setdefault(row[1], []).append((row[0], float(row[3])))
    for precision, runs in by_precision.items():
        fast, slow = min(runs, key=lambda r: r[1]), max(runs, key=lambda r: r[1])
        if len(runs) > 1 and slow[1] > spread * fast[1]:
            return (f"Note: '{fast[0]}' and '{slow[0]}' both trained in {precision}, yet took {fast[1]:.1f} and "
                    f"{slow[1]:.1f} ms per epoch: single runs on a busy machine swing that much, so these times "
                    "do not compare the settings. `OMP_NUM_THREADS=1 python -m ampnet` steadies them; "
                    "`python -m ampnet.benchmark` measures carefully.")
    return None


def _verdict(net: Any, device: str, rows: list[tuple[str, ...]]) -> str:
    """Whether AMP pays off here, from the figures the table shows (the
    median epoch times of the float32 and the AMP run, ``rows[0]`` and
    ``rows[1]``), then what ``amp_enabled='auto'`` (``net``) did, in its own
    figures, saying where the two disagree."""
    result = net.amp_autotune_
    fp32_ms, amp_ms, amp_name = float(rows[0][3]), float(rows[1][3]), rows[1][1]
    ratio = amp_ms / fp32_ms if fp32_ms > 0 else float("inf")
    pays = ratio < 1
    lines = [f"In this run, AMP {'pays off' if pays else 'does not pay off'}: {amp_name} took {ratio:.2f}x "
             f"float32's median epoch time ({amp_ms:.1f} ms against {fp32_ms:.1f} ms, the table's figures)."]
    if torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        lines.append("This CPU has no native bfloat16 (AVX512-BF16 or AMX): bfloat16 is emulated, so AMP cannot "
                     "pay off here; on a CPU with it, or a recent GPU, it can.")
    chose_mixed = bool(result.params.get("amp_enabled"))
    times = [row.get("step_s") for row in result.table]
    if result.source == "measured" and len(times) >= 2 and all(times):
        # the ratio that decided (the median of the per-pair ratios, as the record's note says), else the
        # ratio of the candidates' median steps
        decided = re.search(r"mixed took ([0-9.]+)x float32's step time", result.note or "")
        ratio = decided.group(1) if decided else f"{times[1] / times[0]:.2f}"
        auto = (f"amp_enabled='auto' measured {ratio}x float32's step time in its fit's first "
                f"steps and trains in {result.chosen}")
    elif result.source in ("cache", "checkpoint", "loaded"):
        auto = (f"amp_enabled='auto' trains in {result.chosen}, a choice made by an earlier fit of this model on "
                f"this machine; it measured nothing (to measure again: `python -m ampnet cache --clear`)")
    else:
        auto = f"amp_enabled='auto' trains in {result.chosen} without measuring: {result.note}"
    if chose_mixed != pays:
        auto += (", which this table's epochs do not bear out: a fit's first steps and single runs on a busy "
                 "machine can differ (`python -m ampnet.benchmark` measures carefully)")
    lines.append(auto + ".")
    if result.check:
        lines.append("Its epoch check found the chosen setting slower than measured: the stored choice was "
                     "dropped, and the next fit measures again.")
    return " ".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
