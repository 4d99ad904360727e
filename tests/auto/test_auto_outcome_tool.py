"""tools/auto_outcome.py, the outcome benchmark of amp_enabled='auto': its summaries on
made-up numbers, and one tiny end-to-end run (fresh processes, quick sizes)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from repo_paths import ROOT

TOOL = ROOT / "tools" / "auto_outcome.py"


def load_tool():
    name = "ampnet_tools_auto_outcome"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


ao = load_tool()

MACHINE = {"cpu_model": "Test CPU", "cpu_flags": {"avx512_bf16": True, "amx_bf16": False}, "usable_cores": 2,
           "logical_cores": 4, "torch": "9.9", "date_utc": "2026-01-01 00:00:00"}


def fake_runs(times, precision="bfloat16 (mixed)", rss=None):
    """Runs of one workload from ``{setting: [seconds per round]}``."""
    runs = []
    for setting, seconds in times.items():
        for rnd, s in enumerate(seconds):
            auto = setting.startswith("auto")
            runs.append({"workload": "mlp", "epochs": 3, "round": rnd, "setting": setting, "wall_s": s,
                         "precision": precision if auto else ("float32" if setting == "false" else "bfloat16 (mixed)"),
                         "chosen": None, "params": None, "max_rss_kb": (rss or {}).get(setting, 1000)})
    return runs


def test_median_of_per_round_ratios_is_not_the_ratio_of_medians():
    # per round: 1 / min(1, 2), 1.2 / min(1, 0.5), 3 / min(1, 4) = 1, 2.4, 3; the medians would give 1.2 / 1
    assert ao.median_ratio([1.0, 1.2, 3.0], [1.0, 1.0, 1.0], [2.0, 0.5, 4.0]) == pytest.approx(2.4)
    assert ao.median_ratio([1.1], [2.0], [1.0]) == pytest.approx(1.1)  # min(True, False) per round
    with pytest.raises(ValueError):
        ao.median_ratio([1.0, 2.0], [1.0], [1.0])


def test_relative_spread_of_the_a_a_control():
    assert ao.relative_spread([1.0, 2.0, 1.0], [1.1, 2.0, 0.8]) == pytest.approx(0.1)


def test_right_choice_only_where_true_and_false_differ_by_more_than_ten_percent():
    assert ao.right_choice(1.0, 1.05, chose_amp=False) is None  # 5%: either is right
    assert ao.right_choice(1.0, 1.09, chose_amp=False) is None
    assert ao.right_choice(1.0, 1.11, chose_amp=True) is True  # more than 10%: auto must pick True
    assert ao.right_choice(1.0, 1.5, chose_amp=True) is True
    assert ao.right_choice(1.0, 1.5, chose_amp=False) is False
    assert ao.right_choice(2.0, 1.0, chose_amp=False) is True
    assert ao.right_choice(2.0, 1.0, chose_amp=True) is False


def test_pinned_setting_of_a_choice():
    assert ao.pinned_setting({"precision": "float32", "params": None}) == "false"
    assert ao.pinned_setting({"precision": "bfloat16 (mixed)", "params": {"amp_master_weights": True}}) == "true"
    assert ao.pinned_setting({"precision": "bfloat16 (pure)", "params": None}) == "pinned"
    assert ao.pinned_setting({"precision": "float32", "params": {"memory_format": "channels_last"}}) == "pinned"


def test_summary_and_table_from_made_up_numbers():
    times = {"auto-cold": [1.3, 1.2, 1.25], "auto-warm": [1.0, 1.05, 1.02], "true": [1.0, 1.0, 1.0],
             "false": [2.0, 2.1, 1.9], "true-aa": [1.02, 0.98, 1.0]}
    rows = ao.summarize(fake_runs(times, rss={"auto-cold": 1100, "auto-warm": 1020, "true": 1000}))
    (row,) = rows
    assert row["median_s"]["auto-cold"] == pytest.approx(1.25)
    assert row["cold_ratio"] == pytest.approx(1.25) and row["cold_meets"] is False
    assert row["warm_ratio"] == pytest.approx(1.02) and row["warm_meets"] is True
    assert row["faster"] == "True" and row["true_false_differ"] == pytest.approx(1.0)
    assert row["right_choice"] is True and row["wrong_choices"] == 0 and row["auto_fits"] == 6
    assert row["rss_ratio"] == pytest.approx(1.06) and row["rss_meets"] is False  # median of 1.1 x3, 1.02 x3
    assert row["rss_cold"] == pytest.approx(1.1) and row["rss_cold_meets"] is False
    assert row["rss_warm"] == pytest.approx(1.02) and row["rss_warm_meets"] is True
    assert row["aa_spread"] == pytest.approx(0.02)
    text = ao.markdown(rows, MACHINE, threads=2)
    lines = text.splitlines()
    assert lines[0].startswith("Machine: Test CPU (avx512_bf16 yes, amx_bf16 no)")
    assert "torch 9.9" in lines[0] and "2026-01-01" in lines[0]
    assert lines[2].startswith("| workload | epochs | auto cold s | auto warm s | True s | False s | cold ratio |")
    assert "| mlp | 3 | 1.25 | 1.02 | 1.00 | 2.00 | 1.250 MISS | 1.020 |" in text
    # auto in float32 where True was twice as fast: the wrong choice, counted
    wrong = ao.summarize(fake_runs(times, precision="float32"))[0]
    assert wrong["right_choice"] is False and wrong["wrong_choices"] == 6
    assert "no (6/6)" in ao.markdown([wrong], MACHINE, threads=2)


def test_an_incomplete_round_is_left_out():
    times = {"auto-cold": [1.0, 1.0], "auto-warm": [1.0, 1.0], "true": [1.0, 1.0], "false": [1.0, 1.0],
             "true-aa": [1.0]}
    assert ao.summarize(fake_runs(times))[0]["rounds"] == 1


@pytest.mark.slow
def test_end_to_end_quick_run(tmp_path, monkeypatch, capsys):
    """The driver runs here (no interpreter start to pay for), its six fits in fresh processes."""
    out, md = tmp_path / "r.json", tmp_path / "t.md"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert ao.main(["--quick", "--rounds", "1", "--workloads", "mlp", "--epochs", "1", "--threads", "1",
                    "--out", str(out), "--markdown", str(md)]) == 0
    result = json.loads(out.read_text())
    runs = {r["setting"]: r for r in result["runs"]}
    assert set(ao.SETTINGS) <= set(runs) and result["prefill"]["mlp/1"]["autotune"]
    for run in runs.values():
        assert run["wall_s"] > 0 and run["max_rss_kb"] > 0 and len(run["epoch_s"]) == 1
    assert runs["true"]["precision"] != "float32" and runs["false"]["precision"] == "float32"
    assert runs["auto-cold"]["autotune"] and runs["auto-cold"]["params"]["amp_enabled"] in (True, False)
    (row,) = result["rows"]
    best = min(runs["true"]["wall_s"], runs["false"]["wall_s"])
    assert row["cold_ratio"] == pytest.approx(runs["auto-cold"]["wall_s"] / best)
    assert row["warm_ratio"] == pytest.approx(runs["auto-warm"]["wall_s"] / best)
    assert row["aa_spread"] >= 0 and row["rss_ratio"] > 0
    text = md.read_text()
    assert text.startswith("Machine: ") and "avx512_bf16" in text and "amx_bf16" in text
    assert "| mlp | 1 |" in text and text in capsys.readouterr().out
    assert result["machine"]["torch"] in text.splitlines()[0]
