"""The performance page's overhead-regime table, generated from one JSON file.

``tools/overhead_benchmark.py`` runs :func:`overhead_command` (the overhead
workload on the CPU, one thread, every run a fresh process, interleaved
rounds), keeps of its ``results.json`` what the page shows
(:func:`summarize_overhead`), writes it to
``docs/_data/benchmark_overhead_cpu.json`` and rewrites the table between the
page's markers (:func:`update_overhead_section`). Until then the file holds a
placeholder (:func:`placeholder_overhead`): every figure None, shown as "not
yet measured on a quiet machine".
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any, Mapping

from ampnet_bench.contenders import overhead_contenders
from ampnet_bench.docs_tables import PLACEHOLDER
from ampnet_bench.workloads import OVERHEAD_STEPS, Target

__all__ = [
    "OVERHEAD_LABELS",
    "OVERHEAD_MARKER",
    "OVERHEAD_RUN",
    "OVERHEAD_TARGETS",
    "UNMEASURED",
    "overhead_command",
    "overhead_markdown",
    "placeholder_overhead",
    "summarize_overhead",
    "update_overhead_section",
]

#: The run of the page's table (options of ``python -m ampnet.benchmark``): one torch thread, SGD with
#: momentum, every run (one contender, one round) a fresh process, 5 interleaved rounds.
OVERHEAD_RUN: tuple[str, ...] = (
    "--workload", "overhead", "--device", "cpu", "--threads", "1", "--optimizer", "sgd", "--rounds", "5",
    "--epochs", "3", "--warmup", "1", "--isolation", "process", "--memory", "off",
    "--contenders", ",".join(overhead_contenders("cpu")),
)

#: The page's name for each contender of the table, in the table's order.
OVERHEAD_LABELS: Mapping[str, str] = MappingProxyType({
    "raw-careful": "careful hand loop: tensors indexed once per batch, fused SGD, bf16 autocast, loss read "
                   "once an epoch",
    "raw-careful-aa": "same, A/A control",
    "raw-careful-fp32": "careful hand loop, float32",
    "raw-item-amp": "hand loop with a DataLoader over a TensorDataset, `loss.item()` each step, bf16",
    "raw-item-fp32": "hand loop with a DataLoader over a TensorDataset, `loss.item()` each step, float32",
    "skorch-fp32": "skorch `NeuralNetClassifier`, float32",
    "ampnet-fp32": "AmpNet `amp_enabled=False`",
    "ampnet-auto": "AmpNet `amp_enabled=\"auto\"`",
    "ampnet-mixed": "AmpNet `amp_enabled=True` (default bf16)",
})

#: Issue 37's targets on this workload: (comparison key, target, what the page says).
OVERHEAD_TARGETS: tuple[tuple[str, Target, str], ...] = (
    ("ampnet_mixed_vs_careful", Target("ampnet_mixed_vs_careful", "<=", 1.10),
     "AmpNet default: time a step / the careful loop's"),
    ("ampnet_mixed_vs_skorch", Target("ampnet_mixed_vs_skorch", ">", 1.0),
     "AmpNet default: speed-up over skorch (float32)"),
    ("ampnet_fp32_vs_skorch", Target("ampnet_fp32_vs_skorch", "<", 1.0),
     "AmpNet `amp_enabled=False`: time a step / skorch's"),
)

#: The name of the page's markers: ``% begin generated benchmark table: overhead-cpu``.
OVERHEAD_MARKER = "overhead-cpu"


def overhead_command() -> str:
    """The command the page's table is measured with."""
    return "python -m ampnet.benchmark " + " ".join(OVERHEAD_RUN)


def placeholder_overhead() -> dict[str, Any]:
    """The JSON of an unmeasured table: every figure None."""
    return {
        "measured": False,
        "command": "python tools/overhead_benchmark.py",
        "machine": None,
        "steps_per_epoch": OVERHEAD_STEPS,
        "aa_spread": None,
        "auto_choice": None,
        "rows": [{"key": key, "label": label, "us_per_step": None, "x_careful": None, "error": None}
                 for key, label in OVERHEAD_LABELS.items()],
        "targets": [{"key": key, "what": what, "target": target.text(), "measured": None, "met": None}
                    for key, target, what in OVERHEAD_TARGETS],
    }


def summarize_overhead(results: dict[str, Any]) -> dict[str, Any]:
    """What the page shows of a benchmark run of the overhead workload.

    Parameters
    ----------
    results : dict
      The run's results document (``results.json``), its workload ``overhead``.

    Returns
    -------
    dict
      ``measured`` (True), ``command``, ``machine``, ``steps_per_epoch``,
      ``aa_spread``, ``auto_choice``, ``rows`` (per contender of
      :data:`OVERHEAD_LABELS`: µs a step, the median over rounds of the time
      over the careful loop's in the same round, and why it did not run) and
      ``targets`` (per :data:`OVERHEAD_TARGETS`: the median, whether met).

    Raises
    ------
    ValueError
      The results hold no ``overhead`` workload, or it ran without the careful loop.
    """
    workload = next((w for w in results["workloads"] if w["name"] == "overhead"), None)
    if workload is None:
        raise ValueError("the results hold no 'overhead' workload; run python tools/overhead_benchmark.py")
    if workload["reference"] != "raw-careful":
        raise ValueError(f"the overhead run's reference is {workload['reference']!r}, not the careful loop "
                         "'raw-careful'; run it with the contenders of tools/overhead_benchmark.py")
    by_key = {c["key"]: c for c in workload["contenders"]}
    rows = []
    for key, label in OVERHEAD_LABELS.items():
        c = by_key.get(key)
        median = c["median_s"] if c else None
        rows.append({
            "key": key, "label": label,
            "us_per_step": None if median is None else 1e6 * median / workload["n_batches"],
            "x_careful": c["ratio_to_reference"]["median"] if c else None,
            "error": None if c is None or c["available"] else c["error"],
        })
    comps = {c["key"]: c for c in workload["comparisons"]}
    targets = []
    for key, target, what in OVERHEAD_TARGETS:
        measured = comps[key]["median"] if key in comps else None
        targets.append({"key": key, "what": what, "target": target.text(), "measured": measured,
                        "met": None if measured is None else target.met(measured)})
    auto = by_key.get("ampnet-auto")
    aa = workload.get("aa_control")
    return {
        "measured": True,
        "command": "python tools/overhead_benchmark.py",
        "machine": results["machine"],
        "steps_per_epoch": workload["n_batches"],
        "aa_spread": None if aa is None else aa["spread"],
        "auto_choice": None if not auto or not auto.get("auto_choice") else auto["auto_choice"]["chosen"],
        "rows": rows,
        "targets": targets,
    }


#: A cell of a figure not measured (the line above the table says why).
UNMEASURED = "–"


def _cell(value: float | None, fmt: str) -> str:
    return UNMEASURED if value is None else format(value, fmt)


def overhead_markdown(data: dict[str, Any]) -> list[str]:
    """The page's lines for ``data`` (:func:`summarize_overhead` or
    :func:`placeholder_overhead`): the machine line, the table (µs a step
    and x the careful loop per contender) and the targets."""
    m = data.get("machine")
    if data.get("measured") and m:
        flags = m["cpu_flags"]
        head = (f"Measured on {m['cpu_model']} (avx512_bf16: {'yes' if flags.get('avx512_bf16') else 'no'}, "
                f"amx_bf16: {'yes' if flags.get('amx_bf16') else 'no'}), torch {m['torch']}, skorch "
                f"{m['skorch']}, ampnet {m['ampnet']}"
                + (f" (commit {m['ampnet_commit']})" if m.get("ampnet_commit") else "")
                + f", {m['date_utc']} UTC, load average at start "
                f"{' '.join(map(str, m['load_average_at_start'] or []))}; with `{data['command']}`.")
    else:
        head = f"**Figures: {PLACEHOLDER}.** Measure them with `{data['command']}`."
    lines = [head, "", "| contender | µs/step | x careful loop |", "|---|---:|---:|"]
    for r in data["rows"]:
        if r["error"]:
            lines.append(f"| {r['label']} | not available: {r['error']} | |")
            continue
        lines.append(f"| {r['label']} | {_cell(r['us_per_step'], '.0f')} | {_cell(r['x_careful'], '.2f')} |")
    spread = data.get("aa_spread")
    lines += ["", f"A/A spread: {UNMEASURED if spread is None else f'{100 * spread:.1f}%'}. "
                  f"`amp_enabled=\"auto\"` chose: {data.get('auto_choice') or UNMEASURED}.", "",
              "| target | wanted | measured (median of per-round ratios) | met |", "|---|---|---:|---|"]
    for t in data["targets"]:
        met = UNMEASURED if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['what']} | {t['target']} | {_cell(t['measured'], '.3f')} | {met} |")
    return lines


_BEGIN = f"% begin generated benchmark table: {OVERHEAD_MARKER}"
_END = f"% end generated benchmark table: {OVERHEAD_MARKER}"


def update_overhead_section(text: str, data: dict[str, Any]) -> str:
    """``text`` (the performance page) with the lines between ``% begin
    generated benchmark table: overhead-cpu`` and its ``% end`` line
    replaced by :func:`overhead_markdown` of ``data``.

    Raises
    ------
    ValueError
      The page has no such markers.
    """
    pattern = re.compile(rf"^{re.escape(_BEGIN)}\n.*?^{re.escape(_END)}$", re.M | re.S)
    if not pattern.search(text):
        raise ValueError(f"the page has no markers {_BEGIN!r} ... {_END!r}; add them where the table goes")
    block = "\n".join([_BEGIN, *overhead_markdown(data), "", _END])
    return pattern.sub(lambda m: block, text)
