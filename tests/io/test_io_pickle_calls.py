"""torch's zip format (what torch.save writes): the pickle's skeleton is
read before ``torch.load`` builds it, so that a call allocating what its
arguments ask (``bytearray(10**9)`` allocated 1 GB from a 1.2 KB file) and
a dict key that holds the same tuple many times over (its hash visits 2**60
paths) are refused within a second, naming the file (the legacy format's share is
in test_io_legacy_tensors.py)."""

import collections
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

from ampnet.io.state_files import read_params_file
from repo_paths import ROOT

MiB = 1 << 20


class Call:
    """Pickles as a call of ``fn`` with ``args``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def laughs_tuple(depth=60):
    x = (0,)
    for _ in range(depth):
        x = (x, x)
    return x


def saved(obj, zip_format=True):
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=zip_format)
    return buffer.getvalue()


def with_pickle(raw):
    """A torch zip file whose data.pkl is ``raw``."""
    source = zipfile.ZipFile(io.BytesIO(saved({"a": 1})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            data = raw if info.filename.endswith("/data.pkl") else source.read(info)
            archive.writestr(info.filename, data)
    return out.getvalue()


def key_bomb():
    """``{key: 1}`` with a key of 2**60 paths, as raw pickle opcodes (building
    it here would hash the key)."""
    body = pickle.dumps(laughs_tuple(), protocol=2)[2:-1]  # no PROTO, no STOP
    return b"\x80\x02}" + body + b"K\x01s."


def legacy_with_object(raw):
    """A legacy file without storages whose object pickle is ``raw``."""
    data = saved({"a": 1}, zip_format=False)
    f = io.BytesIO(data)
    for _ in range(3):  # magic, protocol, system info
        pickle.load(f)
    start = f.tell()
    pickle.load(f)
    return data[:start] + raw + data[f.tell():]


HOSTILE = {
    "bytearray": (lambda: saved({"w": Call(bytearray, 10**9)}), r"bytearray\(1000000000\)"),
    "FloatTensor": (lambda: saved({"w": Call(torch.FloatTensor, 10**9)}), r"torch.FloatTensor\(1000000000"),
    "UntypedStorage": (lambda: saved({"w": Call(torch.UntypedStorage, 10**9)}), "UntypedStorage"),
    "dict-key": (lambda: with_pickle(key_bomb()), "a dict key or set entry"),
    # keys of 12,287 places: within the file's entries, beyond what a key may hold (256)
    "OrderedDict-key": (lambda: saved(Call(collections.OrderedDict, [(laughs_tuple(12), 1)])),
                        "collections.OrderedDict over a dict key or set entry"),
    "set-entry": (lambda: saved({"s": Call(set, [laughs_tuple(12)])}), "builtins.set over a dict key"),
    "legacy-dict-key": (lambda: saved(Call(collections.OrderedDict, [(laughs_tuple(12), 1)]), zip_format=False),
                        "collections.OrderedDict over a dict key"),
    "legacy-bytearray": (lambda: saved({"w": Call(bytearray, 10**9)}, zip_format=False), r"bytearray\(1000000000\)"),
    "legacy-dict-key-setitem": (lambda: legacy_with_object(key_bomb()), "a dict key or set entry"),
    "legacy-laughs-key": (lambda: saved(Call(collections.OrderedDict, [(laughs_tuple(), 1)]), zip_format=False),
                          "entries or more"),
}


def _file(tmp_path, name):
    path = tmp_path / f"{name}.pt"
    path.write_bytes(HOSTILE[name][0]())
    return path


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_torch_file_that_would_allocate_or_hash_without_end_is_refused(tmp_path, name):
    path = _file(tmp_path, name)
    assert path.stat().st_size < 2048
    started = time.perf_counter()
    with pytest.raises(ValueError) as info:
        read_params_file(path)
    assert time.perf_counter() - started < 1.0
    assert f"f_params file {str(path)!r}" in str(info.value)
    info.match(HOSTILE[name][1])


def test_a_raw_pickle_in_a_zip_file_is_what_torch_reads(tmp_path):
    """The crafting is sound: the same zip with a harmless key loads."""
    path = tmp_path / "ok.pt"
    path.write_bytes(with_pickle(b"\x80\x02}" + pickle.dumps((1, (2, 3)), protocol=2)[2:-1] + b"K\x01s."))
    assert read_params_file(path) == {(1, (2, 3)): 1}


_MEASURE = textwrap.dedent("""
    import json, resource, sys
    from ampnet.io.state_files import read_params_file
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read_params_file(sys.argv[1])
        outcome = "loaded"
    except ValueError as exc:
        outcome = str(exc)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps({"outcome": outcome, "grown": grown}))
""")


def test_bytearray_of_a_zip_file_allocates_nothing(tmp_path):
    """The probe: a 1.2 KB zip file grew the process by 1 GB (bytearray
    zero-fills what it allocates)."""
    path = _file(tmp_path, "bytearray")
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert "bytearray(1000000000)" in report["outcome"]
    assert report["grown"] < 16 * MiB, report["grown"]
