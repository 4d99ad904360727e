"""``net.memory_report()``: the bytes a net's training state holds now.

Counted are the tensors that live between training steps, by role:
parameters (as the module stores them), gradients (``.grad`` of the
module's parameters and of the float32 masters), float32 master weights,
compensation buffers (``amp_master_weights='compensated'``) and every other
tensor in the optimizers' state (moments, step counters). Activations,
autocast's transient weight casts and the temporaries of a step are not
state and are not counted. A tensor counts ``numel() * element_size()``
bytes; parameters shared by several modules count once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import torch

from ampnet.precision.compensated import KEY

__all__ = ["MemoryReport", "measure_memory"]

_ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("master_weights", "float32 master weights"),
    ("compensation", "compensation buffers"),
    ("optimizer_state", "optimizer state"),
)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of a net's training state, by role (see :meth:`ampnet.AmpNetMixin.memory_report`).

    Attributes
    ----------
    parameters : int
      The module's parameters, in the dtypes they are stored in.

    gradients : int
      Gradients held by the module's parameters and the float32 masters.

    master_weights : int
      Float32 master copies (``amp_level='pure'``, ``amp_master_weights=True``).

    compensation : int
      Compensation buffers (``amp_master_weights='compensated'``).

    optimizer_state : int
      Every other tensor in the optimizers' state.

    precision : str
      The net's precision, e.g. ``'bfloat16 (pure, compensated)'``.
    """

    parameters: int
    gradients: int
    master_weights: int
    compensation: int
    optimizer_state: int
    precision: str

    @property
    def total(self) -> int:
        """The sum of all counted bytes."""
        return self.parameters + self.gradients + self.master_weights + self.compensation + self.optimizer_state

    def to_dict(self) -> dict[str, Any]:
        """The counts (and ``total``) as a plain dict."""
        return {**asdict(self), "total": self.total}

    def __str__(self) -> str:
        rows = [(label, getattr(self, key)) for key, label in _ROWS] + [("total", self.total)]
        width = max(len(label) for label, _ in rows)
        lines = [f"Training state of a {self.precision} net:"]
        for label, value in rows:
            lines.append(f"  {label.ljust(width)}  {value:>14,d} B  {value / 2**20:10.2f} MiB")
        return "\n".join(lines)


def _nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure_memory(
    module: torch.nn.Module | None,
    masters: dict[str, torch.nn.Parameter] | None,
    optimizers: Sequence[torch.optim.Optimizer],
    precision: str,
) -> MemoryReport:
    """Count the training state of a module, its masters and its optimizers."""
    params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    master_list = list((masters or {}).values())
    comp = other = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if key == KEY:
                    comp += _nbytes([value])
                else:
                    other += _nbytes([value])
    return MemoryReport(
        parameters=_nbytes(params),
        gradients=_nbytes(p.grad for p in [*params, *master_list]),
        master_weights=_nbytes(master_list),
        compensation=comp,
        optimizer_state=other,
        precision=precision,
    )
