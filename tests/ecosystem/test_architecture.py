"""The structure the design promises (docs/architecture.md): one override
per skorch method, a short stack at the module's forward, and at most one
device-to-host read per optimizer step on top of skorch's own."""

import inspect
import os

import pytest
import skorch
import torch
from skorch import NeuralNetClassifier

import ampnet
from ampnet import AmpNetClassifier

from conftest import MLP
from host_reads import HOST_READS, HostReadCounter, reads_per_batch



def _skorch_methods():
    names = set()
    for klass in NeuralNetClassifier.__mro__:
        if klass.__module__.startswith("skorch"):
            names.update(k for k, v in vars(klass).items() if callable(v) or isinstance(v, property))
    return names


def test_no_skorch_method_overridden_twice():
    skorch_names = _skorch_methods()
    counts = {}
    for klass in AmpNetClassifier.__mro__:
        if klass.__module__.startswith("ampnet"):
            for name in vars(klass):
                if name in skorch_names:
                    counts[name] = counts.get(name, 0) + 1
    twice = {k: v for k, v in counts.items() if v > 1}
    assert counts, "expected ampnet to override some skorch methods"
    assert twice == {}


class _StackProbe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 2)
        self.files = None

    def forward(self, X):
        if self.training and self.files is None:
            root = os.path.dirname(ampnet.__file__)
            self.files = {
                os.path.relpath(f.filename, root)
                for f in inspect.stack(0)
                if f.filename.startswith(root)
            }
        return torch.softmax(self.lin(X), dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["mixed", "pure"])
def test_stack_at_forward_holds_at_most_two_ampnet_files(classifier_data, level):
    X, y = classifier_data
    net = AmpNetClassifier(_StackProbe, amp_enabled=True, amp_dtype="bfloat16", amp_level=level,
                           max_epochs=1, batch_size=64, train_split=None, verbose=0)
    net.fit(X, y)
    files = net.module_.files
    assert files is not None
    assert len(files) <= 2, sorted(files)


#: One read per fit, on its first training batch: ampnet.training.output_checks (is the output of a
#: classifier with NLLLoss probabilities?), amortized over _reads_per_batch's 2 x 16 batches.
PER_FIT = 1 / 32


def _reads_per_batch(cls, **kwargs):
    return reads_per_batch(cls, MLP, **kwargs)[0]


@pytest.mark.parametrize(
    "settings, steps_per_batch",
    [
        (dict(amp_enabled=False), 1.0),
        (dict(amp_enabled=True, amp_dtype="bfloat16"), 1.0),
        (dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure"), 1.0),
        (dict(amp_enabled=True, amp_dtype="float16"), 1.0),
        (dict(amp_enabled=True, amp_dtype="float16", amp_level="pure"), 1.0),
        (dict(amp_enabled=True, amp_dtype="float16", gradient_accumulation_steps=4), 0.25),
        (dict(amp_enabled=True, amp_dtype="bfloat16", amp_skip_nonfinite=False), 0.0),
        (dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights="compensated"), 1.0),
        (dict(amp_enabled=True, amp_dtype="float16", amp_level="pure", amp_master_weights="compensated"), 1.0),
        (dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights="compensated",
              optimizer=torch.optim.AdamW, optimizer__weight_decay=0.1, gradient_accumulation_steps=2,
              lr=0.005), 0.5),
        (dict(amp_enabled=True, amp_dtype="float16", optimizer=torch.optim.Adam, optimizer__fused=True,
              lr=0.005), 1.0),
        (dict(amp_enabled=True, amp_dtype="float16", amp_level="pure", optimizer=torch.optim.AdamW,
              optimizer__fused=True, lr=0.005), 1.0),
        (dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights="compensated",
              optimizer=torch.optim.AdamW, optimizer__fused=True, lr=0.005), 1.0),
    ],
    ids=["off", "bf16", "bf16-pure", "fp16", "fp16-pure", "fp16-accumulate", "bf16-noguard",
         "bf16-compensated", "fp16-compensated", "bf16-compensated-adamw-accumulate", "fp16-fused-adam",
         "fp16-pure-fused-adamw", "bf16-compensated-fused-adamw"],
)
def test_at_most_one_host_read_per_optimizer_step(settings, steps_per_batch):
    # skorch with the same optimizer (torch's unfused Adam reads its step counters)
    same = {k: v for k, v in settings.items() if k.startswith("optimizer") or k == "lr"}
    baseline = _reads_per_batch(NeuralNetClassifier, **same)
    ours = _reads_per_batch(AmpNetClassifier, **settings)
    assert baseline >= 1.0  # skorch reads the loss once per batch
    assert ours <= baseline + steps_per_batch + PER_FIT + 1e-9, (ours, baseline)


@pytest.mark.parametrize(
    "settings",
    [dict(amp_enabled=True, amp_dtype="float16"),
     dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights=False),
     dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure", amp_master_weights="compensated",
          gradient_accumulation_steps=2)],
    ids=["fp16", "bf16-pure-lost-updates", "bf16-compensated-accumulate"],
)
def test_amp_monitor_keeps_one_host_read_per_step(settings):
    # the flight recorder (grad_norm, lost_updates) reads the device once per epoch
    from ampnet.callbacks import AmpMonitor

    baseline = _reads_per_batch(NeuralNetClassifier)
    steps = 1 / settings.get("gradient_accumulation_steps", 1)
    ours = _reads_per_batch(AmpNetClassifier, callbacks=[AmpMonitor(sink=lambda line: None)], **settings)
    per_epoch = 1 / 16  # 16 batches per epoch
    assert ours <= baseline + steps + per_epoch + PER_FIT + 1e-9, (ours, baseline)


# --- where code lives: imports (parsed with ast, deferred imports inside functions included)

import ast  # noqa: E402

import import_graph  # noqa: E402  (the one reader of the import graph, shared with tools/structure_report.py)
from import_graph import ROOT  # noqa: E402

PACKAGES = ("ampnet", "ampnet_bench")


def _source_files():
    return import_graph.source_files(PACKAGES)


def _imports(name, path):
    return [(module, line) for module, line, _ in import_graph.imports(name, path)]


def test_precision_is_imported_through_its_front_door():
    import ampnet.precision as precision

    outside = []
    for name, path in _source_files():
        if name == "ampnet.precision" or name.startswith("ampnet.precision."):
            continue
        for imported, line in _imports(name, path):
            if imported.startswith("ampnet.precision."):
                outside.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert outside == []
    # the front door lists what it exports, and every listed name exists
    assert len(precision.__all__) == len(set(precision.__all__))
    missing = [n for n in precision.__all__ if not hasattr(precision, n)]
    assert missing == []
    for public in ("Precision", "PrecisionPolicy", "resolve_precision", "GradScaler",
                   "MemoryReport", "PrecisionLayout"):
        assert public in precision.__all__


def test_import_ampnet_in_a_fresh_interpreter():
    import subprocess
    import sys

    # every import of a submodule runs ampnet/__init__ first: one interpreter covers the order
    result = subprocess.run([sys.executable, "-c", "import ampnet_bench.contenders, ampnet.serving.export"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr


def test_cycle_finder_finds_a_cycle():
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_import_reader_sees_deferred_imports_and_skips_type_checking(tmp_path, monkeypatch):
    source = tmp_path / "ampnet" / "mod.py"
    source.parent.mkdir()
    source.write_text(
        "from typing import TYPE_CHECKING\nimport ampnet.a\nif TYPE_CHECKING:\n    import ampnet.b\n"
        "def f():\n    import ampnet.c\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    found = {(m, inside) for m, _, inside in import_graph.imports("ampnet.mod", source)}
    assert ("ampnet.a", False) in found and ("ampnet.c", True) in found
    assert not any(m == "ampnet.b" for m, _ in found)


def test_no_import_circle_in_the_whole_package():
    # imports inside functions count: a circle hidden in a function is still a circle
    graph = import_graph.graph("ampnet")
    assert "ampnet.precision.component" in graph and "ampnet.auto.trial" in graph and "ampnet.net" in graph
    assert import_graph.cycles(graph) == []


def test_every_module_has_a_layer_and_no_lower_layer_imports_a_higher_one():
    graph = import_graph.graph("ampnet")
    for module in graph:
        import_graph.layer(module)  # raises KeyError for a module no layer names
    assert import_graph.back_arrows(graph) == []


def test_precision_imports_nothing_above_it_and_touches_no_net():
    graph = import_graph.graph("ampnet")
    above = {m for m in graph if import_graph.layer(m) > import_graph.layer("ampnet.precision")}
    for module, targets in graph.items():
        if module.startswith("ampnet.precision"):
            assert not targets & above, (module, sorted(targets & above))
    found = []
    for name, path in _source_files():
        if name.startswith("ampnet.precision"):
            text = path.read_text()
            found += [f"{name}: {word}" for word in ("net.__dict__", "vars(net)", "net.module_") if word in text]
    assert found == []


def test_imports_inside_functions_only_for_optional_dependencies():
    # each deferred import names the optional dependency (or the lazily loaded package) on its line
    # or the line before, in a comment
    lines = {}
    unexplained = []
    for module, line, imported in import_graph.function_imports():
        path = next(p for n, p in _source_files() if n == module)
        text = lines.setdefault(path, path.read_text().splitlines())
        window = " ".join(text[max(0, line - 4):line])
        if "#" not in window:
            unexplained.append(f"{module}:{line} imports {imported}")
    assert unexplained == []


def test_the_auto_wing_has_one_door():
    # outside ampnet/auto, ampnet imports only the package itself, never its modules
    outside = []
    for name, path in _source_files():
        if name == "ampnet.auto" or name.startswith("ampnet.auto."):
            continue
        outside += [f"{name}:{line} imports {module}" for module, line in _imports(name, path)
                    if module.startswith("ampnet.auto.")]
    assert outside == []
    import ampnet.auto

    assert callable(ampnet.auto.resolve)


#: skorch's own private names that ampnet's modules above precision may use (its documented
#: extension points: the lists of a net's modules, criteria and optimizers, and init contexts)
SKORCH_PRIVATE = {"_modules", "_criteria", "_optimizers", "_current_init_context", "_format_reinit_msg",
                  "_initialize_optimizer", "_zero_grad_optimizer", "_validate_params", "_params_to_validate",
                  "_trimmed_for_prediction", "_get_module", "_check_device", "_set_training",
                  "_initialize_module", "_get_predict_nonlinearity", "_default_callbacks", "_check_kwargs",
                  "_module_initialized"}


def _private_uses_of_net(prefixes):
    uses = []
    for name, path in _source_files():
        if not name.startswith(prefixes):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "net" and node.attr.startswith("_") and not node.attr.startswith("__")):
                uses.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.attr))
    return uses


def test_the_guard_catches_private_reads_as_well_as_calls(tmp_path):
    tree = ast.parse("net._optimizers\nnet._x()\nnet.public\n")
    found = [n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.attr.startswith("_")]
    assert sorted(found) == ["_optimizers", "_x"]


def test_precision_reads_no_private_attribute_of_a_net():
    assert _private_uses_of_net(("ampnet.precision",)) == []


def test_ampnet_reads_only_skorch_s_private_names_of_a_net():
    # ampnet's own protocol has no private trampolines on the net: what a module
    # needs of another it imports; skorch's private names are its extension points
    ours = [f"{where} net.{attr}" for where, attr in _private_uses_of_net(("ampnet",)) if attr not in SKORCH_PRIVATE]
    assert ours == []
    for gone in ("relayout_precision", "adopt_autotune", "autotune_copy", "precision_params", "_uses_closure"):
        assert not hasattr(AmpNetClassifier, gone), gone


def test_one_constant_lists_the_low_precision_dtypes():
    from ampnet.utils.dtypes import LOW_PRECISION_DTYPES

    assert set(LOW_PRECISION_DTYPES) == {torch.float16, torch.bfloat16}
    low = {"float16", "bfloat16", "half"}
    found = []
    for name, path in _source_files():
        if name == "ampnet.utils.dtypes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
                attrs = {e.attr for e in node.elts if isinstance(e, ast.Attribute)}
                if len(attrs & low) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], "use ampnet.utils.dtypes.LOW_PRECISION_DTYPES"


def test_host_reads_are_counted_in_one_place():
    patches = []
    paths = [p for folder in ("ampnet", "ampnet_bench", "tests", "tools") for p in (ROOT / folder).rglob("*.py")]
    for path in sorted(paths):
        if path.name == "host_reads.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                    and ast.unparse(node.args[0]) == "torch.Tensor"):
                patches.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert patches == [], "count host reads with tests/host_reads.py"
    with HostReadCounter() as counter:
        torch.ones(2).sum().item()
        torch.zeros(3).tolist()
    assert counter.count == 2
    assert torch.Tensor.item is not None and "counted" not in torch.Tensor.item.__name__
    assert set(HOST_READS) >= {"item", "tolist", "cpu", "numpy"}


def test_set_params_of_a_live_scaler_setting_checks_once_and_builds_no_precision(monkeypatch, classifier_data):
    from ampnet.precision import component, scaler, settings

    X, y = classifier_data
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="float16", max_epochs=1, batch_size=64,
                           train_split=None, verbose=0).fit(X[:128], y[:128])
    live = net.grad_scaler_
    builds, checks = [], []
    init = component.Precision.__init__

    def counting_init(self, *args, **kwargs):
        builds.append(1)
        init(self, *args, **kwargs)

    def counting_check(original):
        def check(*args, **kwargs):
            checks.append(kwargs)
            return original(*args, **kwargs)
        return check

    monkeypatch.setattr(component.Precision, "__init__", counting_init)
    import ampnet.config.params as params
    import ampnet.config.reconfigure as reconfigure

    for module in (settings, scaler, params, reconfigure):
        monkeypatch.setattr(module, "validate_scaler_settings", counting_check(module.validate_scaler_settings))
    net.set_params(grad_scaler__growth_factor=4)
    assert len(builds) == 0  # the live scaler changes in place: no new Precision
    assert len(checks) == 1 and checks[0]["growth_factor"] == 4
    # the live scaler changed in place, and the new component holds it
    assert net.grad_scaler_ is live and live.get_settings()["growth_factor"] == 4.0
    assert net.get_params()["grad_scaler__growth_factor"] == 4
    _assert_one_stored_scaler_setting(net, "growth_factor")
    # a bad value is still refused, naming the parameter, and changes nothing:
    # not the parameter, not the component, not the live scaler
    prec = net.precision_
    with pytest.raises(ValueError, match="growth_factor"):
        net.set_params(grad_scaler__growth_factor=0.5)
    assert net.precision_ is prec and net.grad_scaler_ is live
    assert live.get_settings()["growth_factor"] == 4.0 and net.get_params()["grad_scaler__growth_factor"] == 4
    _assert_one_stored_scaler_setting(net, "growth_factor")


def _assert_one_stored_scaler_setting(net, name):
    """The net's parameter is the one stored copy of ``grad_scaler__<name>``:
    the precision component keeps none that could go stale (the live scaler
    holds the running state built from it)."""
    settings = net.precision_.settings
    for field, value in vars(settings).items():
        assert not (isinstance(value, dict) and name in value), f"settings.{field} copies grad_scaler__{name}"
    assert all(not field.startswith("scaler_") for field in vars(settings))


def test_a_rebuilt_scaler_takes_its_settings_from_the_net(classifier_data):
    # a live setting, then one that rebuilds the scaler: the new scaler is
    # built from the net's parameters (no copy of them elsewhere to go stale)
    X, y = classifier_data
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="float16", max_epochs=1, batch_size=64,
                           train_split=None, verbose=0).fit(X[:128], y[:128])
    net.set_params(grad_scaler__growth_factor=4)
    net.set_params(grad_scaler__init_scale=128.0)
    settings = net.grad_scaler_.get_settings()
    assert (settings["growth_factor"], settings["init_scale"]) == (4.0, 128.0)
    assert net.grad_scaler_.get_scale() == 128.0
    net.initialize_grad_scaler()
    assert net.grad_scaler_.get_settings()["growth_factor"] == 4.0
    # torch's own scaler: its setter changes the live one
    net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="float16", max_epochs=1, batch_size=64,
                           train_split=None, verbose=0, grad_scaler=torch.amp.GradScaler).fit(X[:128], y[:128])
    live = net.grad_scaler_
    net.set_params(grad_scaler__growth_factor=3.0)
    assert net.grad_scaler_ is live and live.get_growth_factor() == 3.0
    _assert_one_stored_scaler_setting(net, "growth_factor")
    net.set_params(grad_scaler__init_scale=128.0)  # not settable live: a new scaler
    assert net.grad_scaler_ is not live
    assert (net.grad_scaler_.get_growth_factor(), net.grad_scaler_.get_scale()) == (3.0, 128.0)


def test_the_autos_logic_lives_in_auto():
    """Configuration builds and changes components; switching a net to a choice, what "auto" may choose and
    when a change makes its choice stale are ampnet/auto's (issue 39: about 110 lines of it were in
    config/reconfigure.py). reconfigure.py reads the choice in one place: what 'auto' stands for."""
    import ampnet.auto as auto
    import ampnet.config.reconfigure as reconfigure

    for name in ("apply_choice", "switch_in_fit", "apply_fp32_choice", "choice_problem", "refuse_unswitchable",
                 "_drop_choice_on_new_probe_settings"):
        assert not hasattr(reconfigure, name), name
    from ampnet.auto import stale_choice, switching, unswitchable

    assert callable(switching.apply_choice) and callable(switching.switch_in_fit)
    assert callable(unswitchable.refuse_unswitchable) and auto.check_choosable is unswitchable.check_choosable
    assert auto.drop_stale_choice is stale_choice.drop_stale_choice
    tree = ast.parse(inspect.getsource(reconfigure))
    readers = sorted({fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                      for node in ast.walk(fn) if isinstance(node, ast.Constant) and node.value == "amp_autotune_"})
    assert readers == ["checked_params"]
