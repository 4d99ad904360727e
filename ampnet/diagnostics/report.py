"""``net.precision_report(X, y)``: per-module dtypes, ranges and underflow.

One forward and backward pass on a batch, recorded with temporary hooks;
every change it makes to the net is undone. See
:meth:`ampnet.serving.conversion.ConversionMixin.precision_report`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch
from skorch.dataset import unpack_data

from ampnet.utils.tree import iter_tensors
from ampnet.precision import dtype_name, is_inside, module_root

__all__ = ["PrecisionReport", "ModuleReport", "build_report", "NEAR_OVERFLOW", "UNDERFLOW_FLAG"]

#: A value above ``dtype_max * NEAR_OVERFLOW`` is flagged ``near-overflow``.
NEAR_OVERFLOW = 1 / 8

#: An underflow share at or above this is flagged ``underflow``.
UNDERFLOW_FLAG = 0.01

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def _short(dtype: torch.dtype) -> str:
    name = dtype_name(dtype)
    return _SHORT.get(name, name)


@dataclass
class ModuleReport:
    """What one module saw in the report's forward and backward pass.

    ``grad_dtypes`` are the dtypes of the gradients of the module's
    outputs, ``param_grad_dtypes`` those of its own parameters' gradients.
    ``max_abs_grad`` covers both and is unscaled; ``underflow_share`` is the
    share of the nonzero gradient values (times the loss scale, as in
    training) whose magnitude is so small that they round to zero in the
    target dtype.
    """

    module: str
    type: str
    param_dtypes: list[str] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    grad_dtypes: list[str] = field(default_factory=list)
    param_grad_dtypes: list[str] = field(default_factory=list)
    max_abs_input: float = 0.0
    max_abs_activation: float = 0.0
    max_abs_grad: float = 0.0
    dtype_max: float = 0.0
    underflow_share: float = 0.0
    flags: list[str] = field(default_factory=list)
    recommended: bool = False
    calls: int = 0
    _nonzero: int = 0
    _underflow: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


@dataclass
class PrecisionReport:
    """The result of :meth:`ampnet.AmpNetMixin.precision_report`.

    Attributes
    ----------
    rows : list of ModuleReport
      One row per module, in ``named_modules()`` order (the root is ``''``).

    target_dtype : str
      The dtype whose range and underflow threshold were applied.

    dtype_max : float
      The largest finite value of the target dtype.

    net_precision : str
      How the net computed the pass, e.g. ``'bfloat16 (mixed)'``.

    loss_scale : float
      The loss scale applied to the backward pass (1.0 without scaling).

    recommended_fp32_modules : list of str
      The deepest modules outside existing float32 regions whose output
      comes near or over the target's finite range while their inputs do
      not (where an overflow starts); when no activation does so, the
      deepest modules whose finite gradients do. An overflowing activation
      makes the backward pass non-finite, so non-finite gradients alone are
      flagged but not recommended.
    """

    rows: list[ModuleReport]
    target_dtype: str
    dtype_max: float
    net_precision: str
    loss_scale: float
    recommended_fp32_modules: list[str]

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as a list of plain dicts."""
        return [row.to_dict() for row in self.rows]

    def __str__(self) -> str:
        head = [
            "module", "type", "params", "inputs", "outputs", "grads", "param grads",
            "max|act|", "max|grad|", "underflow", "flags",
        ]
        lines = [head]
        for r in self.rows:
            lines.append([
                r.module or "(root)", r.type,
                ",".join(r.param_dtypes) or "-", ",".join(r.input_dtypes) or "-",
                ",".join(r.output_dtypes) or "-", ",".join(r.grad_dtypes) or "-",
                ",".join(r.param_grad_dtypes) or "-",
                _num(r.max_abs_activation), _num(r.max_abs_grad),
                f"{100 * r.underflow_share:.1f}%", " ".join(r.flags) or "-",
            ])
        widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
        table = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
        table.insert(1, "  ".join("-" * w for w in widths))
        title = (
            f"Precision report: net computes in {self.net_precision}; target "
            f"{self.target_dtype} (finite range +-{self.dtype_max:.4g}); loss scale "
            f"{self.loss_scale:g}"
        )
        if self.recommended_fp32_modules:
            tail = f"Recommended amp_fp32_modules: {self.recommended_fp32_modules!r}"
        else:
            tail = "Recommended amp_fp32_modules: none"
        return "\n".join([title, *table, tail])

    def __repr__(self) -> str:
        return (
            f"<PrecisionReport: {len(self.rows)} modules, target {self.target_dtype}, "
            f"recommended amp_fp32_modules={self.recommended_fp32_modules!r}>"
        )


def _num(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3g}"


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(obj) if t.is_floating_point()]


def _max_abs(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    value = float(t.detach().abs().amax().float())
    return math.inf if math.isnan(value) else value


class _Recorder:
    """Temporary forward hook of one module (with grad hooks on its outputs)."""

    def __init__(self, row: ModuleReport, scale: float, threshold: float) -> None:
        self.row, self.scale, self.threshold = row, scale, threshold

    def grad(self, g: torch.Tensor) -> None:
        self.row.grad_dtypes.append(_short(g.dtype))
        self.add_grad(g)

    def add_grad(self, g: torch.Tensor) -> None:
        row = self.row
        row.max_abs_grad = max(row.max_abs_grad, _max_abs(g) / self.scale)
        mag = g.detach().float().abs()
        nonzero = mag != 0
        row._nonzero += int(nonzero.sum())
        row._underflow += int((nonzero & (mag <= self.threshold)).sum())

    def __call__(self, module, args, kwargs, output) -> None:
        row = self.row
        row.calls += 1
        inputs = _tensors(args) + _tensors(kwargs)
        row.input_dtypes.extend(_short(t.dtype) for t in inputs)
        row.max_abs_input = max([row.max_abs_input, *map(_max_abs, inputs)])
        for t in _tensors(output):
            row.output_dtypes.append(_short(t.dtype))
            row.max_abs_activation = max(row.max_abs_activation, _max_abs(t))
            if t.requires_grad:
                t.register_hook(self.grad)


def _first_batch(net: Any, X: Any, y: Any, rng: torch.Tensor) -> tuple[Any, Any]:
    """(X, y) of the first batch that the net's evaluation iterator yields;
    the RNG is set back to ``rng`` when there is none."""
    try:
        batch = next(iter(net.get_iterator(net.get_dataset(X, y), training=False)))
    except StopIteration:
        torch.set_rng_state(rng)
        raise ValueError(
            "precision_report needs at least one sample, but X holds none (it yields no "
            "batch). Fix: pass a non-empty X, e.g. the first few hundred training samples."
        ) from None
    return unpack_data(batch)


@contextlib.contextmanager
def _recording(net: Any, root: torch.nn.Module, named: list, recorders: dict,
               rng: torch.Tensor) -> Iterator[None]:
    """Hooks ``recorders`` on the modules of ``named`` for one eager pass in
    training mode (as skorch's train step sets it) from no gradients; then
    puts back what the pass changes: hooks, modes, gradients, buffers, the
    compiled module and the RNG state ``rng``."""
    handles = [
        m.register_forward_hook(recorders[n], with_kwargs=True, prepend=True) for n, m in named
    ]
    modules = [m for _, m in named] + [
        c for c in (getattr(net, n + "_", None) for n in net._criteria) if isinstance(c, torch.nn.Module)
    ]
    modes = [m.training for m in modules]
    grads = [(p, p.grad) for p in root.parameters()]
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    compiled = net.module_
    try:
        for p, _ in grads:
            p.grad = None
        net.__dict__["module_"] = root  # record eagerly, also with compile=True
        for m in modules:
            m.train()
        yield
    finally:
        net.__dict__["module_"] = compiled
        for h in handles:
            h.remove()
        for m, mode in zip(modules, modes):
            m.train(mode)
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)


def _training_pass(net: Any, named: list, rows: dict, recorders: dict, Xi: Any, yi: Any,
                   with_loss: bool, scale: float) -> None:
    """One forward and backward pass (the net's loss when ``with_loss``,
    else the sum of the outputs), the parameters' gradients recorded."""
    y_pred = net.infer(Xi)
    if yi is not None and with_loss:
        loss = net.get_loss(y_pred, yi, X=Xi, training=True)
    else:
        loss = sum(t.float().sum() for t in _tensors(y_pred))
    (loss * scale).backward()
    for n, m in named:
        for p in m.parameters(recurse=False):
            if p.grad is not None:
                rows[n].param_grad_dtypes.append(_short(p.grad.dtype))
                recorders[n].add_grad(p.grad)


def _finish_row(row: ModuleReport, module: torch.nn.Module, dtype_max: float, limit: float) -> None:
    """Sort the row's dtypes, set its underflow share and its flags."""
    row.param_dtypes = sorted({_short(p.dtype) for p in module.parameters(recurse=False)})
    for attr in ("input_dtypes", "output_dtypes", "grad_dtypes", "param_grad_dtypes"):
        setattr(row, attr, sorted(set(getattr(row, attr))))
    row.underflow_share = row._underflow / row._nonzero if row._nonzero else 0.0
    for kind, value in (("activation", row.max_abs_activation), ("grad", row.max_abs_grad)):
        if value >= dtype_max:
            row.flags.append(f"{kind}-overflow")
        elif value >= limit:
            row.flags.append(f"{kind}-near-overflow")
    if row.underflow_share >= UNDERFLOW_FLAG:
        row.flags.append("underflow")


def _recommend(rows: list[ModuleReport], limit: float, fp32_roots: Any) -> list[str]:
    """The modules to keep in float32: where an activation overflow begins
    (it poisons the whole backward pass), else those with (finite) huge
    gradients; outermost first, none inside another, none already float32."""
    act_origins = [
        r.module for r in rows
        if not is_inside(r.module, fp32_roots) and r.max_abs_activation >= limit and r.max_abs_input < limit
    ]
    grad_risks = [
        r.module for r in rows
        if not is_inside(r.module, fp32_roots) and math.isfinite(r.max_abs_grad) and r.max_abs_grad >= limit
    ]
    origins = act_origins or grad_risks
    return [
        n for n in origins if not any(o != n and (n == "" or o.startswith(n + ".")) for o in origins)
    ]


def build_report(net: Any, X: Any, y: Any = None, dtype: Any = None) -> PrecisionReport:
    """Build the report of :meth:`precision_report` for an initialized net."""
    target = net.precision_.report_dtype(dtype)
    finfo = torch.finfo(target)
    scaler = net.grad_scaler_
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    rng = torch.get_rng_state()  # the data loader draws a seed
    Xi, yi = _first_batch(net, X, y, rng)

    root = module_root(net.module_)
    named = list(root.named_modules())
    rows = {n: ModuleReport(n, type(m).__name__, dtype_max=float(finfo.max)) for n, m in named}
    # values at most half the smallest subnormal round to zero
    recorders = {n: _Recorder(rows[n], scale, finfo.tiny * finfo.eps / 2) for n, _ in named}
    with _recording(net, root, named, recorders, rng):
        with_loss = y is not None or isinstance(X, torch.utils.data.Dataset)
        _training_pass(net, named, rows, recorders, Xi, yi, with_loss, scale)

    layout = getattr(net, "amp_layout_", None)
    limit = float(finfo.max) * NEAR_OVERFLOW
    for n, m in named:
        _finish_row(rows[n], m, float(finfo.max), limit)
    recommended = _recommend([rows[n] for n, _ in named], limit,
                             layout.fp32_modules if layout is not None else ())
    for n in recommended:
        rows[n].recommended = True
    for n, note in net.precision_.layer_notes(root).items():  # float8: which layers run it, and why not
        rows[n].flags.append(note if note == "float8" else note.replace("kept in bfloat16: ", "bf16: "))
    return PrecisionReport(
        rows=[rows[n] for n, _ in named],
        target_dtype=dtype_name(target),
        dtype_max=float(finfo.max),
        net_precision=net.precision_.name,
        loss_scale=scale,
        recommended_fp32_modules=recommended,
    )
