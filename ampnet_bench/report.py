"""Rendering of the results document: Markdown, JSON and a PNG chart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ampnet_bench.config import OPTIMIZERS
from ampnet_bench.machine import RECOMMENDED_MALLOC_ENV, load_warning

__all__ = ["to_markdown", "write_json", "build_chart", "write_chart", "write_all"]


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 1.0:
        return f"{value:.3f} s"
    return f"{value * 1000:.1f} ms"


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def _machine_md(m: dict[str, Any]) -> list[str]:
    flags = m["cpu_flags"]
    gpu = m["gpu"]
    malloc = ", ".join(f"{k}={v if v is not None else 'unset'}" for k, v in m["malloc_env"].items())
    commit = f" (commit {m['ampnet_commit']})" if m.get("ampnet_commit") else ""
    load = " ".join(map(str, m["load_average_at_start"])) if m["load_average_at_start"] else "n/a"
    rows = [
        ("CPU", f"{m['cpu_model']} ({m['logical_cores']} logical cores, {m['usable_cores']} usable)"),
        (
            "CPU low precision",
            f"avx512_bf16: {'yes' if flags['avx512_bf16'] else 'no'}, "
            f"amx_bf16: {'yes' if flags['amx_bf16'] else 'no'}, "
            f"avx512f: {'yes' if flags['avx512f'] else 'no'} "
            f"(torch CPU capability {m['torch_cpu_capability']})",
        ),
        (
            "Threads",
            f"torch {m['torch_threads']} intra-op, {m['torch_interop_threads']} inter-op; "
            f"OMP_NUM_THREADS={m['omp_num_threads'] or 'unset'}",
        ),
        (
            "GPU",
            f"{gpu['name']} (compute capability {'.'.join(map(str, gpu['capability']))}, CUDA {gpu['cuda']})"
            if gpu
            else "none",
        ),
        (
            "Versions",
            f"Python {m['python']}, torch {m['torch']}, skorch {m['skorch']}, "
            f"ampnet {m['ampnet']}{commit}",
        ),
        ("malloc environment", malloc),
        ("Load average at start", load),
        ("Date (UTC)", m["date_utc"]),
    ]
    lines = ["| Machine | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return lines


def _settings_md(cfg: dict[str, Any]) -> str:
    name, default_lr, extra = OPTIMIZERS[cfg["optimizer"]]
    lr = default_lr if cfg["lr"] is None else cfg["lr"]
    opt = ", ".join([f"lr={lr:g}"] + [f"{k}={v}" for k, v in extra])
    batching = (
        "torch DataLoader over skorch.dataset.Dataset (skorch's default), the same for every contender"
        if cfg["batching"] == "dataloader"
        else "shuffled index slices of the pre-generated tensors, the same for every contender"
    )
    text = (
        f"Settings: device `{cfg['device']}`, AMP dtype `{cfg['dtype']}`, "
        f"{cfg['rounds']} rounds x {cfg['epochs']} measured epochs (+{cfg['warmup']} warm-up "
        f"epochs per run, not measured), optimizer {name}({opt}), seed {cfg['seed']}; "
        f"batching: {batching}; memory: {cfg['memory_method']}."
    )
    if cfg["quick"]:
        text += (
            " **Quick mode: tiny sizes and few rounds, a smoke test: its timings are not "
            "comparable with full runs.**"
        )
    return text


def _memory_cell(mem: dict[str, Any] | None) -> str:
    if not mem:
        return "n/a"
    if mem["delta_mb"] is None:
        return f"{mem['peak_mb']:.0f} MB (process)"
    return f"{mem['peak_mb']:.0f} MB ({mem['delta_mb']:+.0f})"


def _state_cell(state: dict[str, Any] | None) -> str:
    if not state:
        return "n/a"
    return f"{state['total'] / 2**20:.1f} MiB"


def _workload_md(w: dict[str, Any]) -> list[str]:
    unit = "call" if w["task"] == "predict" else "epoch"
    lines = [
        f"## {w['name']}: {w['title']}",
        "",
        f"Batch size {w['batch_size']}, {w['n_samples']} samples ({w['n_batches']} batches) per {w['unit']}.",
        "",
        f"| Contender | Time/{unit} | ms/batch | samples/s | x {w['reference']} | Peak memory (+run) "
        "| State bytes* | Final loss | Loss / fp32 loop | Loss / AMP loop | Accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    unavailable = []
    for c in w["contenders"]:
        if not c["available"]:
            lines.append(f"| {c['key']} | not available | | | | | | | | | |")
            unavailable.append(f"{c['key']} not available: {c['error']}")
            continue
        lines.append(
            f"| {c['key']} | {_seconds(c['median_s'])} | {_num(c['ms_per_batch'], '.3f')} | "
            f"{_num(c['samples_per_s'], ',.0f')} | {_num(c['ratio_to_reference']['median'], '.3f')} | "
            f"{_memory_cell(c['memory'])} | {_state_cell(c.get('state_bytes'))} | "
            f"{_num(c['final_loss'], '.4f')} | {_num(c.get('loss_vs_fp32'), '.4f')} | "
            f"{_num(c.get('loss_vs_raw_amp'), '.4f')} | {_num(c['accuracy'], '.3f')} |"
        )
    for c in w["contenders"]:
        choice = c.get("auto_choice")
        if choice:
            others = sorted(set(choice["per_round"]) - {choice["chosen"]})
            lines += ["", f"{c['key']}: `amp_enabled='auto'` chose **{choice['chosen']}** in "
                          f"{choice['rounds']} of {len(choice['per_round'])} rounds"
                          + (f" (other rounds: {', '.join(others)})" if others else "") + "."]
    comps = [c for c in w["comparisons"] if c["median"] is not None]
    targets = any(c["target"] for c in comps)
    aa = w.get("aa_control")
    if aa is not None:
        lines += [
            "",
            f"A/A control: {aa['a']} and {aa['b']} are the same contender; their per-round time ratio "
            f"has median {aa['median']:.3f} and deviates from 1 by up to **{100 * aa['spread']:.1f}%** "
            "(the A/A spread). A comparison closer to 1 than that is \"within noise\", not a difference.",
        ]
    if comps:
        lines += [
            "",
            "| Comparison (per-round ratios) | Median | Range | Verdict |"
            + (" Target | Met |" if targets else ""),
            "|---|---:|---:|---|" + ("---:|:---:|" if targets else ""),
        ]
        for c in comps:
            row = (f"| {c['label']} | {c['median']:.3f} | {c['min']:.3f}-{c['max']:.3f} | "
                   f"{c.get('verdict') or 'no A/A control'} |")
            if targets:
                met = "" if c["met"] is None else ("yes" if c["met"] else "**no**")
                row += f" {c['target'] or ''} | {met} |"
            lines.append(row)
    notes = list(w["notes"]) + unavailable
    notes.append(
        "*State bytes: parameters, gradients, float32 master or compensation copies and optimizer "
        "state after the run (AmpNet: `net.memory_report()`; others: the same count over their "
        "module and optimizer); activations are not state."
    )
    for c in w["contenders"]:
        notes += [f"{c['key']}: {n}" for n in c["notes"]]
        notes += [f"{c['key']} warned: {msg}" for msg in c["warnings"]]
    lines += [""] + [f"- {n}" for n in notes]
    lines.append(f"- Workload time: {w['elapsed_s']:.1f} s.")
    return lines


def to_markdown(results: dict[str, Any]) -> str:
    """The results document as Markdown: machine description, settings,
    then per workload a contender table, a comparison table and notes.

    Parameters
    ----------
    results : dict
      As returned by :func:`ampnet_bench.runner.run_benchmark`.

    Returns
    -------
    str
    """
    lines = ["# ampnet benchmark", ""]
    machine = results["machine"]
    warning = load_warning(machine.get("load_average_at_start"), machine.get("usable_cores"))
    if warning:
        lines += [f"**{warning}**", ""]
    lines += _machine_md(machine)
    lines += ["", _settings_md(results["config"]), ""]
    m = results["machine"]["malloc_env"]
    if not (m.get("MALLOC_MMAP_MAX_") and m.get("MALLOC_TRIM_THRESHOLD_")):
        lines += [
            f"glibc may return buffers to the OS after every step, which makes CPU timings "
            f"noisy; compare with a run under `{RECOMMENDED_MALLOC_ENV}`.",
            "",
        ]
    lines += [
        "Times are medians over rounds of each run's median measured epoch; "
        "\"x reference\" and the comparisons are computed within each round and "
        "summarized by their median.",
        "",
    ]
    for w in results["workloads"]:
        lines += _workload_md(w) + [""]
    lines.append(f"Total time: {results['elapsed_s']:.1f} s.")
    return "\n".join(lines) + "\n"


def _clean(obj: Any) -> Any:
    """Replace NaN and infinities by None (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(results: dict[str, Any], path: str | Path) -> Path:
    """Write the results document as strict JSON; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(_clean(results), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _ms_per_batch(seconds: float, n_batches: int) -> float:
    return 1000.0 * seconds / n_batches


def build_chart(results: dict[str, Any]):
    """The chart as a matplotlib ``Figure``: one panel per workload, one
    horizontal bar per contender whose length is its median time per batch
    (ms), with whiskers from its fastest to its slowest round; the label at
    the end of each bar is that same number."""
    # a Figure with its own Agg canvas: no pyplot, no global backend switch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    workloads = results["workloads"]
    fig = Figure(figsize=(8, 0.8 + 2.4 * len(workloads)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(workloads), 1, squeeze=False)
    colors = {"raw": "#7f7f7f", "careful": "#4d4d4d", "item": "#bcbcbc", "skorch": "#1f77b4",
              "ampnet": "#d62728", "accelerate": "#2ca02c", "lightning": "#9467bd"}
    for ax, w in zip(axes[:, 0], workloads):
        contenders = w["contenders"][::-1]
        labels = [c["key"] for c in contenders]
        right = 0.0
        for i, c in enumerate(contenders):
            if not c["available"] or c["median_s"] is None:
                ax.text(0.02, i, "not available", va="center", transform=ax.get_yaxis_transform())
                continue
            ms = _ms_per_batch(c["median_s"], w["n_batches"])
            rounds = [_ms_per_batch(t, w["n_batches"]) for t in c["round_times_s"] if t]
            err = [[ms - min(rounds)], [max(rounds) - ms]]
            ax.barh(i, ms, color=colors[c["framework"]], alpha=0.9 if c["amp"] else 0.5,
                    xerr=err, capsize=3)
            ax.text(max(rounds), i, f"  {ms:.2f} ms", va="center", fontsize=8)
            right = max(right, max(rounds))
        ax.set_yticks(range(len(labels)), labels)
        ax.set_title(f"{w['name']}: {w['title']}", fontsize=10)
        ax.set_xlabel(f"ms per batch ({w['batch_size']} rows), median over rounds; "
                      "whiskers: fastest to slowest round (lower is faster)", fontsize=8)
        ax.set_xlim(0, 1.3 * right if right > 0 else 1.0)
    cfg = results["config"]
    fig.suptitle(
        f"ampnet benchmark: {results['machine']['cpu_model']}, {cfg['device']}, {cfg['dtype']}"
        + (" (quick mode)" if cfg["quick"] else ""),
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    return fig


def write_chart(results: dict[str, Any], path: str | Path) -> Path:
    """Write :func:`build_chart`'s figure as a PNG; returns the path."""
    path = Path(path)
    build_chart(results).savefig(path, dpi=110)
    return path


def write_all(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.md``, ``results.json`` and ``results.png`` into
    ``out_dir`` (created if needed); returns the paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "results.md"
    md.write_text(to_markdown(results), encoding="utf-8")
    return {
        "md": md,
        "json": write_json(results, out / "results.json"),
        "png": write_chart(results, out / "results.png"),
    }
