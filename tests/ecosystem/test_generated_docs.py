"""The documentation's tables that come from the code agree with it: the
parameter table (ampnet/config/params.py) and the module map of docs/architecture.md.
Regenerate both with ``python tools/docs_tables.py``."""

import inspect
import sys

import pytest

from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import docs_tables  # noqa: E402

from ampnet import AmpNetMixin  # noqa: E402
from ampnet.config.params import PARAMS, constructor_defaults, markdown_table  # noqa: E402


@pytest.mark.parametrize("kind", ["params", "modules"])
def test_generated_parts_of_the_docs_match_the_code(kind):
    assert docs_tables.current(kind) == docs_tables.generated(kind), (
        f"docs out of date: run python tools/docs_tables.py ({kind})")


def test_module_map_lists_every_module():
    text = docs_tables.module_map()
    for name, _ in docs_tables.import_graph.source_files():
        assert f"`{name}`" in text


def test_constructor_defaults_are_the_table_s():
    signature = inspect.signature(AmpNetMixin.__init__).parameters
    for name, default in constructor_defaults().items():
        assert name in signature, name
        assert signature[name].default is default or signature[name].default == default, name
    amp_like = [n for n in signature if n.startswith("amp_")]
    assert set(amp_like) <= set(PARAMS)


def test_params_table_has_a_row_per_parameter():
    table = markdown_table()
    for name in PARAMS:
        assert f"`{name}`" in table
