"""torch's legacy format: a tensor whose size, stride or offset reach past
the storage it is built on (torch grows such a storage to fit), and the
calls that allocate what their arguments ask (``bytearray(n)``,
``torch.FloatTensor(n)``, ``torch.UntypedStorage(n)``, quantized tensors),
are refused before torch allocates anything larger than the file.
Measured in a subprocess whose address space is
limited to what it uses plus 256 MiB: an allocation beyond it fails."""

import collections
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch._utils

from ampnet.io.state_files import read_params_file
from repo_paths import ROOT

MiB = 1 << 20


class Call:
    """Pickles as a call of ``fn`` with ``args`` (storages in ``args`` are
    saved by torch as the file's storages)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def tensor_over(storage_floats, size, stride, offset=0):
    with warnings.catch_warnings():  # TypedStorage is deprecated, and what torch.save handles
        warnings.simplefilter("ignore")
        storage = torch.zeros(storage_floats).storage()
    return Call(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False,
                collections.OrderedDict())


def legacy(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


HOSTILE = {
    # 16 floats in the file, a tensor of 103 GB declared over them
    "size": (lambda: tensor_over(16, (10**9, 26), (26, 1)), "reaches 104000000000 bytes into a storage of 64"),
    "stride": (lambda: tensor_over(16, (4, 4), (10**9, 1)), "reaches 12000000016 bytes"),
    "offset": (lambda: tensor_over(16, (16,), (1,), offset=10**9), "offset 1000000000"),
    "negative-stride": (lambda: tensor_over(16, (4,), (-1,)), "ints >= 0"),
    "bytearray": (lambda: Call(bytearray, 10**9), r"bytearray\(1000000000\)"),
    "FloatTensor": (lambda: Call(torch.FloatTensor, 10**9), r"torch.FloatTensor\(1000000000"),
    "UntypedStorage": (lambda: Call(torch.UntypedStorage, 10**9), r"torch.storage.UntypedStorage"),
}


def _hostile_file(tmp_path, name):
    make, _ = HOSTILE[name]
    path = tmp_path / f"{name}.pt"
    path.write_bytes(legacy({"w": make(), "b": torch.ones(2)}))
    return path


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_legacy_file_asking_more_than_it_holds_is_refused(tmp_path, name):
    path = _hostile_file(tmp_path, name)
    assert path.stat().st_size < 1500
    with pytest.raises(ValueError, match="legacy format") as info:
        read_params_file(path)
    info.match(HOSTILE[name][1])
    assert f"f_params file {str(path)!r}" in str(info.value)


_MEASURE = textwrap.dedent("""
    import json, resource, sys
    from ampnet.io.state_files import read_params_file
    read_params_file(sys.argv[1])  # warm up the reader on a good file
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = []
    for path in sys.argv[2:]:
        try:
            read_params_file(path)
            out.append({"path": path, "outcome": "loaded"})
        except Exception as exc:
            out.append({"path": path, "outcome": type(exc).__name__, "message": str(exc)})
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps({"results": out, "grown": grown}))
""")


def test_no_allocation_larger_than_the_file(tmp_path):
    """Every hostile file is refused by ampnet's own check (not by a failed
    allocation), and the process grows by less than 16 MiB."""
    good = tmp_path / "good.pt"
    good.write_bytes(legacy({"w": torch.arange(12.0).reshape(3, 4)[:, 1:], "e": torch.ones(1).expand(5)}))
    names = sorted(HOSTILE)
    files = [str(_hostile_file(tmp_path, name)) for name in names]
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(good), str(good), *files],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["results"][0]["outcome"] == "loaded"
    for name, result in zip(names, report["results"][1:]):
        assert result["outcome"] == "ValueError", (name, result)
        assert "legacy format" in result["message"] and "allocate memory" not in result["message"], (name, result)
    assert report["grown"] < 16 * MiB, report["grown"]


def test_views_within_their_storage_still_load(tmp_path):
    """What torch.save writes for views: a slice, a transposed tensor, an
    expanded one (stride 0) and a tensor of no elements at the storage's end."""
    base = torch.arange(12.0)
    state = {
        "slice": base[4:10], "t": base.reshape(3, 4).t(), "expanded": base[:1].expand(7),
        "empty": base[12:],
    }
    path = tmp_path / "views.pt"
    path.write_bytes(legacy(state))
    loaded = read_params_file(path)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
