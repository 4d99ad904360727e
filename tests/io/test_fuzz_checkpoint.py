"""Fuzz test: every file of a checkpoint is untrusted.

Many randomly corrupted versions of each checkpoint file (truncated,
bit-flipped, overwritten, wrong-typed or missing fields, foreign files: a
file of another slot or of another run), every numeric field set to
extremes (0, -1, int32 and int64 bounds, subnormals, float32/float64
bounds, NaN, infinities, ints beyond float range), tensors without values
(meta), torch's legacy format (as written, corrupted, declaring a
storage larger than the file, and with tensors whose size, stride or
offset reach past their storage), structures that hold the same list many
times over (2**60 paths) or themselves, special files and links in each file's place
(a FIFO, a socket, a directory, links to /dev/zero, to a valid copy outside
the folder, to one inside it, and dangling ones) and planted journals are
loaded in one subprocess, with a data-size limit and a per-case alarm so
that a load that hangs or reads without end is a reported failure. Each
load must either succeed (and the net must then step its schedulers to a
finite learning rate, predict, train a step and draw random numbers without
error) or raise a ValueError/OSError that names the file; after a refusal
the net must be exactly as before (parameters, optimizer, criterion,
history, loss scaler, LR scheduler, device and every RNG). A save after a
planted outward link must replace the link and leave its target alone. The
subprocess must never die.

Run by pytest; also runnable by hand::

    python tests/io/test_fuzz_checkpoint.py WORKDIR RESULT.json [SEED]
"""

import collections
import copy
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

#: tests/, where the shared helpers are (this file also runs as a script: no repo_paths import)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 20240610

#: What takes each file's place in the special-file cases.
SPECIAL_KINDS = ("fifo", "socket", "directory", "dev-zero", "link-out", "link-in", "dangling")

#: Seconds one case may take before it counts as a hang.
CASE_ALARM_S = 20

#: Extremes for numeric fields (ints are also tried as floats and vice versa).
EXTREMES = (
    0, -1, 1, 2**31 - 1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63),
    0.0, -0.0, -1.0, 5e-324, 1.1754943508222875e-38, 3.4028234663852886e38, 1e308, -1e308,
    float("nan"), float("inf"), float("-inf"), 10**400, -(10**400),
)

# slot -> file name, as Checkpoint(dirname=...) saves them
FILES = {
    "f_params": "params.pt",
    "f_optimizer": "optimizer.pt",
    "f_criterion": "criterion.pt",
    "f_history": "history.json",
    "f_grad_scaler": "grad_scaler.pt",
    "f_rng_state": "rng_state.pt",
    "f_lr_schedulers": "lr_schedulers.json",
}


@pytest.mark.slow
def test_fuzzed_checkpoints_load_or_are_refused_without_changing_the_net(tmp_path):
    result = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "work"), str(result), str(SEED)],
        cwd=os.path.dirname(TESTS),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.perf_counter() - started
    cpu = None if cpu_before is None else _children_cpu_s() - cpu_before
    progress = tmp_path / "work" / "progress.txt"
    last = progress.read_text().splitlines()[-1:] if progress.exists() else []
    assert proc.returncode == 0, (
        f"the loading process died (exit code {proc.returncode}) at case {last}:\n{proc.stderr[-3000:]}"
    )
    report = json.loads(result.read_text())
    print(
        f"\nfuzz: {report['cases']} cases ({report['refused']} refused, {report['loaded']} "
        f"loaded) in {elapsed:.1f} s" + ("" if cpu is None else f" ({cpu:.1f} s of CPU)")
    )
    assert report["failures"] == [], "\n".join(report["failures"][:20])
    # every kind of corruption ran, for every file, and both outcomes occurred
    assert report["cases"] >= 550
    assert set(report["slots"]) >= set(FILES) | {"journal"}
    assert {"truncate", "bitflip", "field", "foreign", "other-run", "extreme"} <= set(report["kinds"])
    assert report["refused"] > 0 and report["loaded"] > 0
    by_kind = report["by_kind"]
    assert by_kind["extreme"]["refused"] > 0 and by_kind["extreme"]["loaded"] > 0
    # special files and outward links are always refused; links inside the folder load
    for kind in ("fifo", "socket", "directory", "dev-zero", "link-out"):
        assert by_kind[kind] == {"refused": len(FILES), "loaded": 0}, (kind, by_kind[kind])
    assert by_kind["link-in"] == {"refused": 0, "loaded": len(FILES)}
    # torch's legacy format loads; a storage declaring more than the file holds is refused
    assert by_kind["legacy"] == {"refused": 0, "loaded": 5}, by_kind["legacy"]
    assert by_kind["legacy-bomb"]["refused"] >= 3 and by_kind["legacy-bomb"]["loaded"] == 0
    assert sum(by_kind["legacy-corrupt"].values()) == 20
    assert sum(by_kind["dangling"].values()) == len(FILES)
    # shared references are refused in every torch file, within 2 s (JSON cannot share: its
    # structures are as long as their places, and load or are refused in time)
    assert by_kind["shared"] == {"refused": 15, "loaded": 0}, by_kind["shared"]
    assert sum(by_kind["shared-json"].values()) == 6
    # a legacy tensor past its storage is refused before torch allocates (4 GiB data limit)
    assert by_kind["legacy-stride"]["refused"] >= 6 and by_kind["legacy-stride"]["loaded"] == 0
    # the CI budget is 30 s of wall-clock time on an idle machine; CPU time is what a
    # shared machine can measure
    if cpu is not None:
        assert cpu < 30, f"the fuzz test used {cpu:.0f} s of CPU (budget: 30 s)"


def _children_cpu_s():
    """CPU seconds used by finished child processes (None where unknown)."""
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---- the worker (runs in the subprocess) ------------------------------------


def _where(exc):
    """The innermost frames of ``exc``'s traceback, for a failure report."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-8:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames))


class _Hang(BaseException):
    """Raised by the per-case alarm (not an Exception: no reader may turn it
    into a refusal)."""


def _alarm(signum, frame):
    raise _Hang(f"the case ran longer than {CASE_ALARM_S} s (a blocked or endless read?)")


def _worker(workdir, result_path, seed):
    # this checkout's ampnet and the test helpers, whatever is installed
    sys.path[:0] = [os.path.dirname(TESTS), TESTS]
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, _alarm)
    try:  # a read without end fails with MemoryError instead of exhausting the machine
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    except (ImportError, ValueError, OSError):
        pass
    from skorch.callbacks import LRScheduler

    from ampnet import AmpNetClassifier
    from ampnet.io.atomic import JOURNAL_NAME, TEMP_SUFFIX
    from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
    from resume_script import Tiny, make_data

    class Wide(Tiny):
        def __init__(self):
            super().__init__()
            self.hidden = torch.nn.Linear(4, 12)
            self.out = torch.nn.Linear(12, 2)

    X, y = make_data()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    os.makedirs(workdir, exist_ok=True)
    progress = open(os.path.join(workdir, "progress.txt"), "w")

    def make_net(module=Tiny, precision="float16", callbacks=(), **kwargs):
        return AmpNetClassifier(
            module,
            amp_enabled=True,
            amp_dtype=precision,
            optimizer=torch.optim.Adam,
            lr=0.05,
            batch_size=16,
            max_epochs=2,
            train_split=None,
            verbose=0,
            grad_scaler__init_scale=2.0**20,
            grad_scaler__growth_interval=2,
            callbacks=[LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5), *callbacks],
            **kwargs,
        )

    def save_run(dirname, module, precision, safetensors=False):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        cp = Checkpoint(
            monitor=None,
            dirname=dirname,
            use_safetensors=safetensors,
            f_optimizer=None if safetensors else "optimizer.pt",
        )
        make_net(module, precision, callbacks=[cp]).fit(X, y)
        history = os.path.join(dirname, "history.json")
        with open(history) as f:
            rows = json.load(f)
        for row in rows:  # the wall-clock durations would make the bytes differ per run
            row["dur"] = 0.25
        with open(history, "w") as f:
            json.dump(rows, f)
        return cp

    pristine = os.path.join(workdir, "pristine")
    save_run(pristine, Tiny, "float16")
    other = os.path.join(workdir, "other")  # another run: wider module, bfloat16
    save_run(other, Wide, "bfloat16")
    pristine_st = os.path.join(workdir, "pristine_st")
    save_run(pristine_st, Tiny, "float16", safetensors=True)
    ckpt = os.path.join(workdir, "ckpt")
    victims = os.path.join(workdir, "victims")
    os.makedirs(victims)
    victim_files = {}
    for name in ("victim.txt", "dot_bashrc"):
        victim_files[os.path.join(victims, name)] = f"precious {name}\n".encode()
    for path, data in victim_files.items():
        with open(path, "wb") as f:
            f.write(data)

    def reset(source):
        if os.path.lexists(ckpt):
            if os.path.islink(ckpt) or not os.path.isdir(ckpt):
                os.remove(ckpt)
            else:
                shutil.rmtree(ckpt)
        shutil.copytree(source, ckpt)

    # ---- comparing the net before and after a refused load ---------------

    def state_of(net):
        sched = [
            (
                name,
                copy.deepcopy(cb.lr_scheduler_.state_dict()) if cb.lr_scheduler_ else None,
                getattr(cb, "batch_idx_", None),
            )
            for name, cb in net.callbacks_
            if isinstance(cb, LRScheduler)
        ]
        np_state = np.random.get_state(legacy=False)
        return {
            "params": {k: v.clone() for k, v in net.module_.state_dict().items()},
            "optimizer": copy.deepcopy(net.optimizer_.state_dict()),
            "criterion": copy.deepcopy(net.criterion_.state_dict()),
            "history": copy.deepcopy(net.history.to_list()),
            "scaler": copy.deepcopy(net.grad_scaler_.state_dict()),
            "scaler_attrs": {
                k: v for k, v in vars(net.grad_scaler_).items() if k != "_per_optimizer_states"
            },
            "schedulers": sched,
            "device": net.device,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": [
                np_state["state"]["key"].tolist(),
                np_state["state"]["pos"],
                np_state["has_gauss"],
                np_state["gauss"],
            ],
            "python_rng": random.getstate(),
        }

    def differences(a, b, path="net"):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(
                    a.reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a,
                    b.reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b,
                )
            )
            return [] if same else [path]
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                return [f"{path} keys"]
            return [d for k in a for d in differences(a[k], b[k], f"{path}[{k!r}]")]
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if len(a) != len(b):
                return [f"{path} length"]
            return [d for i, (u, v) in enumerate(zip(a, b)) for d in differences(u, v, f"{path}[{i}]")]
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return []
        return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} != {b!r}"]

    # ---- one case ---------------------------------------------------------

    report = {
        "cases": 0,
        "refused": 0,
        "loaded": 0,
        "failures": [],
        "slots": [],
        "kinds": [],
        "outcomes": [],
        "by_kind": {},
    }

    spare = {}  # mode -> a net that a refused load left exactly as it was

    def target_net(safetensors):
        # without an optimizer file (safetensors) skorch cannot rebuild a resumed
        # scheduler, so that checkpoint loads only through load_params
        mode = "load_params" if safetensors or rng.random() < 0.5 else "LoadInitState"
        if mode in spare:
            return spare.pop(mode), mode
        net = make_net().initialize()
        if mode == "load_params":  # schedulers running, as during training
            for _, cb in net.callbacks_:
                if isinstance(cb, LRScheduler):
                    cb.on_train_begin(net)
        return net, mode

    def check_schedulers(net):
        """Step every running scheduler once: the learning rates must stay
        finite and >= 0."""
        for name, cb in net.callbacks_:
            scheduler = getattr(cb, "lr_scheduler_", None) if isinstance(cb, LRScheduler) else None
            if scheduler is None:
                continue
            state = copy.deepcopy(scheduler.state_dict())
            groups = [dict(g) for g in net.optimizer_.param_groups]
            scheduler.step()
            lrs = [g["lr"] for g in net.optimizer_.param_groups]
            scheduler.load_state_dict(state)
            for group, saved in zip(net.optimizer_.param_groups, groups):
                group.update(saved)
            if not all(math.isfinite(lr) and lr >= 0 for lr in lrs):
                raise ValueError(f"scheduler {name!r} stepped to the learning rates {lrs}")

    def run_case(slot, kind, named, safetensors=False, after=None, bound_s=None):
        case = f"{report['cases']}:{slot}:{kind}"
        progress.write(case + "\n")
        progress.flush()
        report["cases"] += 1
        if slot not in report["slots"]:
            report["slots"].append(slot)
        if kind not in report["kinds"]:
            report["kinds"].append(kind)
        cp = Checkpoint(
            monitor=None,
            dirname=ckpt,
            use_safetensors=safetensors,
            f_optimizer=None if safetensors else "optimizer.pt",
        )
        cp.initialize()
        net, mode = target_net(safetensors)
        before = state_of(net)
        if hasattr(signal, "alarm"):
            signal.alarm(CASE_ALARM_S)
        listing = {
            n: open(os.path.join(ckpt, n), "rb").read()
            for n in sorted(os.listdir(ckpt))
            if os.path.isfile(os.path.join(ckpt, n)) and not os.path.islink(os.path.join(ckpt, n))
        }
        started = time.perf_counter()
        try:
            if mode == "load_params":
                net.load_params(checkpoint=cp, use_safetensors=safetensors)
            else:
                lis = LoadInitState(cp, use_safetensors=safetensors).initialize()
                lis.on_train_begin(net)
                for _, cb in net.callbacks_:
                    if isinstance(cb, LRScheduler):
                        cb.on_train_begin(net)
                lis.on_epoch_begin(net)
        except (ValueError, OSError) as exc:
            report["refused"] += 1
            report["outcomes"].append("refused")
            report["by_kind"].setdefault(kind, {"refused": 0, "loaded": 0})["refused"] += 1
            text = str(exc)
            cause = exc
            while cause is not None and not isinstance(cause, MemoryError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None or "can't allocate memory" in text:
                report["failures"].append(f"{case} ({mode}): refused after running out of memory: {text[:200]}")
            if named not in text:
                report["failures"].append(
                    f"{case} ({mode}): the error does not name {named!r}: {text[:300]}"
                )
            changed = differences(before, state_of(net))
            if changed:
                report["failures"].append(
                    f"{case} ({mode}): refused ({text[:150]}) but changed {changed[:3]}"
                )
            else:
                spare[mode] = net
            now = {
                n: open(os.path.join(ckpt, n), "rb").read()
                for n in listing
                if os.path.isfile(os.path.join(ckpt, n))
            }
            if slot == "journal" and now != listing:
                report["failures"].append(f"{case}: a refused journal changed the checkpoint directory")
        except (Exception, _Hang) as exc:  # noqa: BLE001 - any other error is a finding
            report["outcomes"].append("error")
            report["failures"].append(
                f"{case} ({mode}): {type(exc).__name__}: {str(exc)[:300]} at {_where(exc)}"
            )
        else:
            report["loaded"] += 1
            report["outcomes"].append("loaded")
            report["by_kind"].setdefault(kind, {"refused": 0, "loaded": 0})["loaded"] += 1
            try:  # a loaded net must work: schedulers, random numbers, prediction, a training step
                check_schedulers(net)
                np.random.rand(3), random.random(), torch.rand(3)
                net.predict_proba(X[:8])
                net.partial_fit(X[:16], y[:16])
            except Exception as exc:  # noqa: BLE001
                report["failures"].append(
                    f"{case} ({mode}): loaded, then {type(exc).__name__}: {str(exc)[:300]} at {_where(exc)}"
                )
        finally:
            if hasattr(signal, "alarm"):
                signal.alarm(0)
        elapsed = time.perf_counter() - started
        if bound_s is not None and elapsed > bound_s:
            report["failures"].append(f"{case} ({mode}): took {elapsed:.1f} s (bound: {bound_s} s)")
        for path, data in victim_files.items():
            if not os.path.isfile(path) or open(path, "rb").read() != data:
                report["failures"].append(f"{case}: {path} outside the checkpoint was changed")
                with open(path, "wb") as f:
                    f.write(data)
        if after is not None:
            after(net)

    # ---- corruptions --------------------------------------------------------

    def wrong_value(json_only):
        pool = [
            None,
            True,
            False,
            "x",
            "",
            -1,
            0,
            1,
            3.5,
            2**62,
            1e39,
            -1e39,
            1e-50,
            float("nan"),
            float("inf"),
            -float("inf"),
            [],
            {},
            [1, "a"],
            {"a": None},
            "../../victim.txt",
            [[[[]]]],
            10**400,
            [-(10**400)],
        ]
        if not json_only:
            pool += [
                torch.empty((), device="meta"),
                torch.empty(3, device="meta"),
                torch.tensor(7),
                torch.zeros(3),
                torch.tensor([float("nan")]),
                torch.zeros(2, 2, dtype=torch.int64),
                torch.tensor(True),
                torch.full((5,), 2**40),
                torch.zeros(0),
                (1, 2),
            ]
        return copy.deepcopy(rng.choice(pool))

    def mutate_tensor(t):
        choice = rng.randrange(7)
        if choice == 0 and t.numel():
            t = t.clone().reshape(-1)
            extreme = (
                [-1, 0, 624, 625, 2**32, 2**40, -(2**40)]
                if not t.is_floating_point()
                else [float("nan"), float("inf"), -float("inf"), 1e39, 0.0, -1.0]
            )
            value = rng.choice(extreme)
            try:
                t[rng.randrange(t.numel())] = value
            except (RuntimeError, OverflowError):
                t.zero_()
            return t.reshape(-1)
        if choice == 1:
            return torch.zeros_like(t) if rng.random() < 0.8 else t.to("meta")
        if choice == 2:
            return t.to(
                rng.choice(
                    [
                        torch.float32,
                        torch.float64,
                        torch.int32,
                        torch.int64,
                        torch.uint8,
                        torch.bool,
                        torch.float16,
                    ]
                )
            )
        if choice == 3:
            flat = t.reshape(-1)
            return flat[:-1].clone() if flat.numel() else torch.zeros(2)
        if choice == 4:
            return t.unsqueeze(0).clone()
        if choice == 5:
            return torch.cat([t.reshape(-1), t.reshape(-1)[:1]]).clone() if t.numel() else torch.ones(1)
        return torch.randint(-(2**31), 2**31, t.shape).to(t.dtype) if t.dtype != torch.bool else ~t

    def nodes_of(obj, depth=0):
        found = []
        if isinstance(obj, dict):
            for key, value in obj.items():
                found.append((obj, key))
                found += nodes_of(value, depth + 1)
        elif isinstance(obj, list):
            for index, value in enumerate(obj):
                found.append((obj, index))
                found += nodes_of(value, depth + 1)
        return found

    def listify(obj):
        if isinstance(obj, tuple):
            return [listify(v) for v in obj]
        if isinstance(obj, list):
            return [listify(v) for v in obj]
        if isinstance(obj, dict):
            return type(obj)((k, listify(v)) for k, v in obj.items())
        return obj

    def mutate_structure(obj, json_only):
        obj = listify(obj)
        nodes = nodes_of(obj)
        if not nodes:
            return wrong_value(json_only) if rng.random() < 0.5 else {"fuzz": wrong_value(json_only)}
        parent, key = rng.choice(nodes)
        action = rng.randrange(4)
        if action == 0 or (action == 3 and not isinstance(parent[key], torch.Tensor)):
            parent[key] = wrong_value(json_only)
        elif action == 1:
            del parent[key]
        elif action == 2:
            if isinstance(parent, dict):
                parent[rng.choice(["fuzz", "cuda.x", "cuda.7", "_overflow_streak", "lr", 3])] = wrong_value(
                    json_only
                )
            else:
                parent.append(wrong_value(json_only))
        else:
            parent[key] = mutate_tensor(parent[key])
        return obj

    def write(path, data):
        with open(path, "wb") as f:
            f.write(data)

    def bytes_corruption(data, kind):
        data = bytearray(data)
        if kind == "truncate":
            return bytes(data[: rng.randrange(max(len(data), 1))])
        if kind == "bitflip":
            for _ in range(rng.randint(1, 8)):
                if data:
                    i = rng.randrange(len(data))
                    data[i] ^= 1 << rng.randrange(8)
            return bytes(data)
        if kind == "overwrite":
            if data:
                start = rng.randrange(len(data))
                size = rng.randint(1, 64)
                data[start : start + size] = bytes(rng.randrange(256) for _ in range(size))
            return bytes(data)
        if kind == "append":
            return bytes(data) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))
        if kind == "empty":
            return b""
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 2000)))  # "garbage"

    def fuzz_slot(slot, source, safetensors, n_bytes, n_fields):
        name = FILES[slot]
        path = os.path.join(ckpt, name)
        original = open(os.path.join(source, name), "rb").read()
        is_json = name.endswith(".json")
        kinds = ["truncate", "bitflip", "overwrite", "append", "empty", "garbage"]
        for i in range(n_bytes):
            reset(source)
            kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds[:4])
            write(path, bytes_corruption(original, kind))
            run_case(slot, kind, path, safetensors)
        for _ in range(n_fields):
            reset(source)
            if is_json:
                obj = mutate_structure(json.loads(original), json_only=True)
                write(path, json.dumps(obj).encode())
            elif safetensors:
                from safetensors.torch import load, save

                obj = mutate_structure(dict(sorted(load(original).items())), json_only=False)
                tensors = (
                    {str(k): v for k, v in obj.items()  # safetensors cannot write meta tensors
                     if isinstance(v, torch.Tensor) and v.device.type != "meta"}
                    if isinstance(obj, dict)
                    else {}
                )
                write(path, save({k: v.contiguous() for k, v in tensors.items()}))
            else:
                import io

                obj = torch.load(io.BytesIO(original), weights_only=True)
                buffer = io.BytesIO()
                torch.save(mutate_structure(obj, json_only=False), buffer)
                write(path, buffer.getvalue())
            run_case(slot, "field", path, safetensors)
        if is_json:  # nested too deeply for the JSON reader
            reset(source)
            depth = rng.choice([200, 5000, 100000])
            write(path, b"[" * depth + b"]" * depth)
            run_case(slot, "deep", path, safetensors)
        for other_slot, other_name in FILES.items():  # a file of another slot
            if other_slot == slot or not os.path.exists(os.path.join(source, other_name)):
                continue
            reset(source)
            shutil.copyfile(os.path.join(source, other_name), path)
            run_case(slot, "foreign", path, safetensors)
        if not safetensors:  # the same slot of another run
            reset(source)
            shutil.copyfile(os.path.join(other, name), path)
            run_case(slot, "other-run", path, safetensors)

    for slot in FILES:
        fuzz_slot(slot, pristine, False, n_bytes=14, n_fields=20)
    for slot in ("f_params", "f_grad_scaler", "f_rng_state"):
        fuzz_slot(slot, pristine_st, True, n_bytes=8, n_fields=12)

    # ---- numeric extremes, field by field ---------------------------------------

    def numeric_leaves(obj, path=()):
        """Paths to every number in ``obj`` (the first and last of long lists
        of numbers) and to the first and last element of numeric tensors."""
        if obj is None or isinstance(obj, bool):
            return []
        if isinstance(obj, (int, float)):
            return [path]
        if isinstance(obj, torch.Tensor):
            if obj.dtype == torch.bool or obj.numel() == 0:
                return []
            return [path + (("elem", i),) for i in sorted({0, obj.numel() - 1})]
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
            if len(items) > 4 and all(isinstance(v, (int, float)) for _, v in items):
                items = [items[0], items[-1]]
        else:
            return []
        return [leaf for key, value in items for leaf in numeric_leaves(value, path + (key,))]

    def set_leaf(obj, path, value):
        """Set the leaf at ``path`` to ``value``; False where a tensor's dtype
        cannot hold it."""
        if path and isinstance(path[-1], tuple):
            *parents, key, (_, index) = path
        else:
            *parents, key = path
            index = None
        for step in parents:
            obj = obj[step]
        if index is None:
            obj[key] = value
            return True
        tensor = obj[key].clone()
        flat = tensor.reshape(-1)
        try:
            flat[index] = value
        except (RuntimeError, OverflowError, TypeError, ValueError):  # 10**400 in a tensor
            return False
        obj[key] = flat.reshape(tensor.shape)
        return True

    def fuzz_extremes(slot, n_fields, per_field):
        import io

        name = FILES[slot]
        path = os.path.join(ckpt, name)
        original = open(os.path.join(pristine, name), "rb").read()
        is_json = name.endswith(".json")
        load = (lambda: json.loads(original)) if is_json else (
            lambda: listify(torch.load(io.BytesIO(original), weights_only=True)))
        leaves = numeric_leaves(load())
        for leaf in rng.sample(leaves, min(n_fields, len(leaves))):
            for value in rng.sample(EXTREMES, per_field):
                obj = load()
                if not set_leaf(obj, leaf, value):
                    continue
                reset(pristine)
                if is_json:
                    write(path, json.dumps(obj).encode())
                else:
                    buffer = io.BytesIO()
                    torch.save(obj, buffer)
                    write(path, buffer.getvalue())
                run_case(slot, "extreme", path)

    for slot in FILES:
        fuzz_extremes(slot, n_fields=12, per_field=2)

    # ---- torch's legacy format (torch < 1.6) -------------------------------------

    def legacy_bytes(obj):
        import io

        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=False)
        return buffer.getvalue()

    def legacy_bomb(data):
        """``data`` (a legacy file) with its first storage declaring 10**12
        elements: the element count is the opcode after the location."""
        import io
        import pickletools

        f = io.BytesIO(data)
        for _ in range(3):  # magic, protocol, system info
            for _ in pickletools.genops(f):
                pass
        ops = list(pickletools.genops(f))
        for (op, arg, pos), (_, _, after) in zip(ops, ops[1:]):
            if op.name in ("BINUNICODE", "SHORT_BINUNICODE") and arg in ("cpu", "cuda:0"):
                numel_end = next(p for (_, _, p) in ops if p > after)
                huge = (10**12).to_bytes(6, "little")
                return data[:after] + b"\x8a" + bytes([len(huge)]) + huge + data[numel_end:]
        return None  # no storage (an empty criterion state, a scaler state of floats)

    import io as _io

    for slot in ("f_params", "f_optimizer", "f_criterion", "f_grad_scaler", "f_rng_state"):
        path = os.path.join(ckpt, FILES[slot])
        original = open(os.path.join(pristine, FILES[slot]), "rb").read()
        legacy = legacy_bytes(torch.load(_io.BytesIO(original), weights_only=True))
        reset(pristine)
        write(path, legacy)
        run_case(slot, "legacy", path)
        bomb = legacy_bomb(legacy)
        if bomb is not None:
            reset(pristine)
            write(path, bomb)
            run_case(slot, "legacy-bomb", path)
        for kind in ("truncate", "bitflip", "overwrite", "append"):
            reset(pristine)
            write(path, bytes_corruption(legacy, kind))
            run_case(slot, "legacy-corrupt", path)

    # ---- shared references: 2**60 paths in a few KB, a list inside itself ----------

    def laughs(depth, leaf=0.5):
        x = [leaf]
        for _ in range(depth):
            x = [x, x]
        return x

    def self_holding():
        x = [0.5]
        x.append(x)
        return x

    for slot, name in FILES.items():
        path = os.path.join(ckpt, name)
        original = open(os.path.join(pristine, name), "rb").read()
        is_json = name.endswith(".json")
        for variant in ("laughs", "self", "laughs"):
            reset(pristine)
            obj = listify(json.loads(original) if is_json else torch.load(_io.BytesIO(original), weights_only=True))
            if is_json:  # JSON has no references: the structure as long as its places
                structure = laughs(rng.choice([10, 12]))
            else:
                structure = laughs(60) if variant == "laughs" else self_holding()
            nodes = nodes_of(obj)
            if nodes:
                parent, key = rng.choice(nodes)
                parent[key] = structure
            else:
                obj = {"fuzz": structure}
            if is_json:
                write(path, json.dumps(obj).encode())
            else:
                buffer = _io.BytesIO()
                torch.save(obj, buffer)
                write(path, buffer.getvalue())
            run_case(slot, "shared" if not is_json else "shared-json", path, bound_s=2.0)

    # ---- legacy tensors whose size, stride or offset reach past their storage ------

    class Call:
        def __init__(self, fn, *args):
            self.fn, self.args = fn, args

        def __reduce__(self):
            return self.fn, self.args

    def first_tensor(obj):
        for parent, key in nodes_of(obj):
            value = parent[key]
            if isinstance(value, torch.Tensor) and value.numel() and value.device.type == "cpu":
                return parent, key
        return None

    for slot in ("f_params", "f_optimizer", "f_criterion", "f_grad_scaler", "f_rng_state"):
        path = os.path.join(ckpt, FILES[slot])
        original = open(os.path.join(pristine, FILES[slot]), "rb").read()
        for size, stride, offset in (((10**10,), (1,), 0), ((2, 2), (10**10, 1), 0), (None, (1,), 10**10)):
            obj = torch.load(_io.BytesIO(original), weights_only=True)
            place = first_tensor(obj)
            if place is None:  # no tensor (an empty criterion state, a scaler state of floats)
                break
            parent, key = place
            tensor = parent[key].contiguous()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                storage = tensor.storage()
            parent[key] = Call(torch._utils._rebuild_tensor_v2, storage, offset, size or (tensor.numel(),),
                               stride, False, collections.OrderedDict())
            reset(pristine)
            write(path, legacy_bytes(obj))
            run_case(slot, "legacy-stride", path, bound_s=2.0)

    # ---- special files and links in each file's place ------------------------------

    def make_special(kind, path, slot):
        """Put ``kind`` where the file ``path`` was; return the hook to run
        after the case."""
        os.remove(path)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            here = os.getcwd()
            os.chdir(os.path.dirname(path))  # a socket's path is limited to ~100 bytes
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.bind(os.path.basename(path))
            finally:
                os.chdir(here)
        elif kind == "directory":
            os.mkdir(path)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", path)
        elif kind == "dangling":
            os.symlink(os.path.join(ckpt, "no-such-file"), path)
        elif kind == "link-in":
            inside = os.path.join(ckpt, "real-" + os.path.basename(path))
            shutil.copyfile(os.path.join(pristine, FILES[slot]), inside)
            os.symlink(os.path.basename(inside), path)
        else:  # "link-out": a valid copy outside the folder
            outside = os.path.join(victims, "outside-" + os.path.basename(path))
            shutil.copyfile(os.path.join(pristine, FILES[slot]), outside)
            victim_files[outside] = open(outside, "rb").read()
            os.symlink(outside, path)

            def save_over_the_link(net):
                # the README's resume pattern saves into the folder next: the link is
                # replaced by a file, its target is left alone
                net.save_params(**{k: os.path.join(ckpt, n) for k, n in FILES.items()})
                if os.path.islink(path) or open(outside, "rb").read() != victim_files[outside]:
                    report["failures"].append(f"a save wrote through the planted link {path!r}")

            return save_over_the_link
        return None

    for slot in FILES:
        for kind in SPECIAL_KINDS:
            if kind == "socket" and not hasattr(socket, "AF_UNIX"):
                continue
            reset(pristine)
            path = os.path.join(ckpt, FILES[slot])
            after = make_special(kind, path, slot)
            run_case(slot, kind, path, after=after)

    # ---- planted journals -----------------------------------------------------

    journal = os.path.join(ckpt, JOURNAL_NAME)
    hexname = "0123456789ab"
    valid_temp = f".params.pt.{hexname}{TEMP_SUFFIX}"
    victim = os.path.join(victims, "victim.txt")
    names = [
        valid_temp,
        "params.pt",
        victim,
        os.path.join("..", "victims", "victim.txt"),
        os.path.join("sub", "..", "..", "victims", "victim.txt"),
        "..",
        ".",
        "",
        "x\x00y",
        f".victim.txt.{hexname}{TEMP_SUFFIX}",
        f"../.victim.txt.{hexname}{TEMP_SUFFIX}",
        f".params.pt.{hexname[:-1]}{TEMP_SUFFIX}",
        f".history.json.{hexname}{TEMP_SUFFIX}",
        JOURNAL_NAME,
        "../" + JOURNAL_NAME,
        1,
        None,
        ["a"],
        "/",
        "..\\victim.txt",
    ]

    def random_journal():
        shape = rng.randrange(10)
        if shape == 0:
            return bytes_corruption(
                json.dumps({"ampnet_journal_version": 1, "moves": [], "journals": [JOURNAL_NAME]}).encode(),
                rng.choice(["truncate", "bitflip", "overwrite", "garbage"]),
            )
        data = {
            "ampnet_journal_version": 1,
            "moves": [[rng.choice(names), rng.choice(names)] for _ in range(rng.randint(0, 3))],
            "journals": [rng.choice(names) for _ in range(rng.randint(0, 2))],
        }
        if shape == 1:
            data["ampnet_journal_version"] = wrong_value(True)
        elif shape == 2:
            del data[rng.choice(sorted(data))]
        elif shape == 3:
            data[rng.choice(["moves", "journals"])] = wrong_value(True)
        elif shape == 4:
            data["extra"] = 1
        elif shape == 5:
            data = {
                "ampnet_journal_version": 1,
                "moves": [[valid_temp, "params.pt"]],
                "journals": [JOURNAL_NAME],
            }
        return json.dumps(data).encode()

    def clean_journal():
        for n in os.listdir(ckpt):
            if n == JOURNAL_NAME or n.endswith(TEMP_SUFFIX):
                p = os.path.join(ckpt, n)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.remove(p)

    for i in range(50):
        reset(pristine)
        extra = rng.randrange(4)
        if extra == 1:  # a temporary-file name that links outside
            os.symlink(victim, os.path.join(ckpt, valid_temp))
        elif extra == 2:  # a real pending save of params.pt
            shutil.copyfile(os.path.join(pristine, "params.pt"), os.path.join(ckpt, valid_temp))
        if i == 0:  # a journal that is a link to one outside
            outside = os.path.join(victims, "planted.json")
            write(
                outside,
                json.dumps({"ampnet_journal_version": 1, "moves": [], "journals": [JOURNAL_NAME]}).encode(),
            )
            os.symlink(outside, journal)
        elif i == 1:  # a directory in the journal's place
            os.mkdir(journal)
        elif i == 2:  # too large
            write(journal, b" " * (2 << 20))
        else:
            write(journal, random_journal())
        run_case("journal", "journal", journal, after=lambda net: clean_journal())

    progress.close()
    with open(result_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else SEED)
