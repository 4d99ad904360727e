"""The Markdown report of the one-call GPU check (``python -m ampnet.benchmark --check``):
issue 37's targets first, each met, not met or not measured with its figures, then the
machine, the steps, the host syncs, what ``amp_enabled='auto'`` chose, ``pytest -m gpu`` and
every benchmark step's table."""

from __future__ import annotations

from typing import Any

import torch

from ampnet_bench.workloads import GPU_WORKLOADS, Target

__all__ = ["CHECK_TARGETS", "check_targets", "render_report"]

#: Issue 37's targets that the check judges: (workload, comparison key, target, what it says). The
#: workload ``'syncs'`` stands for the host-sync count and ``'auto'`` rows for what auto chose.
CHECK_TARGETS: tuple[tuple[str, str, Target, str], ...] = (
    *((w, "ampnet_mixed_vs_careful", Target("ampnet_mixed_vs_careful", "<=", 1.03),
       "AmpNet default (bf16) time / the careful loop's (the best hand-written loop)") for w in GPU_WORKLOADS),
    *((w, "ampnet_mixed_vs_careful_ieee", Target("ampnet_mixed_vs_careful_ieee", ">=", 1.5),
       "AMP (AmpNet default) speed-up over float32 IEEE (the careful loop, TF32 off)") for w in ("resnet50", "encoder")),
    *((w, "auto_picks_amp", Target("auto_picks_amp", ">=", 1.0),
       "amp_enabled='auto' picks AMP") for w in ("resnet50", "encoder")),
    ("syncs", "ampnet_default_syncs", Target("ampnet_default_syncs", "<=", 0.0),
     "AmpNet default: host syncs per training step, data on the device"),
    ("overhead", "ampnet_mixed_vs_careful", Target("ampnet_mixed_vs_careful", "<=", 1.10),
     "AmpNet default time / the careful loop's"),
    ("overhead", "ampnet_mixed_vs_skorch", Target("ampnet_mixed_vs_skorch", ">", 1.0),
     "AmpNet default: speed-up over skorch (float32)"),
    ("overhead", "ampnet_fp32_vs_skorch", Target("ampnet_fp32_vs_skorch", "<", 1.0),
     "AmpNet amp_enabled=False time / skorch's"),
)


def _bf16_step(check: dict[str, Any], workload: str) -> dict[str, Any] | None:
    return next((b for b in check["benchmarks"] if b["workload"] == workload and b["dtype"] == "bfloat16"), None)


def _comparison_figure(step: dict[str, Any], key: str) -> tuple[float | None, str]:
    comp = next((c for c in step["result"]["comparisons"] if c["key"] == key), None)
    if comp is None or comp["median"] is None:
        return None, "not measured: a contender of the comparison did not run"
    aa = step["result"].get("aa_control")
    spread = f"; A/A spread {100 * aa['spread']:.1f}%" if aa else ""
    return comp["median"], f"{comp['median']:.3f} (rounds {comp['min']:.3f}-{comp['max']:.3f}{spread})"


def _auto_figure(step: dict[str, Any]) -> tuple[float | None, str]:
    auto = next((c for c in step["result"]["contenders"] if c["key"] == "ampnet-auto"), None)
    choice = auto.get("auto_choice") if auto else None
    if not choice:
        return None, "not measured: amp_enabled='auto' did not run"
    picks = 1.0 if (choice.get("params") or {}).get("amp_enabled") is True else 0.0
    return picks, f"chose {choice['chosen']} ({choice['rounds']}/{len(choice['per_round'])} rounds)"


def _sync_figure(check: dict[str, Any]) -> tuple[float | None, str]:
    rows = {(r["contender"], r["dtype"]): r for r in check["syncs"]}
    mine, careful = rows.get(("ampnet-mixed", "bfloat16")), rows.get(("raw-careful", "bfloat16"))
    if mine is None:
        return None, "not measured: the host syncs step did not run"
    if mine["error"]:
        return None, f"not measured: {mine['error']}"
    if mine["per_step"] is None:
        return None, "not measured: n/a on CPU"
    floor = f"; the careful loop: {careful['per_step']:.2f}" if careful and careful["per_step"] is not None else ""
    return mine["per_step"], f"{mine['per_step']:.2f} per step{floor}"


def check_targets(check: dict[str, Any]) -> list[dict[str, Any]]:
    """Judge :data:`CHECK_TARGETS` on what :func:`ampnet_bench.check.run_check` collected.

    Parameters
    ----------
    check : dict
      The check's results (``plan``, ``benchmarks``, ``syncs``).

    Returns
    -------
    list of dict
      One per target whose workload the plan ran (``'syncs'`` always):
      ``workload``, ``what``, ``target`` (e.g. ``'<= 1.03'``), ``measured``
      (its figures, or why there are none), ``status``: ``'met'``, ``'not
      met'`` or ``'not measured'`` (a dry run, a step that did not run, a
      contender that did not run).
    """
    plan = check["plan"]
    rows = []
    for workload, key, target, what in CHECK_TARGETS:
        if workload != "syncs" and workload not in plan["workloads"]:
            continue
        if workload == "syncs":
            value, text = _sync_figure(check)
        else:
            step = _bf16_step(check, workload)
            if step is None or step["result"] is None:
                value, text = None, "not measured: " + (step["status"] if step else "the step did not run")
            elif key == "auto_picks_amp":
                value, text = _auto_figure(step)
            else:
                value, text = _comparison_figure(step, key)
        if value is None:
            status = "not measured"
        elif plan["dry_run"]:
            status, text = "not measured", f"dry run on the CPU at quick sizes ({text})"
        else:
            status = "met" if target.met(value) else "not met"
        shown = "picks AMP" if key == "auto_picks_amp" else ("0 per step" if workload == "syncs" else target.text())
        rows.append({"workload": workload, "what": what, "target": shown, "measured": text, "status": status})
    return rows


def _targets_md(check: dict[str, Any]) -> list[str]:
    lines = ["## Targets (issue 37)", "",
             "Each target is met, not met or not measured, with its figures: medians of per-round ratios "
             "(a time ratio or a speed-up, as the target says) with their range over the rounds and the "
             "workload's A/A spread.", "",
             "| Workload | Target | Wanted | Measured | Status |", "|---|---|---|---|---|"]
    for r in check_targets(check):
        status = r["status"] if r["status"] != "not met" else "**not met**"
        lines.append(f"| {r['workload']} | {r['what']} | {r['target']} | {r['measured']} | {status} |")
    return lines


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
        "placement, the epoch's bookkeeping, the evaluation's predictions). The careful loop puts the data "
        "on the device once and reads the loss once an epoch: its count is the floor. AmpNet takes the "
        "arrays through its array data path (`data_on_device='auto'`: on the device when they fit); the "
        "PyTorch loop copies each batch from a CPU DataLoader."
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


def _auto_md(benchmarks: list[dict[str, Any]], fit_epochs: int) -> list[str]:
    dtypes = tuple(dict.fromkeys(b["dtype"] for b in benchmarks)) or ("bfloat16",)
    workloads = tuple(dict.fromkeys(b["workload"] for b in benchmarks))
    lines = ["## What amp_enabled='auto' chose", "",
             f"Each as in a {fit_epochs}-epoch fit (`--auto-fit-epochs`), its cache off, so that it measures "
             "in its fit's first steps.", "",
             "| Workload | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    cells = {(b["workload"], b["dtype"]): b for b in benchmarks}
    for workload in workloads:
        row = []
        for dtype in dtypes:
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
                row.append("not run" if not b else (b["status"] if b["status"] != "ok" else "not run"))
        lines.append(f"| {workload} | " + " | ".join(row) + " |")
    return lines


def _benchmark_md(b: dict[str, Any]) -> list[str]:
    head = f"### {b['workload']}, {b['dtype']}"
    if b["result"] is None:
        return [head, "", f"{b['status']}" + (f": {b['error']}" if b["error"] else "") + "."]
    w = b["result"]
    ref = _by_key(w).get(w["reference"])
    ref_name = {"raw-fp32": "float32 loop", "raw-careful": "careful loop"}.get(w["reference"], w["reference"])
    lines = [head, "", f"{w['title']}; batch {w['batch_size']}, {w['n_samples']} rows per epoch; "
                       f"{b['seconds']:.1f} s. `{b['command']}`", "",
             f"| Contender | ms/batch | Time/epoch | x {ref_name} | Peak memory | Final loss | Loss / fp32 loop |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in w["contenders"]:
        if not c["available"]:
            lines.append(f"| {c['key']} | not available: {c['error']} | | | | | |")
            continue
        ratio = c["median_s"] / ref["median_s"] if ref and ref.get("median_s") else None
        memory = c["memory"]["peak_mb"] if c.get("memory") else None
        lines.append(
            f"| {c['key']} | {_ms(c['ms_per_batch'])} | {c['median_s'] * 1000:.1f} ms | {_num(ratio, '.3f')} | "
            f"{_num(memory, ',.0f')} MB | {_num(c['final_loss'], '.4f')} | {_num(c.get('loss_vs_fp32'), '.4f')} |"
        )
    aa = w.get("aa_control")
    if aa:
        lines += ["", f"A/A spread ({aa['a']} against {aa['b']}): {100 * aa['spread']:.1f}%."]
    keys = ("ampnet_mixed_vs_fastest_peer", "ampnet_mixed_vs_best_loop", "ampnet_auto_vs_fastest_loop",
            "ampnet_mixed_vs_careful", "ampnet_fp32_vs_careful", "skorch_vs_careful", "item_amp_vs_careful",
            "item_fp32_vs_careful", "ampnet_mixed_vs_skorch", "ampnet_fp32_vs_skorch", "careful_amp_vs_ieee",
            "careful_amp_vs_tf32", "careful_tf32_vs_ieee", "ampnet_mixed_vs_careful_ieee", "ampnet_float8_vs_mixed")
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
      Sections: Targets (issue 37), Machine (CPU flags, GPU), Steps, Host
      syncs per training step, What amp_enabled='auto' chose, pytest -m gpu,
      Benchmark.
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
    lines += _targets_md(check) + [""]
    lines += ["## Machine", ""] + _machine_md(machine) + [""]
    lines += ["## Steps", "", "| Step | Status | Seconds |", "|---|---|---:|"]
    lines += [f"| {s['name']} | {s['status']}{' (optional)' if s.get('optional') else ''} | {s['seconds']:.1f} |"
              for s in check["steps"]]
    lines += [""] + _syncs_md(check["syncs"], plan["device"]) + [""]
    lines += _auto_md(check["benchmarks"], plan.get("auto_fit_epochs", 1000)) + [""]
    lines += _pytest_md(check["pytest"], plan["dry_run"]) + [""]
    lines += ["## Benchmark", "",
              f"{plan['rounds']} rounds of {plan['epochs']} measured epoch(s) after {plan['warmup']} warm-up "
              f"epoch(s), all runs of a workload and dtype in one process (a check, not the fresh-process "
              f"measurement), optimizer {plan['optimizer']}; times are medians over rounds.", ""]
    for b in check["benchmarks"]:
        lines += _benchmark_md(b) + [""]
    return "\n".join(lines).rstrip() + "\n"
