"""The performance page's per-workload sections: a table and a chart per
model workload, generated from one JSON file.

``tools/benchmark_figure.py --measure`` runs :func:`docs_command` for every
workload of :data:`~ampnet_bench.workloads.MODEL_WORKLOADS`, keeps of each
``results.json`` what the page shows (:func:`summarize`), writes it to
``docs/_data/benchmark_workloads.json``, rewrites the tables between the
page's markers (:func:`update_page`) and draws the charts
(:func:`build_chart`). Until then the file holds placeholders
(:func:`placeholder_data`): every figure None, shown as "not yet measured on
a quiet machine".
"""

from __future__ import annotations

import math
import statistics
import re
import textwrap
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from ampnet_bench.config import AUTO_FIT_EPOCHS
from ampnet_bench.contenders import CONTENDERS, HEADLINE_CONTENDERS
from ampnet_bench.workloads import MODEL_WORKLOADS, Target, get_workload

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DOCS_LABELS",
    "DOCS_RUN",
    "PLACEHOLDER",
    "TARGET_KEYS",
    "build_chart",
    "docs_command",
    "machine_markdown",
    "measure_command",
    "placeholder_data",
    "summarize",
    "table_markdown",
    "update_page",
]

#: What the page shows where a figure has not been measured.
PLACEHOLDER = "not yet measured on a quiet machine"

#: The run lengths and settings of the docs' measurement (command-line options of the benchmark).
#: Fresh processes (the benchmark's default): 9 contenders x 3 rounds = 27 runs per workload.
DOCS_RUN: tuple[str, ...] = (
    "--optimizer", "adamw", "--threads", "2", "--rounds", "3", "--epochs", "2", "--warmup", "1",
    "--contenders", ",".join(HEADLINE_CONTENDERS),
)

#: The page's name for each contender of the tables.
DOCS_LABELS: Mapping[str, str] = MappingProxyType({
    "raw-fp32": "PyTorch loop, float32",
    "raw-amp": "PyTorch loop, autocast",
    "raw-amp-aa": "same, A/A control",
    "raw-amp-fused": "PyTorch loop, autocast + fused AdamW",
    "skorch-accelerate": "skorch + accelerate",
    "lightning": "Lightning",
    "ampnet-mixed": "AmpNet, amp_enabled=True (defaults)",
    "ampnet-auto": "AmpNet, amp_enabled='auto' (probe included)",
    "ampnet-pure-comp": "AmpNet, compensated pure",
})

#: The comparisons the page states each workload's targets with.
TARGET_KEYS = ("ampnet_mixed_vs_fastest_peer", "ampnet_mixed_vs_best_loop", "ampnet_auto_vs_fastest_loop")

_TARGET_TEXT: Mapping[str, tuple[str, str]] = MappingProxyType({
    "ampnet_mixed_vs_fastest_peer": ("AmpNet defaults: speed-up over the fastest peer", ">= 1.0"),
    "ampnet_mixed_vs_best_loop": ("AmpNet defaults: time / fused autocast loop's", "<= 1.053 (>= 0.95x)"),
    "ampnet_auto_vs_fastest_loop": ("auto: speed-up over the fastest of the float32 and fused loops", ">= 0.97"),
    "ampnet_auto_10_epochs": ("auto, its probe spread over a 10-epoch fit: speed-up over the fastest of the float32 "
                              "and fused loops", ">= 0.97"),
})

#: The page's targets (issue 27's, for every workload), judged here from the measured medians
#: whatever targets a workload's own report judges (the MLP and CNN keep earlier issues' there).
_PAGE_TARGETS: Mapping[str, Target] = MappingProxyType({
    "ampnet_mixed_vs_fastest_peer": Target("ampnet_mixed_vs_fastest_peer", ">=", 1.0),
    "ampnet_mixed_vs_best_loop": Target("ampnet_mixed_vs_best_loop", "<=", 1 / 0.95),
    "ampnet_auto_vs_fastest_loop": Target("ampnet_auto_vs_fastest_loop", ">=", 0.97),
    "ampnet_auto_10_epochs": Target("ampnet_auto_10_epochs", ">=", 0.97),
})

#: Measured epochs per run of the page's command (``docs_command``): an epoch of the auto contender
#: carries 1/EPOCHS of its probe.
MEASURED_EPOCHS = 2


def _auto_over_10_epochs(workload: dict[str, Any]) -> float | None:
    """The median, over the rounds, of the fastest of the float32 and fused loops' epoch time over
    the auto contender's, with its probe spread over 10 epochs instead of the measured ones."""
    by_key = {c["key"]: c for c in workload["contenders"]}
    auto = by_key.get("ampnet-auto")
    loops = [by_key.get(k) for k in ("raw-fp32", "raw-amp-fused")]
    if not auto or not auto.get("auto_choice") or not all(loops) or not all(c["available"] for c in [auto, *loops]):
        return None
    probes = auto["auto_choice"].get("cost_s", auto["auto_choice"].get("probe_s")) or []
    ratios = []
    for r, (t, probe) in enumerate(zip(auto["round_times_s"], probes)):
        best = [c["round_times_s"][r] for c in loops if r < len(c["round_times_s"]) and c["round_times_s"][r]]
        if not t or not best or probe is None:
            continue
        over_10 = t - probe / MEASURED_EPOCHS + probe / AUTO_FIT_EPOCHS
        ratios.append(min(best) / over_10)
    return statistics.median(ratios) if ratios else None

_FRAMEWORK: Mapping[str, str] = MappingProxyType({c.key: c.framework for c in CONTENDERS})


def docs_command(workload: str) -> list[str]:
    """The benchmark's command-line arguments for one workload of the page
    (``python -m ampnet.benchmark`` followed by these)."""
    return ["--workload", workload, *DOCS_RUN]


def _label(key: str) -> str:
    return DOCS_LABELS.get(key, key)


def placeholder_data() -> dict[str, Any]:
    """The page's data before a measurement: every model workload at its
    full size with its contenders, every figure None.

    Returns
    -------
    dict
      ``{"measured": False, "source", "command", "machine": None, "workloads": [...]}``
      in the layout :func:`summarize` gives.
    """
    workloads = []
    for name in MODEL_WORKLOADS:
        wl = get_workload(name)
        workloads.append({
            "name": name, "title": wl.title, "batch_size": wl.batch_size, "n_samples": wl.n_samples,
            "n_batches": wl.n_batches, "aa_spread": None, "auto_choice": None,
            "rows": [_row(key) for key in HEADLINE_CONTENDERS],
            "targets": [{"key": k, "median": None, "met": None, "verdict": None} for k in TARGET_KEYS],
        })
    return {"measured": False, "source": PLACEHOLDER, "command": measure_command(), "machine": None,
            "workloads": workloads}


def measure_command() -> str:
    """The one command that measures every workload and regenerates the page's tables and charts."""
    return "python tools/benchmark_figure.py --measure"


def _row(key: str, **figures: Any) -> dict[str, Any]:
    row = {"key": key, "label": _label(key), "framework": _FRAMEWORK.get(key, "raw"), "error": None,
           "epoch_s": None, "ms_per_batch": None, "min_ms": None, "max_ms": None, "x_fp32_loop": None,
           "peak_mb": None, "state_mib": None, "final_loss": None, "loss_vs_fp32": None}
    row.update(figures)
    return row


def _finite(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def summarize(workload: dict[str, Any]) -> dict[str, Any]:
    """What the page shows of one workload of a ``results.json``.

    Parameters
    ----------
    workload : dict
      One entry of the results document's ``workloads``.

    Returns
    -------
    dict
      ``name``, ``title``, ``batch_size``, ``n_samples``, ``n_batches``,
      ``aa_spread``, ``auto_choice`` (in words, or None), ``rows`` (one per
      contender: ``epoch_s``, ``ms_per_batch`` with the fastest and slowest
      round's ``min_ms``/``max_ms``, ``x_fp32_loop`` (median per-round time
      ratio), ``peak_mb``, ``state_mib``, ``final_loss``, ``loss_vs_fp32``;
      None where not measured, with ``error``) and ``targets``.
    """
    n_batches = workload["n_batches"]
    rows = []
    for c in workload["contenders"]:
        if not c["available"]:
            rows.append(_row(c["key"], error=c.get("error") or "not available"))
            continue
        rounds = [t for t in c["round_times_s"] if t]
        state = c.get("state_bytes") or {}
        rows.append(_row(
            c["key"], epoch_s=c["median_s"], ms_per_batch=c["ms_per_batch"],
            min_ms=1000 * min(rounds) / n_batches, max_ms=1000 * max(rounds) / n_batches,
            x_fp32_loop=_finite(c["ratio_to_reference"]["median"]),
            peak_mb=(c.get("memory") or {}).get("peak_mb"),
            state_mib=state["total"] / 2**20 if state.get("total") else None,
            final_loss=_finite(c["final_loss"]), loss_vs_fp32=_finite(c.get("loss_vs_fp32")),
        ))
    comps = {c["key"]: c for c in workload["comparisons"]}
    targets = [{"key": k, "median": comps[k]["median"] if k in comps else None,
                "met": (_PAGE_TARGETS[k].met(comps[k]["median"])
                        if k in comps and comps[k]["median"] is not None else None),
                "verdict": comps[k]["verdict"] if k in comps else None} for k in TARGET_KEYS]
    ten = _auto_over_10_epochs(workload)
    targets.append({"key": "ampnet_auto_10_epochs", "median": ten, "verdict": "probe spread over 10 epochs",
                    "met": _PAGE_TARGETS["ampnet_auto_10_epochs"].met(ten) if ten is not None else None})
    auto = next((c.get("auto_choice") for c in workload["contenders"] if c.get("auto_choice")), None)
    aa = workload.get("aa_control")
    return {
        "name": workload["name"], "title": workload["title"], "batch_size": workload["batch_size"],
        "n_samples": workload["n_samples"], "n_batches": n_batches,
        "aa_spread": aa["spread"] if aa else None,
        "auto_choice": (f"{auto['chosen']} ({auto['rounds']} of {len(auto['per_round'])} rounds)"
                        if auto else None),
        "rows": rows, "targets": targets,
    }


# ---- the page's tables ---------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return PLACEHOLDER
    return f"{value:.3f} s" if value >= 1 else f"{value * 1000:.1f} ms"


def _fmt(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def table_markdown(entry: dict[str, Any]) -> list[str]:
    """One workload's table, its A/A spread, auto's choice and its targets.

    Parameters
    ----------
    entry : dict
      One workload of the page's data (:func:`summarize`, :func:`placeholder_data`).

    Returns
    -------
    list of str
      Markdown lines; figures not measured read :data:`PLACEHOLDER` or ``-``.
    """
    lines = [
        f"{entry['title']}; batch {entry['batch_size']}, {entry['n_samples']} rows "
        f"({entry['n_batches']} batches) per epoch.",
        "",
        "| contender | epoch | ms per batch | x float32 loop (per round) | peak RSS | state | final loss "
        "| loss / fp32 loop |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in entry["rows"]:
        if r["error"]:
            lines.append(f"| {r['label']} | not available: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {_seconds(r['epoch_s'])} | {_fmt(r['ms_per_batch'], '.1f')} | "
            f"{_fmt(r['x_fp32_loop'], '.3f')} | {_fmt(r['peak_mb'], ',.0f', ' MB')} | "
            f"{_fmt(r['state_mib'], '.2f', ' MiB')} | {_fmt(r['final_loss'], '.4f')} | "
            f"{_fmt(r['loss_vs_fp32'], '.4f')} |"
        )
    spread = PLACEHOLDER if entry["aa_spread"] is None else f"{100 * entry['aa_spread']:.1f}%"
    lines += ["", f"A/A spread: {spread}. `amp_enabled='auto'` chose: {entry['auto_choice'] or PLACEHOLDER}.",
              "", "| target | measured (median of per-round ratios) | met |", "|---|---:|---|"]
    for t in entry["targets"]:
        label, bound = _TARGET_TEXT[t["key"]]
        if t["median"] is None:
            lines.append(f"| {label} {bound} | {PLACEHOLDER} | |")
            continue
        met = met_cell(t["met"], t["verdict"])
        lines.append(f"| {label} {bound} | {t['median']:.3f} ({t['verdict'] or 'no A/A control'}) | {met} |")
    return lines


def met_cell(met: bool | None, verdict: str | None) -> str:
    """The 'met' cell of a target: yes, **no**, or, where the median misses
    the target but the gap is within the A/A spread, that it is noise."""
    if met is None:
        return ""
    if met:
        return "yes"
    return "no, within the A/A spread (noise)" if verdict == "within noise" else "**no**"


def machine_markdown(data: dict[str, Any]) -> list[str]:
    """The line that says where and when the tables were measured (or that they were not)."""
    m = data.get("machine")
    if not data.get("measured") or not m:
        return [f"**Figures: {PLACEHOLDER}.** Measure them with `{data['command']}`."]
    flags = m["cpu_flags"]
    return [
        f"Measured on {m['cpu_model']} ({m['usable_cores']} usable cores; avx512_bf16: "
        f"{'yes' if flags.get('avx512_bf16') else 'no'}, amx_bf16: {'yes' if flags.get('amx_bf16') else 'no'}), "
        f"torch {m['torch']}, skorch {m['skorch']}, ampnet {m['ampnet']}"
        + (f" (commit {m['ampnet_commit']})" if m.get("ampnet_commit") else "")
        + f", {m['date_utc']} UTC, load average at start {' '.join(map(str, m['load_average_at_start'] or []))}; "
        f"with `{data['command']}`."
    ]


_BEGIN = "% begin generated benchmark table: {name}"
_END = "% end generated benchmark table: {name}"


def update_page(text: str, data: dict[str, Any]) -> str:
    """``text`` (the performance page) with every workload's table replaced
    by the one ``data`` gives, between the lines ``% begin generated
    benchmark table: NAME`` and ``% end generated benchmark table: NAME``,
    and the machine line between the markers named ``machine``.

    Raises
    ------
    ValueError
      A workload of ``data`` has no such markers on the page.
    """
    blocks = [("machine", machine_markdown(data))]
    blocks += [(entry["name"], table_markdown(entry)) for entry in data["workloads"]]
    for name, body in blocks:
        begin, end = _BEGIN.format(name=name), _END.format(name=name)
        pattern = re.compile(rf"^{re.escape(begin)}\n.*?^{re.escape(end)}$", re.M | re.S)
        if not pattern.search(text):
            raise ValueError(f"the page has no markers for {name!r}: {begin!r} ... {end!r}")
        block = "\n".join([begin, *body, "", end])  # a blank line ends a table before the marker
        text = pattern.sub(lambda m: block, text)
    return text


# ---- the charts ----------------------------------------------------------------------------------


_COLORS: Mapping[str, str] = MappingProxyType({
    "raw": "#7f7f7f", "skorch": "#1f77b4", "ampnet": "#d62728", "accelerate": "#2ca02c", "lightning": "#9467bd",
})


def build_chart(entry: dict[str, Any], subtitle: str = "") -> "Figure":
    """One workload's chart: a horizontal bar per contender, as long as its
    median time per batch (ms), with whiskers from its fastest to its slowest
    round and that same number as its label; where nothing is measured, no
    bars and the words of :data:`PLACEHOLDER`.

    Parameters
    ----------
    entry : dict
      One workload of the page's data.

    subtitle : str
      A second title line (the machine and date of the measurement).

    Returns
    -------
    matplotlib.figure.Figure
      With its own Agg canvas (no pyplot).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = entry["rows"][::-1]
    fig = Figure(figsize=(8, 1.3 + 0.32 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    right = 0.0
    for i, r in enumerate(rows):
        if r["ms_per_batch"] is None:
            continue
        low, high = r["min_ms"] if r["min_ms"] is not None else r["ms_per_batch"], r["max_ms"] or r["ms_per_batch"]
        ax.barh(i, r["ms_per_batch"], color=_COLORS.get(r["framework"], "#1f77b4"),
                xerr=[[r["ms_per_batch"] - low], [high - r["ms_per_batch"]]], capsize=3)
        ax.text(high, i, f"  {r['ms_per_batch']:.1f} ms", va="center", fontsize=8)
        right = max(right, high)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    if right == 0.0:
        ax.text(0.5, 0.5, PLACEHOLDER, ha="center", va="center", transform=ax.transAxes, fontsize=11,
                color="#555555")
        ax.set_xlim(0, 1)
        ax.set_xticks([])
    else:
        ax.set_xlim(0, 1.3 * right)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    title = textwrap.fill(f"{entry['name']}: {entry['title']}", 70)
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=9)
    ax.set_xlabel(f"ms per batch ({entry['batch_size']} rows), median over rounds\n"
                  "whiskers: fastest to slowest round (lower is faster)", fontsize=8)
    fig.tight_layout()
    return fig
