"""Print the structure figures of docs/architecture.md for the ampnet on
``sys.path``: import circles and arrows from a lower layer to a higher one
(tests/import_graph.py), the walks of ``set_params(grad_scaler__growth_factor=4)``
on a fitted float16 net and of a whole ``amp_enabled='auto'`` fit (ampnet files
entered, ``Precision`` objects built, parameter checks, traced with
``sys.setprofile``), lists of parameter names in the code, ampnet files on the
stack at the module's forward, skorch methods overridden more than once, host
reads per training batch, the largest modules, the longest functions, the
package's top level and the size of ``io/``, and the re-entries into
``reconfigure.py`` while it is on the stack (configuration that climbs back
up through skorch) during ``initialize()`` and ``set_params``, the paths
that rebuild the optimizers included (``amp_level='pure'``, ``amp_enabled``
off and on).

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
import host_reads  # noqa: E402  (the one host-read counter, shared with tests/ecosystem/test_architecture.py)
import import_graph  # noqa: E402  (the one import-graph reader, shared with tests/ecosystem/test_architecture.py)

import ast  # noqa: E402

import numpy as np  # noqa: E402

try:
    from ampnet.config.params import PARAMS  # noqa: E402
except ImportError:  # ampnet before its sub-packages (0.4.0's layout)
    from ampnet.params import PARAMS  # noqa: E402


def trace(fn):
    """Run ``fn()`` under ``sys.setprofile``: the ampnet files entered, the
    ``Precision`` objects built and the parameter checks run (rows of the
    parameter table and ``validate_scaler_settings`` calls)."""
    root = os.path.dirname(ampnet.__file__)
    files, built, checks = set(), [0], [0]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(root):
            files.add(os.path.relpath(code.co_filename, root))
            if code.co_name == "__init__" and code.co_filename.endswith(os.path.join("precision", "component.py")) \
                    and any(c.__name__ == "Precision" for c in type(frame.f_locals.get("self")).__mro__):
                built[0] += 1
            if code.co_name == "check" and code.co_filename.endswith("params.py") and frame.f_back \
                    and frame.f_back.f_code.co_filename.endswith("params.py") is False:
                checks[0] += 1
            if code.co_name == "validate_scaler_settings":
                checks[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(files), built[0], checks[0]


def bounces(fn):
    """Run ``fn()`` and count, for ``reconfigure.py`` and ``params.py``, the
    entries into the file from another file (visits), and the re-entries
    into ``reconfigure.py`` while a frame of it is already on the stack
    (configuration that climbs back up: reconfigure -> skorch -> net ->
    reconfigure)."""
    visits = {"reconfigure.py": 0, "params.py": 0, "re-entries": 0}

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        name = os.path.basename(frame.f_code.co_filename)
        caller = frame.f_back.f_code.co_filename
        if name not in visits or os.path.basename(caller) == name or "ampnet" not in frame.f_code.co_filename:
            return
        visits[name] += 1
        below = frame.f_back
        while name == "reconfigure.py" and below is not None:
            if below.f_code.co_filename.endswith("reconfigure.py"):
                visits["re-entries"] += 1
                break
            below = below.f_back

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return visits


#: The configuration paths whose re-entries are counted: (label, the fitted net's settings, the change).
#: amp_level='pure' and amp_enabled=False rebuild the optimizers (new parameters, another kernel).
REENTRY_PATHS = (
    ("initialize()", dict(amp_enabled=True, amp_dtype="float16"), None),
    ("set_params(amp_dtype='bfloat16')", dict(amp_enabled=True, amp_dtype="float16"), dict(amp_dtype="bfloat16")),
    ("set_params(amp_level='pure')", dict(amp_enabled=True, amp_dtype="bfloat16"), dict(amp_level="pure")),
    ("set_params(amp_enabled=False)", dict(amp_enabled=True, amp_dtype="bfloat16"), dict(amp_enabled=False)),
    ("set_params(amp_enabled=True)", dict(amp_enabled=False), dict(amp_enabled=True, amp_dtype="bfloat16")),
)


def reentries(X, y, paths=REENTRY_PATHS):
    """(label, re-entries into ``reconfigure.py``) of each of ``paths``
    on a net fitted for one epoch (:func:`bounces`)."""
    out = []
    for label, settings, change in paths:
        net = AmpNetClassifier(MLP, max_epochs=1, batch_size=64, train_split=None, verbose=0,
                               **settings).fit(X, y)
        walk = (lambda: net.initialize()) if change is None else (lambda: net.set_params(**change))
        out.append((label, bounces(walk)["re-entries"]))
    return out


def walks():
    rng = np.random.RandomState(0)
    X = rng.randn(128, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="float16", max_epochs=1, batch_size=64,
                           train_split=None, verbose=0).fit(X, y)
    files, built, checks = trace(lambda: net.set_params(grad_scaler__growth_factor=4))
    print(f"set_params(grad_scaler__growth_factor=4), fitted fp16 net: {len(files)} ampnet files entered "
          f"{files}, {built} Precision built, {checks} parameter checks")
    print("re-entries into reconfigure.py while it is on the stack (climbs back up):",
          " / ".join(f"{label} {n}" for label, n in reentries(X, y)))
    # auto's walks: a fit that measures in its own steps, and the next one, which reads the stored choice
    # (ampnet 0.4's probe, for comparison with older checkouts: amp_autotune__budget=None made it measure)
    import tempfile

    os.environ["AMPNET_CACHE_DIR"] = tempfile.mkdtemp()
    measure = ({"amp_autotune__budget": None} if "amp_autotune__budget" in PARAMS
               else {"amp_autotune__min_steps": 0} if "amp_autotune__min_steps" in PARAMS else {})
    for run in ("measures", "reads the cache"):
        auto = AmpNetClassifier(MLP, amp_enabled="auto", max_epochs=1, batch_size=16, train_split=None, verbose=0,
                                **measure)
        files, built, checks = trace(lambda: auto.fit(X, y))
        print(f"amp_enabled='auto' fit of a tiny MLP (one epoch of 8 steps, {run}): {len(files)} "
              f"ampnet files entered, {built} Precision built")


def parameter_lists():
    """Literal tuples, lists and sets of two or more AMP parameter names in ampnet's code."""
    names = {n for n in PARAMS if "__" not in n}
    found = []
    for module, path in import_graph.source_files():
        if module.endswith(".params"):  # the table itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(values) >= 2 and sum(v in names for v in values) >= 2:
                    found.append(f"{module}:{node.lineno}")
    return found


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
    graph = import_graph.graph()
    print("import circles in ampnet/:", len(import_graph.cycles(graph)), import_graph.cycles(graph))
    print("arrows from a lower layer to a higher one:", len(import_graph.back_arrows(graph)),
          import_graph.back_arrows(graph))
    print("imports inside functions:", len(import_graph.function_imports()))
    lists = parameter_lists()
    print("literal lists of AMP parameter names (the table aside):", len(lists), lists)
    walks()
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
    print("longest functions (body lines after the docstring):", longest_functions(root)[:6])
    top = sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py"))
    packages = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "__init__.py")))
    print(f"top level: {len(top)} modules {top}, {len(packages)} sub-packages {packages}")
    io_sizes = [(n, p) for n, p in sizes if p.startswith("io" + os.sep)]
    print(f"io/: {len(io_sizes)} files, {sum(n for n, _ in io_sizes)} lines")


def longest_functions(root):
    """(lines, 'file:function') of every function in ampnet, longest first:
    the lines of its body after the docstring."""
    found = []
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 \
                            else node.body
                        found.append((node.end_lineno - body[0].lineno + 1,
                                      f"{os.path.relpath(path, root)}:{node.name}"))
    return sorted(found, reverse=True)


if __name__ == "__main__":
    main()
