"""The documentation site (docs/): its pages exist and are linked, every public name of ampnet is in
the API reference, and the Python code on the pages runs as written.

The site's own build (``python -m sphinx -W docs docs/_build/html``, run by ``.ci/run``) checks the
rest: broken references, docstring format, and the notebooks, which it executes.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest
import skorch

import ampnet
from ampnet.io.persistence import PersistenceMixin
from ampnet.serving.conversion import ConversionMixin
from repo_paths import ROOT

DOCS = ROOT / "docs"

USER_GUIDE = [
    "precision", "loss_scaling", "training_step", "checkpoints", "trust_model", "distributed", "serving",
    "debugging", "performance", "faq", "skorch_differences",
]
PAGES = ["index", "getting_started", "api", "development", "architecture", "examples/index",
         "user_guide/index"] + [f"user_guide/{name}" for name in USER_GUIDE]

#: The public names: each module's ``__all__``, or the names of it that users meet (the objects public
#: methods return, the training step). Any other module of ampnet is internal.
PUBLIC = {
    "ampnet": list(ampnet.__all__),
    "ampnet.callbacks": importlib.import_module("ampnet.callbacks").__all__,
    "ampnet.checkpoint": importlib.import_module("ampnet.checkpoint").__all__,
    "ampnet.exceptions": importlib.import_module("ampnet.exceptions").__all__,
    "ampnet.diagnostics.report": ["PrecisionReport", "ModuleReport"],
    "ampnet.precision.memory": ["MemoryReport"],
    "ampnet.precision.plan": ["PrecisionLayout"],
    "ampnet.auto": ["AutotuneResult"],
    "ampnet.training.step": ["train_step", "StepState"],
    "ampnet.benchmark": ["main"],
}

#: Pages whose ```python blocks run, in page order, after the prelude of getting_started.md.
RUN_PAGES = ["index", "getting_started"] + [f"user_guide/{name}" for name in USER_GUIDE]

DIRECTIVE = re.compile(r"^% docs-test: (?P<kind>skip|requires|prelude)\b ?(?P<arg>.*)$")


def read(page: str) -> str:
    return (DOCS / f"{page}.md").read_text(encoding="utf-8")


def code_blocks(page: str) -> list[tuple[int, str, str, str]]:
    """The page's ```python blocks: (line number, code, directive kind, directive argument); the
    directive is a ``% docs-test: ...`` MyST comment on the line before the block."""
    lines = read(page).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            match = DIRECTIVE.match(lines[i - 1]) if i else None
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 1, "\n".join(lines[i + 1:end]),
                           match["kind"] if match else "", match["arg"].strip() if match else ""))
            i = end
        i += 1
    return blocks


def prelude() -> str:
    preludes = [code for _, code, kind, _ in code_blocks("getting_started") if kind == "prelude"]
    assert len(preludes) == 1, "getting_started.md has one block marked '% docs-test: prelude'"
    return preludes[0]


# ---- pages -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
def test_page_exists_with_a_title(page):
    text = read(page)
    assert text.startswith("# "), f"{page}.md starts with its title"


def test_every_user_guide_page_is_in_the_user_guide_menu():
    menu = read("user_guide/index")
    for name in USER_GUIDE:
        assert re.search(rf"^{name}$", menu, re.M), name
    listed = sorted(p.stem for p in (DOCS / "user_guide").glob("*.md") if p.stem != "index")
    assert listed == sorted(USER_GUIDE)


def test_every_notebook_is_an_example_page():
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    examples = DOCS / "examples"
    for name in notebooks:
        link = examples / name
        assert link.is_symlink() and link.resolve() == (ROOT / "notebooks" / name).resolve(), name
        assert re.search(rf"^{Path(name).stem}$", read("examples/index"), re.M), name


def test_build_command_and_footprint_are_documented():
    dev = read("development")
    assert "python -m sphinx -W docs docs/_build/html" in dev
    for heavy in ("Jupyter", "TensorBoard", "Dask", "ONNX"):
        assert re.search(rf"^\| {heavy}.* \| [\d,]+ MB \|$", dev, re.M), heavy


def test_the_benchmark_figure_draws_the_performance_tables():
    figure = load_tool("benchmark_figure")
    data = json.loads(figure.DATA.read_text(encoding="utf-8"))
    assert figure.read_tables()["workloads"] == data["workloads"]
    assert figure.PNG.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "../_static/benchmark.png" in read("user_guide/performance")


# ---- API reference -----------------------------------------------------------------------------------

def documented_names() -> set[str]:
    """Qualified names that api.md's autodoc directives document."""
    names, current = set(), ""
    for line in read("api").splitlines():
        if m := re.match(r"^\.\. currentmodule:: (\S+)", line):
            current = m[1]
        elif m := re.match(r"^\.\. (?:auto(?:class|function|exception|data|attribute)|py:class):: ([\w.]+)", line):
            names.add(m[1] if "." in m[1] else f"{current}.{m[1]}")
    return names


def autodoc_texts() -> list[str]:
    """The docstrings that api.md's autodoc directives render (not those of manual ``py:class`` entries)."""
    texts, current = [], ""
    for line in read("api").splitlines():
        if m := re.match(r"^\.\. currentmodule:: (\S+)", line):
            current = m[1]
        elif m := re.match(r"^\.\. auto(?:class|function|exception):: (\S+)", line):
            qualified = m[1] if "." in m[1] else f"{current}.{m[1]}"
            module, name = qualified.rsplit(".", 1)
            texts.append(inspect.getdoc(getattr(importlib.import_module(module), name)) or "")
    return texts


NETS = (ampnet.AmpNet, ampnet.AmpNetClassifier, ampnet.AmpNetRegressor, ampnet.AmpNetBinaryClassifier)


@pytest.mark.parametrize("cls", NETS, ids=lambda c: c.__name__)
def test_help_shows_the_amp_parameters_first(cls):
    """help(AmpNetClassifier) showed amp_enabled at line 225, after skorch's text."""
    import pydoc

    lines = pydoc.render_doc(cls, renderer=pydoc.plaintext).splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(r"\bamp_enabled : ", line))
    assert first < 40, first
    skorch_param = next(i for i, line in enumerate(lines) if re.search(r"\bmodule : torch module", line))
    assert first < skorch_param  # ampnet's parameters, then skorch's
    doc = cls.__doc__
    for marker in ("Parameters\n    ----------", "Attributes\n    ----------"):
        assert doc.count(marker) == 1, marker  # one numpydoc section each (a second is an error)


def test_the_api_page_has_skorchs_text_once():
    """The API page rendered the docstring of skorch's net four times, once per ampnet net."""
    texts = autodoc_texts()
    skorch_sentence = "In addition to the parameters listed"  # the start of skorch's introduction
    assert sum(t.count(skorch_sentence) for t in texts) == 1
    assert sum(t.count("torch_load_kwargs : ") for t in texts) == 1  # skorch's last parameter
    assert sum(t.count("amp_enabled : ") for t in texts) == 1
    # the other three nets are still listed, by name
    assert {"ampnet.AmpNet", "ampnet.AmpNetRegressor", "ampnet.AmpNetBinaryClassifier"} <= documented_names()


def test_every_public_name_is_in_the_api_reference():
    documented = documented_names()
    objects = {id(getattr(importlib.import_module(q.rsplit(".", 1)[0]), q.rsplit(".", 1)[1])) for q in documented}
    text = read("api")
    missing = []
    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        for name in names:
            qualified = f"{module}.{name}"
            if qualified in documented:
                continue
            # a re-export: the object is documented under its other name, and the page names this one
            if id(getattr(mod, name)) in objects and f"`{qualified}`" in text:
                continue
            if name == "__version__" and "`ampnet.__version__`" in text:
                continue
            missing.append(qualified)
    assert not missing, f"public names missing from docs/api.md: {missing}"


def test_documented_objects_have_docstrings():
    for qualified in documented_names():
        module, name = qualified.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), name)
        assert inspect.getdoc(obj), qualified


def test_every_public_method_of_the_nets_has_a_docstring():
    """autodoc shows the members of AmpNetMixin that have a docstring; skorch's own methods that
    ampnet overrides are documented by skorch."""
    undocumented = []
    for cls in (ampnet.AmpNetMixin, PersistenceMixin, ConversionMixin):
        for name, member in vars(cls).items():
            if name.startswith("_") or hasattr(skorch.NeuralNet, name):
                continue
            if not inspect.getdoc(member):
                undocumented.append(f"{cls.__name__}.{name}")
    assert not undocumented, undocumented


def test_every_amp_parameter_is_in_the_nets_docstrings():
    params = [p for p in inspect.signature(ampnet.AmpNetMixin.__init__).parameters
              if p not in ("self", "args", "kwargs")]
    assert "amp_enabled" in params
    for cls in (ampnet.AmpNet, ampnet.AmpNetClassifier, ampnet.AmpNetRegressor, ampnet.AmpNetBinaryClassifier):
        for p in params:
            assert re.search(rf"^\s*{p} : ", cls.__doc__, re.M), (cls.__name__, p)


# ---- the code on the pages runs ------------------------------------------------------------------------

def test_directives_are_well_formed():
    for page in RUN_PAGES:
        for line in read(page).splitlines():
            if line.startswith("% docs-test"):
                m = DIRECTIVE.match(line)
                assert m, f"{page}.md: {line!r}"
                if m["kind"] == "skip":
                    # a block that cannot run here names the test that runs what it shows
                    tests = re.findall(r"tests/[\w/]+\.py", m["arg"])
                    assert tests and all((ROOT / t).exists() for t in tests), f"{page}.md: {line!r}"
        for _, _, kind, _ in code_blocks(page):
            assert kind != "prelude" or page == "getting_started"


@pytest.mark.parametrize("page", [p for p in RUN_PAGES if code_blocks(p)])
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write checkpoints and model files
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the page runs as a module of its own, so that the classes it defines pickle (deepcopy, clone)
    module = types.ModuleType("ampnet_docs_page")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(prelude(), "docs/getting_started.md:prelude", "exec"), module.__dict__)
    for lineno, code, kind, arg in code_blocks(page):
        if kind in ("prelude", "skip"):
            continue
        if kind == "requires":
            for package in arg.split():
                pytest.importorskip(package)
        exec(compile(code, f"docs/{page}.md:{lineno}", "exec"), module.__dict__)


def test_python_code_outside_the_run_pages_is_marked():
    """Every ```python block of the site runs, or says why not."""
    for page in set(PAGES) - set(RUN_PAGES):
        for lineno, _, kind, _ in code_blocks(page):
            assert kind == "skip", f"docs/{page}.md:{lineno} runs nowhere; add the page to RUN_PAGES"


# ---- the README and the site ----------------------------------------------------------------------------

def load_tool(name: str):
    qualified = f"ampnet_tools_{name}"
    if qualified not in sys.modules:  # dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location(qualified, ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


def test_every_readme_section_has_a_home_in_the_docs():
    """What the README says the site says too, so that the short README loses nothing;
    tools/readme_in_docs.py lists what is missing."""
    report, missing = load_tool("readme_in_docs").check(ROOT / "README.md")
    assert missing == 0, [(e["section"], e["missing"]) for e in report if e["missing"]]
    assert len(report) > 3


def test_readme_in_docs_finds_a_sentence_that_no_page_holds(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n## Quickstart\n\nEverything skorch does keeps working: callbacks, `partial_fit`, `warm_start`.\n\n"
        "## New\n\nThis sentence about a flux capacitor is on no page of the site.\n\n"
        "## Links\n\n<!-- readme-only -->\n\nSee [the site](docs/index.md) for a sentence that no page has.\n",
        encoding="utf-8")
    report, missing = load_tool("readme_in_docs").check(readme)
    assert missing == 1
    by_title = {e["section"]: e for e in report}
    assert by_title["Quickstart"]["home"] == "getting_started.md" and not by_title["Quickstart"]["missing"]
    assert by_title["New"]["missing"] == ["this sentence about a flux capacitor is on no page of the site"]
    assert by_title["Links"]["home"] == "(README only)"


def test_readme_is_short_and_puts_the_cpu_install_first():
    """The README holds what a visitor needs first, the CPU-only install before the two commands;
    the rest is on the site."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    cpu = text.index("download.pytorch.org/whl/cpu")
    install = text.index('python -m pip install -e ".[dev]" && python -m ampnet')
    assert cpu < install < text.index("python -m pytest")
    assert "python -m sphinx -W docs docs/_build/html" in text
    # the performance section shows this release's table, measured on the machine it names
    assert "| workload | 1 epoch | 3 epochs | 10 epochs |" in text and "AMD EPYC" in text
    assert "| Scale bounds, hysteresis, static mode |" in text
    for link in re.findall(r"\]\(((?:docs|notebooks)/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_extras_for_tests_and_docs():
    """The lean ``test`` extra is part of ``dev`` (which runs every test); ``docs`` builds the site."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert set(extras["test"]) <= set(extras["dev"])
    for heavy in ("tensorboard", "nbconvert", "ampnet[onnx,dask]"):
        assert heavy in extras["dev"] and heavy not in extras["test"]
    assert {"sphinx>=7", "myst-nb>=1.1", "numpydoc>=1.6", "furo"} <= set(extras["docs"])


@pytest.mark.parametrize("page", ["README", "index"])
def test_the_comparison_table_is_text(page):
    """Without an emoji font, check marks and crosses render as empty boxes: the table says yes/no/partly."""
    import unicodedata

    text = (ROOT / "README.md").read_text(encoding="utf-8") if page == "README" else read("index")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "Keras" not in line]
    table = [r for r in rows if "hysteresis" in r or "LBFGS" in r or "set_params" in r]
    assert len(table) >= 3, "the comparison table was not found"
    symbols = sorted({ch for r in rows for ch in r if unicodedata.category(ch) == "So"})
    assert not symbols, symbols
    cells = [c.strip() for r in table for c in r.split("|")[2:-1]]
    assert all(c.split(" ")[0] in ("yes", "no", "partly", "n/a") for c in cells), cells


# ---- what a new user tripped on (issue 38, item 19) ---------------------------------------------------


@pytest.mark.parametrize("path", ["README.md", "docs/getting_started.md"])
def test_the_quickstarts_auto_example_says_when_it_measures_and_when_pinning_is_bitwise(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    block = text[text.index("## Quickstart"):]
    block = block[:block.index("```\n", block.index("```python") + 1)]
    comments = " ".join(line.split("#", 1)[1].strip() for line in block.splitlines() if "  # " in line)
    # the example's fit may be short: the comment says a fit measures only with 64 steps or more
    assert "measured in the fit's first steps when the fit has 64 steps or more" in comments
    assert "trains bitwise the same" not in comments.replace("when it trains bitwise the same", "")
    # and the text says when the pinned net trains bitwise the same
    assert "with the same seed, trains bitwise like the pinned net" in " ".join(text.split())
    assert "(a fit that measured does not: its first steps alternate between the two precisions)" in " ".join(text.split())


def test_the_quickstarts_auto_example_measures(tmp_path, monkeypatch):
    """The getting-started quickstart's ``"auto"`` fit is long enough to measure (a new user ran it and it
    never did: 40 steps), and it says what it measured."""
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("ampnet_docs_page")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(prelude(), "docs/getting_started.md:prelude", "exec"), module.__dict__)
    lineno, code = next((n, c) for n, c, _, _ in code_blocks("getting_started") if 'amp_enabled="auto"' in c)
    exec(compile(code, f"docs/getting_started.md:{lineno}", "exec"), module.__dict__)
    result = module.net.amp_autotune_
    assert result.source == "measured" and "timed pairs" in result.note
    assert len(module.net.history) * len(module.net.history[-1]["batches"]) >= 64


@pytest.mark.parametrize("page", ["index", "user_guide/performance"])
def test_the_top_figure_names_its_machine(page):
    alt = next(line for line in read(page).splitlines() if line.startswith(":alt: Epoch time per contender"))
    assert "2-core Intel Xeon with AVX512-BF16 and AMX" in alt and "0.3" in alt
    tool = load_tool("benchmark_figure")
    assert "2-core Intel Xeon\nwith AVX512-BF16 and AMX" in tool.TITLE  # the figure's own title


def test_the_index_figure_claim_names_its_machine():
    text = " ".join(read("index").split())
    assert "1.45x faster than the fastest peer (0.3, on a 2-core Intel Xeon with AVX512-BF16 and AMX" in text


def test_the_no_bf16_chart_is_captioned_with_what_its_labels_omit():
    text = " ".join(read("user_guide/performance").split())
    chart = text[text.index("benchmark-no-bf16.png"):]
    assert "**no native bf16**" in chart[:900] and "`ampnet-auto` is `amp_enabled=\"auto\"` as **0.3's probe**" in chart
    assert "0.3's probe (labelled ampnet-auto)" in chart[:400]  # the alt text


def test_the_every_workload_label_and_its_machine_line_agree():
    text = read("user_guide/performance")
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("## Every workload"))
    label = lines[at]
    machine = next(line for line in lines[at:] if line.startswith("Measured on Intel(R) Xeon(R)"))  # its section's
    assert "commit ee93853" in label and "(commit ee93853)" in machine and "ampnet 0.3.0" in machine
    assert 'The line above says "ampnet 0.3.0" because that was the version string the code still carried' in text
