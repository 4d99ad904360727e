"""``python -m ampnet``: the demo reports progress per run, then what each
run did, amp_enabled='auto''s table and choice, and whether AMP pays off."""

import subprocess
import sys
from types import SimpleNamespace

import pytest


@pytest.mark.slow
def test_demo_prints_progress_and_table(tmp_path):
    err_file = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampnet", "--epochs", "1", "--hidden", "64"],
        stdout=subprocess.PIPE, stderr=err_file, text=True,
    )
    # progress appears while the demo runs, not only at the end
    first = proc.stdout.readline()
    assert first.startswith("ampnet demo: scikit-learn digits")
    assert proc.stdout.readline() == "\n"
    assert proc.stdout.readline().startswith("warming up (")
    progress = proc.stdout.read(len("[1/3] float32 (AMP off): training ..."))
    assert progress == "[1/3] float32 (AMP off): training ..."
    assert proc.poll() is None  # flushed while the first run trains
    rest = proc.stdout.read()
    proc.wait(timeout=300)
    err_file.seek(0)
    assert proc.returncode == 0, err_file.read()
    err_file.close()
    lines = (progress + rest).splitlines()
    done = [line for line in lines if line.startswith("[")]
    assert [line.split(":")[0] for line in done] == ["[1/3] float32 (AMP off)",
                                                    "[2/3] AMP on, amp_dtype='auto'",
                                                    "[3/3] amp_enabled='auto'"]
    assert all(" done in " in line and "(the fit: 1 epoch" in line and "test accuracy 0." in line for line in done)
    header = next(line for line in lines if line.startswith("run"))
    columns = ("precision used", "test acc", "median epoch ms", "skipped", "notes")
    assert all(column in header for column in columns)
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(("float32", "AMP", "amp_enabled"))}
    assert "bfloat16 (mixed)" in rows["AMP on, amp_dtype='auto'"]
    assert "measured: its measuring steps cost" in rows["amp_enabled='auto'"] or \
        "decided without measuring" in rows["amp_enabled='auto'"]
    # auto's record: what it chose and where the choice came from
    start = lines.index(next(line for line in lines if line.startswith("amp_enabled='auto' on cpu: ")))
    head = lines[start]
    if "(measured in this fit's first steps)" in head:  # a CPU with native bfloat16: it measured
        table = lines[start + 1:start + 3]
        assert [row.strip().split("  ")[0] for row in table] == ["float32 (AMP off)", "bfloat16 mixed"]
        assert sum(row.rstrip().endswith("<- chosen") for row in table) == 1
        assert lines[start + 3].startswith("Steps 1-") and " ran in: float32, bfloat16 mixed" in lines[start + 3]
    else:  # bfloat16 emulated: nothing measured, float32, and why
        assert head.endswith("(decided without a training step)")
    # the verdict's figures are the table's: its median epoch times of the float32 and the AMP run
    at = header.index("median epoch ms")
    fp32_ms, amp_ms = (float(rows[name][at:].split()[0]) for name in ("float32 (AMP off)", "AMP on, amp_dtype='auto'"))
    verdict = next(line for line in lines if line.startswith("In this run, AMP "))
    pays = "pays off" if amp_ms / fp32_ms < 1 else "does not pay off"
    assert verdict.startswith(f"In this run, AMP {pays}: bfloat16 (mixed) took {amp_ms / fp32_ms:.2f}x float32's "
                              f"median epoch time ({amp_ms:.1f} ms against {fp32_ms:.1f} ms, the table's figures).")
    assert "amp_autotune__cache=False" not in verdict
    assert any(line.startswith("Pin the choice with AmpNetClassifier(..., **net.amp_autotune_.params)")
               for line in lines)


def test_demo_refuses_a_device_that_is_not_a_torch_device(capsys):
    from ampnet.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--device", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m ampnet: error: argument --device: 'bogus'")
    assert "cpu, cuda, cuda:<index> or mps" in last
    assert "Traceback" not in err


def test_demo_times_each_fit_after_an_untimed_warm_up(capsys, monkeypatch):
    """The first run's "done in" included the process's first-fit costs (float32 "1.0 s" against
    AMP's "0.1 s"): an untimed warm-up fits every precision first, and each line says what it timed."""
    import re

    import ampnet.__main__ as demo
    from ampnet import AmpNetClassifier

    fits = []
    real_fit = AmpNetClassifier.fit

    settings = []

    def fit(self, X, y=None, **kw):
        fits.append((self.amp_enabled, len(X)))
        settings.append(self.get_params().get("amp_autotune__steps", "default"))
        return real_fit(self, X, y, **kw)

    monkeypatch.setattr(AmpNetClassifier, "fit", fit)
    assert demo.main(["--epochs", "2", "--hidden", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    warm = next(i for i, line in enumerate(out) if line.startswith("warming up ("))
    first = next(i for i, line in enumerate(out) if line.startswith("[1/3]"))
    assert warm < first and " done in " in out[warm] and "untimed" in out[warm]
    # the warm-up fits float32 and AMP on a few rows before the timed runs, on all the rows
    n = fits[-1][1]
    assert fits[:2] == [(False, demo.WARM_UP_ROWS), (True, demo.WARM_UP_ROWS)]
    assert [f[0] for f in fits[2:]] == [False, True, "auto"] and all(f[1] == n > demo.WARM_UP_ROWS for f in fits[2:])
    assert settings[-1] == "default" and fits[-1][0] == "auto"  # auto as a user writes it
    done = [line for line in out if line.startswith("[")]
    assert all(re.search(r"done in \d+\.\d+ s \(the fit: 2 epochs", line) for line in done), done
    assert "of measuring steps included" in done[2] and "measuring" not in done[0] + done[1]


@pytest.mark.parametrize("option, value, problem", [
    ("--epochs", "0", "0 is not >= 1"), ("--epochs", "-2", "-2 is not >= 1"),
    ("--hidden", "0", "0 is not >= 1"), ("--epochs", "two", "'two' is not an integer"),
])
def test_demo_refuses_a_count_below_one(capsys, option, value, problem):
    from ampnet.__main__ import main

    with pytest.raises(SystemExit) as info:
        main([option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {problem}" in err and "Traceback" not in err


def test_demo_warns_when_two_runs_in_one_precision_disagree():
    # a busy machine once showed 'AMP on' at 263.7 ms and 'auto' (the same bf16 mixed) at 14.0 ms an epoch
    from ampnet.__main__ import _timing_note

    rows = [("float32 (AMP off)", "float32", "0.97", "35.6", "0", ""),
            ("AMP on, amp_dtype='auto'", "bfloat16 (mixed)", "0.97", "263.7", "0", ""),
            ("amp_enabled='auto'", "bfloat16 (mixed)", "0.97", "14.0", "0", "")]
    note = _timing_note(rows)
    assert note.startswith("Note: 'amp_enabled='auto'' and 'AMP on, amp_dtype='auto'' both trained in "
                           "bfloat16 (mixed), yet took 14.0 and 263.7 ms per epoch")
    assert "OMP_NUM_THREADS=1" in note
    steady = [rows[0], rows[1][:3] + ("17.1",) + rows[1][4:], rows[2][:3] + ("17.3",) + rows[2][4:]]
    assert _timing_note(steady) is None


def test_the_verdict_never_contradicts_the_table():
    """A busy machine's demo said "AMP pays off on this machine: bfloat16 mixed took 0.07x float32's step time"
    under a table of 879 ms AMP epochs against 339 ms float32 ones, after its own check had dropped the choice."""
    from ampnet.__main__ import _verdict
    from ampnet.auto import AutotuneResult
    from ampnet.auto.enabled import table_of

    float32 = {"amp_enabled": False, "amp_dtype": "auto", "amp_level": "mixed", "amp_master_weights": True,
               "memory_format": "preserve"}
    mixed = {**float32, "amp_enabled": True, "amp_dtype": "bfloat16"}
    rows = [("float32 (AMP off)", "float32", "0.97", "339.0", "0", ""),
            ("AMP on, amp_dtype='auto'", "bfloat16 (mixed)", "0.97", "879.0", "0", "")]
    result = AutotuneResult(mixed, source="measured", table=table_of([float32, mixed], [[0.0371], [0.0026]]),
                            check="epoch 1: its steps took 31.1 ms, 12.15x the 2.6 ms measured; the next fit "
                                  "measures again")
    verdict = _verdict(SimpleNamespace(amp_autotune_=result), "cpu", rows)
    assert verdict.startswith("In this run, AMP does not pay off: bfloat16 (mixed) took 2.59x float32's median "
                              "epoch time (879.0 ms against 339.0 ms, the table's figures).")
    assert "pays off:" not in verdict.replace("does not pay off:", "")
    assert ("amp_enabled='auto' measured 0.07x float32's step time in its fit's first steps and trains in bfloat16 "
            "mixed, which this table's epochs do not bear out") in verdict
    assert verdict.endswith("Its epoch check found the chosen setting slower than measured: the stored choice was "
                            "dropped, and the next fit measures again.")
    # a stored choice: the way to measure again is one the user has (the demo has no cache option)
    stored = AutotuneResult(mixed, source="cache", cache="read from /c/auto-1.json")
    verdict = _verdict(SimpleNamespace(amp_autotune_=stored), "cpu", [rows[0], rows[1][:3] + ("100.0",) + rows[1][4:]])
    assert verdict.startswith("In this run, AMP pays off: bfloat16 (mixed) took 0.29x")
    assert "to measure again: `python -m ampnet cache --clear`" in verdict and "amp_autotune__cache" not in verdict
    assert "do not bear out" not in verdict
    # the ratio that decided is the record's (the median of the per-pair ratios), not that of the medians
    decided = AutotuneResult(mixed, source="measured", table=table_of([float32, mixed], [[0.01684], [0.00914]]),
                             note="mixed took 0.71x float32's step time (median of 6 timed pairs), the pairs "
                                  "disagreeing: decided by the median")
    verdict = _verdict(SimpleNamespace(amp_autotune_=decided), "cpu", rows)
    assert "amp_enabled='auto' measured 0.71x float32's step time" in verdict and "0.54x" not in verdict


def test_a_resumed_records_note_keeps_the_file_argument_as_written():
    from ampnet.auto import AutotuneResult

    result = AutotuneResult({"amp_enabled": False}, source="checkpoint", note="f_params='run/params.pt'")
    assert str(result).splitlines()[-1] == "f_params='run/params.pt'."
    assert AutotuneResult({"amp_enabled": False}, note="this fit has 8 steps").__str__().endswith(
        "\nThis fit has 8 steps.")
