"""Where each part of a model computes: the precision layout.

:func:`plan_layout` turns a net's ``amp_level``, ``amp_fp32_modules`` and
``amp_modules`` into a :class:`PrecisionLayout` for one module: the roots of
float32 regions, the roots of low-precision regions, and (``'pure'``) the
parameters stored in the low-precision dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ampnet.precision.policy import PrecisionPolicy
from ampnet.precision.selectors import AUTO, match_modules, parse_selectors

__all__ = ["PrecisionLayout", "plan_layout", "NORM_LAYERS", "is_inside"]

#: Layers whose parameters stay float32 in ``amp_level='pure'``.
NORM_LAYERS: tuple[type, ...] = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())


@dataclass(frozen=True)
class PrecisionLayout:
    """The precision layout of a net's module (fitted attribute ``amp_layout_``).

    Attributes
    ----------
    dtype : torch.dtype or None
      The low-precision dtype, None when AMP is off.

    level : str
      ``'mixed'`` or ``'pure'``.

    fp32_modules : tuple of str
      Qualified names of the modules that run as float32 regions (the
      outermost matches of ``amp_fp32_modules``).

    amp_modules : tuple of str or None
      Qualified names of the low-precision regions (outermost matches of
      ``amp_modules`` outside float32 regions), or None for the whole model.

    low_precision_params : tuple of str
      Parameters stored in ``dtype`` (``'pure'`` only); every other
      parameter is float32.

    memory_format : str
      ``'preserve'`` or ``'channels_last'``.

    auto_fp32_modules : tuple of str or None
      With ``amp_fp32_modules='auto'``: the modules that the probe at the
      start of the first fit kept in float32 (part of ``fp32_modules``);
      None before the probe, or without ``'auto'``.
    """

    dtype: torch.dtype | None = None
    level: str = "mixed"
    fp32_modules: tuple[str, ...] = ()
    amp_modules: tuple[str, ...] | None = None
    low_precision_params: tuple[str, ...] = ()
    memory_format: str = "preserve"
    auto_fp32_modules: tuple[str, ...] | None = None

    @property
    def scoped(self) -> bool:
        """Whether only ``amp_modules`` run in low precision (autocast is off
        for the rest of the model)."""
        return self.dtype is not None and self.amp_modules is not None


def is_inside(name: str, roots: Any) -> bool:
    """Whether module ``name`` is one of ``roots`` or inside one of them."""
    return any(r == "" or name == r or name.startswith(r + ".") for r in roots)


def _outermost(names: list[str]) -> tuple[str, ...]:
    return tuple(n for n in names if not any(o != n and is_inside(n, [o]) for o in names))


def plan_layout(
    root: torch.nn.Module,
    policy: PrecisionPolicy,
    amp_fp32_modules: Any,
    amp_modules: Any,
    memory_format: str = "preserve",
    float32_names: tuple[str, ...] = (),
    auto: tuple[str, ...] | None = None,
) -> PrecisionLayout:
    """Resolve the selectors on ``root`` and plan its precision layout.

    Selectors are validated (TypeError) and matched (AmpWarning for a
    selector that matches nothing) even when AMP is off. ``float32_names``
    are parameters stored in low precision now that count as float32 (the
    module still carries an earlier layout). ``auto``: the modules that
    ``'auto'`` in ``amp_fp32_modules`` stands for (None: not probed yet, so
    none).
    """
    fp32_sel = parse_selectors(amp_fp32_modules, "amp_fp32_modules")
    amp_sel = parse_selectors(amp_modules, "amp_modules")
    wants_auto = AUTO in fp32_sel
    auto = tuple(auto) if wants_auto and auto is not None else None
    names = {n for n, _ in root.named_modules()}
    fp32_names: list[str] = []
    for selector in fp32_sel:  # in the order given, 'auto' where it stands
        found = [n for n in auto or () if n in names] if selector == AUTO else match_modules(
            root, (selector,), "amp_fp32_modules")
        fp32_names += [n for n in found if n not in fp32_names]
    fp32_roots = _outermost(fp32_names)
    amp_names = match_modules(root, amp_sel, "amp_modules") if amp_modules is not None else None
    if not policy.enabled:
        return PrecisionLayout(memory_format=memory_format, auto_fp32_modules=auto)
    amp_roots = None
    if amp_names is not None:
        amp_roots = _outermost([n for n in amp_names if not is_inside(n, fp32_roots)])

    low: list[str] = []
    if policy.level == "pure":
        stored_low = {id(p) for n, p in root.named_parameters() if n in float32_names}
        keep_fp32: set[int] = set()
        candidates: list[torch.nn.Parameter] = []
        for name, module in root.named_modules():
            own = list(module.parameters(recurse=False))
            in_low = amp_roots is None or is_inside(name, amp_roots)
            if not in_low or is_inside(name, fp32_roots) or isinstance(module, NORM_LAYERS):
                keep_fp32.update(id(p) for p in own)
            else:
                candidates.extend(p for p in own if p.dtype == torch.float32 or id(p) in stored_low)
        chosen = {id(p) for p in candidates} - keep_fp32
        low = [n for n, p in root.named_parameters() if id(p) in chosen]
    return PrecisionLayout(
        dtype=policy.compute_dtype,
        level=policy.level,
        fp32_modules=fp32_roots,
        amp_modules=amp_roots,
        low_precision_params=tuple(low),
        memory_format=memory_format,
        auto_fp32_modules=auto,
    )
