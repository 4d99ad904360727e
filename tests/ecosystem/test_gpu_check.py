"""The one-call GPU check (``python -m ampnet.benchmark --check``): its dry run on the CPU writes
the report with every section and its figures, within its budget; its parts on their own."""

import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ampnet_bench import check, cli
from ampnet_bench.check import CHECK_DTYPES, SYNC_SETTINGS, CheckPlan, parse_pytest_summary, render_report
from repo_paths import ROOT

_TINY_TESTS = '''
import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu():
    assert torch.ones(1, device="cuda").item() == 1


def test_not_marked():
    pass
'''

_CONFTEST = '''
def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
'''


def _section(text, title):
    """The lines of a ``## title`` section (up to the next ``## ``)."""
    lines = text.splitlines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1:end]


def _table(lines, first_cell=None):
    """The rows of the first Markdown table in ``lines`` as lists of cells (header and rule left out)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[2:]]
    return [c for c in cells if first_cell is None or c[0] == first_cell]


@pytest.mark.slow
def test_dry_run_writes_one_report_with_every_section(tmp_path):
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_tiny.py").write_text(_TINY_TESTS)
    (tests / "conftest.py").write_text(_CONFTEST)
    report = tmp_path / "out" / "check.md"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ampnet.benchmark", "--check", "--dry-run", "--workload", "mlp",
         "--contenders", "raw-fp32,raw-amp,raw-amp-aa,ampnet-mixed,ampnet-auto", "--pytest-path", str(tests),
         "--budget-s", "55", "--report", str(report)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert elapsed < 60, elapsed
    assert sorted(p.name for p in report.parent.iterdir()) == ["check.md"]  # one file
    text = report.read_text()
    assert text.startswith("# ampnet GPU check (dry run on the CPU)")
    for title in ("Machine", "Steps", "pytest -m gpu", "Host syncs per training step",
                  "What amp_enabled='auto' chose", "Benchmark"):
        assert f"## {title}" in text, title
    # the machine, with the CPU's bf16 flags
    flags = _table(_section(text, "Machine"), "CPU low precision")[0][1]
    assert re.search(r"avx512_bf16: (yes|no), amx_bf16: (yes|no)", flags)
    # every step ran
    steps = {row[0]: row[1] for row in _table(_section(text, "Steps"))}
    assert steps == {"pytest -m gpu": "ok", "host syncs": "ok", "benchmark mlp bfloat16": "ok",
                     "benchmark mlp float16": "ok"}
    # pytest -m gpu: the gpu test skipped (no CUDA), the other deselected
    counts = _table(_section(text, "pytest -m gpu"))[0]
    assert [int(c) for c in counts] == [0, 0, 0, 1, 1]  # passed, failed, errors, skipped, deselected
    # sync counting: n/a on CPU, one row per setting
    syncs = _table(_section(text, "Host syncs per training step"))
    assert [row[0] for row in syncs] == [label for label, _, _ in SYNC_SETTINGS]
    assert all(row[1] == row[2] == "n/a on CPU" for row in syncs)
    # auto's choice on each workload and dtype
    assert any("Each as in a 1000-epoch fit" in line and "its cache off" in line
               for line in _section(text, "What amp_enabled='auto' chose"))
    auto = _table(_section(text, "What amp_enabled='auto' chose"), "mlp")[0]
    for cell in auto[1:]:
        assert re.search(r"^\S.* \([12]/2 rounds, measuring cost [\d.]+ s\)(; other rounds: .+)?$", cell), cell
    # the benchmark's figures: a time per batch for each contender, in each dtype
    bench = _section(text, "Benchmark")
    for dtype in CHECK_DTYPES:
        start = bench.index(f"### mlp, {dtype}")
        rows = _table(bench[start:start + 20])
        assert [r[0] for r in rows] == ["raw-fp32", "raw-amp", "raw-amp-aa", "ampnet-mixed", "ampnet-auto"]
        for r in rows:
            assert float(r[1]) > 0 and float(r[3]) > 0, r  # ms/batch, x float32 loop
        assert float(rows[0][3]) == 1.0
    assert re.search(r"A/A spread \(raw-amp against raw-amp-aa\): [\d.]+%", text)


def test_the_check_plan_fits_the_slot():
    plan = CheckPlan()
    assert plan.device == "cuda" and plan.rounds == 2 and not plan.dry_run
    assert plan.budget_s <= 8 * 60 - 30  # 8 minutes on one H100, with room to start and write
    # the GPU workloads and the overhead workload first, the CPU-sized model workloads last
    assert plan.workloads == ("resnet50", "encoder", "decoder", "overhead", "mlp", "cnn", "transformer", "resnet",
                              "rnn")
    assert plan.gpu_step_s * 3 < plan.budget_s
    assert CHECK_DTYPES == ("bfloat16", "float16")
    assert {"raw-fp32", "raw-amp-fused", "ampnet-mixed", "ampnet-auto", "ampnet-pure-comp", "lightning",
            "skorch-accelerate"} <= set(plan.contenders)
    assert Path(plan.pytest_paths[0]) == ROOT / "tests"
    dry = cli.check_plan_from_args(cli.build_parser().parse_args(["--check", "--dry-run", "--workload", "rnn"]))
    assert dry.dry_run and dry.device == "cpu" and dry.workloads == ("rnn",) and dry.rounds == 2
    assert "--quick" in check._benchmark_command(dry, "rnn", "float16", Path("out"))
    full = check._benchmark_command(plan, "transformer", "float16", Path("out"))
    assert full[full.index("--device") + 1] == "cuda" and full[full.index("--rounds") + 1] == "2"
    assert int(full[full.index("--n-samples") + 1]) == 4 * 32  # 4x the CPU rows per epoch


def test_each_step_runs_its_workloads_contenders():
    plan = CheckPlan()
    gpu = ("raw-careful-fp32", "raw-careful-tf32", "raw-careful", "raw-careful-aa", "ampnet-mixed", "ampnet-auto")
    assert check.step_contenders(plan, "resnet50") == gpu  # float8: the encoder and the decoder only
    assert check.step_contenders(plan, "encoder") == check.step_contenders(plan, "decoder") == (*gpu, "ampnet-float8")
    overhead = check.step_contenders(plan, "overhead")
    assert overhead[:4] == ("raw-careful", "raw-careful-aa", "raw-careful-fp32", "raw-careful-tf32")
    assert {"raw-item-fp32", "raw-item-amp", "skorch-fp32", "ampnet-fp32", "ampnet-mixed", "ampnet-auto"} <= set(overhead)
    assert "raw-careful-tf32" not in check.step_contenders(CheckPlan.dry(), "overhead")  # TF32: CUDA only
    assert check.step_contenders(plan, "mlp") == plan.contenders
    command = check._benchmark_command(plan, "overhead", "bfloat16", Path("out"))
    assert command[command.index("--optimizer") + 1] == "sgd" and "--n-samples" not in command
    command = check._benchmark_command(plan, "decoder", "bfloat16", Path("out"))
    assert command[command.index("--optimizer") + 1] == "adamw" and "--n-samples" not in command
    assert command[command.index("--contenders") + 1].split(",") == [*gpu, "ampnet-float8"]


def _in_process(command, timeout):
    """Run a benchmark step's command (``python -m ampnet_bench ...``) in this process."""
    assert command[1:3] == ["-m", "ampnet_bench"]
    returncode = cli.main(command[3:])
    return subprocess.CompletedProcess(command, returncode, "", "")


def test_dry_run_of_the_gpu_workloads_and_the_overhead_workload(tmp_path, monkeypatch):
    # the check's steps for the GPU workloads and the overhead workload at quick sizes on the CPU, each
    # benchmark step run in this process (the seam of run_check) to keep the test fast
    monkeypatch.setattr(check, "describe_machine", lambda: _machine())
    plan = CheckPlan.dry(workloads=("overhead", "decoder", "encoder", "resnet50"), rounds=1, pytest_paths=(),
                         budget_s=600.0)
    result = check.run_check(plan, tmp_path / "r.md", log=lambda msg: None, run_command=_in_process)
    text = (tmp_path / "r.md").read_text()
    assert result["ok"], result["steps"]
    # the order: the GPU workloads (in their order, whatever the plan's), the overhead workload, the syncs, pytest
    assert [s["name"] for s in result["steps"]] == [
        "benchmark resnet50 bfloat16", "benchmark encoder bfloat16", "benchmark decoder bfloat16",
        "benchmark overhead bfloat16", "host syncs", "pytest -m gpu"]
    assert result["steps"][-1]["status"] == "skipped: no tests folder next to ampnet_bench"
    # the targets come first, every one "not measured" in a dry run, with the figure it would be judged on
    assert text.index("## Targets (issue 37)") < text.index("## Machine")
    targets = _table(_section(text, "Targets (issue 37)"))
    assert [r[0] for r in targets] == ["resnet50", "encoder", "decoder", "resnet50", "encoder", "resnet50",
                                       "encoder", "syncs", "overhead", "overhead", "overhead"]
    assert {r[4] for r in targets} == {"not measured"}
    assert re.fullmatch(r"dry run on the CPU at quick sizes \([\d.]+ \(rounds [\d.]+-[\d.]+; A/A spread [\d.]+%\)\)",
                        targets[0][3]), targets[0]
    assert targets[7][3] == "not measured: n/a on CPU"
    assert re.fullmatch(r"dry run on the CPU at quick sizes \(chose .+ \(1/1 rounds\)\)", targets[5][3])
    # each GPU workload's table: float32 IEEE and TF32 labelled, TF32 and float8 skipped with their reasons
    bench = _section(text, "Benchmark")
    for workload in ("resnet50", "encoder", "decoder"):
        start = bench.index(f"### {workload}, bfloat16")
        rows = {r[0]: r for r in _table(bench[start:start + 20])}
        assert float(rows["raw-careful"][3]) == 1.0  # x careful loop
        for key in ("raw-careful-fp32", "raw-careful-aa", "ampnet-mixed", "ampnet-auto"):
            assert float(rows[key][1]) > 0, (workload, key)
        assert rows["raw-careful-tf32"][1] == "not available: skipped: TF32 is a CUDA setting (this run: the CPU)"
        if workload == "resnet50":
            assert "ampnet-float8" not in rows
        else:
            assert rows["ampnet-float8"][1] == ("not available: skipped: float8 needs a CUDA device of compute "
                                                "capability >= 8.9 (this run: the CPU)")
    start = bench.index("### overhead, bfloat16")
    overhead = {r[0]: r for r in _table(bench[start:start + 20])}
    assert set(overhead) == {"raw-careful", "raw-careful-aa", "raw-careful-fp32", "raw-item-fp32", "raw-item-amp",
                             "skorch-fp32", "ampnet-fp32", "ampnet-mixed", "ampnet-auto"}
    assert "x careful loop" in bench[start + 4]
    auto = {r[0]: r[1] for r in _table(_section(text, "What amp_enabled='auto' chose"))}
    assert set(auto) == {"resnet50", "encoder", "decoder", "overhead"} and "1/1 rounds" in auto["decoder"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_check_without_cuda_points_to_the_dry_run(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--check"])
    assert exc.value.code == 2 and "--dry-run" in capsys.readouterr().err


@pytest.mark.parametrize("line, expected", [
    ("1 failed, 3 passed, 2 skipped, 1315 deselected in 12.30s", dict(failed=1, passed=3, skipped=2, deselected=1315)),
    ("41 skipped, 1315 deselected, 1 warning in 5.40s", dict(skipped=41, deselected=1315, warnings=1)),
    ("2 passed, 1 error in 1.0s", dict(passed=2, errors=1)),
    ("no tests ran in 0.01s", {}),
])
def test_pytest_summary_counts(line, expected):
    counts = parse_pytest_summary(f"....\n===== {line} =====\n")
    assert counts == {**dict.fromkeys(counts, 0), **expected}
    assert parse_pytest_summary("killed before the summary") == dict.fromkeys(counts, 0)


def test_time_budget_skips_what_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "describe_machine", lambda: _machine())
    plan = CheckPlan.dry(budget_s=0.0, workloads=("mlp",))
    result = check.run_check(plan, tmp_path / "r.md", log=lambda msg: None)
    assert not result["ok"] and {s["status"] for s in result["steps"]} == {"skipped: budget spent"}
    text = (tmp_path / "r.md").read_text()
    assert "skipped: budget spent" in text and "**some steps failed, timed out or were skipped**" in text


def _machine():
    return {"cpu_model": "CPU", "logical_cores": 16, "usable_cores": 16,
            "cpu_flags": {"avx512_bf16": False, "amx_bf16": False, "avx512f": True},
            "torch_cpu_capability": "AVX512", "torch_threads": 1, "torch_interop_threads": 1, "omp_num_threads": None,
            "gpu": {"name": "NVIDIA H100", "capability": [9, 0], "count": 1, "cuda": "12.8"},
            "python": "3.11", "torch": "2.13", "skorch": "1.4", "ampnet": "0.3", "ampnet_commit": None,
            "malloc_env": {}, "load_average_at_start": [0.1, 0.1, 0.1], "date_utc": "now"}


def _step(workload, comparisons, auto_amp=None, status="ok"):
    """A benchmark step's entry as run_check records it, with the given comparison medians."""
    if status != "ok":
        return {"workload": workload, "dtype": "bfloat16", "status": status, "error": None, "result": None,
                "seconds": 0.0}
    contenders = []
    if auto_amp is not None:
        chosen = "bfloat16 mixed" if auto_amp else "float32 (AMP off)"
        contenders.append({"key": "ampnet-auto", "available": False, "error": "figures left out",
                           "auto_choice": {"chosen": chosen, "params": {"amp_enabled": auto_amp},
                                           "rounds": 2, "per_round": [chosen, chosen]}})
    comps = [{"key": k, "label": k, "median": v, "min": v * 0.99, "max": v * 1.01, "verdict": "differs"}
             for k, v in comparisons.items()]
    return {"workload": workload, "dtype": "bfloat16", "status": "ok", "error": None, "seconds": 1.0,
            "command": "python -m ampnet_bench", "result": {
                "title": workload, "batch_size": 1, "n_samples": 1, "reference": "raw-careful",
                "contenders": contenders, "comparisons": comps, "aa_control": {"a": "a", "b": "b", "spread": 0.02}}}


def test_targets_are_judged_met_not_met_or_not_measured_with_their_figures():
    from ampnet_bench.check_report import check_targets

    benchmarks = [
        _step("resnet50", {"ampnet_mixed_vs_careful": 1.02, "ampnet_mixed_vs_careful_ieee": 1.4}, auto_amp=True),
        _step("encoder", {}, status="timed out"),
        _step("decoder", {"ampnet_mixed_vs_careful": 1.08}),
        _step("overhead", {"ampnet_mixed_vs_careful": 1.2, "ampnet_mixed_vs_skorch": 1.1,
                           "ampnet_fp32_vs_skorch": 0.9}),
    ]
    syncs = [{"label": "careful", "contender": "raw-careful", "dtype": "bfloat16", "per_step": 0.0, "fixed": 3.0,
              "sources": [], "error": None},
             {"label": "AmpNet", "contender": "ampnet-mixed", "dtype": "bfloat16", "per_step": 0.0, "fixed": 9.0,
              "sources": [], "error": None}]
    result = {"plan": {**dataclasses.asdict(CheckPlan()), "pytest_paths": []}, "machine": _machine(),
              "pytest": None, "syncs": syncs, "benchmarks": benchmarks, "steps": [], "elapsed_s": 1.0, "ok": False}
    rows = {(r["workload"], r["what"].split(" ")[0], r["target"]): r for r in check_targets(result)}
    assert rows[("resnet50", "AmpNet", "<= 1.03")]["status"] == "met"
    assert rows[("resnet50", "AmpNet", "<= 1.03")]["measured"] == "1.020 (rounds 1.010-1.030; A/A spread 2.0%)"
    assert rows[("resnet50", "AMP", ">= 1.5")]["status"] == "not met"
    assert rows[("resnet50", "amp_enabled='auto'", "picks AMP")]["status"] == "met"
    assert rows[("resnet50", "amp_enabled='auto'", "picks AMP")]["measured"] == "chose bfloat16 mixed (2/2 rounds)"
    assert rows[("encoder", "AmpNet", "<= 1.03")] == {**rows[("encoder", "AmpNet", "<= 1.03")],
                                                       "status": "not measured", "measured": "not measured: timed out"}
    assert rows[("decoder", "AmpNet", "<= 1.03")]["status"] == "not met"
    syncs_row = rows[("syncs", "AmpNet", "0 per step")]
    assert syncs_row["status"] == "met" and syncs_row["measured"] == "0.00 per step; the careful loop: 0.00"
    assert rows[("overhead", "AmpNet", "<= 1.1")]["status"] == "not met"
    assert rows[("overhead", "AmpNet", "> 1")]["status"] == "met"
    assert rows[("overhead", "AmpNet", "< 1")]["status"] == "met"
    syncs[1]["per_step"] = 1.0  # a read per step: not met
    assert {r["workload"]: r["status"] for r in check_targets(result)}["syncs"] == "not met"
    text = render_report(result)
    targets = _table(_section(text, "Targets (issue 37)"))
    assert ["decoder", "AmpNet default (bf16) time / the careful loop's (the best hand-written loop)", "<= 1.03",
            "1.080 (rounds 1.069-1.091; A/A spread 2.0%)", "**not met**"] in targets


def test_report_on_cuda_shows_the_sync_counts():
    rows = [{"label": label, "contender": key, "dtype": dtype, "per_step": float(i), "fixed": 10.0 + i,
             "sources": [("step.py:120", 8)], "error": None} for i, (label, key, dtype) in enumerate(SYNC_SETTINGS)]
    rows[-1].update(per_step=None, fixed=None, error="RuntimeError: boom")
    result = {"plan": {**CheckPlan().__dict__, "workloads": ["mlp"]}, "machine": _machine(), "pytest": None,
              "syncs": rows, "benchmarks": [], "steps": [], "elapsed_s": 1.0, "ok": True}
    text = render_report(result)
    syncs = _table(_section(text, "Host syncs per training step"))
    assert [float(r[1]) for r in syncs[:-1]] == [float(i) for i in range(len(SYNC_SETTINGS) - 1)]
    assert syncs[0][3] == "`step.py:120` x8" and syncs[-1][1] == "failed" and "boom" in syncs[-1][3]
    assert "n/a on CPU" not in text and "NVIDIA H100" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sync_counter_sees_the_grad_scalers_read():
    rows = {(r["contender"], r["dtype"]): r for r in check.count_host_syncs("cuda", quick=True)}
    assert all(r["error"] is None for r in rows.values()), [r["error"] for r in rows.values()]
    for r in rows.values():
        assert r["per_step"] >= 0 and math.isfinite(r["fixed"])
    # torch's GradScaler.step reads found_inf on the host once per step
    assert rows[("raw-amp", "float16")]["per_step"] >= 1


def test_sync_sources_reads_the_warnings_the_run_recorded_itself():
    # a contender's run records its own warnings (an outer catch_warnings sees none of them,
    # which once made every count 0 on an H100): the counter reads what the run hands back
    import warnings

    from ampnet_bench.contenders import CONTENDERS, run_contender
    from ampnet_bench.config import BenchConfig
    from ampnet_bench.workloads import get_workload

    def warns(sink):
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("something else")
        sink.extend(recorded)

    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        sources = check._sync_sources(warns, count=False)
    assert outer == [] and sum(sources.values()) == 1
    (where,) = sources
    assert where.startswith("test_gpu_check.py:")
    # run_contender hands its recorded warnings to the sink, file and line included (here the
    # module's forward warns once per call)
    wl = get_workload("mlp", quick=True)
    cfg = BenchConfig(workloads=("mlp",), device="cpu", quick=True, rounds=1, epochs=1, warmup=0, threads=1,
                      memory="off", isolation="inprocess")
    by_key = {c.key: c for c in CONTENDERS}
    sink: list = []

    inner = wl.module_factory
    wl_warning = dataclasses.replace(wl, module_factory=lambda *a, **k: _Warns(inner(*a, **k)))
    run_contender(by_key["raw-fp32"], wl_warning, wl.make_data(0), cfg, caught=sink)
    assert any("synchronizing" in str(w.message) and w.lineno > 0 for w in sink)


class _Warns(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import warnings

        warnings.warn("called a synchronizing CUDA operation")
        return self.inner(x)
