"""amp_enabled='auto''s cache (ampnet.auto.cache) on its own: entries read back
as written, refused when they are not an entry of their key, bounded in
number, and whole under concurrent writers."""

import json
import multiprocessing
import os
import time

import pytest

from ampnet.auto import cache

KEY = {"machine": {"cpu": "test"}, "torch": "x", "model": "m", "batch_size": 8, "accumulation": 1,
       "optimizers": ["Adam"], "candidates": [{"amp_enabled": False}, {"amp_enabled": True}]}
CHOICE = {"amp_enabled": True, "amp_dtype": "bfloat16", "amp_level": "mixed", "amp_master_weights": True,
          "memory_format": "preserve"}


def test_an_entry_reads_back_as_written(tmp_path):
    assert cache.read_entry(KEY, str(tmp_path)) == (None, None)  # none yet: no problem either
    assert cache.write_entry(KEY, CHOICE, 0.25, str(tmp_path)) is None
    entry, problem = cache.read_entry(KEY, str(tmp_path))
    assert problem is None and entry["params"] == CHOICE and entry["step_s"] == 0.25 and entry["key"] == KEY
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("auto-") and path.suffix == ".json" and path.stat().st_size < cache.MAX_BYTES
    cache.forget_entry(KEY, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_an_entry_under_another_keys_name_is_refused(tmp_path):
    cache.write_entry(KEY, CHOICE, 0.25, str(tmp_path))
    (path,) = tmp_path.iterdir()
    other = {**KEY, "batch_size": 16}
    path.rename(tmp_path / os.path.basename(cache._path(str(tmp_path), other)))
    entry, problem = cache.read_entry(other, str(tmp_path))
    assert entry is None and "its key is not the one its name stands for" in problem and str(tmp_path) in problem


@pytest.mark.parametrize("text, problem", [
    ('{"version": 2}', "not an ampnet cache entry of this version"),
    ('{"version": 1, "key": KEY, "params": {"amp_enabled": [1]}, "step_s": 1}', "'params' is not a dict of plain"),
    ('{"version": 1, "key": KEY, "params": {}, "step_s": Infinity}', "holds Infinity"),
    ('{"version": 1, "key": KEY, "params": {}, "step_s": -1}', "'step_s' is not a step time in [1e-05, 3600] seconds"),
    # issue 38 items 5 and 7: implausible numbers are untrusted, a 400-digit integer included (no OverflowError)
    ('{"version": 1, "key": KEY, "params": {}, "step_s": 1e-9}', "'step_s' is not a step time"),
    ('{"version": 1, "key": KEY, "params": {}, "step_s": 1e300}', "'step_s' is not a step time"),
    ('{"version": 1, "key": KEY, "params": {}, "step_s": 1' + "0" * 400 + '}', "'step_s' is not a step time"),
])
def test_a_malformed_entry_names_its_problem(tmp_path, text, problem):
    cache.write_entry(KEY, CHOICE, 0.25, str(tmp_path))
    (path,) = tmp_path.iterdir()
    path.write_text(text.replace("KEY", json.dumps(KEY)))
    entry, found = cache.read_entry(KEY, str(tmp_path))
    assert entry is None and problem in found and str(path) in found


def test_the_folder_keeps_the_newest_entries(tmp_path):
    for i in range(6):
        cache.write_entry({**KEY, "batch_size": i}, CHOICE, 0.1, str(tmp_path), keep=4)
        time.sleep(0.01)  # distinct modification times
    kept = {json.loads(p.read_text())["key"]["batch_size"] for p in tmp_path.iterdir()}
    assert kept == {2, 3, 4, 5}


def _write_many(folder, n, step):
    for _ in range(n):
        cache.write_entry(KEY, CHOICE, step, folder)


@pytest.mark.slow
def test_concurrent_writers_leave_whole_entries(tmp_path):
    folder = str(tmp_path)
    cache.write_entry(KEY, CHOICE, 0.5, folder)
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(folder, 150, step)) for step in (0.1, 0.2)]
    for w in writers:
        w.start()
    while any(w.is_alive() for w in writers):
        entry, problem = cache.read_entry(KEY, folder)
        assert problem is None and entry is not None  # never a torn or missing entry
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert cache.read_entry(KEY, folder)[0]["step_s"] in (0.1, 0.2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_numpy_values_in_the_key_are_stored(tmp_path):
    """Issue 38 item 7: GridSearchCV passes np.int64; the key takes it as the int it is."""
    np = pytest.importorskip("numpy")
    given = {**KEY, "batch_size": np.int64(8), "accumulation": np.int64(1)}
    assert cache.write_entry(given, CHOICE, 0.25, str(tmp_path)) is None
    entry, problem = cache.read_entry(KEY, str(tmp_path))  # the same key as with Python ints
    assert problem is None and entry["key"]["batch_size"] == 8


def _entry_text(key, written):
    return json.dumps({"version": 1, "key": key, "params": CHOICE, "step_s": 0.1, "written": written})


def test_eviction_removes_only_ampnet_entries_and_never_the_new_one(tmp_path):
    """Issue 38 item 8: files that match the name but not the content, and other names, are the user's."""
    users = [tmp_path / f"auto-report-{i}.json" for i in range(5)]
    for path in users:
        path.write_text("{}")
    lookalike = tmp_path / ("auto-" + "a" * 40 + ".json")  # an ampnet name, not an ampnet entry
    lookalike.write_text('{"mine": true}')
    os.utime(lookalike, (1, 1))  # the oldest file of all
    for i in range(4):
        cache.write_entry({**KEY, "batch_size": i}, CHOICE, 0.1, str(tmp_path), keep=3)
        time.sleep(0.01)
    assert all(p.exists() for p in users) and lookalike.read_text() == '{"mine": true}'
    kept = sorted(json.loads(p.read_text())["key"]["batch_size"] for p in tmp_path.glob("auto-*.json")
                  if "key" in json.loads(p.read_text()))
    assert kept == [1, 2, 3]


def test_future_dated_entries_cannot_evict_a_new_one(tmp_path):
    future = time.time() + 10 * 365 * 86400
    for i in range(4):
        cache.write_entry({**KEY, "batch_size": 100 + i}, CHOICE, 0.1, str(tmp_path))
    for path in tmp_path.iterdir():
        os.utime(path, (future, future))
    assert cache.write_entry(KEY, CHOICE, 0.25, str(tmp_path), keep=2) is None
    entry, problem = cache.read_entry(KEY, str(tmp_path))
    assert problem is None and entry["step_s"] == 0.25  # kept: the future-dated ones went first
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize("age_days, used", [(0, True), (6.9, True), (7.1, False), (-2, False)])
def test_a_stored_choice_expires(tmp_path, age_days, used):
    """Issue 38 item 16: an entry is used for EXPIRES_S (7 days), then measured again; a date in the future
    is not trusted."""
    now = time.time()
    entry = {"written": now - age_days * 86400}
    assert cache.expired(entry, now) is (not used)
    assert cache.EXPIRES_S == 7 * 86400
