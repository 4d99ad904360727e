"""``ampnet.plot_precision(net)``: the flight record of a fit, drawn.

Needs matplotlib (``pip install ampnet[plot]``). The figure is built with
matplotlib's object API (no pyplot state): a notebook shows it when it is a
cell's value; ``fig.savefig(path)`` saves it.
"""

from __future__ import annotations

import math
from typing import Any

from ampnet.training.step import SKIP_CAUSES

__all__ = ["plot_precision"]

_COLORS = {"overflow": "tab:red", "nonfinite_loss": "tab:orange", "nonfinite_input": "tab:purple"}


def _column(history: Any, key: str) -> list[tuple[int, float]]:
    """(epoch, value) of every epoch that recorded a number under ``key``."""
    out = []
    for row in history:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((row.get("epoch", len(out) + 1), float(value)))
    return out


def plot_precision(net: Any, figsize: tuple[float, float] | None = None) -> Any:
    """Draw a fitted net's precision record: the training (and validation)
    loss, the loss scale per step (log axis; only where the loss is scaled,
    float16 with loss scaling: bfloat16 and float32 have no loss scale),
    skipped steps per epoch by cause and, where recorded (with :class:`ampnet.callbacks.AmpMonitor`),
    the gradient norm and the share of lost updates.

    Parameters
    ----------
    net : AmpNet
      A net with a history (fitted).

    figsize : tuple of float or None (default=None)
      The figure size in inches; by default 11 wide and 2.6 high per panel.

    Returns
    -------
    fig : matplotlib.figure.Figure
      One panel per series, each titled with labelled axes. Non-finite
      losses are left out of the loss panel and counted in its title.

    Raises
    ------
    ImportError
      Without matplotlib.

    ValueError
      A net whose history holds no epoch.
    """
    try:
        # optional dependency: matplotlib (the plot extra)
        from matplotlib.ticker import MaxNLocator

        from ampnet.diagnostics.figure import PngFigure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_precision needs matplotlib. Fix: pip install 'ampnet[plot]' (or matplotlib)."
        ) from exc
    history = getattr(net, "history", None)
    if not history:
        raise ValueError(
            f"plot_precision needs a fitted net; got {type(net).__name__} with no epoch in its "
            "history. Fix: call net.fit(X, y) first."
        )
    panels = ["loss"]
    steps = [(row.get("epoch", 0), b) for row in history for b in row.get("batches", []) if "loss_scale" in b]
    if steps and _has_loss_scale(net, steps):
        panels.append("scale")
    panels.append("skips")
    grad = _column(history, "grad_norm")
    lost = _column(history, "lost_updates")
    if grad:
        panels.append("grad")
    if lost:
        panels.append("lost")
    fig = PngFigure(figsize=figsize or (11.0, 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        if panel != "scale":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs
        if panel == "loss":
            _loss_panel(ax, history)
        elif panel == "scale":
            ax.plot(range(1, len(steps) + 1), [b["loss_scale"] for _, b in steps], drawstyle="steps-post")
            ax.set_yscale("log")
            ax.set(title="Loss scale after each step", xlabel="training batch", ylabel="loss scale")
        elif panel == "skips":
            _skips_panel(ax, history)
        elif panel == "grad":
            ax.plot(*zip(*grad), marker="o")
            ax.set(title="Gradient norm (unscaled, before clipping; mean over applied steps)",
                   xlabel="epoch", ylabel="global L2 norm")
        else:
            ax.plot(*zip(*lost), marker="o", color="tab:brown")
            ax.set_ylim(-0.02, 1.02)
            ax.set(title="Updates lost to rounding (low-precision weights)", xlabel="epoch",
                   ylabel="share of updates")
    return fig


def _has_loss_scale(net: Any, steps: list[tuple[int, dict]]) -> bool:
    """Whether the fit had a loss scale to draw: the net scales its loss
    (float16 with loss scaling), or its record holds a scale other than
    1.0 (an earlier float16 fit of the history). bfloat16 and float32 steps
    record 1.0: a flat line that says nothing."""
    precision = net.__dict__.get("precision_")
    if bool(getattr(precision, "scaling", False)):
        return True
    return any(b.get("loss_scale") not in (None, 1.0) for _, b in steps)


def _loss_panel(ax: Any, history: Any) -> None:
    bad = 0
    for key in ("train_loss", "valid_loss"):
        points = _column(history, key)
        finite = [(e, v) for e, v in points if math.isfinite(v)]
        bad += len(points) - len(finite)
        if finite:
            ax.plot(*zip(*finite), marker="o", label=key)
    title = "Loss"
    if bad:
        title += f" ({bad} non-finite epoch value{'s' if bad > 1 else ''} left out)"
    ax.set(title=title, xlabel="epoch", ylabel="loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")


def _skips_panel(ax: Any, history: Any) -> None:
    epochs = [row.get("epoch", i + 1) for i, row in enumerate(history)]
    bottom = [0] * len(epochs)
    for cause in SKIP_CAUSES:
        counts = [
            sum(1 for b in row.get("batches", []) if b.get("step_skipped") and b.get("skip_cause") == cause)
            for row in history
        ]
        if any(counts):
            ax.bar(epochs, counts, bottom=bottom, label=cause, color=_COLORS[cause])
            bottom = [a + b for a, b in zip(bottom, counts)]
    if not any(bottom):
        ax.text(0.5, 0.5, "no step was skipped", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
    else:
        ax.legend(loc="best", title="cause")
    ax.set(title="Skipped optimizer steps by cause", xlabel="epoch", ylabel="skipped steps")
