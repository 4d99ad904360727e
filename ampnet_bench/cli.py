"""Command line of ``python -m ampnet.benchmark``."""

from __future__ import annotations

import argparse
import os
import sys
from types import MappingProxyType
from typing import Any, Sequence

from ampnet_bench.config import AUTO_FIT_EPOCHS, BATCHING, ISOLATION, MEMORY_METHODS, OPTIMIZERS, BenchConfig
from ampnet_bench.contenders import CONTENDER_KEYS
from ampnet_bench.machine import load_warning, usable_cores
from ampnet_bench.report import to_markdown, write_all
from ampnet_bench.runner import run_benchmark
from ampnet_bench.workloads import GPU_WORKLOADS, MODEL_DIMS, MODEL_WORKLOADS, WORKLOAD_NAMES

__all__ = ["build_parser", "check_plan_from_args", "config_from_args", "main"]

_DESCRIPTION = """\
Train the same model (an MLP, a CNN, a transformer encoder, ResNet-18, an
LSTM, ...) on the same synthetic data with a hand-written PyTorch
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
  python -m ampnet.benchmark --workload transformer resnet rnn --optimizer adamw --threads 2 --rounds 3 \\
      --epochs 2 --contenders raw-fp32,raw-amp,raw-amp-aa,raw-amp-fused,ampnet-mixed,ampnet-auto
  python -m ampnet.benchmark --workload transformer --dims transformer.d_model=128 transformer.n_layers=2
  python -m ampnet.benchmark --check              # the one-call GPU check (tools/gpu_check.sh)
  python -m ampnet.benchmark --check --dry-run    # its steps on the CPU at quick sizes
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


def _dims_item(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    workload, dot, size = key.partition(".")
    if not sep or not dot or not value:
        raise argparse.ArgumentTypeError(f"expected WORKLOAD.SIZE=VALUE, e.g. transformer.d_model=128; got {text!r}")
    if workload not in MODEL_DIMS or size not in MODEL_DIMS[workload][0]:
        choices = ", ".join(f"{w}.{k}" for w, (full, _) in MODEL_DIMS.items() for k in full)
        raise argparse.ArgumentTypeError(f"unknown size {key!r}; choose from {choices}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m ampnet.benchmark``."""
    p = argparse.ArgumentParser(
        prog="python -m ampnet.benchmark",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", nargs="+", default=["all"], choices=[*WORKLOAD_NAMES, *GPU_WORKLOADS, "all"],
                   metavar="NAME",
                   help=f"workload(s) to run: {', '.join(WORKLOAD_NAMES)} or all (default: all); sized for a "
                        f"GPU, not in all: {', '.join(GPU_WORKLOADS)}")
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
                   help="CNN and ResNet in the channels_last memory format (all contenders)")
    p.add_argument("--dims", nargs="+", type=_dims_item, default=[], metavar="WORKLOAD.SIZE=VALUE",
                   help="override model sizes, e.g. transformer.d_model=128 rnn.cell=gru "
                        "resnet.widths=32-64-128-256 (sizes: "
                        + "; ".join(f"{w}: {', '.join(full)}" for w, (full, _) in MODEL_DIMS.items()) + ")")
    p.add_argument("--auto-fit-epochs", type=_positive_int, default=AUTO_FIT_EPOCHS, metavar="N",
                   help="the fit amp_enabled='auto' runs as (max_epochs; the report spreads its measuring "
                        "cost over as many epochs); its run stops after the warm-up and measured epochs "
                        f"(default: {AUTO_FIT_EPOCHS})")
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
    check = p.add_argument_group(
        "one-call GPU check",
        "--check runs pytest -m gpu, counts host syncs per training step, and benchmarks the model "
        f"workloads ({', '.join(MODEL_WORKLOADS)}, or --workload) on CUDA in bf16 and fp16 (2 rounds; "
        "the contenders of the docs' tables, or --contenders), with what amp_enabled='auto' chose on "
        "each, within --budget-s; writes one Markdown report. --dry-run: the same steps on the CPU at "
        "quick sizes.")
    check.add_argument("--check", action="store_true", help="run the GPU check (see above)")
    check.add_argument("--dry-run", action="store_true",
                       help="with --check: run its steps on the CPU at quick sizes (no GPU needed)")
    check.add_argument("--report", default=None, metavar="FILE",
                       help="with --check: the report (default: ampnet-gpu-check.md, "
                            "ampnet-gpu-check-dry-run.md with --dry-run)")
    check.add_argument("--budget-s", type=float, default=None,
                       help="with --check: wall-clock budget in seconds (default: 450 on CUDA, for an "
                            "8-minute slot; 600 in a dry run)")
    check.add_argument("--pytest-path", nargs="+", default=None, metavar="PATH",
                       help="with --check: what pytest -m gpu runs (default: the source tree's tests/)")
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
        dims=tuple(args.dims),
        auto_fit_epochs=args.auto_fit_epochs,
        **run_lengths,
    )


def check_plan_from_args(args: argparse.Namespace) -> Any:
    """The :class:`ampnet_bench.check.CheckPlan` that ``--check`` (and ``--dry-run``) arguments give."""
    from ampnet_bench.check import CheckPlan

    changes: dict[str, Any] = {}
    if "all" not in args.workload:
        changes["workloads"] = tuple(dict.fromkeys(args.workload))
    if args.contenders is not None:
        changes["contenders"] = tuple(args.contenders)
    if args.budget_s is not None:
        changes["budget_s"] = args.budget_s
    if args.pytest_path is not None:
        changes["pytest_paths"] = tuple(args.pytest_path)
    for name in ("rounds", "epochs", "warmup", "threads"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.optimizer != "sgd":  # the check's default optimizer is AdamW, the docs' tables'
        changes["optimizer"] = args.optimizer
    if args.dry_run:
        return CheckPlan.dry(**{"budget_s": 600.0, **changes})
    return CheckPlan(device=args.device if args.device != "cpu" else "cuda", **changes)


def _main_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from ampnet_bench.check import run_check

    plan = check_plan_from_args(args)
    if not plan.dry_run and not torch.cuda.is_available():
        parser.error("--check: CUDA is not available on this machine; --check --dry-run runs the same "
                     "steps on the CPU")
    report = args.report or ("ampnet-gpu-check-dry-run.md" if plan.dry_run else "ampnet-gpu-check.md")
    check = run_check(plan, report)
    print(f"Wrote {check['report']} ({check['elapsed_s']:.0f} s): "
          + ("all steps ran and passed" if check["ok"] else "some steps failed, timed out or were skipped"),
          file=sys.stderr)
    return 0 if check["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the Markdown report and write the files.

    Parameters
    ----------
    argv : sequence of str or None
      Arguments without the program name; None reads ``sys.argv``.

    Returns
    -------
    int
      The exit status: 0; with ``--check``, 1 when a test or a step failed,
      timed out or was skipped for lack of time.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check or args.dry_run:
        return _main_check(parser, args)
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
