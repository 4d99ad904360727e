"""The on-disk memory of ``amp_enabled='auto'``: one small JSON file per
key, so that the next fit of the same model on the same machine (the next
fold of a grid search, a clone, the script run again, another process)
starts with the choice at its first step and measures nothing.

The key is what decides the choice (:func:`cache_key`): the machine (CPU
model and bf16 flags, or the GPU's name and compute capability), torch's
thread count, the torch version, the model's parameter shapes and dtypes,
the batch size, the optimizer classes and the candidates the net's settings
allow. The folder is ``AMPNET_CACHE_DIR`` where that is set (a leading
``~`` is the home folder, there and in ``amp_autotune__cache``), else the
user's cache folder by the platform's convention (``platformdirs``:
``~/.cache/ampnet`` on Linux). ``amp_autotune__cache=False`` turns it off
for a net: nothing is read or written.

Every file is untrusted: a read takes at most :data:`MAX_BYTES` of a
regular file (no link, FIFO or device), and an entry is used only when its
key matches and its choice passes the parameter table; anything else is
reported as a problem (the caller warns once and measures, and the new
entry replaces it). Writes go to a temporary file in the same folder and
are renamed into place, so a reader sees a whole entry or none, whatever
the number of concurrent writers; the folder keeps at most
:data:`MAX_ENTRIES` entries, the oldest removed first. ``python -m ampnet
cache --clear`` (:mod:`ampnet.auto.cache_command`) removes them all.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import stat
import tempfile
import time
from typing import Any, Mapping

import platformdirs
import torch

__all__ = ["cache_dir", "entry_path", "cache_key", "read_entry", "write_entry", "forget_entry", "machine_choices", "MAX_BYTES",
           "MAX_ENTRIES"]

#: The most bytes an entry may have; a larger file is refused unread.
MAX_BYTES = 16 * 1024

#: The most entries the folder keeps.
MAX_ENTRIES = 512

_VERSION = 1
_PREFIX = "auto-"


def cache_dir(folder: str | None = None) -> str:
    """The folder of the cache: ``folder`` (a net's ``amp_autotune__cache``)
    where given, else ``AMPNET_CACHE_DIR`` where that is set, else the
    platform's user cache folder for ampnet; a leading ``~`` is the user's
    home folder, as in a shell.

    Parameters
    ----------
    folder : str or None
      A folder of the user's own; None: the default folder.

    Returns
    -------
    str
      The folder, ``~`` expanded.
    """
    given = folder or os.environ.get("AMPNET_CACHE_DIR")
    if given:
        return os.path.expanduser(given)
    return platformdirs.user_cache_dir("ampnet", appauthor=False)


def _cpu() -> dict[str, Any]:
    model, vendor, flags = platform.processor() or platform.machine(), "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    return {"cpu": model, "vendor": vendor, "flags": sorted(flags.intersection(wanted))}


def machine(device: torch.device) -> dict[str, Any]:
    """What of the machine decides the choice on ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"gpu": torch.cuda.get_device_name(index),
                "capability": list(torch.cuda.get_device_capability(index))}
    if device.type != "cpu":
        return {"device": device.type}
    return {**_cpu(), "threads": torch.get_num_threads()}


def cache_key(net: Any, candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields that decide ``net``'s choice among ``candidates`` (JSON values)."""
    device = torch.device(net.device or "cpu")
    shapes = []
    for name in net._modules:
        module = net.__dict__.get(name + "_")
        if isinstance(module, torch.nn.Module):
            shapes += [[name, type(module).__qualname__]]
            shapes += [[n, list(p.shape), str(p.dtype)] for n, p in module.named_parameters()]
    model = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:32]
    optimizers = [type(net.__dict__.get(n + "_")).__qualname__ for n in net._optimizers]
    return {
        "machine": machine(device), "torch": torch.__version__, "model": model,
        "batch_size": net.batch_size if isinstance(net.batch_size, int) else repr(net.batch_size),
        "accumulation": net.gradient_accumulation_steps, "optimizers": optimizers,
        "candidates": candidates,
    }


def entry_path(key: Mapping[str, Any], folder: str | None = None) -> str:
    """The file of ``key``'s entry in ``folder`` (default: :func:`cache_dir`)."""
    return _path(folder or cache_dir(), key)


def _path(folder: str, key: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return os.path.join(folder, f"{_PREFIX}{digest}.json")


def _read_bytes(path: str) -> bytes | None:
    """At most :data:`MAX_BYTES` + 1 bytes of the regular file ``path``;
    None where there is no file."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def read_entry(key: Mapping[str, Any], folder: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The stored entry for ``key``: ``(entry, None)``; ``(None, None)``
    when there is none; ``(None, problem)`` for a file that is not a
    well-formed entry of this key (the problem names the file). An entry is
    a dict with ``params`` (the chosen constructor parameters, unchecked:
    the caller checks them) and ``step_s`` (the chosen setting's measured
    median step, in seconds)."""
    path = _path(folder or cache_dir(), key)
    try:
        raw = _read_bytes(path)
        if raw is None:
            return None, None
        if len(raw) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        entry = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        if not isinstance(entry, dict) or entry.get("version") != _VERSION:
            raise ValueError("not an ampnet cache entry of this version")
        if entry.get("key") != json.loads(json.dumps(key, sort_keys=True)):
            raise ValueError("its key is not the one its name stands for")
        params = entry.get("params")
        if not isinstance(params, dict) or not all(isinstance(v, (bool, str)) for v in params.values()):
            raise ValueError("'params' is not a dict of plain values")
        if not _finite(entry.get("step_s")):
            raise ValueError("'step_s' is not a positive finite number")
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        return None, f"{path}: {exc}"
    return entry, None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"holds {name}")


def write_entry(key: Mapping[str, Any], params: Mapping[str, Any], step_s: float,
                folder: str | None = None, keep: int = MAX_ENTRIES) -> str | None:
    """Store ``params`` (and its median step ``step_s``) for ``key``,
    atomically; then keep at most ``keep`` entries, the newest. Returns why
    it could not be written (None when it was)."""
    folder = folder or cache_dir()
    entry = {"version": _VERSION, "key": key, "params": dict(params), "step_s": float(step_s),
             "written": time.time()}
    data = json.dumps(entry, sort_keys=True).encode()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, _path(folder, key))
        except BaseException:
            _remove(tmp)
            raise
    except OSError as exc:
        return f"{folder}: {exc}"
    _bound(folder, keep)
    return None


def machine_choices(key: Mapping[str, Any], folder: str | None = None, newest: int = 64) -> dict[bool, int]:
    """How often the entries stored for other models on this machine (the
    same ``machine`` and ``torch`` fields of their key) chose mixed
    precision (True) and float32 (False), among the ``newest`` entries of
    the folder; entries that cannot be read are passed over."""
    folder = folder or cache_dir()
    try:
        with os.scandir(folder) as it:
            found = [(e.stat(follow_symlinks=False).st_mtime, e.path) for e in it
                     if e.name.startswith(_PREFIX) and e.name.endswith(".json") and e.is_file(follow_symlinks=False)]
    except OSError:
        return {}
    counts: dict[bool, int] = {}
    for _, path in sorted(found, reverse=True)[:newest]:
        try:
            raw = _read_bytes(path)
            entry = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant) if raw else None
            other = entry.get("key") if isinstance(entry, dict) else None
            chose = entry.get("params", {}).get("amp_enabled") if isinstance(other, dict) else None
        except (OSError, ValueError, UnicodeDecodeError, RecursionError, AttributeError):
            continue
        if isinstance(chose, bool) and other.get("machine") == key.get("machine") \
                and other.get("torch") == key.get("torch"):
            counts[chose] = counts.get(chose, 0) + 1
    return counts


def forget_entry(key: Mapping[str, Any], folder: str | None = None) -> None:
    """Remove the entry for ``key``, if there is one."""
    _remove(_path(folder or cache_dir(), key))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _bound(folder: str, keep: int) -> None:
    try:
        with os.scandir(folder) as it:
            entries = [(e.stat(follow_symlinks=False).st_mtime, e.path) for e in it
                       if e.name.startswith(_PREFIX) and e.name.endswith(".json")]
    except OSError:
        return
    for _, path in sorted(entries)[:max(len(entries) - keep, 0)]:
        _remove(path)
