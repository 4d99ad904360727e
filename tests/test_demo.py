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
    assert all(" done in " in line and "(test accuracy 0." in line for line in done)
    header = next(line for line in lines if line.startswith("run"))
    columns = ("precision used", "test acc", "median epoch ms", "skipped", "notes")
    assert all(column in header for column in columns)
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(("float32", "AMP", "amp_enabled"))}
    assert "bfloat16 (mixed)" in rows["AMP on, amp_dtype='auto'"]
    assert "chosen by a " in rows["amp_enabled='auto'"] and " s probe" in rows["amp_enabled='auto'"]
    # auto's table: float32 first, then the AMP candidates, one of them chosen
    start = lines.index(next(line for line in lines if line.startswith("amp_enabled='auto' on cpu: chose ")))
    chosen = lines[start].split(": chose ")[1]
    table = lines[start + 2:start + 5]
    assert [row.strip().split("  ")[0] for row in table] == [
        "float32 (AMP off)", "bfloat16 mixed", "bfloat16 pure (compensated)"]
    assert sum(row.rstrip().endswith("chosen") for row in table) == 1
    assert any(row.strip().startswith(chosen) and row.rstrip().endswith("chosen") for row in table)
    after = lines[start + 5:start + 7]
    if after[0].startswith("screen: "):  # the screen ran: its ratio, then what was timed
        assert "a dtype more than 3x slower is not measured" in after[0]
        probe = after[1]
        assert probe.startswith("probe: ") and (" training steps of " in probe or "no training step timed" in probe)
    else:
        assert after[0].startswith("probe: ") and " training steps of 3 candidates (" in after[0]
    verdict = next(line for line in lines if line.startswith(("AMP does not pay off", "AMP pays off")))
    if chosen.startswith("float32"):
        assert verdict.startswith("AMP does not pay off for this model on this machine")
        assert rows["amp_enabled='auto'"].split()[1] == "float32"
    else:
        assert verdict.startswith(f"AMP pays off on this machine: {chosen} ran ")
    assert any(line.startswith("Pin the choice with AmpNetClassifier(..., **net.amp_autotune_.params)")
               for line in lines)


def test_demo_refuses_a_device_that_is_not_a_torch_device(capsys):
    from ampnet.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--device", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "python -m ampnet: error: argument --device: 'bogus' is not a torch device; use cpu, cuda, "
        "cuda:<index> or mps")
    assert "Traceback" not in err
