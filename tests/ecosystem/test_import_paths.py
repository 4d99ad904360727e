"""Import paths users hold: the public names, the callbacks and checkpoint modules, and the modules that
0.4.0 moved into sub-packages (their old paths give the same objects)."""

import importlib

import pytest

MOVED = {
    "ampnet.step": "ampnet.training.step",
    "ampnet.report": "ampnet.diagnostics.report",
    "ampnet.user_inputs": "ampnet.training.user_inputs",
    "ampnet.random_state": "ampnet.utils.random_state",
    "ampnet.parallel": "ampnet.training.parallel",  # in ampnet 0.3's pickles
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_module_keeps_its_old_path(old, new):
    before, after = importlib.import_module(old), importlib.import_module(new)
    assert before.__all__ == after.__all__ and before.__all__
    for name in after.__all__:
        assert getattr(before, name) is getattr(after, name), name


def test_documented_names_import_from_where_the_docs_say():
    from ampnet import AmpNet, AmpNetClassifier, GradScaler, plot_precision  # noqa: F401
    from ampnet.callbacks import AmpMonitor, Checkpoint, LoadInitState, TrainEndCheckpoint
    from ampnet.checkpoint import Checkpoint as Checkpoint2, LoadInitState as Load2, TrainEndCheckpoint as End2
    from ampnet.exceptions import AmpWarning, DirectoryLockedError  # noqa: F401
    from ampnet.random_state import kept_random_state  # noqa: F401
    from ampnet.step import StepState, train_step  # noqa: F401

    assert (Checkpoint2, Load2, End2) == (Checkpoint, LoadInitState, TrainEndCheckpoint)
    assert AmpMonitor.__module__.startswith("ampnet.callbacks")


def test_the_top_level_holds_the_net_and_its_doors_only():
    # the package's folder list reads as its architecture: sub-packages by subject, and at the top only
    # the net, its command line, the public exceptions and the import paths kept for users
    import pathlib

    import ampnet

    top = sorted(p.stem for p in pathlib.Path(ampnet.__file__).parent.glob("*.py"))
    assert top == sorted(["__init__", "__main__", "net", "exceptions", "checkpoint", *(m.split(".")[1] for m in MOVED)])
