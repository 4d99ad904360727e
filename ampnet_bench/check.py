"""The one-call GPU check: ``python -m ampnet.benchmark --check`` (``tools/gpu_check.sh``).

In one call, within a time budget (default 450 s, for the 8 minutes a lent H100 gives), it

1. runs the workloads sized for a GPU (:data:`~ampnet_bench.workloads.GPU_WORKLOADS`: a
   ResNet-50 at 224 px, a BERT-base-sized encoder, a GPT-2-small-sized decoder) in bfloat16,
   2 rounds, with the contenders of :data:`~ampnet_bench.contenders.GPU_CONTENDERS` (float32
   IEEE and TF32, the careful loop twice, AmpNet's default, ``'auto'`` and float8), each
   workload in its own process with its own time limit;
2. runs the overhead workload (MLP 20-32-2, batch 32, 400 steps) on the device with the
   contenders of :func:`~ampnet_bench.contenders.overhead_contenders`;
3. counts host synchronizations per training step under
   ``torch.cuda.set_sync_debug_mode("warn")``: the warnings raised over two
   short epochs of different lengths, so that their difference gives the
   count per step and the rest the count per epoch, for the careful loop and
   AmpNet's default (the data on the device), a hand-written autocast loop
   fed by a DataLoader and AmpNet's other settings (AMP off, fp16 with loss
   scaling, compensated pure bf16);
4. runs ``pytest -m gpu`` (the tests marked ``gpu``);
5. as time allows, the benchmark's CPU-sized model workloads
   (:data:`~ampnet_bench.workloads.MODEL_WORKLOADS`) in bfloat16 and float16, with the
   contenders of :data:`~ampnet_bench.contenders.HEADLINE_CONTENDERS`;

records what ``amp_enabled='auto'`` chose on each workload, and writes one Markdown report
(:mod:`ampnet_bench.check_report`) that opens with issue 37's targets, each met, not met or not
measured with its figures. A step that would not fit in what is left of the budget is skipped
and reported as such, so the check ends in time; the steps of part 5 are optional (skipping
them for time does not fail the check).

``--dry-run`` runs the same steps on the CPU at the workloads' quick sizes
(so the check is known to work before a GPU is at hand): ``pytest -m gpu``
reports its tests skipped and deselected, and the sync counts are "n/a on
CPU" (the same training steps run, uncounted).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ampnet_bench.config import BenchConfig
from ampnet_bench.check_report import render_report
from ampnet_bench.contenders import CONTENDERS, GPU_CONTENDERS, HEADLINE_CONTENDERS, overhead_contenders
from ampnet_bench.files import write_text_atomic
from ampnet_bench.machine import describe_machine
from ampnet_bench.memory import subprocess_env
from ampnet_bench.workloads import GPU_WORKLOADS, MODEL_WORKLOADS, get_workload

__all__ = [
    "CHECK_DTYPES",
    "CHECK_WORKLOADS",
    "CheckPlan",
    "SYNC_SETTINGS",
    "count_host_syncs",
    "default_test_paths",
    "parse_pytest_summary",
    "render_report",
    "run_check",
    "run_pytest",
    "step_contenders",
]

#: The AMP dtypes every workload runs in.
CHECK_DTYPES = ("bfloat16", "float16")

#: The workloads of ``--check``, in the order it runs them: the GPU workloads, the overhead workload,
#: then (after the host syncs and ``pytest -m gpu``, as time allows) the CPU-sized model workloads.
CHECK_WORKLOADS = (*GPU_WORKLOADS, "overhead", *MODEL_WORKLOADS)

#: Settings whose host syncs are counted: (label, contender key, dtype). The first two have the data on
#: the device (the careful loop puts it there; AmpNet's array data path does, ``data_on_device='auto'``).
SYNC_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("careful loop, autocast bf16, data on the device", "raw-careful", "bfloat16"),
    ("AmpNet, amp_enabled=True, bf16 (defaults), array data on the device", "ampnet-mixed", "bfloat16"),
    ("PyTorch loop, autocast bf16, CPU DataLoader", "raw-amp", "bfloat16"),
    ("PyTorch loop, autocast fp16 + GradScaler", "raw-amp", "float16"),
    ("AmpNet, amp_enabled=False", "ampnet-fp32", "bfloat16"),
    ("AmpNet, amp_enabled=True, fp16 (defaults: loss scaling)", "ampnet-mixed", "float16"),
    ("AmpNet, compensated pure bf16", "ampnet-pure-comp", "bfloat16"),
)

#: The part of the message of ``set_sync_debug_mode("warn")``'s warning that identifies it.
_SYNC_MESSAGE = "synchronizing cuda operation"

Logger = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_test_paths() -> tuple[str, ...]:
    """The ``tests`` folder of the source tree ``ampnet_bench`` is in (empty
    where the package is installed without its tests)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    return (str(tests),) if tests.is_dir() else ()


@dataclass(frozen=True)
class CheckPlan:
    """What ``--check`` runs.

    Attributes
    ----------
    dry_run : bool
      Run on the CPU at the workloads' quick sizes instead of on CUDA.

    device : str
      The device of the training steps (``'cuda'``; ``'cpu'`` in a dry run).

    workloads : tuple of str
      Workloads benchmarked (:data:`CHECK_WORKLOADS`, in that order whatever
      the order given): the GPU workloads in bfloat16 with
      :attr:`gpu_contenders`, the overhead workload in bfloat16 with
      :func:`~ampnet_bench.contenders.overhead_contenders`, the model
      workloads in every dtype of :data:`CHECK_DTYPES` with :attr:`contenders`.

    contenders : tuple of str
      Contender keys of the model workloads' steps.

    gpu_contenders : tuple of str
      Contender keys of the GPU workloads' steps (``ampnet-float8`` on the
      encoder and decoder only).

    gpu_step_s : float
      The longest a GPU workload's step may take.

    rounds, epochs, warmup : int
      Run lengths of the benchmark steps.

    rows_factor : int
      Rows per epoch, as a multiple of the workload's default (a GPU runs the
      CPU-sized epochs in milliseconds); 1 in a dry run, which runs quick sizes.

    budget_s : float
      Wall-clock budget of the whole check; a step that would start with
      less than :attr:`min_step_s` left is skipped.

    min_step_s : float
      The least time a step is started with.

    pytest_paths : tuple of str
      What ``pytest -m gpu`` runs (default: the source tree's ``tests``).

    pytest_share : float
      The largest share of the budget ``pytest -m gpu`` may take.

    threads : int
      torch threads of the benchmark steps.

    optimizer : str
      The benchmark's optimizer.

    auto_fit_epochs : int
      The fit ``amp_enabled='auto'`` is told it runs (``--auto-fit-epochs``):
      long, so that its probe's budget lets it measure as on a long fit
      (the check is after its choice on the GPU, not its cost on the
      check's short epochs).
    """

    dry_run: bool = False
    device: str = "cuda"
    workloads: tuple[str, ...] = CHECK_WORKLOADS
    contenders: tuple[str, ...] = HEADLINE_CONTENDERS
    gpu_contenders: tuple[str, ...] = GPU_CONTENDERS
    gpu_step_s: float = 120.0
    rounds: int = 2
    epochs: int = 1
    warmup: int = 1
    rows_factor: int = 4
    budget_s: float = 450.0
    min_step_s: float = 15.0
    pytest_paths: tuple[str, ...] = field(default_factory=default_test_paths)
    pytest_share: float = 0.35
    threads: int = 1
    optimizer: str = "adamw"
    auto_fit_epochs: int = 1000

    @classmethod
    def dry(cls, **changes: Any) -> "CheckPlan":
        """The dry-run plan: the CPU, quick sizes, a shorter minimum step."""
        base = dict(dry_run=True, device="cpu", rows_factor=1, min_step_s=3.0)
        base.update(changes)
        return cls(**base)

    def ordered(self, group: tuple[str, ...]) -> tuple[str, ...]:
        """The workloads of :attr:`workloads` that are in ``group``, in ``group``'s order."""
        return tuple(w for w in group if w in self.workloads)


# ---- step 1: pytest -m gpu ----------------------------------------------------------------------


_OUTCOMES = ("passed", "failed", "skipped", "deselected", "errors", "xfailed", "xpassed", "warnings")


def parse_pytest_summary(output: str) -> dict[str, int]:
    """The counts of pytest's final summary line (``3 passed, 2 skipped,
    1315 deselected in 12.3s``) as a dict; ``error`` is counted as ``errors``.

    Parameters
    ----------
    output : str
      pytest's output.

    Returns
    -------
    dict
      Every key of ``passed, failed, skipped, deselected, errors, xfailed,
      xpassed, warnings``, 0 where the line does not name it.
    """
    counts = dict.fromkeys(_OUTCOMES, 0)
    lines = [line for line in output.splitlines() if re.search(r"\bin [\d.]+s\b", line)]
    if not lines:
        return counts
    for number, word in re.findall(r"(\d+) (\w+)", lines[-1]):
        word = {"error": "errors", "warning": "warnings"}.get(word, word)
        if word in counts:
            counts[word] = int(number)
    return counts


def run_pytest(paths: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """Run ``python -m pytest -m gpu -q -rfEs PATHS`` in a subprocess.

    Returns
    -------
    dict
      ``command``, ``returncode`` (None when it timed out), ``counts`` (see
      :func:`parse_pytest_summary`), ``failures`` (pytest's ``FAILED`` and
      ``ERROR`` lines), ``skip_reasons`` (the distinct reasons of the
      ``SKIPPED`` lines), ``seconds``, ``timed_out`` and ``tail``.
    """
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider", *paths]
    started = time.perf_counter()
    timed_out = False
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = _text(exc.stdout) + _text(exc.stderr)
        returncode, timed_out = None, True
    lines = output.splitlines()
    reasons = [re.sub(r"^SKIPPED \[\d+\] ", "", line) for line in lines if line.startswith("SKIPPED")]
    return {
        "command": "python -m pytest -m gpu -q -rfEs " + " ".join(paths),
        "returncode": returncode,
        "counts": parse_pytest_summary(output),
        "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
        "skip_reasons": sorted({re.sub(r"^[^:]+:\d+: ", "", r) for r in reasons}),
        "seconds": time.perf_counter() - started,
        "timed_out": timed_out,
        "tail": lines[-15:],
    }


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# ---- step 2: host syncs per step ----------------------------------------------------------------


def _sync_sources(fn: Callable[[list], Any], count: bool) -> collections.Counter:
    """Run ``fn(caught)`` under ``set_sync_debug_mode("warn")`` (when
    ``count``) and return where the sync warnings it put in ``caught`` came
    from (``file:line`` -> number). ``fn`` records its warnings itself (a
    contender's run does): a ``catch_warnings`` around it would see none."""
    caught: list[warnings.WarningMessage] = []
    if count:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        fn(caught)
    finally:
        if count:
            torch.cuda.set_sync_debug_mode("default")
    sources: collections.Counter = collections.Counter()
    for w in caught:
        if _SYNC_MESSAGE in str(w.message).lower():
            sources[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return sources


def count_host_syncs(
    device: str, quick: bool, steps: tuple[int, int] = (4, 12), threads: int = 1
) -> list[dict[str, Any]]:
    """Count the host synchronizations per training step of each of
    :data:`SYNC_SETTINGS` on the MLP workload.

    Each setting trains three fresh models for one epoch each: one to warm
    up (not counted), then ``steps[0]`` and ``steps[1]`` batches under
    ``torch.cuda.set_sync_debug_mode("warn")``. The difference of the two
    counts over the difference of the steps is the count per step; what is
    left of the shorter epoch's count is the fixed count of a fit (model
    placement, the epoch's bookkeeping, the evaluation's predictions). On a CPU
    nothing is counted, and only the warm-up fit runs.

    Parameters
    ----------
    device : str
      ``'cuda'`` (counted) or ``'cpu'`` (run, not counted).

    quick : bool
      The MLP at its quick sizes.

    steps : (int, int)
      Batches of the two counted epochs.

    threads : int
      torch threads.

    Returns
    -------
    list of dict
      Per setting: ``label``, ``contender``, ``dtype``, ``per_step`` and
      ``fixed`` (None on a CPU), ``sources`` (the most frequent
      ``file:line`` of the longer epoch's warnings with their counts) and
      ``error`` (None, or why the setting could not run).
    """
    from ampnet_bench.contenders import run_contender

    counted = torch.device(device).type == "cuda"
    by_key = {c.key: c for c in CONTENDERS}
    rows = []
    torch.set_num_threads(threads)
    for label, key, dtype in SYNC_SETTINGS:
        row: dict[str, Any] = {"label": label, "contender": key, "dtype": dtype, "per_step": None,
                               "fixed": None, "sources": [], "error": None}
        try:
            counts = []
            # on a CPU nothing is counted: the warm-up fit alone runs the setting's steps
            for n_batches in (steps[0], steps[0], steps[1]) if counted else (steps[0],):
                cfg = BenchConfig(workloads=("mlp",), device=device, dtype=dtype, quick=quick, rounds=1,
                                  epochs=1, warmup=0, threads=threads, optimizer="adamw", memory="off",
                                  isolation="inprocess")
                base = get_workload("mlp", quick=quick)
                wl = get_workload("mlp", quick=quick, n_samples=n_batches * base.batch_size)
                data = wl.make_data(cfg.seed)
                counts.append(_sync_sources(lambda sink: run_contender(by_key[key], wl, data, cfg, caught=sink),
                                            counted))
            if counted:
                short, long = sum(counts[1].values()), sum(counts[2].values())
                row["per_step"] = (long - short) / (steps[1] - steps[0])
                row["fixed"] = short - row["per_step"] * steps[0]
                row["sources"] = counts[2].most_common(4)
        except Exception as exc:  # reported, not fatal: the rest of the check still runs
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


# ---- step 3: the workloads ----------------------------------------------------------------------


def step_contenders(plan: CheckPlan, workload: str) -> tuple[str, ...]:
    """The contenders a step of ``workload`` runs: the GPU contenders (float8 on the encoder and the
    decoder only), the overhead workload's, or :attr:`CheckPlan.contenders`."""
    if workload in GPU_WORKLOADS:
        from ampnet_bench.contenders import FLOAT8_WORKLOADS

        return tuple(k for k in plan.gpu_contenders if k != "ampnet-float8" or workload in FLOAT8_WORKLOADS)
    if workload == "overhead":
        return overhead_contenders(torch.device(plan.device).type)
    return plan.contenders


def _benchmark_command(plan: CheckPlan, workload: str, dtype: str, out: Path) -> list[str]:
    # the overhead workload is the issue's: SGD with momentum, 400 steps an epoch as they are
    optimizer = "sgd" if workload == "overhead" else plan.optimizer
    command = [
        sys.executable, "-m", "ampnet_bench", "--workload", workload, "--device", plan.device,
        "--dtype", dtype, "--rounds", str(plan.rounds), "--epochs", str(plan.epochs),
        "--warmup", str(plan.warmup), "--isolation", "inprocess", "--memory", "inprocess",
        "--optimizer", optimizer, "--threads", str(plan.threads),
        "--contenders", ",".join(step_contenders(plan, workload)), "--auto-fit-epochs", str(plan.auto_fit_epochs),
        "--out", str(out),
    ]
    if plan.dry_run:
        command.append("--quick")
    elif plan.rows_factor != 1 and workload in MODEL_WORKLOADS:
        command += ["--n-samples", str(get_workload(workload).n_samples * plan.rows_factor)]
    return command


#: Runs a benchmark step's command within a time limit: ``run_command(command, timeout)`` returns a
#: ``subprocess.CompletedProcess`` (with text ``stdout`` and ``stderr``) or raises ``subprocess.TimeoutExpired``.
RunCommand = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


def _run_command(command: list[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    """A benchmark step's command in a fresh process (:data:`RunCommand`)."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def _run_benchmark_step(plan: CheckPlan, workload: str, dtype: str, out: Path, timeout: float,
                        run_command: RunCommand = _run_command) -> dict[str, Any]:
    command = _benchmark_command(plan, workload, dtype, out)
    started = time.perf_counter()
    step: dict[str, Any] = {"workload": workload, "dtype": dtype, "status": "ok", "error": None,
                            "result": None, "command": _display(command)}
    try:
        proc = run_command(command, timeout)
        if proc.returncode != 0 or not (out / "results.json").exists():
            tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            step.update(status="failed", error=tail[-1] if tail else f"exit status {proc.returncode}")
        else:
            results = json.loads((out / "results.json").read_text(encoding="utf-8"))
            step["result"] = results["workloads"][0]
    except subprocess.TimeoutExpired:
        step.update(status="timed out", error=f"stopped after {timeout:.0f} s (the budget left)")
    step["seconds"] = time.perf_counter() - started
    return step


def _display(command: list[str]) -> str:
    return " ".join(["python", *command[1:]])


# ---- the check ----------------------------------------------------------------------------------


def run_check(plan: CheckPlan, report: str | Path, log: Logger = _stderr,
              run_command: RunCommand = _run_command) -> dict[str, Any]:
    """Run the check's steps within ``plan.budget_s`` and write the Markdown report.

    Parameters
    ----------
    plan : CheckPlan
      What to run.

    report : str or Path
      The Markdown file to write (its folder is created).

    log : callable
      Receives one progress line per step.

    run_command : callable
      Runs each benchmark step's command (:data:`RunCommand`; default: a
      fresh process with the step's time limit).

    Returns
    -------
    dict
      ``plan``, ``machine``, ``pytest``, ``syncs``, ``benchmarks`` (one
      entry per workload and dtype), ``steps`` (name, status, seconds,
      optional), ``elapsed_s``, ``report`` (the path) and ``ok`` (no test
      failed, no step failed or timed out, no step skipped but the optional
      ones for lack of time).
    """
    started = time.monotonic()
    deadline = started + plan.budget_s

    def left() -> float:
        return deadline - time.monotonic()

    steps: list[dict[str, Any]] = []
    check: dict[str, Any] = {"plan": dataclasses.asdict(plan), "machine": describe_machine(), "pytest": None,
                             "syncs": [], "benchmarks": [], "steps": steps}

    def benchmark(workload: str, dtype: str, tmp: str, limit: float, optional: bool = False) -> None:
        name = f"benchmark {workload} {dtype}"
        if left() < plan.min_step_s:
            steps.append({"name": name, "status": "skipped: budget spent", "seconds": 0.0, "optional": optional})
            check["benchmarks"].append({"workload": workload, "dtype": dtype, "status": "skipped: budget spent",
                                        "error": None, "result": None, "seconds": 0.0})
            return
        log(f"[check] {name} ...")
        step = _run_benchmark_step(plan, workload, dtype, Path(tmp) / f"{workload}-{dtype}", min(left(), limit),
                                   run_command)
        check["benchmarks"].append(step)
        steps.append({"name": name, "status": step["status"], "seconds": step["seconds"], "optional": optional})
        log(f"[check] {name}: {step['status']} ({step['seconds']:.1f} s)")

    with tempfile.TemporaryDirectory(prefix="ampnet-check-") as tmp:
        # 1. the workloads sized for a GPU, then 2. the overhead workload (bf16: AmpNet's default)
        for workload in plan.ordered(GPU_WORKLOADS):
            benchmark(workload, "bfloat16", tmp, plan.gpu_step_s)
        for workload in plan.ordered(("overhead",)):
            benchmark(workload, "bfloat16", tmp, plan.gpu_step_s)

        # 3. host syncs per step
        if left() < plan.min_step_s:
            steps.append({"name": "host syncs", "status": "skipped: budget spent", "seconds": 0.0})
        else:
            log("[check] host syncs per step ...")
            t0 = time.perf_counter()
            check["syncs"] = count_host_syncs(plan.device, quick=plan.dry_run, threads=plan.threads)
            failed = [r for r in check["syncs"] if r["error"]]
            steps.append({"name": "host syncs", "status": "failed" if failed else "ok",
                          "seconds": time.perf_counter() - t0})

        # 4. pytest -m gpu
        if not plan.pytest_paths:
            steps.append({"name": "pytest -m gpu", "status": "skipped: no tests folder next to ampnet_bench",
                          "seconds": 0.0})
        elif left() < plan.min_step_s:
            steps.append({"name": "pytest -m gpu", "status": "skipped: budget spent", "seconds": 0.0})
        else:
            log("[check] pytest -m gpu ...")
            result = run_pytest(plan.pytest_paths, timeout=max(1.0, min(left(), plan.pytest_share * plan.budget_s)))
            check["pytest"] = result
            status = "timed out" if result["timed_out"] else (
                "ok" if not result["counts"]["failed"] and not result["counts"]["errors"] else "failed")
            steps.append({"name": "pytest -m gpu", "status": status, "seconds": result["seconds"]})
            log(f"[check] pytest -m gpu: {status} {result['counts']}")

        # 5. the CPU-sized model workloads, bf16 first, as time allows
        for dtype in CHECK_DTYPES:
            for workload in plan.ordered(MODEL_WORKLOADS):
                benchmark(workload, dtype, tmp, float("inf"), optional=True)

    check["elapsed_s"] = time.monotonic() - started
    check["ok"] = all(s["status"] == "ok" or s["status"].startswith("skipped: no tests")
                      or (s.get("optional") and s["status"] == "skipped: budget spent") for s in steps)
    path = Path(report)
    check["report"] = str(path)
    write_text_atomic(path, render_report(check))
    return check


