"""CI-sized checks of ``python -m ampnet_bench``: the quick mode runs
in process and writes a well-formed report. No timing assertions: speed
claims come from real benchmark runs, not from unit tests."""

import importlib
import importlib.abc
import json
import math
import subprocess
import sys

import pytest
import torch
from skorch.dataset import Dataset

import ampnet
from ampnet_bench import cli, runner
from ampnet_bench.config import BenchConfig
from ampnet_bench.contenders import CONTENDER_KEYS, TensorBatches
from ampnet_bench.machine import load_warning
from ampnet_bench.report import build_chart, to_markdown


_PEER_MODULES = {"skorch-accelerate": "accelerate", "lightning": "lightning"}

#: Contenders that run on CUDA only (TF32, float8).
_CUDA_ONLY = ("raw-careful-tf32", "ampnet-float8")


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _importable(name):
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def by_key(w, key):
    return next(c for c in w["contenders"] if c["key"] == key)


def _check_results(results, workloads, rounds):
    assert results["schema_version"] == runner.SCHEMA_VERSION
    machine = results["machine"]
    for key in ("cpu_model", "logical_cores", "torch", "torch_threads", "cpu_flags", "malloc_env"):
        assert key in machine
    assert "MALLOC_MMAP_MAX_" in machine["malloc_env"]
    assert [w["name"] for w in results["workloads"]] == workloads
    for w in results["workloads"]:
        assert w["contenders"], w["name"]
        assert w["reference"] == "raw-fp32"
        for c in w["contenders"]:
            if c["key"] == "lightning" and w["name"] == "predict":
                # refused before lightning is imported: the same with or without the extra
                assert not c["available"] and "times training only" in c["error"]
                continue
            if c["key"] in _PEER_MODULES and not _importable(_PEER_MODULES[c["key"]]):
                # optional extra "bench" not installed: reported, not fatal
                assert not c["available"] and "No module named" in c["error"]
                continue
            if c["key"] in _CUDA_ONLY and not torch.cuda.is_available():
                # TF32, float8: reported skipped with the reason
                assert not c["available"] and c["error"].startswith("skipped: "), c["error"]
                continue
            assert c["available"], (w["name"], c["key"], c["error"])
            assert len(c["round_times_s"]) == rounds
            assert all(_positive(t) for t in c["round_times_s"])
            for key in ("median_s", "samples_per_s", "ms_per_batch"):
                assert _positive(c[key]), (w["name"], c["key"], key)
            ratio = c["ratio_to_reference"]
            assert _positive(ratio["median"])
            assert len(ratio["per_round"]) == rounds and all(_positive(r) for r in ratio["per_round"])
            assert 0.0 <= c["accuracy"] <= 1.0
            assert math.isfinite(c["final_loss"]) and c["final_loss"] >= 0
            assert c["memory"] is not None and _positive(c["memory"]["peak_mb"])
            if w["task"] == "train":
                state = c["state_bytes"]
                assert state["total"] == sum(state[k] for k in (
                    "parameters", "gradients", "master_weights", "compensation", "optimizer_state"))
                assert c["loss_vs_fp32"] == pytest.approx(c["final_loss"] / by_key(w, "raw-fp32")["final_loss"])
            else:
                assert c["state_bytes"] is None
        assert w["comparisons"]
        aa = w["aa_control"]
        assert aa["a"] == "raw-amp" and aa["b"] == "raw-amp-aa" and aa["spread"] >= 0
        for comp in w["comparisons"]:
            if comp["median"] is None:  # a contender of it could not run
                continue
            assert comp["verdict"] == runner.verdict(comp["median"], aa["spread"])
            assert comp["min"] <= comp["median"] <= comp["max"]
            # --quick runs tiny sizes: no speed target is checked
            assert comp["target"] is None and comp["met"] is None


@pytest.mark.slow
def test_quick_benchmark_writes_report(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = cli.main([
        "--quick", "--workload", "mlp", "predict", "--threads", "1", "--optimizer", "adamw",
        "--rounds", "2", "--n-samples", "512", "--out", str(out),
    ])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("# ampnet benchmark")
    assert "avx512_bf16" in stdout and "MALLOC_MMAP_MAX_" in stdout
    assert "| Contender |" in stdout and "| ampnet-mixed |" in stdout
    for name in ("results.md", "results.json", "results.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    _check_results(results, ["mlp", "predict"], rounds=2)
    keys = [c["key"] for c in results["workloads"][0]["contenders"]]
    assert keys == list(CONTENDER_KEYS)
    mlp = results["workloads"][0]
    # compensated pure stores bf16 weights and bf16 compensation, no float32 masters: less state
    comp, mixed = by_key(mlp, "ampnet-pure-comp"), by_key(mlp, "ampnet-mixed")
    assert comp["state_bytes"]["compensation"] > 0 and comp["state_bytes"]["master_weights"] == 0
    assert comp["state_bytes"]["parameters"] * 2 == mixed["state_bytes"]["parameters"]
    assert comp["state_bytes"]["total"] < mixed["state_bytes"]["total"]
    assert comp["param_dtypes"] == ["bfloat16"] and mixed["param_dtypes"] == ["float32"]
    assert "A/A control: raw-amp and raw-amp-aa" in stdout and "| Verdict |" in stdout
    # every contender's settings act (AMP settings only on the AMP contenders)
    assert not [w for wl in results["workloads"] for c in wl["contenders"] for w in c["warnings"]
                if "no effect" in w]
    assert (out / "results.md").read_text() == to_markdown(results)
    # no verdicts and no internal jargon in a smoke test
    assert "Met" not in stdout and "Target" not in stdout and "issue" not in stdout
    assert "Quick mode: tiny sizes and few rounds, a smoke test" in stdout
    _check_chart(build_chart(results), results)


def _check_chart(fig, results):
    """Each bar is as long as its label says, and is the contender's
    median time per batch."""
    panels = fig.axes
    assert len(panels) == len(results["workloads"])
    for ax, w in zip(panels, results["workloads"]):
        bars = {round(r.get_y() + r.get_height() / 2): r.get_width() for r in ax.patches}
        labels = {round(t.get_position()[1]): t.get_text().strip() for t in ax.texts
                  if t.get_text() != "not available"}
        names = [t.get_text() for t in ax.get_yticklabels()]
        contenders = {c["key"]: c for c in w["contenders"]}
        available = {c["key"] for c in w["contenders"] if c["available"]}
        assert sorted(bars) == sorted(labels)
        assert {names[y] for y in bars} == available and len(names) == len(w["contenders"])
        for y, width in bars.items():
            value, unit = labels[y].split()
            assert unit == "ms"
            assert abs(width - float(value)) <= 0.005 + 1e-9, (names[y], width, labels[y])
            c = contenders[names[y]]
            assert width == pytest.approx(1000 * c["median_s"] / w["n_batches"])
            assert width == pytest.approx(c["ms_per_batch"])
        assert "ms per batch" in ax.get_xlabel() and ax.get_title().startswith(w["name"])


def _fake_results(quick, load, cores=2):
    """A results document with two contenders whose times differ 30-fold."""
    def contender(key, framework, seconds):
        return {
            "key": key, "framework": framework, "amp": framework == "ampnet", "available": True,
            "median_s": seconds, "round_times_s": [seconds * 0.9, seconds * 1.1],
            "ms_per_batch": 1000 * seconds / 10,
        }
    return {
        "machine": {"cpu_model": "CPU", "load_average_at_start": [load, load, load],
                    "usable_cores": cores},
        "config": {"device": "cpu", "dtype": "bfloat16", "quick": quick},
        "workloads": [{
            "name": "mlp", "title": "MLP", "unit": "epoch", "n_batches": 10, "batch_size": 8,
            "contenders": [contender("raw-fp32", "raw", 0.3022), contender("ampnet-mixed", "ampnet", 9.066)],
        }],
    }


def test_chart_bars_agree_with_their_labels():
    results = _fake_results(quick=False, load=0.1)
    fig = build_chart(results)
    _check_chart(fig, results)
    ax = fig.axes[0]
    widths = sorted(r.get_width() for r in ax.patches)
    assert widths[1] / widths[0] == pytest.approx(30.0)  # 30x slower, 30x longer


def test_comparisons_check_targets_outside_quick_mode():
    wl = BenchConfig(workloads=("mlp",)).workload("mlp")
    records = {k: runner._Record(next(c for c in runner.CONTENDERS if c.key == k))
               for k in ("ampnet-mixed", "ampnet-fp32")}
    records["ampnet-mixed"].round_times = [1.0, 1.0]
    records["ampnet-fp32"].round_times = [3.0, 2.4]
    full = {c["key"]: c for c in runner._comparisons(records, wl, 2)}
    speedup = full["ampnet_mixed_speedup"]
    assert speedup["median"] == pytest.approx(2.7)
    assert speedup["target"] == ">= 2" and speedup["met"] is True
    quick = {c["key"]: c for c in runner._comparisons(records, wl, 2, quick=True)}
    assert quick["ampnet_mixed_speedup"]["target"] is None
    assert quick["ampnet_mixed_speedup"]["met"] is None


@pytest.mark.parametrize("load, warned", [(1.99, False), (2.0, True), (3.5, True)])
def test_load_average_at_or_above_cores_warns(load, warned):
    text = load_warning([load, 0.0, 0.0], 2)
    assert (text is not None) == warned
    if warned:
        assert f"load average is {load:.2f} on 2 usable core(s)" in text
    assert load_warning(None, 2) is None


def test_cli_warns_on_a_loaded_machine(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli.os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    monkeypatch.setattr(cli, "usable_cores", lambda: 2)
    monkeypatch.setattr(cli, "run_benchmark", lambda cfg: _fake_results(cfg.quick, 8.0))
    monkeypatch.setattr(cli, "to_markdown", lambda results: "report\n")
    assert cli.main(["--quick", "--out", ""]) == 0
    err = capsys.readouterr().err
    assert "Warning: the load average is 8.00 on 2 usable core(s)" in err


def test_report_shows_load_warning():
    results = _fake_results(quick=True, load=4.0)
    results["machine"].update(
        cpu_flags={"avx512_bf16": True, "amx_bf16": False, "avx512f": True}, logical_cores=2,
        torch_cpu_capability="AVX512", torch_threads=2, torch_interop_threads=2,
        omp_num_threads=None, gpu=None, python="3", torch="2", skorch="1", ampnet="0",
        malloc_env={}, date_utc="now",
    )
    warning = load_warning(results["machine"]["load_average_at_start"], 2)
    md_head = ["# ampnet benchmark", "", f"**{warning}**"]
    results["config"].update(rounds=1, epochs=1, warmup=0, optimizer="sgd", lr=None, seed=0,
                             batching="tensors", memory_method="off")
    results.update(elapsed_s=1.0)
    results["workloads"] = []
    assert to_markdown(results).splitlines()[:3] == md_head


@pytest.mark.slow
def test_failing_contender_is_reported_not_fatal(monkeypatch):
    real = runner.run_contender

    def flaky(contender, *args, **kwargs):
        if contender.key == "ampnet-pure":
            raise NotImplementedError("amp_level='pure' is not implemented")
        return real(contender, *args, **kwargs)

    monkeypatch.setattr(runner, "run_contender", flaky)
    cfg = BenchConfig(
        workloads=("overhead",), quick=True, rounds=1, epochs=1, warmup=0, n_samples=256,
        batching="tensors", contenders=("raw-fp32", "ampnet-mixed", "ampnet-pure"),
    )
    results = runner.run_benchmark(cfg, log=lambda msg: None)
    by_key = {c["key"]: c for c in results["workloads"][0]["contenders"]}
    assert by_key["ampnet-mixed"]["available"]
    pure = by_key["ampnet-pure"]
    assert not pure["available"] and pure["median_s"] is None
    assert pure["error"] == "NotImplementedError: amp_level='pure' is not implemented"
    comps = {c["key"]: c for c in results["workloads"][0]["comparisons"]}
    assert comps["pure_vs_mixed"]["median"] is None
    md = to_markdown(results)
    assert "| ampnet-pure | not available |" in md
    assert "amp_level='pure' is not implemented" in md
    json.dumps(results, allow_nan=False)


def test_config_round_trips_through_json():
    cfg = BenchConfig(workloads=("mlp", "cnn"), contenders=("raw-fp32",), lr=0.1, quick=True)
    assert BenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.memory_method == "inprocess"
    assert BenchConfig(workloads=("mlp",)).memory_method == "subprocess"


def test_tensor_batches_cover_every_row_once():
    X = torch.arange(10.0)[:, None]
    y = torch.arange(10)
    batches = list(TensorBatches(Dataset(X, y), batch_size=4, shuffle=True,
                                 generator=torch.Generator().manual_seed(0)))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    seen = torch.cat([b[1] for b in batches])
    assert sorted(seen.tolist()) == list(range(10))
    assert all(torch.equal(b[0][:, 0].long(), b[1]) for b in batches)


def test_cli_rejects_unknown_contender():
    with pytest.raises(SystemExit):
        cli.main(["--contenders", "raw-fp32,nope"])


@pytest.mark.parametrize("median, spread, expected", [
    (1.04, 0.05, "within noise"), (1 / 1.04, 0.05, "within noise"), (1.06, 0.05, "differs"),
    (0.90, 0.05, "differs"), (1.0, 0.0, "within noise"), (1.2, None, None), (None, 0.1, None),
])
def test_verdict_refuses_differences_inside_the_aa_spread(median, spread, expected):
    assert runner.verdict(median, spread) == expected


def _records(times):
    records = {}
    for key, rounds in times.items():
        rec = runner._Record(next(c for c in runner.CONTENDERS if c.key == key))
        rec.round_times = list(rounds)
        records[key] = rec
    return records


def test_aa_control_and_fastest_peer():
    records = _records({
        "raw-amp": [1.0, 1.0, 1.0], "raw-amp-aa": [1.1, 0.95, 1.0],
        "lightning": [0.9, 1.2, None], "ampnet-pure-comp-fused": [0.6, 0.8, 0.5],
    })
    aa = runner.aa_control(records, 3)
    assert aa["per_round"] == pytest.approx([1 / 1.1, 1 / 0.95, 1.0])
    assert aa["spread"] == pytest.approx(0.1)  # 1.1 / 1.0: the largest deviation
    wl = BenchConfig(workloads=("mlp",)).workload("mlp")
    comps = {c["key"]: c for c in runner._comparisons(records, wl, 3, spread=aa["spread"])}
    best = comps["pure_comp_fused_vs_fastest_peer"]
    # per round: the fastest of the peers that ran (0.9, 1.0, 1.0) over ampnet's time
    assert best["per_round"] == pytest.approx([0.9 / 0.6, 1.0 / 0.8, 1.0 / 0.5])
    assert best["median"] == pytest.approx(1.5) and best["verdict"] == "differs"
    assert best["target"] == ">= 1.15" and best["met"] is True
    assert "lightning_vs_raw_amp" in comps and "accelerate_vs_raw_amp" not in comps
    assert runner.aa_control(_records({"raw-amp": [1.0]}), 1) is None


@pytest.mark.slow
def test_process_isolation_runs_each_round_in_a_fresh_process(monkeypatch):
    calls = []
    real = runner.run_in_subprocess

    def spy(cfg, workload, contender, weights=None):
        calls.append(contender)
        return real(cfg, workload, contender, weights)

    monkeypatch.setattr(runner, "run_in_subprocess", spy)
    monkeypatch.setattr(runner, "run_contender", None)  # nothing runs in this process
    cfg = BenchConfig(workloads=("overhead",), quick=True, rounds=1, epochs=1, warmup=0,
                      n_samples=256, batching="tensors", isolation="process",
                      contenders=("raw-amp", "raw-amp-aa"))
    assert cfg.memory_method == "subprocess"
    w = runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]
    assert calls == ["raw-amp", "raw-amp-aa"]
    for c in w["contenders"]:
        assert c["available"], c["error"]
        assert c["memory"]["method"] == "rss_hwm" and _positive(c["memory"]["peak_mb"])
        assert c["state_bytes"]["optimizer_state"] > 0  # SGD momentum buffers
    assert w["aa_control"]["spread"] >= 0
    assert "fresh Python process" in " ".join(w["notes"])


@pytest.mark.slow
def test_worker_error_is_reported_not_fatal():
    # a failure injected deterministically, on every torch release and machine: ampnet refuses
    # float16 compensated pure training with Adam (float16 optimizer state) at initialize(),
    # inside the worker process
    cfg = BenchConfig(workloads=("overhead",), quick=True, rounds=1, epochs=1, warmup=0,
                      n_samples=256, batching="tensors", isolation="process", dtype="float16",
                      optimizer="adam", contenders=("ampnet-pure-comp",))
    pure = runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]["contenders"][0]
    assert not pure["available"] and pure["median_s"] is None
    assert pure["error"].startswith("ValueError: amp_master_weights='compensated' with amp_dtype='float16'")
    assert "got optimizer=torch.optim.adam.Adam" in pure["error"]


class _Missing(importlib.abc.MetaPathFinder):
    """Makes ``import NAME`` fail as on a machine without NAME."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def test_peers_without_the_bench_extra_are_reported_not_fatal(monkeypatch):
    # the `bench` extra (accelerate, lightning) is optional: `pip install -e ".[dev]"` lacks it
    for name in list(sys.modules):
        if name.split(".")[0] in _PEER_MODULES.values():
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Missing(_PEER_MODULES.values())] + sys.meta_path)
    cfg = BenchConfig(workloads=("overhead",), quick=True, rounds=1, epochs=1, warmup=0,
                      n_samples=64, batching="tensors", contenders=("raw-fp32",) + tuple(_PEER_MODULES))
    contenders = {c["key"]: c for c in runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]["contenders"]}
    assert contenders["raw-fp32"]["available"]
    for key, module in _PEER_MODULES.items():
        assert not contenders[key]["available"] and contenders[key]["median_s"] is None
        assert contenders[key]["error"] == f"ModuleNotFoundError: No module named '{module}'"


@pytest.mark.slow
def test_benchmark_is_not_part_of_the_core_package():
    code = ("import sys, ampnet; from ampnet import AmpNetClassifier; "
            "print(sorted(m for m in sys.modules if m.startswith(('ampnet_bench', 'ampnet.benchmark'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    help_text = subprocess.run([sys.executable, "-m", "ampnet.benchmark", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert help_text.startswith("usage: python -m ampnet.benchmark")
    assert "--isolation" in help_text


# ---- the contenders: the best hand-written loop and AmpNet auto ----------------------------


def _tiny(contenders):
    cfg = BenchConfig(workloads=("overhead",), quick=True, rounds=1, epochs=2, warmup=1, n_samples=256,
                      batching="tensors", optimizer="adamw", contenders=contenders)
    wl = cfg.workload("overhead")
    return cfg, wl, wl.make_data(cfg.seed)


def _contender(key):
    return next(c for c in runner.CONTENDERS if c.key == key)


def test_best_loop_steps_a_fused_optimizer_under_autocast():
    from ampnet_bench import contenders

    cfg, wl, data = _tiny(("raw-amp-fused",))
    times, loss, model, optimizer = contenders._raw_train(_contender("raw-amp-fused"), wl, data, cfg, epochs=1)
    assert optimizer.defaults["fused"] is True
    assert len(times) == 1 and _positive(times[0]) and math.isfinite(loss)
    _, _, _, plain = contenders._raw_train(_contender("raw-amp"), wl, data, cfg, epochs=1)
    assert plain.defaults["fused"] is None  # the default loop keeps torch's default kernel


def test_ampnet_auto_contender_includes_its_measuring_cost(monkeypatch):
    from ampnet import AmpNetClassifier
    from ampnet_bench import contenders

    real_fit = AmpNetClassifier.fit
    seen = []

    def fit(self, X, y=None, **kw):
        net = real_fit(self, X, y, **kw)
        seen.append((self.max_epochs, self.get_params()["amp_autotune__cache"]))
        net.amp_autotune_.cost_s = 100.0  # measuring steps that cost 100 s: 50 s in each of the 2 timed epochs
        return net

    monkeypatch.setattr(AmpNetClassifier, "fit", fit)
    cfg, wl, data = _tiny(("ampnet-auto",))
    outcome = contenders.run_contender(_contender("ampnet-auto"), wl, data, cfg)
    # 'auto' fits as for 10 epochs, its cache off, and is stopped after the 1 + 2 timed
    assert cfg.auto_fit_epochs == 10 and seen == [(10, False)]
    assert len(outcome.epoch_times) == 2 and all(50.0 < t < 60.0 for t in outcome.epoch_times)
    assert math.isfinite(outcome.final_loss)
    assert not [w for w in outcome.warnings if "no effect" in w]


def test_new_comparisons_and_their_targets():
    comps = {c.key: c for c in runner.COMPARISONS}
    assert (comps["ampnet_auto_vs_best_loop"].a, comps["ampnet_auto_vs_best_loop"].b) == ("ampnet-auto", "raw-amp-fused")
    assert comps["ampnet_mixed_vs_best_loop"].b == "raw-amp-fused"
    assert comps["ampnet_auto_vs_fastest_peer"].b == runner.PEERS and "raw-amp-fused" not in runner.PEERS
    wl = BenchConfig(workloads=("mlp",)).workload("mlp")
    records = {k: runner._Record(_contender(k)) for k in ("ampnet-auto", "raw-amp-fused", *runner.PEERS)}
    for key, times in {"ampnet-auto": [1.0, 1.0], "raw-amp-fused": [1.02, 0.99], "raw-amp": [1.5, 1.4],
                       "skorch-accelerate": [1.6, 1.5], "lightning": [1.7, 1.6]}.items():
        records[key].round_times = times
    full = {c["key"]: c for c in runner._comparisons(records, wl, 2)}
    assert full["ampnet_auto_vs_best_loop"]["median"] == pytest.approx((1 / 1.02 + 1 / 0.99) / 2)
    assert full["ampnet_auto_vs_best_loop"]["met"] is True
    # the fastest peer per round: 1.5 and 1.4 s
    assert full["ampnet_auto_vs_fastest_peer"]["median"] == pytest.approx(1.45)
    assert full["ampnet_auto_vs_fastest_peer"]["target"] == ">= 1.3" and full["ampnet_auto_vs_fastest_peer"]["met"]


def test_aa_control_falls_back_to_the_ampnet_fp32_pair():
    # where the AMP loop does not run (a float32 comparison), AmpNet fp32 run twice is the control
    records = _records({"ampnet-fp32": [1.0, 2.0], "ampnet-fp32-aa": [1.05, 2.0],
                        "ampnet-fp32-noguard": [0.98, 1.96]})
    aa = runner.aa_control(records, 2)
    assert (aa["a"], aa["b"]) == ("ampnet-fp32", "ampnet-fp32-aa")
    assert aa["spread"] == pytest.approx(0.05)
    wl = BenchConfig(workloads=("mlp",)).workload("mlp")
    comps = {c["key"]: c for c in runner._comparisons(records, wl, 2, spread=aa["spread"])}
    guard = comps["guard_cost_fp32"]
    assert guard["per_round"] == pytest.approx([1.0 / 0.98, 2.0 / 1.96])
    assert guard["verdict"] == "within noise"
    # the AMP loop's pair wins where both ran
    both = _records({"raw-amp": [1.0], "raw-amp-aa": [1.2], "ampnet-fp32": [1.0], "ampnet-fp32-aa": [1.0]})
    assert runner.aa_control(both, 1)["a"] == "raw-amp"


def test_monitor_and_noguard_contenders_train_as_labelled():
    from ampnet_bench.contenders import CONTENDERS, _make_net

    cfg = BenchConfig(workloads=("overhead",), quick=True, threads=1)
    wl = cfg.workload("overhead")
    data = wl.make_data(cfg.seed)
    by = {c.key: c for c in CONTENDERS}
    nets = {}
    for key in ("ampnet-fp32", "ampnet-fp32-monitor", "ampnet-fp32-noguard"):
        nets[key] = _make_net(by[key], wl.build_module(cfg.seed), wl, cfg, max_epochs=1)
        nets[key].fit(data.X, data.y)
    assert "grad_norm" in nets["ampnet-fp32-monitor"].history[-1]
    assert "grad_norm" not in nets["ampnet-fp32"].history[-1]
    assert nets["ampnet-fp32-noguard"].amp_skip_nonfinite is False
    assert nets["ampnet-fp32"].amp_skip_nonfinite is True
    assert not nets["ampnet-fp32-monitor"].precision_policy_.enabled


# ---- the workloads people train with AMP: transformer, ResNet, LSTM ---------------------------


def _count(module, cls):
    return sum(isinstance(m, cls) for m in module.modules())


def test_full_size_workloads_are_the_stated_models():
    from torch import nn

    from ampnet_bench.workloads import get_workload

    t = get_workload("transformer")
    module, data = t.build_module(0), t.make_data(0)
    layers = [m for m in module.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == 4 and all(m.self_attn.batch_first for m in layers)
    assert module.embed.embedding_dim == 256 and data.X.shape[1] == 128 and data.X.dtype == torch.int64
    r = get_workload("resnet")
    resnet, images = r.build_module(0), r.make_data(0)
    # ResNet-18 with a 10-class head: torchvision's 11,689,512 less 512 x 990 + 990
    assert sum(p.numel() for p in resnet.parameters()) == 11_181_642
    assert _count(resnet, nn.BatchNorm2d) == 20 and images.X.shape[1:] == (3, 64, 64)
    n = get_workload("rnn")
    rnn = n.build_module(0)
    assert _count(rnn, nn.LSTM) == 1 and rnn.rnn.num_layers == 2 and rnn.rnn.batch_first
    with torch.no_grad():
        for wl, module, X in ((t, module, data.X[:2]), (r, resnet.eval(), images.X[:2]),
                              (n, rnn, n.make_data(0).X[:2])):
            assert module(X).shape == (2, 10), wl.name
    for wl in (t, r, n):
        assert wl.task == "train" and wl.n_batches >= 2
        assert {tg.comparison for tg in wl.targets} >= {"ampnet_mixed_vs_fastest_peer", "ampnet_auto_vs_fastest_loop"}


def test_quick_workloads_are_tiny_and_sizes_override():
    from ampnet_bench.workloads import MODEL_DIMS, get_workload

    for name in MODEL_DIMS:
        module = get_workload(name, quick=True).build_module(0)
        assert sum(p.numel() for p in module.parameters()) < 100_000, name
    wl = get_workload("transformer", quick=True, dims={"d_model": "48", "n_layers": 2})
    assert wl.build_module(0).embed.embedding_dim == 48 and "2 layers" in wl.title
    gru = get_workload("rnn", quick=True, dims={"cell": "gru"}).build_module(0)
    assert isinstance(gru.rnn, torch.nn.GRU)
    narrow = get_workload("resnet", quick=True, dims={"widths": "4-8-16-32"}).build_module(0)
    assert narrow.fc.in_features == 32
    with pytest.raises(ValueError, match="no size 'depth'"):
        get_workload("transformer", dims={"depth": 3})
    with pytest.raises(ValueError, match="takes no sizes"):
        get_workload("mlp", dims={"d_model": 3})


def test_cli_reaches_the_new_workloads_and_their_sizes():
    args = cli.build_parser().parse_args(
        ["--workload", "transformer", "resnet", "rnn", "--quick", "--dims", "transformer.d_model=64",
         "rnn.cell=gru"])
    cfg = cli.config_from_args(args)
    assert cfg.workloads == ("transformer", "resnet", "rnn")
    assert cfg.workload("transformer").build_module(0).embed.embedding_dim == 64
    assert isinstance(cfg.workload("rnn").build_module(0).rnn, torch.nn.GRU)
    assert cfg.workload_dims("resnet") == {}
    assert BenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # the workers get the sizes
    all_cfg = cli.config_from_args(cli.build_parser().parse_args([]))
    assert {"transformer", "resnet", "rnn"} <= set(all_cfg.workloads)
    for bad in ("transformer.depth=3", "mlp.d_model=3", "d_model=3"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--dims", bad])


def test_written_out_resnet18_has_torchvisions_structure():
    import pickle

    from ampnet_bench.workloads import ResNet18, resnet18_module

    torch.manual_seed(0)
    module = resnet18_module(10, use_torchvision=False)
    assert isinstance(module, ResNet18)
    stages = [getattr(module, f"layer{i}") for i in range(1, 5)]
    assert [len(s) for s in stages] == [2, 2, 2, 2]
    assert [s[0].downsample is not None for s in stages] == [False, True, True, True]
    assert [s[-1].conv2.out_channels for s in stages] == [64, 128, 256, 512]
    assert module.conv1.kernel_size == (7, 7) and module.conv1.stride == (2, 2)
    X = torch.randn(2, 3, 64, 64)
    last = resnet18_module(10, use_torchvision=False, channels_last=True)
    last.load_state_dict(module.state_dict())
    last = last.to(memory_format=torch.channels_last).eval()
    with torch.no_grad():
        torch.testing.assert_close(last(X), module.eval()(X), rtol=1e-4, atol=1e-4)
    assert pickle.loads(pickle.dumps(last))(X).shape == (2, 10)  # the hook is a module-level function


def test_resnet_is_torchvisions_resnet18_where_installed():
    torchvision = pytest.importorskip("torchvision")
    from ampnet_bench.workloads import get_workload, resnet18_module

    ours = resnet18_module(10, use_torchvision=False)
    theirs = torchvision.models.resnet18(weights=None, num_classes=10)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(ours.state_dict())
    X = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(X), ours.eval()(X))
    assert isinstance(resnet18_module(10), torchvision.models.ResNet)
    assert get_workload("resnet").title.startswith("torchvision resnet18")


@pytest.mark.slow
def test_new_workloads_run_every_contender(tmp_path):
    from ampnet_bench.docs_tables import summarize, table_markdown

    cfg = BenchConfig(workloads=("transformer", "resnet", "rnn"), quick=True, rounds=1, epochs=1, warmup=1,
                      optimizer="adamw")
    results = runner.run_benchmark(cfg, log=lambda msg: None)
    _check_results(results, ["transformer", "resnet", "rnn"], rounds=1)
    flags = results["machine"]["cpu_flags"]
    assert isinstance(flags["avx512_bf16"], bool) and isinstance(flags["amx_bf16"], bool)
    md = to_markdown(results)
    for w in results["workloads"]:
        assert [c["key"] for c in w["contenders"]] == list(CONTENDER_KEYS)
        auto = by_key(w, "ampnet-auto")["auto_choice"]
        assert auto["chosen"] and auto["rounds"] == 1 and auto["per_round"] == [auto["chosen"]]
        assert auto["cost_s"][0] >= 0 and "amp_enabled" in json.dumps(auto["params"])
        assert f"`amp_enabled='auto'` chose **{auto['chosen']}**" in md
        assert all(c["auto_choice"] is None for c in w["contenders"] if c["key"] != "ampnet-auto")
        entry = summarize(w)
        for row in entry["rows"]:
            c = by_key(w, row["key"])
            if not c["available"]:  # the peers without the bench extra; an fp16 LSTM on a CPU
                assert c["error"] and row["ms_per_batch"] is None
                continue
            assert row["ms_per_batch"] == pytest.approx(c["ms_per_batch"])
            assert row["min_ms"] <= row["ms_per_batch"] <= row["max_ms"]
            assert row["final_loss"] == pytest.approx(c["final_loss"])
        assert entry["aa_spread"] == pytest.approx(w["aa_control"]["spread"])
        assert auto["chosen"] in entry["auto_choice"]
        assert "not yet measured" not in "\n".join(table_markdown(entry)).split("| target |")[0]
    assert "avx512_bf16" in md and "amx_bf16" in md


# ---- the performance page's per-workload sections ---------------------------------------------


def _docs_entry(times_ms):
    from ampnet_bench.docs_tables import placeholder_data

    entry = placeholder_data()["workloads"][0]
    entry["auto_choice"] = "bfloat16 (mixed) (3 of 3 rounds)"
    for row, ms in zip(entry["rows"], times_ms):
        row.update(ms_per_batch=ms, min_ms=0.9 * ms, max_ms=1.2 * ms, epoch_s=ms * entry["n_batches"] / 1000,
                   x_fp32_loop=ms / times_ms[0], final_loss=0.5, loss_vs_fp32=1.0, peak_mb=500.0, state_mib=96.4)
    return entry


def _check_docs_chart(fig, entry):
    ax = fig.axes[0]
    bars = {round(r.get_y() + r.get_height() / 2): r.get_width() for r in ax.patches}
    labels = {round(t.get_position()[1]): t.get_text().strip() for t in ax.texts}
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(bars) == sorted(labels)
    rows = {r["label"]: r for r in entry["rows"]}
    for y, width in bars.items():
        value, unit = labels[y].split()
        assert unit == "ms" and abs(width - float(value)) <= 0.05 + 1e-9, (names[y], width, labels[y])
        assert width == pytest.approx(rows[names[y]]["ms_per_batch"])
    return bars


def test_docs_chart_bars_agree_with_their_labels():
    from ampnet_bench.docs_tables import PLACEHOLDER, build_chart, placeholder_data

    times = [120.0, 60.0, 61.5, 45.25, 70.0, 72.0, 47.0, 50.0, 66.6]
    entry = _docs_entry(times)
    bars = _check_docs_chart(build_chart(entry), entry)
    assert sorted(bars.values()) == pytest.approx(sorted(times))  # one bar per contender, as long as its time
    placeholder = placeholder_data()["workloads"][2]
    ax = build_chart(placeholder).axes[0]
    assert not ax.patches and [t.get_text() for t in ax.texts] == [PLACEHOLDER]
    assert len(ax.get_yticklabels()) == len(placeholder["rows"])


def test_docs_tables_are_generated_between_the_markers():
    from ampnet_bench.docs_tables import PLACEHOLDER, placeholder_data, table_markdown, update_page

    data = placeholder_data()
    page = "intro\n" + "".join(f"% begin generated benchmark table: {n}\nold\n% end generated benchmark table: {n}\n"
                               for n in ["machine"] + [w["name"] for w in data["workloads"]]) + "outro\n"
    once = update_page(page, data)
    assert "old" not in once and once.startswith("intro\n") and once.endswith("outro\n")
    assert update_page(once, data) == once
    assert once.count(PLACEHOLDER) > len(data["workloads"]) and "tools/benchmark_figure.py --measure" in once
    data["workloads"][0] = _docs_entry([10.0] * 9)
    data["workloads"][0]["aa_spread"] = 0.042
    measured = "\n".join(table_markdown(data["workloads"][0]))
    row = next(line for line in measured.splitlines() if line.startswith("| PyTorch loop, float32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    entry = data["workloads"][0]
    assert float(cells[1].split()[0]) == pytest.approx(10.0 * entry["n_batches"])  # epoch, ms
    assert [float(cells[i].split()[0]) for i in (2, 3, 4, 5)] == pytest.approx([10.0, 1.0, 500.0, 96.4])
    assert "4.2%" in measured and PLACEHOLDER not in measured.split("| target |")[0]
    with pytest.raises(ValueError, match="no markers"):
        update_page("no markers here\n", data)


def test_performance_page_shows_every_workload_from_the_json():
    from ampnet_bench.docs_tables import update_page
    from ampnet_bench.workloads import MODEL_WORKLOADS

    from repo_paths import ROOT as root

    data = json.loads((root / "docs" / "_data" / "benchmark_workloads.json").read_text(encoding="utf-8"))
    page = (root / "docs" / "user_guide" / "performance.md").read_text(encoding="utf-8")
    assert [w["name"] for w in data["workloads"]] == list(MODEL_WORKLOADS)
    assert update_page(page, data) == page  # the page's tables are the JSON's
    for name in MODEL_WORKLOADS:
        png = root / "docs" / "_static" / f"benchmark-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"../_static/benchmark-{name}.png" in page
    assert "python tools/benchmark_figure.py --measure" in page


def test_a_missed_target_within_the_aa_spread_reads_as_noise():
    from ampnet_bench.docs_tables import met_cell

    assert met_cell(True, "within noise") == "yes"
    assert met_cell(False, "within noise") == "no, within the A/A spread (noise)"
    assert met_cell(False, "differs") == "**no**" and met_cell(False, None) == "**no**"
    assert met_cell(None, "differs") == ""


# ---- issue 37: the GPU workloads, the overhead workload and the careful loop ------------------


def test_gpu_workloads_are_the_stated_models():
    from torch import nn

    from ampnet_bench.gpu_models import DecoderLM, ResNet50, TokenCrossEntropy
    from ampnet_bench.workloads import GPU_WORKLOADS, WORKLOAD_NAMES, get_workload

    assert GPU_WORKLOADS == ("resnet50", "encoder", "decoder") and not set(GPU_WORKLOADS) & set(WORKLOAD_NAMES)
    with torch.device("meta"):  # full sizes without allocating them
        resnet = get_workload("resnet50").module_factory()
        encoder = get_workload("encoder").module_factory()
        decoder = get_workload("decoder").module_factory()
    assert isinstance(resnet, ResNet50) and sum(p.numel() for p in resnet.parameters()) == 25_557_032
    assert [len(stage) for stage in resnet.stages] == [3, 4, 6, 3]
    for module, n_layers in ((encoder, 12), (decoder, 12)):
        layers = [m for m in module.modules() if isinstance(m, nn.TransformerEncoderLayer)]
        assert len(layers) == n_layers
        assert {(m.self_attn.embed_dim, m.self_attn.num_heads, m.linear1.out_features) for m in layers} == {
            (768, 12, 3072)}
    assert encoder.embed.num_embeddings == 30522 and encoder.pos.shape == (128, 768)
    assert isinstance(decoder, DecoderLM) and decoder.head.out_features == 50304 and decoder.pos.shape == (256, 768)
    r, e, d = (get_workload(n) for n in GPU_WORKLOADS)
    assert (r.batch_size, e.batch_size, d.batch_size) == (64, 32, 16)
    assert r.n_batches == e.n_batches == d.n_batches == 16
    assert "3x224x224" in r.title and "seq 128" in e.title and "seq 256" in d.title
    assert d.criterion is TokenCrossEntropy and r.criterion is e.criterion is nn.CrossEntropyLoss
    assert {t.comparison for t in r.targets} == {t.comparison for t in e.targets} == {
        "ampnet_mixed_vs_careful", "ampnet_mixed_vs_careful_ieee"}
    assert {t.comparison for t in d.targets} == {"ampnet_mixed_vs_careful"}
    # named on the command line, not part of --workload all
    assert not set(GPU_WORKLOADS) & set(cli.config_from_args(cli.build_parser().parse_args([])).workloads)
    assert cli.config_from_args(cli.build_parser().parse_args(["--workload", "decoder"])).workloads == ("decoder",)


def test_the_decoder_is_causal_and_its_loss_covers_every_token():
    from ampnet_bench.workloads import get_workload

    wl = get_workload("decoder", quick=True)
    module, data = wl.build_module(0).eval(), wl.make_data(0)
    X = data.X[:2]
    assert data.y.shape == data.X.shape and torch.equal(data.X[:, 1:], data.y[:, :-1])  # the next token
    changed = X.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        logits, other = module(X), module(changed)
    assert logits.shape == (2, 16, 256)
    assert torch.equal(logits[:, :-1], other[:, :-1]) and not torch.equal(logits[:, -1], other[:, -1])
    loss = wl.criterion()(logits, data.y[:2])
    assert loss == torch.nn.functional.cross_entropy(logits.reshape(-1, 256), data.y[:2].reshape(-1))


def test_the_overhead_workload_is_the_issues():
    from ampnet_bench.workloads import OVERHEAD_STEPS, get_workload

    wl = get_workload("overhead")
    module = wl.build_module(0)
    assert [m.weight.shape for m in module.layers if isinstance(m, torch.nn.Linear)] == [(32, 20), (2, 32)]
    assert wl.batch_size == 32 and wl.n_batches == OVERHEAD_STEPS == 400 and wl.n_samples == 32 * 400
    assert {(t.comparison, t.op, t.value) for t in wl.targets} == {
        ("ampnet_mixed_vs_careful", "<=", 1.10), ("ampnet_mixed_vs_skorch", ">", 1.0),
        ("ampnet_fp32_vs_skorch", "<", 1.0)}
    assert get_workload("overhead", quick=True).n_batches == 20
    assert BenchConfig(workloads=("overhead",)).optimizer_spec() == (torch.optim.SGD, {"momentum": 0.9, "lr": 0.01})


class _RowRecorder(torch.nn.Module):
    """A linear model that records the row ids (column 0 of its input) of every batch."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.batches = []

    def forward(self, X):
        self.batches.append(X[:, 0].detach().clone())  # no host read here: the test counts them
        return self.linear(X)


def test_careful_loop_batches_every_row_once_an_epoch_and_reads_the_loss_once():
    from ampnet_bench.careful_loop import careful_train
    from host_reads import HostReadCounter

    X = torch.stack([torch.arange(70.0), torch.randn(70)], dim=1)
    y = torch.randint(0, 2, (70,))
    ticks = iter([0.0, 2.0, 10.0, 13.0])
    model = _RowRecorder()
    with HostReadCounter() as counter:
        run = careful_train(model, X, y, batch_size=32, epochs=2, optimizer_cls=torch.optim.SGD,
                            optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, clock=lambda: next(ticks))
    assert run.epoch_times == [2.0, 3.0]  # the clock's differences
    assert counter.count == 2  # the loss read once an epoch, never per step
    batches = [b.long().tolist() for b in model.batches]
    assert [len(b) for b in batches] == [32, 32, 6, 32, 32, 6]
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(first) == sorted(second) == list(range(70)) and first != second  # a new permutation each epoch
    assert run.optimizer_impl == "fused" and run.optimizer.defaults["fused"] is True
    assert len(run.epoch_losses) == 2 and all(math.isfinite(v) for v in run.epoch_losses)


def test_careful_loop_refuses_bad_sizes():
    from ampnet_bench.careful_loop import careful_train

    X, y = torch.randn(8, 2), torch.zeros(8, dtype=torch.int64)
    kwargs = dict(optimizer_cls=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer; got 0\. Pass e\.g\. batch_size=32"):
        careful_train(torch.nn.Linear(2, 2), X, y, batch_size=0, epochs=1, **kwargs)
    with pytest.raises(ValueError, match=r"epochs must be a positive integer; got 1\.5\. Pass e\.g\. epochs=1"):
        careful_train(torch.nn.Linear(2, 2), X, y, batch_size=4, epochs=1.5, **kwargs)
    with pytest.raises(ValueError, match=r"X and y must hold the same rows; got 8 and 7\."):
        careful_train(torch.nn.Linear(2, 2), X, y[:7], batch_size=4, epochs=1, **kwargs)


def test_careful_loop_falls_back_to_foreach_where_fused_is_refused():
    from ampnet_bench.careful_loop import make_fast_optimizer

    class NoFused(torch.optim.SGD):
        def __init__(self, params, fused=None, **kwargs):
            if fused:
                raise RuntimeError("`fused=True` is not supported here")
            super().__init__(params, **kwargs)

    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer, impl = make_fast_optimizer(NoFused, params, {"lr": 0.1})
    assert impl == "foreach" and optimizer.defaults["foreach"] is True and not optimizer.defaults.get("fused")


def test_float32_mode_sets_tf32_and_restores_it():
    from ampnet_bench.careful_loop import float32_mode

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with float32_mode("ieee"):
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    with float32_mode("tf32"):
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    with float32_mode(None):
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(ValueError, match=r"float32 mode 'fp32' is not one of None, 'ieee', 'tf32'; pass 'ieee'"):
        with float32_mode("fp32"):
            pass


def test_item_loop_reads_the_loss_every_step():
    from ampnet_bench.contenders import _item_train, _shuffle_generator
    from host_reads import HostReadCounter

    cfg = BenchConfig(workloads=("overhead",), quick=True, threads=1)
    wl = cfg.workload("overhead")
    data = wl.make_data(cfg.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.X, data.y), batch_size=wl.batch_size,
                                         shuffle=True, generator=_shuffle_generator(cfg))
    with HostReadCounter() as loading:  # what the DataLoader's sampler reads itself (its seed, its order)
        for _ in range(2):
            list(loader)
    with HostReadCounter() as counter:
        times, loss, _, optimizer = _item_train(_contender("raw-item-amp"), wl, data, cfg, epochs=2)
    assert counter.count - loading.count == 2 * wl.n_batches  # loss.item() each step
    assert len(times) == 2 and math.isfinite(loss) and not optimizer.defaults.get("fused")


def test_float8_contender_runs_only_where_it_can():
    from ampnet_bench.contenders import float8_unavailable

    assert float8_unavailable("cuda", "encoder", capability=(9, 0), torchao=True) is None
    assert float8_unavailable("cuda", "decoder", capability=(8, 9), torchao=True) is None
    assert float8_unavailable("cuda", "encoder", capability=(8, 0), torchao=True) == (
        "skipped: float8 needs compute capability >= 8.9 (this GPU: 8.0)")
    assert float8_unavailable("cuda", "encoder", capability=(9, 0), torchao=False) == (
        "skipped: float8 needs torchao, which is not installed (pip install torchao)")
    assert float8_unavailable("cpu", "encoder") == (
        "skipped: float8 needs a CUDA device of compute capability >= 8.9 (this run: the CPU)")
    assert float8_unavailable("cuda", "resnet50", capability=(9, 0), torchao=True) == (
        "skipped: the float8 contender runs on the encoder and the decoder only")


def test_float8_contender_refused_by_an_ampnet_reads_not_available(monkeypatch):
    from ampnet_bench import contenders

    # stand for a GPU where it may run, and for an ampnet without float8 (0.4 refused amp_dtype='float8'
    # with this error when the net was built): the contender reports it, the others run
    monkeypatch.setattr(contenders, "float8_unavailable", lambda device, workload: None)
    refusal = "amp_dtype='float8' is not valid. Valid values: 'auto', 'bfloat16', 'float16'."
    make_net = contenders._make_net

    def without_float8(contender, *args, **kwargs):
        if contender.amp_dtype == "float8":
            raise ValueError(refusal)
        return make_net(contender, *args, **kwargs)

    monkeypatch.setattr(contenders, "_make_net", without_float8)
    cfg = BenchConfig(workloads=("encoder",), quick=True, rounds=1, epochs=1, warmup=0, threads=1, memory="off",
                      isolation="inprocess", contenders=("raw-careful", "ampnet-float8"))
    w = runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]
    float8 = by_key(w, "ampnet-float8")
    assert not float8["available"] and float8["error"] == f"not available in this version: {refusal}"
    assert by_key(w, "raw-careful")["available"]


def test_overhead_and_gpu_workloads_run_their_contenders_in_quick_mode():
    from ampnet_bench.contenders import GPU_CONTENDERS, overhead_contenders

    cfg = BenchConfig(workloads=("overhead",), quick=True, rounds=1, epochs=1, warmup=1, threads=1, memory="off",
                      isolation="inprocess", contenders=overhead_contenders("cpu"))
    w = runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]
    assert w["reference"] == "raw-careful" and w["aa_control"]["a"] == "raw-careful"
    assert all(c["available"] for c in w["contenders"]), [(c["key"], c["error"]) for c in w["contenders"]]
    assert by_key(w, "raw-careful")["ratio_to_reference"]["median"] == 1.0
    # the careful loop twice: the same batches, the same weights, the same loss
    assert by_key(w, "raw-careful")["final_loss"] == by_key(w, "raw-careful-aa")["final_loss"]
    comps = {c["key"]: c for c in w["comparisons"]}
    for key in ("ampnet_mixed_vs_careful", "ampnet_mixed_vs_skorch", "ampnet_fp32_vs_skorch", "item_amp_vs_careful"):
        assert _positive(comps[key]["median"]), key
        assert comps[key]["target"] is None  # quick mode judges no target
    for name in ("resnet50", "encoder", "decoder"):
        keys = ("raw-careful", "raw-careful-fp32", "raw-careful-tf32", "ampnet-mixed", "ampnet-float8")
        assert set(keys) <= set(GPU_CONTENDERS)
        cfg = BenchConfig(workloads=(name,), quick=True, rounds=1, epochs=1, warmup=0, threads=1, memory="off",
                          isolation="inprocess", contenders=keys)
        w = runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]
        for key in ("raw-careful", "raw-careful-fp32", "ampnet-mixed"):
            c = by_key(w, key)
            assert c["available"] and math.isfinite(c["final_loss"]) and 0 <= c["accuracy"] <= 1, (name, key)
        assert by_key(w, "raw-careful-tf32")["error"] == "skipped: TF32 is a CUDA setting (this run: the CPU)"
        assert by_key(w, "ampnet-float8")["error"].startswith("skipped: ")


def test_a_skipped_contender_in_a_fresh_process_reads_its_reason():
    from ampnet_bench.contenders import ContenderUnavailable
    from ampnet_bench.worker import run_in_subprocess

    cfg = BenchConfig(workloads=("overhead",), quick=True, rounds=1, epochs=1, warmup=0, threads=1)
    with pytest.raises(ContenderUnavailable) as exc:
        run_in_subprocess(cfg, "overhead", "raw-careful-tf32")
    assert str(exc.value) == "skipped: TF32 is a CUDA setting (this run: the CPU)"


# ---- the overhead regime's table on the performance page ------------------------------------------


def _overhead_results():
    """A results document of the overhead workload as the benchmark writes it (figures made up)."""
    from ampnet_bench.overhead_table import OVERHEAD_LABELS

    times = {"raw-careful": 0.156, "raw-careful-aa": 0.158, "raw-careful-fp32": 0.150, "raw-item-amp": 0.204,
             "raw-item-fp32": 0.152, "skorch-fp32": 0.192, "ampnet-fp32": 0.160, "ampnet-auto": 0.164,
             "ampnet-mixed": 0.168}
    contenders = [{"key": k, "available": True, "error": None, "median_s": times[k],
                   "ratio_to_reference": {"median": times[k] / 0.156}, "auto_choice": None} for k in OVERHEAD_LABELS]
    contenders[7]["auto_choice"] = {"chosen": "float32 (AMP off)"}
    contenders.append({"key": "raw-careful-tf32", "available": False, "error": "skipped", "median_s": None,
                       "ratio_to_reference": {"median": None}, "auto_choice": None})
    comps = [{"key": "ampnet_mixed_vs_careful", "median": 1.077}, {"key": "ampnet_mixed_vs_skorch", "median": 1.143},
             {"key": "ampnet_fp32_vs_skorch", "median": 0.833}]
    machine = {"cpu_model": "AMD EPYC", "cpu_flags": {"avx512_bf16": True, "amx_bf16": False}, "torch": "2.14.1",
               "skorch": "1.4.0", "ampnet": "0.5.0", "ampnet_commit": "abc1234", "date_utc": "2026-12-06 10:00:00",
               "load_average_at_start": [0.1, 0.2, 0.3]}
    workload = {"name": "overhead", "reference": "raw-careful", "n_batches": 400, "contenders": contenders,
                "comparisons": comps, "aa_control": {"spread": 0.013}}
    return {"machine": machine, "workloads": [workload]}


def test_overhead_table_from_a_run():
    from ampnet_bench.overhead_table import overhead_markdown, summarize_overhead

    data = summarize_overhead(_overhead_results())
    rows = {r["key"]: r for r in data["rows"]}
    assert rows["raw-careful"]["us_per_step"] == pytest.approx(390.0) and rows["raw-careful"]["x_careful"] == 1.0
    assert rows["ampnet-mixed"]["us_per_step"] == pytest.approx(420.0)
    assert [t["met"] for t in data["targets"]] == [True, True, True]
    assert data["auto_choice"] == "float32 (AMP off)" and data["aa_spread"] == 0.013
    lines = overhead_markdown(data)
    assert lines[0].startswith("Measured on AMD EPYC (avx512_bf16: yes, amx_bf16: no), torch 2.14.1, skorch 1.4.0, "
                               "ampnet 0.5.0 (commit abc1234), 2026-12-06 10:00:00 UTC")
    table = [line for line in lines if line.startswith("| AmpNet `amp_enabled=True`")]
    assert table == ["| AmpNet `amp_enabled=True` (default bf16) | 420 | 1.08 |"]
    assert "| AmpNet default: time a step / the careful loop's | <= 1.1 | 1.077 | yes |" in lines
    assert "A/A spread: 1.3%. `amp_enabled=\"auto\"` chose: float32 (AMP off)." in lines
    # a missed target, and a contender that could not run
    results = _overhead_results()
    results["workloads"][0]["comparisons"][0]["median"] = 1.25
    results["workloads"][0]["contenders"][5].update(available=False, error="boom", median_s=None)
    lines = overhead_markdown(summarize_overhead(results))
    assert "| AmpNet default: time a step / the careful loop's | <= 1.1 | 1.250 | **no** |" in lines
    assert "| skorch `NeuralNetClassifier`, float32 | not available: boom | |" in lines
    results["workloads"][0]["reference"] = "raw-fp32"
    with pytest.raises(ValueError, match="not the careful loop 'raw-careful'"):
        summarize_overhead(results)


def test_overhead_tool_writes_the_json_and_the_page(tmp_path):
    import importlib.util

    from ampnet_bench.overhead_table import placeholder_overhead, update_overhead_section
    from repo_paths import ROOT

    spec = importlib.util.spec_from_file_location("overhead_benchmark", ROOT / "tools" / "overhead_benchmark.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_overhead_results()))
    page = tmp_path / "performance.md"
    page.write_text("before\n% begin generated benchmark table: overhead-cpu\nold\n"
                    "% end generated benchmark table: overhead-cpu\nafter\n")
    data_file = tmp_path / "_data" / "overhead.json"
    from ampnet_bench.overhead_table import summarize_overhead

    tool.write(summarize_overhead(json.loads(results.read_text())), page=page, path=data_file)
    text = page.read_text()
    assert text.startswith("before\n% begin generated") and text.endswith("overhead-cpu\nafter\n")
    assert "old" not in text and "| AmpNet `amp_enabled=True` (default bf16) | 420 | 1.08 |" in text
    assert json.loads(data_file.read_text())["measured"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_data", "performance.md", "results.json"]  # no temp files
    # a page without the markers: neither file is written
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match="no markers '% begin generated benchmark table: overhead-cpu'"):
        tool.write(placeholder_overhead(), page=bare, path=tmp_path / "never.json")
    assert bare.read_text() == "no markers\n" and not (tmp_path / "never.json").exists()
    assert update_overhead_section(text, placeholder_overhead()).count("not yet measured on a quiet machine") == 1


def test_a_failed_write_leaves_the_old_file(tmp_path):
    from ampnet_bench.files import write_text_atomic

    path = tmp_path / "report.md"
    write_text_atomic(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "new \ud800\n")  # fails while writing
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["report.md"]
    assert write_text_atomic(tmp_path / "sub" / "r.md", "x") == tmp_path / "sub" / "r.md"


def test_performance_page_shows_the_overhead_table_from_the_json():
    from ampnet_bench.overhead_table import update_overhead_section
    from repo_paths import ROOT

    page = (ROOT / "docs" / "user_guide" / "performance.md").read_text(encoding="utf-8")
    data = json.loads((ROOT / "docs" / "_data" / "benchmark_overhead_cpu.json").read_text(encoding="utf-8"))
    assert update_overhead_section(page, data) == page
    if not data["measured"]:  # until a quiet machine measures it: no figure on the page
        section = page[page.index("% begin generated benchmark table: overhead-cpu"):]
        assert "**Figures: not yet measured on a quiet machine.** Measure them with " \
               "`python tools/overhead_benchmark.py`." in section
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert ("AMP pays where large matrix products and convolutions fill a step; on tiny models the trainer's own "
            "cost per step is what matters: compare with a careful hand-written loop.") in readme


# ---- on a GPU (pytest -m gpu; the check runs them) ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_careful_loop_makes_no_host_sync_per_step_on_cuda():
    import warnings

    from ampnet_bench.careful_loop import careful_train

    def syncs(n_rows):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).cuda()
        X, y = torch.randn(n_rows, 20, device="cuda"), torch.randint(0, 2, (n_rows,), device="cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                careful_train(model, X, y, batch_size=32, epochs=1, optimizer_cls=torch.optim.SGD,
                              optimizer_kwargs={"lr": 0.01, "momentum": 0.9}, device="cuda")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message).lower() for w in caught)

    syncs(64)  # warm-up
    assert syncs(32 * 12) == syncs(32 * 4)  # 8 more steps, not one more sync


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_mode_switches_tf32_for_cuda_matmuls():
    from ampnet_bench.careful_loop import float32_mode

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability >= 8.0")
    a = torch.randn(512, 512, device="cuda")
    exact = (a.double() @ a.double()).float()
    with float32_mode("ieee"):
        ieee = a @ a
    with float32_mode("tf32"):
        tf32 = a @ a
    assert (ieee - exact).abs().max() < (tf32 - exact).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workloads_run_every_contender_on_cuda():
    from ampnet_bench.contenders import GPU_CONTENDERS

    for name in ("resnet50", "encoder", "decoder"):
        cfg = BenchConfig(workloads=(name,), device="cuda", quick=True, rounds=1, epochs=1, warmup=0, threads=1,
                          optimizer="adamw", memory="off", isolation="inprocess", contenders=GPU_CONTENDERS)
        w = runner.run_benchmark(cfg, log=lambda msg: None)["workloads"][0]
        for c in w["contenders"]:
            if c["key"] == "ampnet-float8":  # runs, or says why not
                assert c["available"] or c["error"].startswith(("skipped: ", "not available in this version")), c
                continue
            assert c["available"], (name, c["key"], c["error"])
