"""Models and probes shared by the precision-control tests, and the settings and buffers of
``amp_master_weights='compensated'`` (:data:`COMP`, :func:`compensation`, :func:`true_weights`).

A :class:`Probe` records, from inside the model, what each watched module
computes with: the autocast state, the dtypes of its inputs, outputs and
parameters, and whether 4-D inputs use channels_last strides.
"""

from functools import partial

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from ampnet.precision.compensated import KEY

CL = torch.channels_last


class Head(torch.nn.Module):
    def __init__(self, n_in=16, n_out=2):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.lin(x)


class ThreePart(torch.nn.Module):
    """embed -> block (Linear, ReLU) -> head; returns probabilities."""

    def __init__(self, n_in=20):
        super().__init__()
        self.embed = torch.nn.Linear(n_in, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.head = Head(16, 2)

    def forward(self, X):
        return torch.softmax(self.head(self.block(self.embed(X))), dim=-1)


class NormZoo(torch.nn.Module):
    """Every normalization layer family, between convolutions and linears."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.inorm = torch.nn.InstanceNorm2d(8, affine=True)
        self.fc = torch.nn.Linear(8 * 4 * 4, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, X):
        h = torch.relu(self.inorm(self.gn(self.bn(self.conv(X)))))
        return self.out(self.ln(self.fc(h.flatten(1))))


class DigitsMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(128, 10)

    def forward(self, X):
        return self.out(torch.relu(self.hidden(X)))


class DigitsCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.BatchNorm2d(32),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Linear(32 * 16, 10)

    def forward(self, X):
        return self.head(self.features(X.view(-1, 1, 8, 8)).flatten(1))


def digits_split():
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    return train_test_split(X, y.astype(np.int64), test_size=0.25, random_state=0, stratify=y)


def image_data(n=32, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(n, 3, 4, 4).astype(np.float32)
    y = (X[:, 0].mean((1, 2)) > 0).astype(np.int64)
    return X, y


def _dtypes(obj):
    if isinstance(obj, torch.Tensor):
        return [obj.dtype] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [d for o in obj for d in _dtypes(o)]
    return []


class Probe:
    """Hooks on the named submodules of ``root`` (``''`` is the root).

    ``calls[name]`` is a list of dicts, one per forward call, with the keys
    ``autocast`` (enabled inside the module), ``inputs`` (dtypes, after any
    casting by ampnet's regions), ``outputs`` (dtypes as computed, before
    ampnet casts them), ``params`` (dtypes of the module's own parameters)
    and ``channels_last`` (whether every 4-D input uses channels_last).
    """

    def __init__(self, root, names, device_type="cpu"):
        self.device_type = device_type
        self.calls = {n: [] for n in names}
        self.handles = []
        for n in names:
            module = root.get_submodule(n)
            # pre-hook appended: runs after ampnet's region pre-hook
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, n)))
            # forward hook prepended: runs before ampnet's region post-hook
            self.handles.append(module.register_forward_hook(partial(self._post, n), prepend=True))

    def _pre(self, name, module, args):
        four_d = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
        self.calls[name].append({
            "autocast": torch.is_autocast_enabled(self.device_type),
            "inputs": _dtypes(args),
            "params": [p.dtype for p in module.parameters(recurse=False)],
            "channels_last": all(a.is_contiguous(memory_format=CL) for a in four_d) if four_d else None,
        })

    def _post(self, name, module, args, output):
        self.calls[name][-1]["outputs"] = _dtypes(output)

    def seen(self, name, key):
        """The set of values of ``key`` over all calls of ``name`` (dtype
        lists are flattened)."""
        out = set()
        for call in self.calls[name]:
            value = call[key]
            out.update(value if isinstance(value, list) else [value])
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


# ---- amp_master_weights='compensated' ---------------------------------------------------

PURE = dict(amp_enabled=True, amp_level="pure")
COMP = dict(PURE, amp_dtype="bfloat16", amp_master_weights="compensated")


def compensation(net):
    """name -> compensation buffer of the net's optimizer."""
    state = net.optimizer_.state
    return {n: state[p][KEY] for n, p in net.module_.named_parameters() if p in state and KEY in state[p]}


def true_weights(net):
    """name -> weight plus compensation, in float64."""
    comps = compensation(net)
    return {n: p.detach().double() + (comps[n].double() if n in comps else 0)
            for n, p in net.module_.named_parameters()}
