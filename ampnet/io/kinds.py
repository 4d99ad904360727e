"""The kinds of file a checkpoint holds, in one table: their default names,
whether a checkpoint may lack them, and the most bytes a load reads from
each (see :mod:`ampnet.io.reading`).

``save_params``, ``load_params``, ``Checkpoint`` and ``TrainEndCheckpoint``
spell the ``f_*`` arguments out in their signatures (for help and
``get_params``); everything else that lists the kinds uses this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "FileKind", "KINDS", "OPTIONAL_FILES", "TENSOR_FILE_MAX_BYTES", "JOURNAL_MAX_BYTES",
    "LOCK_MAX_BYTES", "max_bytes", "MiB",
]

MiB = 1 << 20

#: Parameter, optimizer and criterion files (and any other ``f_<name>``):
#: tensors of any size, so the limit only rules out the absurd.
TENSOR_FILE_MAX_BYTES = 1 << 40

#: A journal lists a few renames.
JOURNAL_MAX_BYTES = 1 * MiB

#: A lock file holds a process id, a host name and a token.
LOCK_MAX_BYTES = 4096


@dataclass(frozen=True)
class FileKind:
    """One kind of checkpoint file.

    Parameters
    ----------
    key : str
      The argument that names it (``'f_params'``).

    default : str
      Its name in a ``Checkpoint`` folder.

    max_bytes : int
      The most bytes a load reads from it; a larger file is refused.

    optional : bool
      Whether a checkpoint may lack it (an older checkpoint, or skorch's
      ``Checkpoint``): it is then skipped with an ``AmpWarning``.

    consequence : str
      For optional kinds: what a load without the file loses.
    """

    key: str
    default: str
    max_bytes: int
    optional: bool = False
    consequence: str = ""


#: Every kind, in the order of the ``f_*`` arguments.
KINDS: "MappingProxyType[str, FileKind]" = MappingProxyType({
    kind.key: kind
    for kind in (
        FileKind("f_params", "params.pt", TENSOR_FILE_MAX_BYTES),
        FileKind("f_optimizer", "optimizer.pt", TENSOR_FILE_MAX_BYTES),
        FileKind("f_criterion", "criterion.pt", TENSOR_FILE_MAX_BYTES),
        FileKind("f_history", "history.json", 256 * MiB),
        FileKind(
            "f_grad_scaler", "grad_scaler.pt", 1 * MiB, optional=True,
            consequence="the loss scale restarts from grad_scaler__init_scale",
        ),
        FileKind(
            "f_rng_state", "rng_state.pt", 16 * MiB, optional=True,
            consequence="random numbers (shuffling, dropout) will differ from an "
            "uninterrupted run",
        ),
        FileKind(
            "f_lr_schedulers", "lr_schedulers.json", 16 * MiB, optional=True,
            consequence="skorch rebuilds the learning-rate schedulers from the history, "
            "which is not exact",
        ),
    )
})

#: Checkpoint files that older checkpoints lack; they load with a warning.
OPTIONAL_FILES = tuple(key for key, kind in KINDS.items() if kind.optional)


def max_bytes(key: str) -> int:
    """The most bytes a load reads from the file of ``key`` (any other
    ``f_<name>`` holds a state dict, as a parameter file does)."""
    kind = KINDS.get(key)
    return kind.max_bytes if kind is not None else TENSOR_FILE_MAX_BYTES
