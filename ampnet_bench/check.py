"""The one-call GPU check: ``python -m ampnet.benchmark --check`` (``tools/gpu_check.sh``).

In one call, within a time budget (default 450 s, for the 8 minutes a lent H100 gives), it

1. runs ``pytest -m gpu`` (the tests marked ``gpu``);
2. counts host synchronizations per training step under
   ``torch.cuda.set_sync_debug_mode("warn")``: the warnings raised over two
   short epochs of different lengths, so that their difference gives the
   count per step and the rest the count per epoch, for a hand-written
   autocast loop and for AmpNet (AMP off, bf16, fp16 with loss scaling,
   compensated pure bf16);
3. runs the benchmark's model workloads (:data:`~ampnet_bench.workloads.MODEL_WORKLOADS`)
   on the device in bfloat16 and float16, 2 rounds, with the contenders of
   :data:`~ampnet_bench.contenders.HEADLINE_CONTENDERS`, each workload and
   dtype in its own process with its own time limit, and records what
   ``amp_enabled='auto'`` chose on each;

and writes one Markdown report. A step that would not fit in what is left
of the budget is skipped and reported as such, so the check ends in time.

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
from ampnet_bench.contenders import CONTENDERS, HEADLINE_CONTENDERS
from ampnet_bench.machine import describe_machine
from ampnet_bench.memory import subprocess_env
from ampnet_bench.workloads import MODEL_WORKLOADS, get_workload

__all__ = [
    "CHECK_DTYPES",
    "CheckPlan",
    "SYNC_SETTINGS",
    "count_host_syncs",
    "default_test_paths",
    "parse_pytest_summary",
    "render_report",
    "run_check",
    "run_pytest",
]

#: The AMP dtypes every workload runs in.
CHECK_DTYPES = ("bfloat16", "float16")

#: Settings whose host syncs are counted: (label, contender key, dtype).
SYNC_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("PyTorch loop, autocast bf16", "raw-amp", "bfloat16"),
    ("PyTorch loop, autocast fp16 + GradScaler", "raw-amp", "float16"),
    ("AmpNet, amp_enabled=False", "ampnet-fp32", "bfloat16"),
    ("AmpNet, amp_enabled=True, bf16 (defaults)", "ampnet-mixed", "bfloat16"),
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
      Workloads benchmarked, each in every dtype of :data:`CHECK_DTYPES`.

    contenders : tuple of str
      Contender keys of the benchmark steps.

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
    workloads: tuple[str, ...] = MODEL_WORKLOADS
    contenders: tuple[str, ...] = HEADLINE_CONTENDERS
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


def _benchmark_command(plan: CheckPlan, workload: str, dtype: str, out: Path) -> list[str]:
    command = [
        sys.executable, "-m", "ampnet_bench", "--workload", workload, "--device", plan.device,
        "--dtype", dtype, "--rounds", str(plan.rounds), "--epochs", str(plan.epochs),
        "--warmup", str(plan.warmup), "--isolation", "inprocess", "--memory", "inprocess",
        "--optimizer", plan.optimizer, "--threads", str(plan.threads),
        "--contenders", ",".join(plan.contenders), "--auto-fit-epochs", str(plan.auto_fit_epochs),
        "--out", str(out),
    ]
    if plan.dry_run:
        command.append("--quick")
    elif plan.rows_factor != 1:
        command += ["--n-samples", str(get_workload(workload).n_samples * plan.rows_factor)]
    return command


def _run_benchmark_step(plan: CheckPlan, workload: str, dtype: str, out: Path, timeout: float) -> dict[str, Any]:
    command = _benchmark_command(plan, workload, dtype, out)
    started = time.perf_counter()
    step: dict[str, Any] = {"workload": workload, "dtype": dtype, "status": "ok", "error": None,
                            "result": None, "command": _display(command)}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
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


def run_check(plan: CheckPlan, report: str | Path, log: Logger = _stderr) -> dict[str, Any]:
    """Run the check's steps within ``plan.budget_s`` and write the Markdown report.

    Parameters
    ----------
    plan : CheckPlan
      What to run.

    report : str or Path
      The Markdown file to write (its folder is created).

    log : callable
      Receives one progress line per step.

    Returns
    -------
    dict
      ``plan``, ``machine``, ``pytest``, ``syncs``, ``benchmarks`` (one
      entry per workload and dtype), ``steps`` (name, status, seconds),
      ``elapsed_s``, ``report`` (the path) and ``ok`` (no test failed, no
      step failed or timed out).
    """
    started = time.monotonic()
    deadline = started + plan.budget_s

    def left() -> float:
        return deadline - time.monotonic()

    steps: list[dict[str, Any]] = []
    check: dict[str, Any] = {"plan": dataclasses.asdict(plan), "machine": describe_machine(), "pytest": None,
                             "syncs": [], "benchmarks": [], "steps": steps}

    # 1. pytest -m gpu
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

    # 2. host syncs per step
    if left() < plan.min_step_s:
        steps.append({"name": "host syncs", "status": "skipped: budget spent", "seconds": 0.0})
    else:
        log("[check] host syncs per step ...")
        t0 = time.perf_counter()
        check["syncs"] = count_host_syncs(plan.device, quick=plan.dry_run, threads=plan.threads)
        failed = [r for r in check["syncs"] if r["error"]]
        steps.append({"name": "host syncs", "status": "failed" if failed else "ok",
                      "seconds": time.perf_counter() - t0})

    # 3. the workloads, bf16 first
    with tempfile.TemporaryDirectory(prefix="ampnet-check-") as tmp:
        for dtype in CHECK_DTYPES:
            for workload in plan.workloads:
                name = f"benchmark {workload} {dtype}"
                if left() < plan.min_step_s:
                    steps.append({"name": name, "status": "skipped: budget spent", "seconds": 0.0})
                    check["benchmarks"].append({"workload": workload, "dtype": dtype, "status": "skipped: budget spent",
                                                "error": None, "result": None, "seconds": 0.0})
                    continue
                log(f"[check] {name} ...")
                step = _run_benchmark_step(plan, workload, dtype, Path(tmp) / f"{workload}-{dtype}", left())
                check["benchmarks"].append(step)
                steps.append({"name": name, "status": step["status"], "seconds": step["seconds"]})
                log(f"[check] {name}: {step['status']} ({step['seconds']:.1f} s)")

    check["elapsed_s"] = time.monotonic() - started
    check["ok"] = all(s["status"] == "ok" or s["status"].startswith("skipped: no tests") for s in steps)
    path = Path(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    check["report"] = str(path)
    path.write_text(render_report(check), encoding="utf-8")
    return check


# ---- the report ---------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _pytest_md(result: dict[str, Any] | None, dry_run: bool) -> list[str]:
    lines = ["## pytest -m gpu", ""]
    if result is None:
        return lines + ["Not run (see Steps)."]
    counts = result["counts"]
    lines += [f"`{result['command']}`: exit status {result['returncode']}"
              + (" (timed out)" if result["timed_out"] else "") + f", {result['seconds']:.1f} s.", "",
              "| passed | failed | errors | skipped | deselected |", "|---:|---:|---:|---:|---:|",
              f"| {counts['passed']} | {counts['failed']} | {counts['errors']} | {counts['skipped']} "
              f"| {counts['deselected']} |"]
    if dry_run:
        lines += ["", "Dry run on the CPU: the tests marked `gpu` skip without a CUDA device; the others are "
                      "deselected by `-m gpu`."]
    if result["failures"]:
        lines += ["", "Failures:", ""] + [f"- `{line}`" for line in result["failures"]]
    if result["skip_reasons"]:
        lines += ["", "Skip reasons:", ""] + [f"- {reason}" for reason in result["skip_reasons"][:8]]
    if result["timed_out"] or (result["returncode"] not in (0, 5) and not result["failures"]):
        lines += ["", "Last lines of its output:", "", "```"] + result["tail"] + ["```"]
    return lines


def _syncs_md(rows: list[dict[str, Any]], device: str) -> list[str]:
    lines = ["## Host syncs per training step", ""]
    if not rows:
        return lines + ["Not run (see Steps)."]
    cpu = torch.device(device).type != "cuda"
    lines += [
        "Counted with `torch.cuda.set_sync_debug_mode(\"warn\")` on the MLP workload: the warnings over a "
        "one-epoch fit of 4 and one of 12 batches, a fresh model each (after an uncounted warm-up fit); per "
        "step is their difference over the 8 steps, per fit what is left of the shorter fit's count (model "
        "placement, the epoch's bookkeeping, the evaluation's predictions). Every setting gets its batches "
        "from the same CPU DataLoader: the hand-written loop's count is the floor."
        + (" **n/a on CPU**: each setting trained one fit on the CPU, where nothing is counted." if cpu else ""),
        "",
        "| Setting | Syncs per step | Syncs per fit, outside the steps | Most frequent sources (file:line x count) |",
        "|---|---:|---:|---|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['label']} | failed | | {r['error']} |")
            continue
        if cpu:
            lines.append(f"| {r['label']} | n/a on CPU | n/a on CPU | |")
            continue
        sources = ", ".join(f"`{where}` x{n}" for where, n in r["sources"])
        lines.append(f"| {r['label']} | {r['per_step']:.2f} | {r['fixed']:.1f} | {sources} |")
    return lines


def _by_key(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["key"]: c for c in result["contenders"]}


def _auto_md(benchmarks: list[dict[str, Any]], workloads: tuple[str, ...], fit_epochs: int) -> list[str]:
    lines = ["## What amp_enabled='auto' chose", "",
             f"Each as in a {fit_epochs}-epoch fit (`--auto-fit-epochs`), its cache off, so that it measures "
             "in its fit's first steps.", "",
             "| Workload | " + " | ".join(CHECK_DTYPES) + " |", "|---|" + "---|" * len(CHECK_DTYPES)]
    cells = {(b["workload"], b["dtype"]): b for b in benchmarks}
    for workload in workloads:
        row = []
        for dtype in CHECK_DTYPES:
            b = cells.get((workload, dtype))
            auto = _by_key(b["result"]).get("ampnet-auto") if b and b["result"] else None
            choice = auto.get("auto_choice") if auto else None
            if choice:
                probe = [p for p in choice.get("cost_s", choice.get("probe_s")) or [] if p is not None]
                others = sorted(set(choice["per_round"]) - {choice["chosen"]})
                row.append(f"{choice['chosen']} ({choice['rounds']}/{len(choice['per_round'])} rounds"
                           + (f", measuring cost {max(probe):.2f} s" if probe else "") + ")"
                           + (f"; other rounds: {', '.join(others)}" if others else ""))
            else:
                row.append("n/a" if not b else (b["status"] if b["status"] != "ok" else "not run"))
        lines.append(f"| {workload} | " + " | ".join(row) + " |")
    return lines


def _benchmark_md(b: dict[str, Any]) -> list[str]:
    head = f"### {b['workload']}, {b['dtype']}"
    if b["result"] is None:
        return [head, "", f"{b['status']}" + (f": {b['error']}" if b["error"] else "") + "."]
    w = b["result"]
    fp32 = _by_key(w).get("raw-fp32")
    lines = [head, "", f"{w['title']}; batch {w['batch_size']}, {w['n_samples']} rows per epoch; "
                       f"{b['seconds']:.1f} s. `{b['command']}`", "",
             "| Contender | ms/batch | Time/epoch | x float32 loop | Peak memory | Final loss | Loss / fp32 loop |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in w["contenders"]:
        if not c["available"]:
            lines.append(f"| {c['key']} | not available: {c['error']} | | | | | |")
            continue
        ratio = c["median_s"] / fp32["median_s"] if fp32 and fp32.get("median_s") else None
        memory = c["memory"]["peak_mb"] if c.get("memory") else None
        lines.append(
            f"| {c['key']} | {_ms(c['ms_per_batch'])} | {c['median_s'] * 1000:.1f} ms | {_num(ratio, '.3f')} | "
            f"{_num(memory, ',.0f')} MB | {_num(c['final_loss'], '.4f')} | {_num(c.get('loss_vs_fp32'), '.4f')} |"
        )
    aa = w.get("aa_control")
    if aa:
        lines += ["", f"A/A spread ({aa['a']} against {aa['b']}): {100 * aa['spread']:.1f}%."]
    keys = ("ampnet_mixed_vs_fastest_peer", "ampnet_mixed_vs_best_loop", "ampnet_auto_vs_fastest_loop")
    comps = [c for c in w["comparisons"] if c["key"] in keys and c["median"] is not None]
    if comps:
        lines += ["", "| Comparison (per-round ratios) | Median | Verdict |", "|---|---:|---|"]
        lines += [f"| {c['label']} | {c['median']:.3f} | {c.get('verdict') or 'no A/A control'} |" for c in comps]
    return lines


def render_report(check: dict[str, Any]) -> str:
    """The check's Markdown report.

    Parameters
    ----------
    check : dict
      What :func:`run_check` collected (``plan``, ``machine``, ``pytest``,
      ``syncs``, ``benchmarks``, ``steps``, ``elapsed_s``, ``ok``).

    Returns
    -------
    str
      Sections: Machine (CPU flags, GPU), Steps, pytest -m gpu, Host syncs
      per training step, What amp_enabled='auto' chose, Benchmark.
    """
    plan = check["plan"]
    machine = check["machine"]
    from ampnet_bench.report import _machine_md

    title = "# ampnet GPU check" + (" (dry run on the CPU)" if plan["dry_run"] else "")
    verdict = "all steps ran and passed" if check["ok"] else "**some steps failed, timed out or were skipped**"
    lines = [
        title, "",
        f"Device `{plan['device']}`; {check['elapsed_s']:.0f} s of a {plan['budget_s']:.0f} s budget; {verdict}. "
        f"Written by `python -m ampnet.benchmark --check{' --dry-run' if plan['dry_run'] else ''}`.", "",
    ]
    if plan["dry_run"]:
        lines += ["Dry run: the same steps on the CPU at the workloads' quick sizes; its timings say nothing "
                  "about a GPU.", ""]
    lines += ["## Machine", ""] + _machine_md(machine) + [""]
    lines += ["## Steps", "", "| Step | Status | Seconds |", "|---|---|---:|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} |" for s in check["steps"]]
    lines += [""] + _pytest_md(check["pytest"], plan["dry_run"]) + [""]
    lines += _syncs_md(check["syncs"], plan["device"]) + [""]
    lines += _auto_md(check["benchmarks"], tuple(plan["workloads"]),
                      plan.get("auto_fit_epochs", CheckPlan.auto_fit_epochs)) + [""]
    lines += ["## Benchmark", "",
              f"{plan['rounds']} rounds of {plan['epochs']} measured epoch(s) after {plan['warmup']} warm-up "
              f"epoch(s), all runs of a workload and dtype in one process (a check, not the fresh-process "
              f"measurement), optimizer {plan['optimizer']}; times are medians over rounds.", ""]
    for b in check["benchmarks"]:
        lines += _benchmark_md(b) + [""]
    return "\n".join(lines).rstrip() + "\n"
