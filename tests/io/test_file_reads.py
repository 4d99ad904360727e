"""Every number a load reads from a file, and
every scaler hyper-parameter, is refused with a ValueError naming the file
(or parameter), the field and the value, including ints beyond float range
and tensors without values (meta); every torch file goes through one checked
reader (no ``torch.load`` elsewhere in ampnet); torch's legacy format loads,
with each declared storage checked against the file's length.
"""

import ast
import io
import json
import os
import pickle
import re
import struct
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.model_selection import GridSearchCV

import ampnet
from ampnet.callbacks.checkpoint import LoadInitState
import ampnet.io.state_files as files
from checkpoint_helpers import (  # noqa: F401  (fixtures)
    _policy_checkpoint,
    _policy_net,
    data,
    fitted,
    quietly,
    refused_unchanged,
    saved,
    snapshot,
    tiny_net,
)
from resume_script import differences

HUGE = 10**400
DIGITS = "1" + "0" * 40  # the start of HUGE as messages show it


def meta():
    return torch.empty((), device="meta")


def _rewrite(path, change):
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


# ---- item 6: huge numbers and meta tensors in files ------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("scale", "meta")] + [
        (field, value) for field in ("scale", "growth_factor", "min_scale", "max_scale")
        for value in (HUGE, -HUGE)
    ],
    ids=["scale-meta"] + [
        f"{field}-{sign}huge" for field in ("scale", "growth_factor", "min_scale", "max_scale")
        for sign in ("", "minus-")
    ],
)
def test_scaler_file_with_a_huge_or_meta_number_is_refused(tmp_path, saved, field, value):
    bad = str(tmp_path / "s.pt")
    state = torch.load(saved["f_grad_scaler"], weights_only=True)
    state[field] = meta() if value == "meta" else value
    torch.save(state, bad)
    info = refused_unchanged(
        tiny_net().initialize(), {**saved, "f_grad_scaler": bad},
        re.escape(f"f_grad_scaler file {bad!r}"), re.escape(field),
    )
    shown = "meta" if value == "meta" else DIGITS
    assert shown in str(info.value)


@pytest.mark.parametrize("where", ["epoch", "batch"])
@pytest.mark.parametrize("key", ["dur", "loss_scale", "train_loss"])
def test_history_with_a_400_digit_number_is_refused(tmp_path, saved, where, key):
    rows = json.loads(Path(saved["f_history"]).read_text())
    (rows[0] if where == "epoch" else rows[0]["batches"][0])[key] = HUGE
    bad = str(tmp_path / "h.json")
    Path(bad).write_text(json.dumps(rows))
    info = refused_unchanged(
        tiny_net().initialize(), {**saved, "f_history": bad},
        re.escape(f"f_history file {bad!r}"), re.escape(repr(key)),
    )
    assert DIGITS in str(info.value)


def test_history_checks_do_not_overflow_on_their_own():
    """The field rules refuse a huge int by their own rule too (not only the
    walk over the whole file)."""
    from ampnet.io.state_files import _history_value_problem

    for key in ("dur", "loss_scale"):
        problem = _history_value_problem(key, HUGE)
        assert problem and "finite number" in problem and key in problem


@pytest.mark.parametrize(
    "field, value",
    [("gamma", HUGE), ("base_lrs", [HUGE]), ("_last_lr", [HUGE]), ("gamma", -HUGE)],
)
@pytest.mark.parametrize("path", ["LoadInitState", "load_params"])
def test_scheduler_file_with_a_400_digit_number_is_refused(tmp_path, data, field, value, path):
    cp = _policy_checkpoint(tmp_path, data, "StepLR")
    target = os.path.join(cp.dirname, "lr_schedulers.json")
    saved_data = json.loads(Path(target).read_text())
    saved_data["schedulers"]["LRScheduler"]["state"][field] = value
    Path(target).write_text(json.dumps(saved_data))
    net = _policy_net("StepLR")
    cb = dict(net.callbacks_)["LRScheduler"]
    if path == "load_params":
        cb.on_train_begin(net)
    before = snapshot(net)
    with pytest.raises(ValueError) as info:
        if path == "LoadInitState":
            LoadInitState(cp).initialize().on_train_begin(net)
        else:
            net.load_params(checkpoint=cp)
    message = str(info.value)
    assert f"f_lr_schedulers file {target!r}" in message
    assert repr(field) in message and DIGITS[:20] in message.replace("-", "")
    assert "Nothing was loaded" in message
    assert differences(snapshot(net), before) == []


def test_scheduler_rules_do_not_overflow_on_their_own():
    from ampnet.io.scheduler_fields import field_problems

    problems = field_problems(
        "StepLR", {"gamma": HUGE, "base_lrs": [HUGE], "_last_lr": [1.0], "other": HUGE}, "s"
    )
    assert len(problems) == 3
    assert any("'gamma'" in p for p in problems) and any("'base_lrs'" in p for p in problems)
    assert any("'other'" in p for p in problems)


@pytest.mark.parametrize(
    "key, change, field",
    [
        ("f_optimizer", lambda s: s["param_groups"][0].__setitem__("lr", HUGE), "'lr'"),
        ("f_optimizer", lambda s: s["param_groups"][0].__setitem__("lr", meta()), "'lr'"),
        ("f_optimizer", lambda s: s["param_groups"][0].__setitem__("extra", HUGE), "'extra'"),
        ("f_params", lambda s: s._metadata[""].__setitem__("version", HUGE), "version"),
    ],
)
def test_other_numeric_fields_of_torch_files_are_refused(tmp_path, saved, key, change, field):
    bad = str(tmp_path / "bad.pt")
    state = torch.load(saved[key], weights_only=True)
    change(state)
    torch.save(state, bad)
    info = refused_unchanged(
        tiny_net().initialize(), {**saved, key: bad}, re.escape(f"{key} file {bad!r}"),
    )
    assert field in str(info.value)
    assert ("meta" in str(info.value)) or (DIGITS in str(info.value))


# ---- item 6: huge hyper-parameters -----------------------------------------------

SCALER_NAMES = ["init_scale", "growth_factor", "min_scale", "max_scale"]


def _check_parameter_error(exc, name):
    message = str(exc)
    assert f"grad_scaler__{name}=" in message
    assert DIGITS in message and "float32" in message and "Fix:" in message


@pytest.mark.parametrize("name", SCALER_NAMES)
def test_huge_scaler_settings_name_the_parameter_in_the_constructor_path(name):
    with pytest.raises(ValueError) as info:
        tiny_net(**{f"grad_scaler__{name}": HUGE}).initialize()
    _check_parameter_error(info.value, name)


@pytest.mark.parametrize("name", SCALER_NAMES)
def test_huge_scaler_settings_name_the_parameter_in_set_params(name):
    net = tiny_net().initialize()
    before = net.grad_scaler_.get_settings()
    with pytest.raises(ValueError) as info:
        net.set_params(**{f"grad_scaler__{name}": HUGE})
    _check_parameter_error(info.value, name)
    assert net.grad_scaler_.get_settings() == before
    assert net.get_params().get(f"grad_scaler__{name}") != HUGE


@pytest.mark.parametrize("name", SCALER_NAMES)
def test_huge_scaler_settings_name_the_parameter_in_a_grid_search(data, name):
    X, y = data
    search = GridSearchCV(
        tiny_net(max_epochs=1), {f"grad_scaler__{name}": [HUGE]}, cv=2, error_score="raise",
    )
    with pytest.raises(ValueError) as info:
        quietly(search.fit, X, y)
    _check_parameter_error(info.value, name)


def test_huge_negative_and_meta_settings_are_value_errors():
    from ampnet.precision.scaler_checks import validate_scaler_settings

    for value in (-HUGE, meta(), torch.tensor(float("nan"))):
        for name in SCALER_NAMES + ["backoff_factor"]:
            with pytest.raises(ValueError, match=re.escape(f"grad_scaler__{name}=")):
                validate_scaler_settings(**{name: value})


# ---- item 8: one checked reader --------------------------------------------------

AMPNET = Path(ampnet.__file__).parent
#: The modules that may call torch.load: the checked reader.
READERS = {"io/state_files.py"}


def _torch_load_calls(tree):
    """Lines of calls to torch.load (any spelling: torch.load, an alias of
    torch or of torch.serialization, or a name imported from them)."""
    modules, names = {"torch"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("torch", "torch.serialization"):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            for alias in node.names:
                if alias.name == "load":
                    names.add(alias.asname or "load")
                if alias.name == "serialization":
                    modules.add(alias.asname or "serialization")
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            lines.append(node.lineno)
        elif isinstance(func, ast.Attribute) and func.attr == "load":
            owner = ast.unparse(func.value)
            if owner in modules or owner in ("torch.serialization",):
                lines.append(node.lineno)
    return lines


def test_no_torch_load_outside_the_checked_reader():
    """Item 8: net_autotune's resume path called torch.load on params.pt
    (a FIFO hung the fit, a zip bomb filled the memory). Every read goes
    through ampnet.io.state_files.read_state / read_params_file. The search is on
    the syntax tree, so text that mentions torch.load (docstrings) is not a
    call and any spelling of a call is."""
    found = []
    for path in sorted(AMPNET.rglob("*.py")):
        rel = path.relative_to(AMPNET).as_posix()
        source = path.read_text(encoding="utf-8")
        lines = _torch_load_calls(ast.parse(source))  # calls only: not docstrings or comments
        if rel not in READERS and lines:
            found.append(f"ampnet/{rel}: lines {sorted(lines)}")
    code = (  # the search finds every spelling
        "import torch\nimport torch as T\nfrom torch import load as L\n"
        "from torch import serialization\n"
        "torch.load(1)\nT.load(2)\nL(3)\nserialization.load(4)\ntorch.serialization.load(5)\n"
        "x.load(6)\n"
    )
    assert _torch_load_calls(ast.parse(code)) == [5, 6, 7, 8, 9]
    assert found == [], (
        "torch.load outside the checked reader; use ampnet.io.state_files.read_params_file(path) "
        "(or read_state): " + "; ".join(found)
    )


def test_read_params_file_reads_what_load_params_reads(saved, fitted):
    state = files.read_params_file(saved["f_params"])
    assert differences(dict(state), fitted.module_.state_dict()) == []
    assert all(t.device.type == "cpu" for t in state.values())
    assert "" in state._metadata  # the module metadata (the 'auto' choices) is kept


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_read_params_file_refuses_a_fifo_without_hanging(tmp_path):
    fifo = str(tmp_path / "params.pt")
    os.mkfifo(fifo)
    outcome = []

    def read():
        try:
            files.read_params_file(fifo)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock it before failing
        with open(fifo, "wb"):
            pass
        pytest.fail("read_params_file blocked on a FIFO")
    assert isinstance(outcome[0], ValueError)
    assert fifo in str(outcome[0]) and "FIFO" in str(outcome[0]) and "Fix:" in str(outcome[0])


def test_read_params_file_refuses_a_compressed_zip(tmp_path, saved):
    bomb = str(tmp_path / "params.pt")
    with zipfile.ZipFile(saved["f_params"]) as src, zipfile.ZipFile(
        bomb, "w", compression=zipfile.ZIP_DEFLATED
    ) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    with pytest.raises(ValueError, match="compressed") as info:
        files.read_params_file(bomb)
    assert repr(bomb) in str(info.value)


# ---- item 11: torch's legacy format ----------------------------------------------


def _legacy(obj, path):
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path


@pytest.mark.parametrize("keys", [("f_params",), ("f_params", "f_optimizer", "f_criterion",
                                                  "f_grad_scaler", "f_rng_state")])
def test_legacy_files_load(tmp_path, saved, fitted, keys):
    legacy = dict(saved)
    for key in keys:
        state = torch.load(saved[key], weights_only=True)
        legacy[key] = _legacy(state, str(tmp_path / f"{key}.legacy.pt"))
    net = tiny_net().initialize()
    net.load_params(**legacy)
    assert differences(net.module_.state_dict(), fitted.module_.state_dict()) == []
    assert differences(net.optimizer_.state_dict(), fitted.optimizer_.state_dict()) == []
    assert net.grad_scaler_.state_dict() == fitted.grad_scaler_.state_dict()


def test_legacy_file_with_views_dtypes_and_a_cuda_location_loads_to_cpu(tmp_path):
    """A file written on a GPU (as skorch's own net_cuda.pt): location
    'cuda:0', mapped to the CPU."""
    base = torch.arange(12, dtype=torch.float64)
    state = {
        "view": base[2:5], "base": base, "half": torch.ones(3, dtype=torch.float16),
        "long": torch.arange(4), "flag": torch.tensor([True, False]), "n": 3, "x": 0.5,
    }
    path = _legacy(state, str(tmp_path / "p.pt"))
    raw = Path(path).read_bytes()
    cpu = b"X\x03\x00\x00\x00cpu"
    assert cpu in raw
    Path(path).write_bytes(raw.replace(cpu, b"X\x06\x00\x00\x00cuda:0"))
    got = files.read_params_file(path)
    assert set(got) == set(state)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].device.type == "cpu"
            assert torch.equal(got[key], value)
        else:
            assert got[key] == value


def _hostile_legacy(numel, declared_keys=("k",), header=None, tail=64, dtype_name="FloatStorage"):
    """A legacy file whose one tensor declares ``numel`` elements."""
    buf = io.BytesIO()
    for obj in (0x1950A86A20F9469CFC6C, 1001,
                {"protocol_version": 1001, "little_endian": True,
                 "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(obj, buf, protocol=2)
    storage_type = getattr(torch, dtype_name)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, str) and obj == "THE-STORAGE":
                return ("storage", storage_type, "k", "cpu", numel, None)
            return None

    Pickler(buf, protocol=2).dump({"weight": "THE-STORAGE"})
    pickle.dump(list(declared_keys), buf, protocol=2)
    buf.write(struct.pack("<q", numel if header is None else header))
    buf.write(b"\0" * tail)
    return buf.getvalue()


@pytest.mark.parametrize(
    "numel, kwargs, problem",
    [
        (10**9, {}, r"declares 1000000000 elements \(4000000000 bytes\), but only 64 bytes"),
        (2**61, {}, r"declares 2305843009213693952 elements"),
        (17, {}, r"declares 17 elements \(68 bytes\), but only 64 bytes"),
        (4, {"declared_keys": ()}, r"does not list each of the 1 storages"),
        (4, {"declared_keys": ("k", "k")}, r"does not list each"),
        (4, {"header": 5}, r"declares 4 elements, its data header 5"),
        (4, {"dtype_name": "QInt8Storage"}, r"unknown type torch.QInt8Storage"),
    ],
)
def test_hostile_legacy_files_are_refused_before_torch_allocates(
    tmp_path, saved, monkeypatch, numel, kwargs, problem
):
    bad = tmp_path / "params.pt"
    bad.write_bytes(_hostile_legacy(numel, **kwargs))
    assert bad.stat().st_size < 400

    def no_allocation(*args, **kw):
        raise AssertionError("torch.load ran on a file the checks should refuse")

    net = tiny_net().initialize()
    before = snapshot(net)
    monkeypatch.setattr(torch, "load", no_allocation)
    with pytest.raises(ValueError, match=problem) as info:
        net.load_params(f_params=str(bad))
    monkeypatch.undo()
    assert f"f_params file {str(bad)!r}" in str(info.value) and "legacy format" in str(info.value)
    assert "Fix:" in str(info.value)
    assert differences(snapshot(net), before) == []


def test_a_zip_behind_a_legacy_file_is_refused(tmp_path, saved, monkeypatch):
    """Python's zipfile finds a zip's directory at the end of a file, torch
    tells zip files by their first bytes: a legacy bomb with a valid zip
    appended passed the zip checks and was read as legacy by torch."""
    bad = tmp_path / "params.pt"
    bad.write_bytes(_hostile_legacy(10**9) + Path(saved["f_params"]).read_bytes())
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran"))
    with pytest.raises(ValueError, match="legacy format") as info:
        files.read_params_file(str(bad))
    assert str(bad) in str(info.value)


def test_damaged_legacy_pickles_are_refused_naming_the_file(tmp_path, saved):
    good = _legacy(torch.load(saved["f_params"], weights_only=True), str(tmp_path / "g.pt"))
    raw = Path(good).read_bytes()
    for cut in (20, 60, len(raw) // 2, len(raw) - 10):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(raw[:cut])
        with pytest.raises(ValueError) as info:
            files.read_params_file(str(bad))
        assert str(bad) in str(info.value)


def test_legacy_pickles_run_no_code(tmp_path):
    """The structure check builds nothing: a legacy file whose pickle names
    os.system is refused by torch's weights_only loader afterwards, and the
    check itself runs none of it."""
    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = _legacy({"x": RunsCode(), "w": torch.ones(2)}, str(tmp_path / "p.pt"))
    with pytest.raises(ValueError, match="which a safe load refuses"):
        files.read_params_file(path)
    assert not marker.exists()
    np.testing.assert_equal(marker.exists(), False)
