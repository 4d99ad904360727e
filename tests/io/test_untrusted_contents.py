"""What the files of a checkpoint hold, checked field by field before anything loads: optimizer
states, histories (however deeply nested), parameters and buffers, scheduler states (their types and
their ranges, for every stock scheduler), and files that each pass alone but come from another run.
Values of the right type, shape and range are not judged."""

import copy
import json
import os
import re
from pathlib import Path

import pytest
import torch
from skorch.callbacks import LRScheduler

from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
from ampnet.exceptions import AmpWarning
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    Wide,
    tiny_net,
    quietly,
    snapshot,
    data,
    fitted,
    saved,
    refused_unchanged,
    _step_lr,
    _scheduler_net,
    scheduler_checkpoint,
    _SCHEDULERS,
    _policy_checkpoint,
    _policy_net,
)
from resume_script import Tiny, differences, make_data


# ---- optimizer, history and parameter files ------------------------------------------------------


def _optimizer_cases():
    def group(key, value):
        def change(s):
            s["param_groups"][0][key] = value

        return change

    def entry(key, value):
        def change(s):
            s["state"][0][key] = value(s["state"][0][key]) if callable(value) else value

        return change

    return {
        "lr str": (group("lr", "x"), r"param_groups\[0\]\['lr'\] must be a number, got 'x' \(str\)"),
        "lr nan": (group("lr", float("nan")), r"param_groups\[0\]\['lr'\] must be a finite number"),
        "lr missing": (lambda s: s["param_groups"][0].pop("lr"), r"param_groups\[0\]\['lr'\] is missing"),
        "betas length": (group("betas", (0.9,)), r"param_groups\[0\]\['betas'\] must have 2 entries"),
        "betas refused": (
            group("betas", (1.0, 0.999)),
            r"Adam refuses these settings \(Invalid beta parameter",
        ),
        "lr too large": (
            group("lr", 1e39),
            r"Adam fails to step with the saved settings and state "
            r"\(RuntimeError: value cannot be converted to type float without overflow",
        ),
        "flag type": (group("amsgrad", "yes"), r"param_groups\[0\]\['amsgrad'\] must be True or False"),
        "initial_lr": (group("initial_lr", "x"), r"param_groups\[0\]\['initial_lr'\] must be a number"),
        "unknown group key": (group("fuzz", [1, 2]), r"param_groups\[0\]\['fuzz'\] = \[1, 2\]"),
        "param id": (lambda s: s["param_groups"][0]["params"].__setitem__(0, "a"), "is not a new int id"),
        "exp_avg shape": (
            entry("exp_avg", torch.zeros(3, 3)),
            r"state\[0\]\['exp_avg'\] has shape \(3, 3\)",
        ),
        "exp_avg broadcast": (
            entry("exp_avg", torch.zeros(1, 4)),
            r"state\[0\]\['exp_avg'\] has shape \(1, 4\), expected \(8, 4\)",
        ),
        "exp_avg str": (
            entry("exp_avg", "x"),
            r"state\[0\]\['exp_avg'\] must be a tensor like the optimizer's own",
        ),
        "exp_avg nan": (
            entry("exp_avg", lambda t: torch.full_like(t, float("nan"))),
            r"state\[0\]\['exp_avg'\] holds NaN",
        ),
        "exp_avg missing": (
            lambda s: s["state"][0].pop("exp_avg"),
            r"state\[0\] lacks 'exp_avg', which Adam needs",
        ),
        "step str": (entry("step", "x"), r"state\[0\]\['step'\] must be a number or a one-element tensor"),
        "stray state": (lambda s: s["state"].__setitem__(99, {}), r"state\[99\] belongs to no parameter"),
        "extra key": (lambda s: s.__setitem__("extra", 1), r"unknown keys \['extra'\]"),
    }


@pytest.mark.parametrize("case", list(_optimizer_cases()))
def test_invalid_optimizer_file_is_refused_naming_the_field(tmp_path, saved, case):
    change, problem = _optimizer_cases()[case]
    state = torch.load(saved["f_optimizer"], weights_only=True)
    change(state)
    bad = str(tmp_path / "opt.pt")
    torch.save(state, bad)
    refused_unchanged(
        # the single-tensor kernel: fused Adam steps with lr=1e39 (in double) without failing
        tiny_net(optimizer__fused=False).initialize(),
        {**saved, "f_optimizer": bad},
        problem,
        re.escape(f"f_optimizer file {bad!r}"),
    )


def test_optimizer_state_from_an_older_torch_loads(tmp_path, saved):
    """Flags that newer torch versions added to the groups (here removed)
    get torch's defaults; a number for 'step' is converted by torch."""
    state = torch.load(saved["f_optimizer"], weights_only=True)
    for flag in ("foreach", "maximize", "capturable", "differentiable", "fused"):
        state["param_groups"][0].pop(flag, None)
    for entry in state["state"].values():
        entry["step"] = float(entry["step"])
    older = str(tmp_path / "old.pt")
    torch.save(state, older)
    net = tiny_net().initialize()
    net.load_params(**{**saved, "f_optimizer": older})
    quietly(net.partial_fit, *make_data())


@pytest.mark.parametrize(
    "rows, problem",
    [
        (
            [{"epoch": "x"}],
            r"in row 0, 'epoch' must be an int greater than the previous row's \(0\), got 'x'",
        ),
        (
            [{"epoch": 2}, {"epoch": 2}],
            r"in row 1, 'epoch' must be an int greater than the previous row's \(2\)",
        ),
        ([{"epoch": True}], "'epoch' must be an int"),
        ([{"epoch": 1, "batches": {}}], "'batches' must be a list of dicts"),
        ([{"epoch": 1, "batches": [1]}], "'batches' must be a list of dicts"),
        ([{"epoch": 1, "train_batch_count": "x"}], r"'train_batch_count' must be an int in \[0, 2\*\*53\]"),
        ([{"epoch": 1, "valid_loss_best": 1}], "'valid_loss_best' must be true or false"),
        (
            [{"epoch": 1, "batches": [{"train_batch_size": 2, "batch_size": "x"}]}],
            r"batch 0: 'batch_size' must be an int in \[0, 2\*\*53\], got 'x'",
        ),
        ([{"epoch": 1, "dur": None}], r"'dur' must be a finite number >= 0 \(seconds\), got None"),
        # counters and numbers in range, not only of the right type
        ([{"epoch": 2**40}], r"'epoch' must be an int greater .*, got 1099511627776 \(int\) \(epochs are numbered up to 2\*\*31 - 1\)"),
        ([{"epoch": 1, "train_batch_count": -1}], r"'train_batch_count' must be an int in \[0, 2\*\*53\], got -1"),
        ([{"epoch": 1, "valid_batch_count": 2**60}], r"'valid_batch_count' must be an int in \[0, 2\*\*53\]"),
        ([{"epoch": 1, "skipped_steps": -3}], r"'skipped_steps' must be an int in \[0, 2\*\*53\], got -3"),
        ([{"epoch": 1, "dur": float("nan")}], r"'dur' must be a finite number >= 0 \(seconds\), got nan"),
        ([{"epoch": 1, "dur": -1.0}], r"'dur' must be a finite number >= 0"),
        ([{"epoch": 1, "loss_scale": 0.0}], r"'loss_scale' must be a finite number > 0, got 0.0"),
        ([{"epoch": 1, "loss_scale": float("inf")}], r"'loss_scale' must be a finite number > 0, got inf"),
        (
            [{"epoch": 1, "batches": [{"train_batch_size": -2}]}],
            r"batch 0: 'train_batch_size' must be an int in \[0, 2\*\*53\], got -2",
        ),
        ([{"epoch": 1, "batches": [{"step_skipped": "no"}]}], "batch 0: 'step_skipped' must be true or false"),
        ({"epoch": 1}, "expected a JSON list of epoch dicts, got dict"),
    ],
)
def test_invalid_history_is_refused(tmp_path, saved, rows, problem):
    bad = tmp_path / "h.json"
    bad.write_text(json.dumps(rows))
    refused_unchanged(
        tiny_net().initialize(),
        {**saved, "f_history": str(bad)},
        problem,
        re.escape(f"f_history file {str(bad)!r}"),
    )


@pytest.mark.parametrize("depth", [70, 100000])
def test_deeply_nested_history_raises_value_error_not_recursion_error(tmp_path, saved, depth):
    bad = tmp_path / "h.json"
    bad.write_text("[" * depth + "]" * depth)
    refused_unchanged(
        tiny_net().initialize(),
        {**saved, "f_history": str(bad)},
        "is not a JSON history.*nested",
        re.escape(str(bad)),
    )


@pytest.mark.parametrize(
    "case, problem",
    [
        ("nan weight", "parameter hidden.weight holds NaN or inf values"),
        ("inf bias", "parameter out.bias holds NaN or inf values"),
        ("int weight", r"hidden.weight holds torch.int64 values, the net torch.float32 \(floating\)"),
        ("not a tensor", "hidden.weight is a list instead of a tensor"),
        ("sparse", "hidden.weight is a torch.sparse_coo tensor instead of a dense one"),
    ],
)
def test_invalid_parameters_are_refused(tmp_path, saved, case, problem):
    state = torch.load(saved["f_params"], weights_only=True)
    if case == "nan weight":
        state["hidden.weight"][0, 0] = float("nan")
    elif case == "inf bias":
        state["out.bias"][1] = float("inf")
    elif case == "int weight":
        state["hidden.weight"] = state["hidden.weight"].long()
    elif case == "not a tensor":
        state["hidden.weight"] = state["hidden.weight"].tolist()
    else:
        state["hidden.weight"] = state["hidden.weight"].to_sparse()
    bad = str(tmp_path / "p.pt")
    torch.save(state, bad)
    refused_unchanged(
        tiny_net().initialize(), {**saved, "f_params": bad}, problem, re.escape(f"f_params file {bad!r}")
    )


class Masked(Tiny):
    """A module with a buffer that holds -inf by design, and a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.norm(self.hidden(X)))) + self.mask * 0, dim=-1)


def test_buffers_may_hold_inf_where_the_module_does(tmp_path):
    net = tiny_net(Masked).initialize()
    net.save_params(f_params=str(tmp_path / "p.pt"))
    other = tiny_net(Masked).initialize()
    other.load_params(f_params=str(tmp_path / "p.pt"))  # the -inf mask loads
    state = torch.load(tmp_path / "p.pt", weights_only=True)
    state["norm.running_var"][0] = float("nan")
    torch.save(state, tmp_path / "bad.pt")
    refused_unchanged(
        other, {"f_params": str(tmp_path / "bad.pt")}, "buffer norm.running_var holds NaN or inf"
    )


def test_plausible_weights_of_the_right_shape_load_as_they_are(tmp_path, saved, data):
    """Values of the right type, shape and range are not judged: the weights
    of another run of the same model load."""
    torch.manual_seed(1)
    other = tiny_net(max_epochs=1)
    quietly(other.fit, *data)
    other.save_params(f_params=str(tmp_path / "other.pt"))
    net = tiny_net().initialize()
    net.load_params(**{**saved, "f_params": str(tmp_path / "other.pt")})
    assert differences(net.module_.state_dict(), other.module_.state_dict()) == []


# ---- scheduler states: their types ---------------------------------------------------------------


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda st: st.__setitem__("last_epoch", "x"), r"\['last_epoch'\] must be a number, got 'x'"),
        (lambda st: st.__setitem__("base_lrs", [0.1, 0.2]), r"\['base_lrs'\] must have 1 entries"),
        (lambda st: st.__setitem__("step", 5), r"holds keys \['step'\] that the scheduler does not have"),
        (lambda st: st.__setitem__("optimizer", 5), r"the keys \['optimizer'\] are not scheduler state"),
    ],
)
@pytest.mark.parametrize("path", ["LoadInitState", "load_params"])
def test_invalid_scheduler_state_is_refused_before_anything_loads(
    scheduler_checkpoint, change, problem, path
):
    target = os.path.join(scheduler_checkpoint.dirname, "lr_schedulers.json")
    data = json.loads(Path(target).read_text())
    change(data["schedulers"]["LRScheduler"]["state"])
    Path(target).write_text(json.dumps(data))
    net = _scheduler_net().initialize()
    if path == "load_params":
        for _, cb in net.callbacks_:
            if isinstance(cb, LRScheduler):
                cb.on_train_begin(net)  # running, as during training
    before = snapshot(net)
    with pytest.raises(ValueError, match=problem) as info:
        if path == "load_params":
            net.load_params(checkpoint=scheduler_checkpoint)
        else:
            LoadInitState(scheduler_checkpoint).initialize().on_train_begin(net)
    info.match(re.escape(f"f_lr_schedulers file {target!r}"))
    assert differences(snapshot(net), before) == []


def test_checkpoint_without_scheduler_resumes_with_one(tmp_path, data):
    """A checkpoint saved without an LRScheduler (no 'initial_lr' in the
    optimizer) resumes in a net that has one, instead of torch's KeyError."""
    cp = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    quietly(tiny_net(callbacks=[cp], max_epochs=1).fit, *data)
    cp2 = Checkpoint(monitor=None, dirname=str(tmp_path / "cp"))
    net = _scheduler_net(max_epochs=3, callbacks=[LoadInitState(cp2), _step_lr()])
    with pytest.warns(
        AmpWarning, match="it does not save|does not exist|Learning-rate schedulers not restored"
    ):
        quietly(net.fit, *data)
    assert len(net.history) == 4  # one loaded epoch, three new ones
    assert net.optimizer_.param_groups[0]["initial_lr"] == 0.05
    assert net.history[-1, "event_lr"] < net.history[1, "event_lr"] <= 0.05  # the schedule runs


class CountingAdam(torch.optim.Adam):
    """A user's optimizer class (outside torch.optim) that counts its instances."""

    made = 0

    def __init__(self, *args, **kwargs):
        type(self).made += 1
        super().__init__(*args, **kwargs)


def test_checks_never_build_a_users_optimizer(scheduler_checkpoint):
    """The scheduler check builds its scratch scheduler on an SGD, and the
    optimizer check steps no scratch copy of a class outside torch.optim;
    both still refuse what they check."""
    target = os.path.join(scheduler_checkpoint.dirname, "lr_schedulers.json")
    data = json.loads(Path(target).read_text())
    data["schedulers"]["LRScheduler"]["state"]["last_epoch"] = "x"
    Path(target).write_text(json.dumps(data))
    net = _scheduler_net(optimizer=CountingAdam).initialize()
    made = CountingAdam.made
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"\['last_epoch'\] must be a number, got 'x'"):
        LoadInitState(scheduler_checkpoint).initialize().on_train_begin(net)
    assert differences(snapshot(net), before) == []
    state = torch.load(os.path.join(scheduler_checkpoint.dirname, "optimizer.pt"), weights_only=True)
    state["param_groups"][0]["lr"] = "x"
    torch.save(state, os.path.join(scheduler_checkpoint.dirname, "optimizer.pt"))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] must be a number"):
        net.load_params(f_optimizer=os.path.join(scheduler_checkpoint.dirname, "optimizer.pt"))
    assert CountingAdam.made == made


# ---- scheduler states: their ranges --------------------------------------------------------------


def _edit_scheduler_state(cp, edit):
    path = os.path.join(cp.dirname, "lr_schedulers.json")
    data = json.loads(Path(path).read_text())
    edit(data["schedulers"]["LRScheduler"]["state"])
    Path(path).write_text(json.dumps(data))
    return path


def _set(key, value):
    def edit(state):
        state[key] = value
    return edit


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "policy, edit, problem",
    [
        ("StepLR", _set("step_size", 0), r"\['step_size'\] = 0 \(int\) must be an int in \[1, 2\*\*53\]"),
        ("StepLR", _set("gamma", _NAN), r"\['gamma'\] = nan \(float\) must be a finite number in \(0, 1000\]"),
        ("StepLR", _set("gamma", -1e300), r"\['gamma'\] = -1e\+300 \(float\) must be a finite number in \(0,"),
        ("StepLR", _set("gamma", 1e300), r"\['gamma'\] = 1e\+300 \(float\) must be a finite number in \(0,"),
        ("StepLR", _set("last_epoch", -5), r"\['last_epoch'\] = -5 \(int\) must be an int in \[-1, 2\*\*53\]"),
        ("StepLR", _set("_step_count", 2**60), r"\['_step_count'\] = 1152921504606846976 \(int\) must be an int"),
        ("StepLR", _set("base_lrs", [-0.1]), r"\['base_lrs'\] = \[-0.1\] \(list\) must be a list of finite numbers >= 0"),
        ("StepLR", _set("_last_lr", [_INF]), r"\['_last_lr'\] = \[inf\] \(list\) must be a list of finite"),
        ("MultiStepLR", _set("milestones", {"x": 1}), r"\['milestones'\] = \{'x': 1\} \(dict\) must map epochs"),
        ("MultiStepLR", _set("milestones", {"2": -1}), r"\['milestones'\] = Counter\(\{2: -1\}\) \(Counter\) must map"),
        ("MultiStepLR", _set("gamma", _NAN), r"\['gamma'\] = nan \(float\) must be a finite number"),
        ("ExponentialLR", _set("gamma", 0.0), r"\['gamma'\] = 0.0 \(float\) must be a finite number in \(0, 1000\]"),
        ("LinearLR", _set("start_factor", 0.0), r"\['start_factor'\] = 0.0 \(float\) must be a finite number in \(0, 1\]"),
        ("LinearLR", _set("end_factor", 2.0), r"\['end_factor'\] = 2.0 \(float\) must be a finite number in \[0, 1\]"),
        ("PolynomialLR", _set("total_iters", 0), r"\['total_iters'\] = 0 \(int\) must be an int in \[1, 2\*\*53\]"),
        ("PolynomialLR", _set("power", -1.0), r"\['power'\] = -1.0 \(float\) must be a finite number in \[0, 1000\]"),
        ("CosineAnnealingLR", _set("T_max", 0), r"\['T_max'\] = 0 \(int\) must be a finite number in \(0, "),
        ("CosineAnnealingLR", _set("eta_min", -1.0), r"\['eta_min'\] = -1.0 \(float\) must be a finite number in \[0, inf\]"),
        ("ReduceLROnPlateau", _set("factor", 1.5), r"\['factor'\] = 1.5 \(float\) must be a finite number in \[0, 1\)"),
        ("ReduceLROnPlateau", _set("patience", -1), r"\['patience'\] = -1 \(int\) must be an int in \[0, 2\*\*53\]"),
        ("ReduceLROnPlateau", _set("best", _NAN), r"\['best'\] = nan \(float\) must be a number \(not NaN\)"),
        ("ReduceLROnPlateau", _set("mode", "up"), r"\['mode'\] = 'up' \(str\) must be one of 'min', 'max'"),
        ("OneCycleLR", _set("total_steps", 0), r"\['total_steps'\] = 0 \(int\) must be an int in \[1, 2\*\*53\]"),
        (
            "OneCycleLR",
            lambda s: s["_schedule_phases"][0].update(start_lr="lr"),
            r"\['_schedule_phases'\]\[0\]\['start_lr'\] = 'lr' \(str\) must be one of",
        ),
        (   # every field in range, but the phases end on the same step: the trial step divides by zero
            "OneCycleLR",
            lambda s: [p.update(end_step=2.0) for p in s["_schedule_phases"]],
            r"makes the scheduler fail to step \(ZeroDivisionError",
        ),
    ],
)
@pytest.mark.parametrize("path", ["LoadInitState", "load_params"])
def test_scheduler_fields_out_of_range_are_refused(tmp_path, data, policy, edit, problem, path):
    """Out-of-range scheduler fields are refused at load: unchecked, step_size 0 crashed the resumed
    fit (ZeroDivisionError), gamma NaN or -1e300 made the learning rate NaN or -3.6e298."""
    cp = _policy_checkpoint(tmp_path, data, policy)
    target = _edit_scheduler_state(cp, edit)
    net = _policy_net(policy)
    cb = dict(net.callbacks_)["LRScheduler"]
    if path == "load_params":
        cb.on_train_begin(net)  # running, as during training
    scheduler_before = copy.deepcopy(cb.lr_scheduler_.state_dict()) if cb.lr_scheduler_ else None
    before = snapshot(net)
    with pytest.raises(ValueError, match=problem) as info:
        if path == "LoadInitState":
            LoadInitState(cp).initialize().on_train_begin(net)
        else:
            net.load_params(checkpoint=cp)
    info.match(re.escape(f"f_lr_schedulers file {target!r} holds an invalid state for scheduler 'LRScheduler'"))
    info.match(re.escape("schedulers['LRScheduler']['state']"))
    assert differences(snapshot(net), before) == []
    if path == "load_params":
        assert differences(cb.lr_scheduler_.state_dict(), scheduler_before) == []


@pytest.mark.parametrize("policy", sorted(_SCHEDULERS))
def test_every_stock_scheduler_resumes_as_saved(tmp_path, data, policy):
    """The range checks accept what the schedulers save; MultiStepLR's
    milestones (a Counter, whose int keys JSON turns into strings) resume
    as ints, so that a MultiStepLR checkpoint loads."""
    cp = _policy_checkpoint(tmp_path, data, policy)
    saved = json.loads(Path(cp.dirname, "lr_schedulers.json").read_text())["schedulers"]["LRScheduler"]
    net = _policy_net(policy)
    cb = dict(net.callbacks_)["LRScheduler"]
    lis = LoadInitState(cp).initialize()
    lis.on_train_begin(net)
    cb.on_train_begin(net)
    lis.on_epoch_begin(net)  # restores the saved scheduler state
    state = cb.lr_scheduler_.state_dict()
    assert json.loads(json.dumps(state)) == saved["state"]
    if policy == "MultiStepLR":
        assert state["milestones"] == {1: 1, 3: 1} and all(type(k) is int for k in state["milestones"])
    assert net.optimizer_.param_groups[0]["lr"] == pytest.approx(saved["state"]["_last_lr"][0])


# ---- files from another run ----------------------------------------------------------------------


@pytest.mark.parametrize("swapped", ["f_params", "f_optimizer", "f_grad_scaler", "all"])
def test_files_swapped_from_another_run_are_refused_before_anything_changes(tmp_path, data, swapped):
    """A checkpoint directory whose files were replaced by those of another
    run (a wider module, trained in bfloat16): refused, nothing changes."""
    ours = Checkpoint(monitor=None, dirname=str(tmp_path / "ours"))
    theirs = Checkpoint(monitor=None, dirname=str(tmp_path / "theirs"))
    torch.manual_seed(0)
    quietly(tiny_net(callbacks=[ours]).fit, *data)
    quietly(tiny_net(Wide, "bfloat16", callbacks=[theirs]).fit, *data)
    names = {"f_params": "params.pt", "f_optimizer": "optimizer.pt", "f_grad_scaler": "grad_scaler.pt"}
    for key, name in names.items():
        if swapped in (key, "all"):
            (tmp_path / "ours" / name).write_bytes((tmp_path / "theirs" / name).read_bytes())
    net = tiny_net().initialize()
    quietly(net.partial_fit, *data)
    before = snapshot(net)
    problems = {
        "f_params": r"does not match net.module_: shape mismatch hidden.weight: "
        r"\(12, 4\) in the file, \(8, 4\)",
        "f_optimizer": r"does not match net.optimizer_: state\[0\]\['exp_avg'\] has shape \(12, 4\)",
        "f_grad_scaler": "holds an empty loss-scaler state",
    }
    with pytest.raises(ValueError) as info:
        net.load_params(checkpoint=ours)
    refused = [key for key in names if key in str(info.value)]
    assert refused == ([swapped] if swapped != "all" else refused) and len(refused) == 1
    info.match(problems[refused[0]])
    info.match(re.escape(f"{refused[0]} file {str(tmp_path / 'ours' / names[refused[0]])!r}"))
    assert differences(snapshot(net), before) == []
