"""Where things are, for the tests in any sub-folder of ``tests/``: the repository's root, the
``tests/`` folder (its shared helpers: ``conftest.py``, ``resume_script.py``, ``dist_worker.py``,
...) and the files of older versions (``tests/data``)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
