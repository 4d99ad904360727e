"""A matplotlib Figure that shows itself in notebooks (imports matplotlib:
imported by :mod:`ampnet.diagnostics.plotting` only when a plot is drawn)."""

from __future__ import annotations

import io

from matplotlib.figure import Figure

__all__ = ["PngFigure"]


class PngFigure(Figure):
    """A :class:`matplotlib.figure.Figure` that IPython and Jupyter display
    as a PNG when it is a cell's value, with or without ``%matplotlib inline``
    and without pyplot's global figure list."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()
