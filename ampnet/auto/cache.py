"""The on-disk memory of ``amp_enabled='auto'``: one small JSON file per
key, so that the next fit of the same model on the same machine (the next
fold of a grid search, a clone, the script run again, another process)
starts with the choice at its first step and measures nothing.

The key is what decides the choice (:func:`cache_key`): the machine (CPU
model and bf16 flags, or the GPU's name and compute capability), torch's
thread count, the torch version, the model's structure (its modules'
``repr``, parameter and buffer shapes and dtypes), the criterion, the
input's per-row shape and dtype, the batch size the fit uses
(``iterator_train__batch_size`` over ``batch_size``), gradient
accumulation, the optimizers with the kernel settings the user gave, the
modules kept in float32 and the candidates the net's settings allow. A
choice measured under a test clock (``amp_autotune__timer``) has a key of
its own (``clock``): it never stands for the machine's. The folder is
``AMPNET_CACHE_DIR`` where that is set (a leading ``~`` is the home folder,
there and in ``amp_autotune__cache``), else the
user's cache folder by the platform's convention (``platformdirs``:
``~/.cache/ampnet`` on Linux). ``amp_autotune__cache=False`` turns it off
for a net: nothing is read or written.

Every file is untrusted: a read takes at most :data:`MAX_BYTES` of a
regular file (no link, FIFO or device), and an entry is used only when its
key matches and its choice passes the parameter table; anything else is
reported as a problem (the caller warns once and measures, and the new
entry replaces it), and so is a ``step_s`` outside
[:data:`MIN_STEP_S`, :data:`MAX_STEP_S`] (no training step is that short
or that long: the number was not measured). An entry older than
:data:`EXPIRES_S` (or dated in the future) is not used: the next fit
measures again, so that a choice gets a chance to be proven wrong. Writes go to a temporary file in the same folder and
are renamed into place, so a reader sees a whole entry or none, whatever
the number of concurrent writers; the folder keeps at most
:data:`MAX_ENTRIES` entries, the oldest removed first. Eviction removes only
files that ampnet wrote (named ``auto-<40 hex digits>.json`` and holding an
entry), never the entry just written, and counts a file dated in the
future as the oldest. ``python -m ampnet cache --clear``
(:mod:`ampnet.auto.cache_command`) removes them all.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import platform
import re
import stat
import tempfile
import time
from typing import Any, Mapping

import platformdirs
import torch

from ampnet.config.params import parsed

__all__ = ["cache_dir", "entry_path", "cache_key", "read_bytes", "read_entry", "write_entry", "forget_entry", "expired",
           "MAX_BYTES", "MAX_ENTRIES", "MIN_STEP_S", "MAX_STEP_S", "EXPIRES_S"]

#: The most bytes an entry may have; a larger file is refused unread.
MAX_BYTES = 16 * 1024

#: The most entries the folder keeps.
MAX_ENTRIES = 512

#: The shortest ``step_s`` an entry may hold: no training step takes less
#: (Python's own overhead of a step is larger).
MIN_STEP_S = 1e-5

#: The longest ``step_s`` an entry may hold (one hour).
MAX_STEP_S = 3600.0

#: How long a stored choice is used (7 days): then the next fit measures
#: again, at the cost of one measurement (``2 * (warmup + steps)`` steps at
#: most, about half of them in the slower setting) per model and week.
EXPIRES_S = 7 * 24 * 3600.0

_VERSION = 1
_PREFIX = "auto-"
_NAME = re.compile(r"auto-[0-9a-f]{40}\.json")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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


def _plain(value: Any) -> Any:
    """``value`` as JSON values: numpy and other numbers as Python's, the
    rest as a ``repr`` without memory addresses."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(float(value)) else repr(float(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _module(module: Any) -> list[Any]:
    """A module's structure: its ``repr`` (children and their settings),
    parameter and buffer names, shapes and dtypes."""
    if not isinstance(module, torch.nn.Module):
        return [type(module).__qualname__]
    tensors = [[n, list(t.shape), str(t.dtype)] for n, t in module.named_parameters()]
    tensors += [["buffer", n, list(t.shape), str(t.dtype)] for n, t in module.named_buffers()]
    return [type(module).__qualname__, _ADDRESS.sub("", repr(module)), tensors]


def inputs_of(X: Any) -> Any:
    """What of the fit's input ``X`` decides the choice: each array's
    per-row shape and dtype (a dict's and a list's, item by item), else
    its type."""
    shape, dtype = getattr(X, "shape", None), getattr(X, "dtype", None)
    if shape is not None and dtype is not None:
        return [[int(n) for n in tuple(shape)[1:]], str(dtype)]
    if isinstance(X, dict):
        return {str(k): inputs_of(v) for k, v in sorted(X.items(), key=lambda kv: str(kv[0]))}
    if isinstance(X, (list, tuple)) and X and all(hasattr(v, "shape") for v in X):
        return [inputs_of(v) for v in X]
    dtypes = getattr(X, "dtypes", None)  # a pandas DataFrame
    if shape is not None and dtypes is not None:
        return [list(tuple(shape)[1:]), [str(d) for d in dtypes]]
    return type(X).__qualname__


def batch_size(net: Any) -> Any:
    """The batch size the fit's training batches have:
    ``iterator_train__batch_size`` where set, else ``batch_size``."""
    return net.get_params_for("iterator_train").get("batch_size", net.batch_size)


_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def cache_key(net: Any, candidates: list[dict[str, Any]], X: Any = None, clock: bool = False) -> dict[str, Any]:
    """The fields that decide ``net``'s choice among ``candidates`` (JSON
    values) for a fit on ``X``; ``clock``: the choice is timed by a test
    clock (``amp_autotune__timer``), not the machine's."""
    device = torch.device(net.device or "cpu")
    structure = [[name, _module(net.__dict__.get(name + "_"))] for name in net._modules]
    criteria = [[name, _module(net.__dict__.get(name + "_"))] for name in getattr(net, "_criteria", ["criterion"])]
    model = hashlib.sha256(json.dumps(_plain([structure, criteria])).encode()).hexdigest()[:32]
    optimizers = []
    for name in net._optimizers:
        factory = getattr(net, name, None)
        given = net.get_params_for(name)
        optimizers.append([_plain(factory) if isinstance(factory, type) else type(net.__dict__.get(name + "_")).__qualname__,
                           {k: _plain(given[k]) for k in _KERNEL_KEYS if k in given}])
    key = {
        "machine": machine(device), "torch": torch.__version__, "model": model,
        "batch_size": _plain(batch_size(net)), "accumulation": _plain(net.gradient_accumulation_steps),
        "optimizers": optimizers, "fp32_modules": _plain(parsed(net, "amp_fp32_modules")),
        "inputs": _plain(inputs_of(X)), "candidates": _plain(candidates),
    }
    if clock:
        key["clock"] = "amp_autotune__timer"
    return key


def entry_path(key: Mapping[str, Any], folder: str | None = None) -> str:
    """The file of ``key``'s entry in ``folder`` (default: :func:`cache_dir`)."""
    return _path(folder or cache_dir(), key)


def _path(folder: str, key: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(_plain(key), sort_keys=True).encode()).hexdigest()[:40]
    return os.path.join(folder, f"{_PREFIX}{digest}.json")


def read_bytes(path: str) -> bytes | None:
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


def _plausible(value: Any) -> bool:
    """Whether ``value`` is a step time a machine could have measured (a
    400-digit integer is not: it is refused, not converted)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and MIN_STEP_S <= value <= MAX_STEP_S
    except OverflowError:
        return False


def expired(entry: Mapping[str, Any], now: float | None = None) -> bool:
    """Whether ``entry`` is older than :data:`EXPIRES_S`, dated in the
    future, or undated: the next fit measures again."""
    written = entry.get("written")
    now = time.time() if now is None else now
    if not isinstance(written, (int, float)) or isinstance(written, bool):
        return True
    try:
        return not (math.isfinite(written) and now - EXPIRES_S <= written <= now + 60.0)
    except OverflowError:
        return True


def read_entry(key: Mapping[str, Any], folder: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The stored entry for ``key``: ``(entry, None)``; ``(None, None)``
    when there is none; ``(None, problem)`` for a file that is not a
    well-formed entry of this key (the problem names the file). An entry is
    a dict with ``params`` (the chosen constructor parameters, unchecked:
    the caller checks them) and ``step_s`` (the chosen setting's measured
    median step, in seconds); whether it is :func:`expired` is the
    caller's to judge."""
    path = _path(folder or cache_dir(), key)
    try:
        raw = read_bytes(path)
        if raw is None:
            return None, None
        if len(raw) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        entry = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        if not isinstance(entry, dict) or entry.get("version") != _VERSION:
            raise ValueError("not an ampnet cache entry of this version")
        if entry.get("key") != json.loads(json.dumps(_plain(key), sort_keys=True)):
            raise ValueError("its key is not the one its name stands for")
        params = entry.get("params")
        if not isinstance(params, dict) or not all(isinstance(v, (bool, str)) for v in params.values()):
            raise ValueError("'params' is not a dict of plain values")
        if not _plausible(entry.get("step_s")):
            raise ValueError(f"'step_s' is not a step time in [{MIN_STEP_S:g}, {MAX_STEP_S:g}] seconds: "
                             "untrusted")
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, OverflowError) as exc:
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
    key = _plain(key)
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
    _bound(folder, keep, _path(folder, key))
    return None


def forget_entry(key: Mapping[str, Any], folder: str | None = None) -> None:
    """Remove the entry for ``key``, if there is one."""
    _remove(_path(folder or cache_dir(), key))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _ours(path: str) -> bool:
    """Whether the file ``path`` holds an entry that ampnet wrote (a JSON
    object with this cache's ``version`` and a ``key``)."""
    try:
        raw = read_bytes(path)
        entry = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant) if raw else None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(entry, dict) and entry.get("version") == _VERSION and isinstance(entry.get("key"), dict)


def _bound(folder: str, keep: int, written: str) -> None:
    """Keep at most ``keep`` entries in ``folder``: remove the oldest of
    the files that ampnet wrote (by name and content), never ``written``
    (the entry just written); a file dated in the future counts as the
    oldest (its date cannot be trusted)."""
    now = time.time()
    try:
        with os.scandir(folder) as it:
            named = [(e.stat(follow_symlinks=False).st_mtime, e.path) for e in it
                     if _NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)]
    except OSError:
        return
    if len(named) <= keep:
        return
    entries = [(mtime if mtime <= now + 60.0 else -math.inf, path) for mtime, path in named
               if path != written and _ours(path)]
    excess = len(entries) + 1 - keep  # the entry just written counts
    for _, path in sorted(entries)[:max(excess, 0)]:
        _remove(path)
