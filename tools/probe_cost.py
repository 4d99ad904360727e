"""What the probe of ``amp_enabled='auto'`` costs on the benchmark MLP
(1024-2048-2048-10, AdamW, batch 256, 8192 rows): its extra wall time and
extra peak memory over a net pinned to the same choice (issue 27, item 4:
targets 0.35 s and 1.5x the net's own model + optimizer state).

Each run is a fresh interpreter (``python tools/probe_cost.py --worker
...``) that primes torch on a miniature fit, then fits one epoch either with
``amp_enabled='auto'`` or pinned to auto's choice, and reports the fit's wall
time and the rise of its resident set size (``VmHWM`` reset before the fit;
Linux). The pinned and auto runs alternate, ``--rounds`` times each; the
medians and the per-pair differences are printed. Run it on a quiet machine::

    OMP_NUM_THREADS=2 python tools/probe_cost.py --rounds 5

``--quick`` uses the MLP 256-512-512-10 on 1024 rows (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _worker(mode: str, quick: bool, threads: int) -> dict:
    import torch

    from ampnet import AmpNetClassifier
    from ampnet_bench.memory import MemoryMeter
    from ampnet_bench.workloads import get_workload

    torch.set_num_threads(threads)
    wl = get_workload("mlp", quick=quick)
    data = wl.make_data(0)
    X, y = data.X.numpy(), data.y.numpy()
    pinned = json.loads(os.environ.get("PROBE_COST_PINNED", "null"))

    def make(module, **extra):
        kwargs = dict(module=module, criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.AdamW,
                      lr=1e-3, batch_size=wl.batch_size, max_epochs=1, train_split=None, verbose=0)
        kwargs.update(extra)
        return AmpNetClassifier(**kwargs)

    precision = {"amp_enabled": "auto"} if mode == "auto" else (pinned or {"amp_enabled": True})
    # prime: the same kind of fit on a miniature, so that lazy imports and kernel caches are resident
    mini = get_workload("mlp", quick=True)
    mdata = mini.make_data(0)
    make(mini.build_module(0), **precision).fit(mdata.X[:512].numpy(), mdata.y[:512].numpy())
    net = make(wl.build_module(0), **precision)
    state_bytes = sum(p.numel() * 4 for p in net.initialize().module_.parameters()) * 3  # weights + AdamW's 2
    with MemoryMeter("cpu") as meter:
        start = time.perf_counter()
        net.fit(X, y)
        wall = time.perf_counter() - start
    out = {"mode": mode, "fit_s": wall, "rss_rise_mb": meter.reading.delta_mb,
           "state_mb": state_bytes / 2**20}
    result = getattr(net, "amp_autotune_", None)
    if result is not None:
        out.update(probe_s=result.probe_s, choice=result.params, table=str(result))
    return out


def _run(mode: str, args: argparse.Namespace, pinned: dict | None) -> dict:
    env = {**os.environ, "PROBE_COST_PINNED": json.dumps(pinned)}
    cmd = [sys.executable, __file__, "--worker", mode, "--threads", str(args.threads)]
    if args.quick:
        cmd.append("--quick")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Measure and print; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode (default 3)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
                        or os.cpu_count() or 1, help="torch threads (default: OMP_NUM_THREADS or all cores)")
    parser.add_argument("--quick", action="store_true", help="the quick MLP (a smoke run)")
    parser.add_argument("--worker", choices=("auto", "pinned"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.quick, args.threads)))
        return 0
    first = _run("auto", args, None)  # auto's choice, which the pinned runs take
    choice = first["choice"]
    print(first["table"], flush=True)
    autos, pins = [first], []
    for i in range(args.rounds):
        pins.append(_run("pinned", args, choice))
        if i:
            autos.append(_run("auto", args, None))
    pairs = list(zip(autos, pins))
    extra_s = [a["fit_s"] - p["fit_s"] for a, p in pairs]
    extra_mb = [a["rss_rise_mb"] - p["rss_rise_mb"] for a, p in pairs]
    state_mb = pins[0]["state_mb"]
    print(f"\nMLP, AdamW, {args.threads} threads, {args.rounds} pairs of fresh processes; auto chose "
          f"{', '.join(f'{k}={v!r}' for k, v in choice.items())}")
    print(f"fit of one epoch: auto {statistics.median(a['fit_s'] for a in autos):.3f} s, pinned "
          f"{statistics.median(p['fit_s'] for p in pins):.3f} s; probe_s (auto's own clock) "
          f"{statistics.median(a['probe_s'] for a in autos):.3f} s")
    print(f"extra wall time (auto - pinned, median of pairs): {statistics.median(extra_s):.3f} s "
          f"(target <= 0.35 s)")
    print(f"extra peak RSS (auto - pinned, median of pairs): {statistics.median(extra_mb):.1f} MB = "
          f"{statistics.median(extra_mb) / state_mb:.2f}x the model + optimizer state ({state_mb:.1f} MB; "
          "target <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
