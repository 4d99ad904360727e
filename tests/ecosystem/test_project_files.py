"""The project's own files: what the READMEs reference exists in the
repository, every test file the docs and tools name exists, the version has one source, running the notebooks as their
README says leaves the work tree clean."""

import re

import pytest

from repo_paths import ROOT

READMES = [ROOT / "README.md", ROOT / "notebooks" / "README.md"]


def _references(text):
    """Markdown link targets and backticked paths to files."""
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    paths = re.findall(r"`([^`\s]+/[^`\s]+\.(?:md|ipynb|py|toml|txt|cfg|yml|yaml))`", text)
    return [t.split("#")[0] for t in links if not re.match(r"[a-z]+:|#", t)], paths


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_references_files_in_the_repository(readme):
    links, paths = _references(readme.read_text(encoding="utf-8"))
    for target in links:  # relative to the README, as a browser or GitHub resolves them
        path = (readme.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{readme.name} links {target}, outside the repository"
        assert path.exists(), f"{readme.name} links {target}, which does not exist"
    for target in paths:  # written relative to the repository's root (or the README)
        found = [p for p in (ROOT / target, readme.parent / target) if p.resolve().exists()]
        assert found and all(p.resolve().is_relative_to(ROOT) for p in found), (
            f"{readme.name} names {target}, which is not in the repository")


def _test_paths_named():
    """(file, path) for every ``tests/....py`` that the docs, the READMEs, the tools and
    pyproject.toml name (``docs/_data`` holds dated reports: their paths are as they were)."""
    sources = [ROOT / "README.md", ROOT / "notebooks" / "README.md", ROOT / "pyproject.toml"]
    sources += [p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".txt", ".py")
                and "_data" not in p.parts and "_build" not in p.parts]
    sources += sorted((ROOT / "tools").rglob("*.py")) + sorted((ROOT / "ampnet_bench").rglob("*.py"))
    for source in sources:
        for path in re.findall(r"(?<![\w/])tests/[\w/]+\.py", source.read_text(encoding="utf-8")):
            yield source.relative_to(ROOT), path


def test_every_test_file_the_docs_and_tools_name_exists():
    named = list(_test_paths_named())
    assert any(path == "tests/ecosystem/test_docs.py" for _, path in named)
    missing = [f"{source}: {path}" for source, path in named if not (ROOT / path).is_file()]
    assert missing == []


def _pyproject():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_has_one_source_ampnet_init():
    import ampnet

    config = _pyproject()
    assert "version" not in config["project"]  # no second copy to forget
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ampnet.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", ampnet.__version__)
    assert tuple(map(int, ampnet.__version__.split("."))) >= (0, 3, 0)  # not the 0.1.0 it once said


def test_setuptools_builds_the_version_from_ampnet_init(tmp_path):
    """What pip installs: setuptools resolves the dynamic version statically."""
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")
    import ampnet

    config = pyprojecttoml.read_configuration(ROOT / "pyproject.toml", expand=True)
    assert config["project"]["version"] == ampnet.__version__
