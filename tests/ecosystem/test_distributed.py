"""Data-parallel training with torch.distributed (gloo, 2 CPU processes)."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ampnet import AmpNetClassifier
from ampnet.training import parallel as ampdist
from conftest import MLP
from repo_paths import TESTS

WORKER = TESTS / "dist_worker.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, world, batch, accum, precision="fp16", init_params=None):
    port = str(free_port())
    extra = [precision] + ([str(init_params)] if init_params else [])
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(world), port, str(tmp_path), str(batch), str(accum),
             *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    results = [torch.load(tmp_path / f"{precision}_rank{r}_world{world}.pt", weights_only=False)
               for r in range(world)]
    return results, outs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    two, outs = launch(tmp, world=2, batch=4, accum=1)
    one, _ = launch(tmp, world=1, batch=8, accum=1)
    return {"two": two, "one": one, "outs": outs, "dir": tmp}


@pytest.mark.slow
def test_two_ranks_match_one_process_with_double_batch(runs):
    (r0, r1), (single,) = runs["two"], runs["one"]
    assert r0["ddp"] and r1["ddp"] and not single["ddp"]
    for key, value in single["params"].items():
        torch.testing.assert_close(r0["params"][key], value, atol=1e-3, rtol=1e-3)
        assert torch.equal(r0["params"][key], r1["params"][key])


@pytest.mark.slow
def test_overflow_on_one_rank_skips_on_both_with_identical_scale(runs):
    (r0, r1), (single,) = runs["two"], runs["one"]
    skipped0 = [b["step_skipped"] for row in r0["history"] for b in row["batches"] if "step_skipped" in b]
    skipped1 = [b["step_skipped"] for row in r1["history"] for b in row["batches"] if "step_skipped" in b]
    assert skipped0 == skipped1 and skipped0[2] is True and sum(skipped0) == 1
    scales0 = [b["loss_scale"] for row in r0["history"] for b in row["batches"] if "loss_scale" in b]
    scales1 = [b["loss_scale"] for row in r1["history"] for b in row["batches"] if "loss_scale" in b]
    assert scales0 == scales1 and scales0[2] == scales0[1] / 2
    assert r0["scale"] == r1["scale"] == single["scale"]


@pytest.mark.slow
def test_history_identical_on_every_rank_and_only_rank0_prints(runs):
    r0, r1 = runs["two"]
    assert repr(r0["history"]) == repr(r1["history"])  # repr: NaN losses compare equal
    assert {"train_loss", "valid_loss", "valid_acc", "loss_scale", "skipped_steps"} <= set(r0["history"][-1])
    out0, out1 = runs["outs"]
    assert "valid_acc" in out0 and out1.strip() == ""
    # only rank 0 writes checkpoints
    assert (runs["dir"] / "checkpoint_fp16_world2_rank0" / "params.pt").exists()
    assert not list((runs["dir"] / "checkpoint_fp16_world2_rank1").glob("*"))


@pytest.mark.slow
def test_distributed_checkpoint_loads_in_one_process(runs):
    X = np.random.RandomState(0).randn(70, 6).astype(np.float32)
    sys.path.insert(0, str(WORKER.parent))
    net = AmpNetClassifier(MLP, module__n_in=6, module__n_hidden=8).initialize()
    state = torch.load(runs["dir"] / "fp16_params_world2.pt", weights_only=True)
    assert set(state) == {"hidden.weight", "hidden.bias", "out.weight", "out.bias"}  # no DDP prefix
    net.module_.load_state_dict(state)
    assert net.predict_proba(X).shape == (70, 2)


@pytest.mark.slow
def test_accumulation_skips_allreduce_on_micro_batches(tmp_path):
    (r0, r1), _ = launch(tmp_path, world=2, batch=2, accum=2)
    (single,), _ = launch(tmp_path, world=1, batch=4, accum=2)
    # 70 rows, 4/5 for training = 56 rows, 28 per rank, 14 micro-batches: 7 real steps per epoch
    assert r0["reductions"] == r1["reductions"] == 3 * 7
    for key, value in single["params"].items():
        torch.testing.assert_close(r0["params"][key], value, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["off", "bf16", "pure", "compensated"])
def test_other_precisions_match_one_process(tmp_path, precision):
    (r0, r1), _ = launch(tmp_path, world=2, batch=4, accum=1, precision=precision)
    (single,), _ = launch(tmp_path, world=1, batch=8, accum=1, precision=precision)
    low = precision in ("pure", "compensated")
    assert r0["param_dtypes"] == (["torch.bfloat16"] if low else ["torch.float32"])
    # compensation buffers: identical on every rank, close to one process's
    assert len(r0["compensation"]) == (4 if precision == "compensated" else 0)
    for key, value in single["compensation"].items():
        assert torch.equal(r0["compensation"][key], r1["compensation"][key])
        assert value.dtype == torch.bfloat16
    if precision == "compensated":  # in use (one small buffer may round to zero with the fused kernel)
        assert any(value.abs().max() > 0 for value in single["compensation"].values())
    tol = 1e-5 if precision == "off" else 2e-2
    for key, value in single["params"].items():
        assert torch.equal(r0["params"][key], r1["params"][key])
        torch.testing.assert_close(r0["params"][key].float(), value.float(), atol=tol, rtol=tol)
    assert repr(r0["history"]) == repr(r1["history"])


@pytest.mark.slow
def test_auto_trains_every_rank_with_rank_0s_choice(tmp_path):
    """Rank 0's timer finds mixed precision 2x faster, rank 1's 2x slower: both ranks train with rank 0's
    choice, step for step identical."""
    (r0, r1), _ = launch(tmp_path, world=2, batch=4, accum=1, precision="auto")
    assert r0["auto"] == r1["auto"] and r0["auto"]["amp_enabled"] is True
    for key, value in r0["params"].items():
        assert torch.equal(value, r1["params"][key])
    assert repr(r0["history"]) == repr(r1["history"])


@pytest.mark.slow
def test_single_process_checkpoint_loads_into_a_distributed_run(runs, tmp_path):
    single_params = runs["dir"] / "fp16_params_world1.pt"
    saved = torch.load(single_params, weights_only=True)
    (r0, r1), _ = launch(tmp_path, world=2, batch=4, accum=1, precision="off", init_params=single_params)
    for key, value in saved.items():
        assert torch.equal(r0["start_params"][key], value) and torch.equal(r1["start_params"][key], value)
    assert torch.equal(r0["params"]["out.bias"], r1["params"]["out.bias"])


def test_distributed_true_without_process_group_is_an_error():
    net = AmpNetClassifier(MLP, distributed=True)
    with pytest.raises(ValueError, match="no torch.distributed process group is initialized"):
        net.initialize()
    with pytest.raises(ValueError, match="distributed must be 'auto', True or False; got 'yes'"):
        AmpNetClassifier(MLP, distributed="yes").initialize()


@pytest.mark.parametrize("value", ["AUTO", " Auto ", "auto"])
def test_auto_in_any_case_is_auto(monkeypatch, value):
    """``distributed`` is read through the parameter table, which takes string
    choices whatever their case: 'AUTO' is off without a process group and on
    with one (where the closure optimizer is then refused)."""
    net = AmpNetClassifier(MLP, distributed=value).initialize()
    assert net.parallel_.ddp is None and net.parallel_.world_size == 1
    assert net.get_params()["distributed"] == value  # kept as given
    _fake_gloo(monkeypatch)
    with pytest.raises(ValueError, match="cannot use skorch's closure path"):
        AmpNetClassifier(MLP, distributed=value, optimizer=torch.optim.LBFGS).initialize()


def test_nccl_with_cpu_device_is_an_error(monkeypatch):
    monkeypatch.setattr(ampdist, "_process_group_ready", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    with pytest.raises(ValueError, match="'nccl' backend, which needs CUDA tensors, but device='cpu'"):
        AmpNetClassifier(MLP, distributed=True).initialize()


def test_auto_is_off_without_process_group():
    net = AmpNetClassifier(MLP).initialize()
    assert net.parallel_.ddp is None and net.parallel_.world_size == 1


def _fake_gloo(monkeypatch):
    monkeypatch.setattr(ampdist, "_process_group_ready", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")


def test_closure_optimizer_with_ddp_is_an_error(monkeypatch):
    _fake_gloo(monkeypatch)
    with pytest.raises(ValueError, match="cannot use skorch's closure path"):
        AmpNetClassifier(MLP, optimizer=torch.optim.LBFGS).initialize()


def test_learnable_parameters_outside_module_with_ddp_are_an_error(monkeypatch):
    _fake_gloo(monkeypatch)

    class WithExtra(AmpNetClassifier):
        def initialize_module(self):
            super().initialize_module()
            self.extra_ = torch.nn.Linear(2, 2)
            return self

    with pytest.raises(ValueError, match=r"extra_ also has learnable parameters"):
        WithExtra(MLP).initialize()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["pure", "compensated"])
def test_accumulation_with_low_precision_weights_keeps_ranks_identical(tmp_path, precision):
    """Under no_sync, gradients stay on the module until the boundary, where
    DDP all-reduces them (then they move into the masters)."""
    (r0, r1), _ = launch(tmp_path, world=2, batch=2, accum=2, precision=precision)
    (single,), _ = launch(tmp_path, world=1, batch=4, accum=2, precision=precision)
    for key, value in single["params"].items():
        assert torch.equal(r0["params"][key], r1["params"][key]), key
        torch.testing.assert_close(r0["params"][key].float(), value.float(), atol=2e-2, rtol=2e-2)
