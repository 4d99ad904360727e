"""``python -m ampnet``: the demo reports progress per run, then what each
run did, amp_enabled='auto''s table and choice, and whether AMP pays off."""

import subprocess
import sys

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
    chosen = head.split(": ", 1)[1].split(" (")[0]
    verdict = next(line for line in lines
                   if line.startswith(("AMP does not pay off", "AMP pays off", "amp_enabled='auto' trains in")))
    if verdict.startswith("amp_enabled='auto' trains in"):  # a 1-epoch fit is too short to measure
        assert "without measuring: this fit has" in verdict and "(decided without a training step)" in head
    elif chosen.startswith("float32"):
        assert verdict.startswith("AMP does not pay off for this model on this machine")
        assert rows["amp_enabled='auto'"].split()[1] == "float32"
    else:
        assert verdict.startswith(f"AMP pays off on this machine: {chosen} took ")
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
