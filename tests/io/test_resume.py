"""Exact resume: a run stopped cleanly or killed mid-epoch resumes in a
fresh process from its last checkpoint and ends bitwise identical to the
run that was never interrupted; a process killed while writing checkpoints
always leaves the last one whole."""

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import resume_script as rs
from resume_script import differences
from ampnet import AmpNetClassifier
from ampnet.io.atomic import JOURNAL_NAME, TEMP_SUFFIX
from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.exceptions import AmpWarning
from ampnet.io.rng import get_rng_state, set_rng_state
from repo_paths import TESTS

SCRIPT = str(TESTS / "resume_script.py")
STOP = 3  # epochs of the interrupted run before it stops


def quietly(fn, *args, **kwargs):
    """Run ``fn`` ignoring only the float16-on-CPU notice of each fit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="float16 autocast on CPU", category=AmpWarning)
        return fn(*args, **kwargs)


def final_state(out):
    """What ``resume_script.run`` saved at the end (history without durations)."""
    state = {
        name: torch.load(os.path.join(out, name + ".pt"), weights_only=True)
        for name in ("params", "optimizer", "grad_scaler")
    }
    with open(os.path.join(out, "history.json"), encoding="utf-8") as f:
        state["history"] = [{k: v for k, v in row.items() if k != "dur"} for row in json.load(f)]
    return state


def run_script(*args):
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def saved_epochs(dirname):
    with open(os.path.join(dirname, "history.json"), encoding="utf-8") as f:
        return len(json.load(f))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (in this process)."""
    root = tmp_path_factory.mktemp("reference")
    quietly(rs.run, str(root / "cp"), str(root / "out"))
    return final_state(str(root / "out"))


def test_reference_run_exercises_skips_and_held_scheduler(reference):
    history = reference["history"]
    assert len(history) == rs.N_EPOCHS
    assert sum(row["skipped_steps"] for row in history) >= 8
    # every step of epochs 1-2 overflowed: the LR scheduler did not step there
    assert [("event_lr" in row) for row in history[:3]] == [False, False, True]
    assert 1.0 <= reference["grad_scaler"]["scale"] < 2.0**24  # backed off from init_scale


@pytest.mark.slow
def test_bitexact_resume_after_clean_stop(tmp_path, reference):
    cp = str(tmp_path / "cp")
    quietly(rs.run, cp, None, stop_after=STOP)
    assert saved_epochs(cp) == STOP
    run_script(cp, str(tmp_path / "out"))  # a fresh process resumes through LoadInitState
    assert differences(final_state(str(tmp_path / "out")), reference) == []


def kill_when_hanging(args, env=None):
    """Run the script; SIGKILL it when it says it hangs (in epoch STOP + 1,
    after batch 2)."""
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    guard = threading.Timer(120, proc.kill)  # never hang the test suite
    guard.start()
    try:
        for line in proc.stdout:
            if line.strip() == rs.KILL_MARKER:
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait()
    finally:
        guard.cancel()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_bitexact_resume_after_sigkill_mid_epoch(tmp_path, reference):
    cp, out = str(tmp_path / "cp"), str(tmp_path / "out")
    kill_when_hanging([cp, out, "--hang-epoch", str(STOP + 1)])
    assert not os.path.exists(out)
    assert saved_epochs(cp) == STOP  # the last checkpoint is from before the kill
    run_script(cp, out)
    assert differences(final_state(out), reference) == []


@pytest.mark.slow
def test_rerunning_the_same_command_finishes_the_run(tmp_path, reference):
    """LoadInitState(cp, resume="total"): the README's promise, "run the same
    script again after a crash: it finishes the run"."""
    cp, out = str(tmp_path / "cp"), str(tmp_path / "out")
    command = [cp, out, "--resume", "total"]
    kill_when_hanging(command, env={**os.environ, "RESUME_SCRIPT_HANG_EPOCH": str(STOP + 1)})
    assert not os.path.exists(out) and saved_epochs(cp) == STOP
    rerun = run_script(*command)  # the same command, after the crash
    assert "EPOCHS 6" in rerun.stdout
    assert saved_epochs(cp) == rs.N_EPOCHS
    assert differences(final_state(out), reference) == []  # as if never interrupted
    # once more: the run is complete, nothing is trained and nothing changes
    again = run_script(*command)
    assert "EPOCHS 6" in again.stdout and saved_epochs(cp) == rs.N_EPOCHS
    assert differences(final_state(out), reference) == []


def _fit_bf16(dirname, resume, max_epochs, verbose=0):
    cp = Checkpoint(monitor=None, dirname=str(dirname))
    net = AmpNetClassifier(
        rs.Tiny, amp_enabled=True, amp_dtype="bfloat16", max_epochs=max_epochs, batch_size=32,
        verbose=verbose, train_split=None, callbacks=[LoadInitState(cp, resume=resume), cp],
    )
    return net.fit(*rs.make_data())


def test_resume_more_is_skorchs_behaviour(tmp_path):
    assert len(_fit_bf16(tmp_path, "more", 2).history) == 2
    assert len(_fit_bf16(tmp_path, "more", 2).history) == 4  # a rerun trains max_epochs more
    assert LoadInitState(Checkpoint()).resume == "more"  # the default, as in skorch


def test_resume_total_trains_until_max_epochs(tmp_path, capsys):
    first = _fit_bf16(tmp_path, "total", 2)
    assert len(first.history) == 2
    done = _fit_bf16(tmp_path, "total", 2, verbose=1)  # complete: trains nothing
    assert len(done.history) == 2 and done.history[-1, "epoch"] == 2
    for a, b in zip(first.module_.parameters(), done.module_.parameters()):
        assert torch.equal(a, b)
    assert "Resumed from a checkpoint with 2 epoch(s); training 0 more to reach max_epochs=2." in (
        capsys.readouterr().out
    )
    longer = _fit_bf16(tmp_path, "total", 3)  # a larger max_epochs extends the run
    assert [row["epoch"] for row in longer.history] == [1, 2, 3]
    load = dict(longer.callbacks_)["LoadInitState"]
    assert load.epochs_left_ is None  # only the fit that loaded is shortened
    longer.partial_fit(*rs.make_data())
    assert len(longer.history) == 6  # later partial_fit calls train max_epochs, as in skorch


def test_resume_value_is_checked():
    net = AmpNetClassifier(rs.Tiny, callbacks=[LoadInitState(Checkpoint(), resume="all")])
    with pytest.raises(ValueError, match=r"resume must be one of 'more', 'total'; got 'all' \(str\)"):
        net.initialize()


@pytest.mark.parametrize("left_out", ["f_grad_scaler", "f_rng_state", "f_lr_schedulers"])
def test_resume_without_a_state_file_differs(tmp_path, reference, left_out):
    """Negative controls: the comparison above detects a missing piece."""
    cp = str(tmp_path / "cp")
    quietly(rs.run, cp, None, stop_after=STOP, **{left_out: None})
    quietly(rs.run, cp, str(tmp_path / "out"), **{left_out: None})
    assert len(final_state(str(tmp_path / "out"))["history"]) == rs.N_EPOCHS
    assert any(
        d.startswith(("state['params']", "state['optimizer']"))
        for d in differences(final_state(str(tmp_path / "out")), reference)
    )


# ---- killed during checkpoint writes --------------------------------------


def _set_state(net, i):
    """Make every file of the checkpoint tell which save it belongs to."""
    with torch.no_grad():
        for p in net.module_.parameters():
            p.fill_(float(i))
    for group in net.optimizer_.param_groups:
        group["lr"] = float(i)
    scaler = net.grad_scaler_.state_dict()
    scaler.update(scale=float(i), _growth_tracker=i % 5)
    net.grad_scaler_.load_state_dict(scaler)
    net.history.new_epoch()
    net.history.new_batch()
    net.history.record("marker", i)
    net.history.record("event_cp", True)
    torch.manual_seed(i)
    np.random.seed(i)


def _save_forever(net, cp, first, done):  # runs in the forked child
    i = first
    while i < first + 100000:
        _set_state(net, i)
        cp.save_model(net)
        done.value = i
        i += 1


def _fp16_net():
    return AmpNetClassifier(
        rs.Tiny, amp_enabled=True, amp_dtype="float16", max_epochs=1, verbose=0,
        optimizer=torch.optim.Adam, grad_scaler__min_scale=1.0, grad_scaler__max_scale=1e9,
    ).initialize()


def _loaded_marker(cp):
    """Load the checkpoint into a fresh net; check that all files agree."""
    net = _fp16_net()
    net.load_params(checkpoint=cp)
    i = net.history[-1, "marker"]
    assert all(bool((p == float(i)).all()) for p in net.module_.parameters()), i
    assert net.optimizer_.param_groups[0]["lr"] == float(i)
    assert net.grad_scaler_.get_scale() == float(i)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(i)))
    assert np.random.rand() == np.random.RandomState(i).rand()
    return i


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs fork and SIGKILL"
)
def test_killed_saves_always_leave_a_loadable_checkpoint(tmp_path):
    """Kill a process at random moments while it writes checkpoints in a
    loop; every time, the last checkpoint loads and all its files come from
    the same save. The writer is forked from this process (a fresh
    interpreter per kill would spend seconds importing torch)."""
    saved_rng = get_rng_state()
    cp = Checkpoint(monitor=None, dirname=str(tmp_path))
    cp.initialize()
    net = _fp16_net()
    _set_state(net, 1)
    cp.save_model(net)
    last = 1
    ctx = multiprocessing.get_context("fork")
    done = ctx.Value("q", -1, lock=False)  # no lock: a child killed while holding one would block this reader
    chance = random.Random(0)
    mid_save = 0
    try:
        for kill in range(25):
            first = (kill + 1) * 1000
            done.value = -1
            child = ctx.Process(target=_save_forever, args=(net, cp, first, done))
            child.start()
            time.sleep(chance.uniform(0.01, 0.12))
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            assert child.exitcode == -signal.SIGKILL
            leftovers = [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX) or n == JOURNAL_NAME]
            mid_save += bool(leftovers)
            completed = done.value
            allowed = (last, first) if completed < 0 else (completed, completed + 1)
            last = _loaded_marker(cp)
            assert last in allowed
        assert mid_save >= 5  # the kills did land inside saves
        cp.save_model(net)  # a later save cleans what the killed writers left
        assert not [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX) or n == JOURNAL_NAME]
    finally:
        set_rng_state(saved_rng)
