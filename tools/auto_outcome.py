"""The outcome of ``amp_enabled='auto'``: is a whole fit with ``'auto'`` as fast as
the faster of ``amp_enabled=True`` and ``amp_enabled=False``?

For every model workload of the benchmark (``ampnet_bench.workloads.MODEL_WORKLOADS``)
and fit length (``--epochs``), a whole fit (module construction, ``AmpNetClassifier``
construction and ``net.fit``, timed end to end; the data are generated before the clock
starts) runs in a fresh process per setting:

- ``auto-cold``: ``amp_enabled='auto'`` with a fresh, empty ``AMPNET_CACHE_DIR`` (the
  first fit ever on this machine);
- ``auto-warm``: ``'auto'`` with a copy of a cache directory pre-filled by one untimed
  ``'auto'`` fit of the same workload and length (the stored choice is read);
- ``true`` and ``false``: ``amp_enabled=True`` / ``False``;
- ``true-aa``: ``amp_enabled=True`` again (the A/A control);
- ``pinned``: only where the pre-filling fit chose something other than plain True or
  False (pure weights, channels_last): its parameters, pinned (the memory reference).

The nets are configured as the benchmark's AmpNet contenders are (AdamW, lr 1e-3, the
workload's batch size, ``train_split=None``, a seeded shuffling ``DataLoader``), with
``amp_dtype`` left at ``'auto'`` (bfloat16 on a CPU). The settings are interleaved within
each round in a rotating order. Per workload and length the tool reports the medians over
rounds, the median of the per-round ratios auto / min(True, False) (target <= 1.05),
auto's choice and whether it was the faster one where True and False differ by more
than 10%, auto's peak RSS over the setting pinned to its choice (target <= 1.05), and
the A/A spread. Run it on a quiet machine::

    python tools/auto_outcome.py --rounds 3 --out auto-outcome.json --markdown auto-outcome.md

``--quick`` uses the workloads' tiny sizes (smoke tests). ``--device cuda`` trains on
the GPU (``amp_dtype`` 'auto': bfloat16 where the GPU has it); the memory compared is
then the GPU's peak allocation (``torch.cuda.max_memory_allocated``), not the RSS.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The settings timed in every round (``pinned`` is added where a choice needs it).
SETTINGS = ("auto-cold", "auto-warm", "true", "false", "true-aa")
#: The constructor parameters of each setting (``pinned`` takes the pre-filling fit's choice).
PARAMS = {"auto-cold": {"amp_enabled": "auto"}, "auto-warm": {"amp_enabled": "auto"},
          "true": {"amp_enabled": True}, "false": {"amp_enabled": False}, "true-aa": {"amp_enabled": True}}
TARGET = 1.05  # auto / min(True, False), and auto's peak RSS / its pinned choice's
DECISIVE = 0.10  # True and False differ by more than this: auto must pick the faster one


# ---- the worker (one fit in this fresh process) ----------------------------------------------


def fit_once(workload: str, epochs: int, params: dict[str, Any], quick: bool, threads: int,
             device: str = "cpu") -> dict[str, Any]:
    """Build and fit one net; its wall time, precision, auto's choice and peak RSS.

    Parameters
    ----------
    workload : str
        A name of ``MODEL_WORKLOADS``.
    epochs : int
        ``max_epochs`` of the fit.
    params : dict
        AMP constructor parameters (``amp_enabled`` and, for ``pinned``, auto's choice).
    quick : bool
        The workload's tiny sizes.
    threads : int
        torch intra-op threads.
    device : str
        The net's ``device``.

    Returns
    -------
    dict
        ``wall_s``, ``precision`` (``net.precision_policy_.name``), ``chosen``, ``params``
        and ``autotune`` (auto only, else None), ``epoch_s`` (skorch's ``dur`` of each epoch),
        ``warnings`` (distinct messages), ``max_rss_kb`` (on CUDA: the GPU's peak allocation).
    """
    import warnings

    import torch

    from ampnet import AmpNetClassifier
    from ampnet_bench.workloads import get_workload

    torch.set_num_threads(threads)
    wl = get_workload(workload, quick=quick)
    data = wl.make_data(0)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = AmpNetClassifier(
        module=wl.build_module(0), criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.AdamW,
            lr=1e-3, batch_size=wl.batch_size, max_epochs=epochs, train_split=None, verbose=0,
            iterator_train__shuffle=True, iterator_train__generator=torch.Generator().manual_seed(1),
            device=device, **params,
        )
        net.fit(data.X, data.y)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    peak_kb = (torch.cuda.max_memory_allocated() // 1024 if device.startswith("cuda")
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    tune = net.__dict__.get("amp_autotune_")
    tuned = params.get("amp_enabled") == "auto" and tune is not None
    chosen = getattr(tune, "params", None) if tuned else None
    return {
        "wall_s": wall, "precision": net.precision_policy_.name, "epoch_s": list(net.history[:, "dur"]),
        "warnings": list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)),
        "chosen": getattr(tune, "chosen", None) if tuned else None,
        "params": {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                   for k, v in chosen.items()} if isinstance(chosen, dict) else None,
        "autotune": str(tune) if tuned else None,
        "max_rss_kb": peak_kb,
    }


# ---- pure functions (summaries) -------------------------------------------------------------


def median_ratio(numerators: Sequence[float], trues: Sequence[float], falses: Sequence[float]) -> float:
    """The median over rounds of ``numerator / min(true, false)`` (one triple per round)."""
    return statistics.median(n / min(t, f) for n, t, f in zip(numerators, trues, falses, strict=True))


def relative_spread(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of ``|a - b| / min(a, b)`` (the A/A control)."""
    return statistics.median(abs(x - y) / min(x, y) for x, y in zip(a, b, strict=True))


def right_choice(true_s: float, false_s: float, chose_amp: bool, decisive: float = DECISIVE) -> bool | None:
    """Whether auto chose the faster of True and False; None when they differ by at most
    ``decisive`` (relative to the faster), where either choice is right."""
    if max(true_s, false_s) / min(true_s, false_s) - 1 <= decisive:
        return None
    return chose_amp == (true_s < false_s)


def pinned_setting(run: dict[str, Any]) -> str:
    """The setting that pins an auto fit's choice: ``'false'`` (float32), ``'true'``
    (mixed, default masters, contiguous) or ``'pinned'`` (anything else)."""
    params = run.get("params") or {}
    if params.get("memory_format", "preserve") not in ("preserve", None):
        return "pinned"
    if run["precision"] == "float32":
        return "false"
    mixed = run["precision"].endswith("(mixed)") and params.get("amp_master_weights", True) is True
    return "true" if mixed else "pinned"


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, epochs): medians, ratios, choice, right choice, RSS, A/A."""
    groups: dict[tuple[str, int], dict[int, dict[str, dict[str, Any]]]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["epochs"]), {}).setdefault(run["round"], {})[run["setting"]] = run
    rows = []
    for (workload, epochs), by_round in groups.items():
        rounds = [r for _, r in sorted(by_round.items()) if all(s in r for s in SETTINGS)]
        if not rounds:
            continue
        col = {s: [r[s]["wall_s"] for r in rounds] for s in SETTINGS}
        medians = {s: statistics.median(col[s]) for s in SETTINGS}
        autos = [r[s] for r in rounds for s in ("auto-cold", "auto-warm")]
        verdicts = [right_choice(medians["true"], medians["false"], a["precision"] != "float32") for a in autos]
        rss = {s: [r[s]["max_rss_kb"] / r[pinned_setting(r[s])]["max_rss_kb"] for r in rounds
                   if pinned_setting(r[s]) in r] for s in ("auto-cold", "auto-warm")}
        choices = collections.Counter(a["chosen"] or a["precision"] for a in autos)
        row = {
            "workload": workload, "epochs": epochs, "rounds": len(rounds),
            "median_s": medians,
            "cold_ratio": median_ratio(col["auto-cold"], col["true"], col["false"]),
            "warm_ratio": median_ratio(col["auto-warm"], col["true"], col["false"]),
            "choices": dict(choices),
            "faster": "True" if medians["true"] < medians["false"] else "False",
            "true_false_differ": max(medians["true"], medians["false"]) / min(medians["true"], medians["false"]) - 1,
            "right_choice": None if all(v is None for v in verdicts) else all(v is not False for v in verdicts),
            "wrong_choices": sum(v is False for v in verdicts), "auto_fits": len(autos),
            "rss_ratio": statistics.median(rss["auto-cold"] + rss["auto-warm"]) if any(rss.values()) else None,
            "rss_cold": statistics.median(rss["auto-cold"]) if rss["auto-cold"] else None,
            "rss_warm": statistics.median(rss["auto-warm"]) if rss["auto-warm"] else None,
            "aa_spread": relative_spread(col["true"], col["true-aa"]),
        }
        row.update(cold_meets=row["cold_ratio"] <= TARGET, warm_meets=row["warm_ratio"] <= TARGET,
                   rss_meets=None if row["rss_ratio"] is None else row["rss_ratio"] <= TARGET,
                   **{f"rss_{k}_meets": None if row[f"rss_{k}"] is None else row[f"rss_{k}"] <= TARGET
                      for k in ("cold", "warm")})
        rows.append(row)
    return rows


def machine_line(machine: dict[str, Any], threads: int) -> str:
    """CPU, its bf16 flags, cores, threads, torch and the date, in one line."""
    flags = machine.get("cpu_flags", {})
    have = ", ".join(f"{f} {'yes' if flags.get(f) else 'no'}" for f in ("avx512_bf16", "amx_bf16"))
    gpu = machine.get("gpu")
    on = f"GPU {gpu['name']} (capability {'.'.join(map(str, gpu['capability']))}), host CPU " if gpu else ""
    return (f"Machine: {on}{machine['cpu_model']} ({have}); {machine['usable_cores']} usable of "
            f"{machine['logical_cores']} cores, {threads} threads; torch {machine['torch']}; "
            f"{machine['date_utc']} UTC")


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any], threads: int) -> str:
    """The Markdown table of :func:`summarize`'s rows, headed by the machine line."""
    def ratio(value: float | None, meets: bool | None) -> str:
        return "-" if value is None else f"{value:.3f}" + ("" if meets else " MISS")

    head = ("workload", "epochs", "auto cold s", "auto warm s", "True s", "False s", "cold ratio",
            "warm ratio", "choice", "right?", "A/A", "RSS cold/pinned", "RSS warm/pinned")
    lines = [machine_line(machine, threads), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r["median_s"]
        choice = ", ".join(f"{c} {n}/{r['auto_fits']}" for c, n in r["choices"].items()) if len(r["choices"]) > 1 \
            else next(iter(r["choices"]))
        right = ("n/a (<=10%)" if r["right_choice"] is None else "yes" if r["right_choice"]
                 else f"no ({r['wrong_choices']}/{r['auto_fits']})")
        cells = (r["workload"], str(r["epochs"]), *(f"{m[s]:.2f}" for s in ("auto-cold", "auto-warm", "true", "false")),
                 ratio(r["cold_ratio"], r["cold_meets"]), ratio(r["warm_ratio"], r["warm_meets"]),
                 choice, f"{right}; {r['faster']} faster by {r['true_false_differ']:.0%}",
                 f"{r['aa_spread']:.1%}", ratio(r["rss_cold"], r["rss_cold_meets"]),
                 ratio(r["rss_warm"], r["rss_warm_meets"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Ratios: median over rounds of auto / min(True, False) and auto's peak RSS over the "
                  f"setting pinned to its choice; target <= {TARGET} (MISS: not met; on a GPU, its peak allocation). right?: auto chose the "
                  f"faster of True and False where they differ by more than {DECISIVE:.0%}."]
    return "\n".join(lines) + "\n"


# ---- the driver -------------------------------------------------------------------------------


def spawn(workload: str, epochs: int, params: dict[str, Any], cache_dir: str,
          args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`fit_once` in a fresh interpreter with ``AMPNET_CACHE_DIR=cache_dir``,
    ``OMP_NUM_THREADS=args.threads`` and the benchmark's recommended malloc settings."""
    from ampnet_bench.machine import RECOMMENDED_MALLOC_ENV

    job = {"workload": workload, "epochs": epochs, "params": params, "quick": args.quick, "threads": args.threads,
           "device": args.device}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "AMPNET_CACHE_DIR": cache_dir,
           **dict(item.split("=", 1) for item in RECOMMENDED_MALLOC_ENV.split())}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(job)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"fit {job} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All rounds of all (workload, epochs, setting) fits; writes ``--out``/``--markdown``."""
    from ampnet_bench.machine import describe_machine

    machine = describe_machine()
    combos = [(w, e) for w in args.workloads for e in args.epochs]
    base = tempfile.mkdtemp(prefix="auto-outcome-")
    result: dict[str, Any] = {"machine": machine, "config": vars(args), "runs": [], "prefill": {}, "rows": []}
    try:
        plan = {}  # per (workload, epochs): its settings ('pinned' where the choice needs it)
        for workload, epochs in combos:  # the warm caches: one untimed auto fit each
            prefill = os.path.join(base, f"prefill-{workload}-{epochs}")
            os.makedirs(prefill)
            first = spawn(workload, epochs, PARAMS["auto-cold"], prefill, args)
            result["prefill"][f"{workload}/{epochs}"] = first
            pin = pinned_setting(first) == "pinned" and first["params"]
            plan[workload, epochs] = SETTINGS + (("pinned",) if pin else ())
        for rnd in range(args.rounds):
            for workload, epochs in combos:
                order = plan[workload, epochs]
                for setting in order[rnd % len(order):] + order[: rnd % len(order)]:
                    cache = tempfile.mkdtemp(dir=base)  # empty: a cold cache
                    if setting == "auto-warm":
                        shutil.copytree(os.path.join(base, f"prefill-{workload}-{epochs}"), cache, dirs_exist_ok=True)
                    params = (result["prefill"][f"{workload}/{epochs}"]["params"] if setting == "pinned"
                              else PARAMS[setting])
                    out = spawn(workload, epochs, params, cache, args)
                    shutil.rmtree(cache, ignore_errors=True)
                    result["runs"].append({"workload": workload, "epochs": epochs, "round": rnd,
                                           "setting": setting, **out})
                    print(f"round {rnd + 1}/{args.rounds} {workload} {epochs} ep {setting:9s} "
                          f"{out['wall_s']:8.2f} s  {out['precision']}", file=sys.stderr, flush=True)
            result["rows"] = summarize(result["runs"])
            write(result, args)  # after every round: an interrupted run keeps what it measured
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the JSON results and the Markdown table where asked."""
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(markdown(result["rows"], result["machine"], args.threads), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point (``--one JSON``: the worker mode)."""
    from ampnet_bench.workloads import MODEL_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--one", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--workloads", default=",".join(MODEL_WORKLOADS), help="comma-separated (default: all models)")
    p.add_argument("--epochs", default="1,3,10", help="fit lengths, comma-separated (default: 1,3,10)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved fits (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS and torch threads (default: 2)")
    p.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (smoke tests)")
    p.add_argument("--device", default="cpu", help="the nets' device, e.g. cuda (default: cpu)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the table as Markdown")
    args = p.parse_args(argv)
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(fit_once(job["workload"], job["epochs"], job["params"], job["quick"], job["threads"],
                                  job.get("device", "cpu"))))
        return 0
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(args.workloads) - set(MODEL_WORKLOADS))
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(MODEL_WORKLOADS)}")
    args.epochs = [int(e) for e in args.epochs.split(",") if e]
    if args.rounds < 1 or args.threads < 1 or not args.epochs or min(args.epochs) < 1:
        p.error("--rounds, --threads and every --epochs must be positive")
    result = run(args)
    print(markdown(result["rows"], result["machine"], args.threads), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
