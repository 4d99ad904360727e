"""A file whose structure holds the same list many times over ("billion
laughs": 2**60 paths in a few KB) or a list inside itself is refused within
a second, naming the file and the field, for every kind of torch file and
for the storage key list of a legacy file."""

import io
import json
import pickle
import pickletools
import time

import pytest
import torch

from ampnet.io.state_files import read_params_file
from checkpoint_helpers import paths, quietly, snapshot, tiny_net
from resume_script import differences

#: Seconds a refusal may take (the walk it prevents takes for ever).
BOUND_S = 1.0


def laughs(depth=60, leaf=0.5):
    """A list holding the same inner list twice, ``depth`` levels deep."""
    x = [leaf]
    for _ in range(depth):
        x = [x, x]
    return x


def self_holding():
    x = [1.0]
    x.append(x)
    return x


@pytest.fixture(scope="module")
def fitted():
    from resume_script import make_data

    torch.manual_seed(0)
    net = tiny_net(max_epochs=1)
    quietly(net.fit, *make_data())
    return net


@pytest.fixture
def saved(tmp_path, fitted):
    files = paths(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    fitted.save_params(**files)
    return files


def refused_quickly(net, key, path, *match):
    before = snapshot(net)
    started = time.perf_counter()
    with pytest.raises(ValueError) as info:
        net.load_params(**{key: path})
    elapsed = time.perf_counter() - started
    assert elapsed < BOUND_S, f"the refusal took {elapsed:.1f} s"
    assert f"{key} file {str(path)!r}" in str(info.value)
    for pattern in match:
        info.match(pattern)
    assert differences(snapshot(net), before) == []
    return info


@pytest.mark.parametrize("where", [
    ("state", 0, "junk"), ("state", 0, "exp_avg_sq"), ("param_groups", 0, "betas"),
    ("param_groups", 0, "extra"),
])
def test_a_shared_structure_in_the_optimizer_file_is_refused_within_a_second(fitted, saved, where):
    """The probe of item 1: a 3 KB optimizer.pt whose walk has 2**60 paths."""
    state = torch.load(saved["f_optimizer"], weights_only=True)
    top, index, key = where
    state[top][index][key] = laughs()
    torch.save(state, saved["f_optimizer"])
    net = tiny_net(max_epochs=1).initialize()
    info = refused_quickly(net, "f_optimizer", saved["f_optimizer"], "entries or more when each place")
    assert f"field {top}[{index}]['{key}']" in str(info.value)


def test_a_list_inside_itself_is_refused(fitted, saved):
    state = torch.load(saved["f_optimizer"], weights_only=True)
    state["state"][0]["junk"] = self_holding()
    torch.save(state, saved["f_optimizer"])
    net = tiny_net(max_epochs=1).initialize()
    refused_quickly(net, "f_optimizer", saved["f_optimizer"], r"field state\[0\]\['junk'\]\[1\] holds itself")


@pytest.mark.parametrize("key", ["f_params", "f_criterion", "f_grad_scaler", "f_rng_state"])
def test_a_shared_structure_in_any_torch_file_is_refused_within_a_second(fitted, saved, key):
    state = torch.load(saved[key], weights_only=True)
    state["junk"] = laughs()
    torch.save(state, saved[key])
    net = tiny_net(max_epochs=1).initialize()
    refused_quickly(net, key, saved[key], r"field junk\[0\]", "entries or more when each place")


def test_shared_settings_of_several_groups_still_load(tmp_path):
    """torch's optimizers share one ``betas`` tuple between their groups, so a
    file holds it once, referenced from each group: a few shared places load."""
    module = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(8)])
    optimizer = torch.optim.Adam([{"params": m.parameters()} for m in module])
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    state = read_params_file(path)  # the checked reader of every load
    groups = state["param_groups"]
    assert groups[0]["betas"] is groups[7]["betas"] and len(groups) == 8


def _legacy_with_keys(obj, keys):
    """A legacy file of ``obj`` whose storage key list is ``keys``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    f = io.BytesIO(data)
    for _ in range(4):  # magic, protocol, system info, the object
        for _ in pickletools.genops(f):
            pass
    start = f.tell()
    pickle.load(f)
    return data[:start] + pickle.dumps(keys, protocol=2) + data[f.tell():]


@pytest.mark.parametrize("keys", [laughs(), self_holding()], ids=["laughs", "self-holding"])
def test_a_legacy_key_list_that_holds_itself_many_times_is_refused_within_a_second(fitted, tmp_path, keys):
    """The probe of item 2: a 1.2 KB legacy params.pt whose storage key list
    made the refusal's message ``repr`` 2**60 entries."""
    path = tmp_path / "params.pt"
    path.write_bytes(_legacy_with_keys(fitted.module_.state_dict(), keys))
    assert path.stat().st_size < 2048
    net = tiny_net(max_epochs=1).initialize()
    refused_quickly(net, "f_params", path, "legacy format, its storage key list")


def test_the_history_and_scheduler_files_cannot_share_and_load_or_refuse_quickly(fitted, saved, tmp_path):
    """JSON has no references: a history whose every row holds a structure
    expanded from shared lists is as long as its places, and is read in time."""
    rows = json.loads(open(saved["f_history"]).read())
    rows[0]["junk"] = laughs(depth=12)
    with open(saved["f_history"], "w") as f:
        json.dump(rows, f)
    net = tiny_net(max_epochs=1).initialize()
    started = time.perf_counter()
    net.load_params(f_history=saved["f_history"])
    assert time.perf_counter() - started < BOUND_S
    assert net.history[0]["junk"] == laughs(depth=12)


def test_the_limit_is_one_entry_per_byte_of_the_file():
    """What the walks may visit: at least MIN_ENTRIES, else the file's size."""
    from ampnet.io.untrusted.values import MIN_ENTRIES, structure_problem

    assert structure_problem(laughs(depth=14), MIN_ENTRIES) is None  # 3 * 2**14 - 1 places
    field, problem = structure_problem(laughs(depth=15), MIN_ENTRIES)
    assert field == "" and "98303 entries or more" in problem and f"the {MIN_ENTRIES}" in problem
    # a shared tuple counts in each place, and that is all
    shared = (0.9, 0.999)
    assert structure_problem([{"betas": shared} for _ in range(100)], 401) is None
    assert structure_problem([{"betas": shared} for _ in range(100)], 400) is not None


def test_brief_shows_the_first_entries_of_any_structure():
    from ampnet.io.untrusted.values import brief

    started = time.perf_counter()
    text = brief(laughs())
    assert time.perf_counter() - started < 0.1
    assert text.startswith("[[[[") and text.endswith("... (list)") and len(text) <= 90
    assert brief(self_holding(), typed=False).startswith("[1.0, [1.0, [1.0")
    assert brief({"a": 1}) == "{'a': 1} (dict)"
    assert brief("x" * 10**6).endswith("... (str)") and len(brief("x" * 10**6)) < 100
