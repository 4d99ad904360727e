"""Print the structure figures of docs/architecture.md for the ampnet on
``sys.path``: ampnet files on the stack at the module's forward, skorch
methods overridden more than once, host reads per training batch, and the
largest module.

    python tools/structure_report.py            # this checkout
    PYTHONPATH=/path/to/other python tools/structure_report.py
"""

import inspect
import os
import sys
import warnings

import torch
from skorch import NeuralNetClassifier

import ampnet
from ampnet import AmpNetClassifier

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import host_reads  # noqa: E402  (the one host-read counter, shared with tests/test_architecture.py)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(20, 16), torch.nn.Linear(16, 2)
        self.files = None

    def forward(self, X):
        if self.training and self.files is None:
            root = os.path.dirname(ampnet.__file__)
            self.files = sorted({os.path.relpath(f.filename, root) for f in inspect.stack(0)
                                 if f.filename.startswith(root)})
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


def reads_per_batch(cls, **kw):
    return host_reads.reads_per_batch(cls, MLP, **kw)


def main():
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    _, net = reads_per_batch(AmpNetClassifier, amp_enabled=True, amp_dtype="bfloat16")
    print("ampnet files at forward (bf16 mixed):", net.module_.files)
    skorch_names = set()
    for klass in NeuralNetClassifier.__mro__:
        if klass.__module__.startswith("skorch"):
            skorch_names.update(k for k, v in vars(klass).items() if callable(v) or isinstance(v, property))
    counts = {}
    for klass in AmpNetClassifier.__mro__:
        if klass.__module__.startswith("ampnet"):
            for name in vars(klass):
                if name in skorch_names:
                    counts[name] = counts.get(name, 0) + 1
    print("skorch methods overridden more than once:", {k: v for k, v in counts.items() if v > 1})
    print("host reads per training batch (SGD):")
    print(f"  skorch               {reads_per_batch(NeuralNetClassifier)[0]:.2f}")
    for label, kw in [("off", {}), ("bf16", dict(amp_dtype="bfloat16")),
                      ("bf16 pure", dict(amp_dtype="bfloat16", amp_level="pure")),
                      ("fp16", dict(amp_dtype="float16")),
                      ("fp16 pure", dict(amp_dtype="float16", amp_level="pure")),
                      ("fp16 accumulate 4", dict(amp_dtype="float16", gradient_accumulation_steps=4))]:
        print(f"  ampnet {label:<13} {reads_per_batch(AmpNetClassifier, amp_enabled=bool(kw), **kw)[0]:.2f}")
    root = os.path.dirname(ampnet.__file__)
    sizes = []
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path) as fh:
                    sizes.append((sum(1 for _ in fh), os.path.relpath(path, root)))
    print("largest modules:", sorted(sizes, reverse=True)[:3])


if __name__ == "__main__":
    main()
