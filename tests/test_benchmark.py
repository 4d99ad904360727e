"""CI-sized checks of ``python -m ampnet.benchmark``: the quick mode runs
in process and writes a well-formed report. No timing assertions: speed
claims come from real benchmark runs, not from unit tests."""

import json
import math

import pytest
import torch
from skorch.dataset import Dataset

from ampnet.benchmark import cli, runner
from ampnet.benchmark.config import BenchConfig
from ampnet.benchmark.contenders import CONTENDER_KEYS, TensorBatches
from ampnet.benchmark.report import to_markdown


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


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
        assert w["comparisons"]
        for comp in w["comparisons"]:
            assert _positive(comp["median"]), comp
            assert comp["min"] <= comp["median"] <= comp["max"]
            assert comp["met"] in (None, True, False)
        assert any(comp["target"] for comp in w["comparisons"])


def test_quick_benchmark_writes_report(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = cli.main([
        "--quick", "--workload", "mlp", "predict", "--threads", "1",
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
    assert (out / "results.md").read_text() == to_markdown(results)


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
