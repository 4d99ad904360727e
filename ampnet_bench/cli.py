"""Command line of ``python -m ampnet.benchmark``."""

from __future__ import annotations

import argparse
import os
import sys
from types import MappingProxyType
from typing import Any, Sequence

from ampnet_bench.config import BATCHING, ISOLATION, MEMORY_METHODS, OPTIMIZERS, BenchConfig
from ampnet_bench.contenders import CONTENDER_KEYS
from ampnet_bench.machine import load_warning, usable_cores
from ampnet_bench.report import to_markdown, write_all
from ampnet_bench.runner import run_benchmark
from ampnet_bench.workloads import WORKLOAD_NAMES

__all__ = ["build_parser", "config_from_args", "main"]

_DESCRIPTION = """\
Train the same model on the same synthetic data with a hand-written PyTorch
loop (float32 and AMP, the AMP loop twice as an A/A control), skorch's
NeuralNetClassifier, AmpNet (float32, mixed, pure, compensated pure, fused
optimizers) and, when installed, skorch + accelerate and Lightning;
interleave the contenders in rounds, each run in a fresh process, and report
median epoch time, samples/s, ms/batch, peak memory, training-state bytes,
final loss, accuracy and per-round ratios (judged against the A/A spread) as
Markdown (stdout and results.md), JSON and a PNG chart.
"""

_EPILOG = """\
examples:
  python -m ampnet.benchmark --quick
  python -m ampnet.benchmark --workload mlp --threads 2 --out bench-mlp
  python -m ampnet.benchmark --workload mlp cnn --optimizer adamw --threads 2 \\
      --contenders raw-amp,raw-amp-aa,ampnet-mixed,ampnet-pure-comp-fused,lightning
  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 \\
      python -m ampnet.benchmark --workload overhead predict --threads 2
"""

#: Defaults of the run-length options, normal and --quick.
_RUN_DEFAULTS = MappingProxyType({"rounds": (5, 2), "epochs": (3, 1), "warmup": (1, 1)})


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
    return value


def _contender_list(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in CONTENDER_KEYS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown contender(s) {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join(CONTENDER_KEYS)}"
        )
    return keys


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m ampnet.benchmark``."""
    p = argparse.ArgumentParser(
        prog="python -m ampnet.benchmark",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", nargs="+", default=["all"], choices=[*WORKLOAD_NAMES, "all"],
                   metavar="NAME",
                   help=f"workload(s) to run: {', '.join(WORKLOAD_NAMES)} or all (default: all)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="AMP dtype (default: bfloat16)")
    p.add_argument("--rounds", type=_positive_int, default=None,
                   help="interleaved rounds (default: 5; quick: 2)")
    p.add_argument("--epochs", type=_positive_int, default=None,
                   help="measured epochs (predict: calls) per run (default: 3; quick: 1)")
    p.add_argument("--warmup", type=_nonnegative_int, default=None,
                   help="un-measured warm-up epochs at the start of each run (default: 1)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="override every workload's batch size")
    p.add_argument("--n-samples", type=_positive_int, default=None,
                   help="override every workload's rows per epoch")
    p.add_argument("--channels-last", action="store_true",
                   help="CNN in the channels_last memory format (all contenders)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and few rounds: a smoke test whose timings are not comparable "
                        "with full runs")
    p.add_argument("--out", default="benchmark-results", metavar="DIR",
                   help="write results.md, results.json, results.png here "
                        "(default: ./benchmark-results; '' writes no files)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's default)")
    p.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS),
                   help="optimizer for every contender (default: sgd, momentum 0.9)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, weights and shuffling")
    p.add_argument("--batching", default="dataloader", choices=BATCHING,
                   help="dataloader: DataLoader over skorch's Dataset for every contender "
                        "(skorch's default); tensors: index slices, no collation")
    p.add_argument("--memory", default="auto", choices=MEMORY_METHODS,
                   help="peak memory: subprocess (fresh process per contender), inprocess "
                        "(approximate on CPU), off; auto: subprocess on CPU, inprocess on "
                        "CUDA and in --quick")
    p.add_argument("--isolation", default="auto", choices=ISOLATION,
                   help="process: every run (contender x round) in a fresh Python process, "
                        "peak memory measured in it; inprocess: all runs in this process; "
                        "auto: inprocess in --quick, process otherwise")
    p.add_argument("--contenders", type=_contender_list, default=None,
                   help=f"comma-separated subset of: {', '.join(CONTENDER_KEYS)}")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed arguments into a :class:`BenchConfig`."""
    import torch

    names = WORKLOAD_NAMES if "all" in args.workload else tuple(dict.fromkeys(args.workload))
    run_lengths: dict[str, Any] = {}
    for name, (normal, quick) in _RUN_DEFAULTS.items():
        value = getattr(args, name)
        run_lengths[name] = value if value is not None else (quick if args.quick else normal)
    return BenchConfig(
        workloads=tuple(names),
        device=args.device,
        dtype=args.dtype,
        batch_size=args.batch_size,
        n_samples=args.n_samples,
        channels_last=args.channels_last,
        quick=args.quick,
        threads=args.threads if args.threads is not None else torch.get_num_threads(),
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        batching=args.batching,
        memory=args.memory,
        contenders=args.contenders,
        isolation=args.isolation,
        **run_lengths,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the Markdown report and write the files.

    Parameters
    ----------
    argv : sequence of str or None
      Arguments without the program name; None reads ``sys.argv``.

    Returns
    -------
    int
      The exit status (0).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if cfg.device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {cfg.device}: CUDA is not available on this machine")
    try:
        warning = load_warning(os.getloadavg(), usable_cores())
    except OSError:  # no load average on this system
        warning = None
    if warning:
        print(warning, file=sys.stderr, flush=True)
    results = run_benchmark(cfg)
    sys.stdout.write(to_markdown(results))
    if args.out:
        paths = write_all(results, args.out)
        print(
            "\nWrote " + ", ".join(str(p) for p in paths.values()),
            file=sys.stderr,
        )
    return 0
