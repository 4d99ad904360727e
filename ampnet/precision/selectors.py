"""Module selectors of ``amp_fp32_modules`` and ``amp_modules``.

A selector is a :class:`torch.nn.Module` subclass (matches instances), a
glob pattern on the qualified module name as given by
``module.named_modules()`` (``'encoder.*'``, ``'*attn'``; the root module
is ``''``), or a compiled regular expression that must match the whole
qualified name. A net parameter takes one selector or a list/tuple of them.

In ``amp_fp32_modules`` the string ``'auto'`` is not a pattern: it stands
for the modules that overflow the low-precision range on the first
training batch (see :mod:`ampnet.auto.fp32_modules`). Select a module named
``auto`` with ``re.compile('auto')``.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any, Union

import torch

from ampnet.exceptions import amp_warn
from ampnet.utils.values import describe

__all__ = ["Selector", "parse_selectors", "match_modules", "describe_selector", "AUTO"]

#: In ``amp_fp32_modules``: the modules found by the probe of the first fit.
AUTO = "auto"

#: One selector: a module class, a glob pattern or a compiled regex.
Selector = Union[type, str, "re.Pattern[str]"]

_KINDS = (
    "a torch.nn.Module subclass (e.g. torch.nn.LayerNorm), a glob pattern on the "
    "qualified module name (e.g. 'encoder.*'), or a compiled regex "
    "(e.g. re.compile(r'layers\\.\\d+\\.attn'))"
)


def describe_selector(selector: Selector) -> str:
    """A short readable form: the class name, the pattern or ``re:<pattern>``."""
    if isinstance(selector, type):
        return selector.__name__
    if isinstance(selector, re.Pattern):
        return f"re:{selector.pattern}"
    if isinstance(selector, str):
        return repr(str.__str__(selector))  # a str subclass's own __repr__ may raise
    return describe(selector)


def parse_selectors(value: Any, param: str) -> tuple[Selector, ...]:
    """Validate the value of a selector parameter; return a tuple of selectors.

    Parameters
    ----------
    value : None, selector, or list/tuple of selectors
      The value of the net parameter.

    param : str
      The parameter name, used in error messages.

    Raises
    ------
    TypeError
      If ``value`` or one of its items is not a valid selector.
    """
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    bad = []
    for item in items:
        ok = (
            (isinstance(item, type) and issubclass(item, torch.nn.Module))
            or isinstance(item, (str, re.Pattern))
        )
        if not ok:
            bad.append(describe(item))
    if bad:
        raise TypeError(
            f"{param} must be None, a selector or a list of selectors; got invalid "
            f"item(s) {', '.join(bad)}. A selector is {_KINDS}. Fix: e.g. "
            f"{param}=[torch.nn.LayerNorm, 'head.*']."
        )
    # a str subclass is read as the str it holds (its own methods may raise)
    return tuple(str.__str__(item) if isinstance(item, str) else item for item in items)


def _matches(selector: Selector, name: str, module: torch.nn.Module) -> bool:
    if isinstance(selector, type):
        return isinstance(module, selector)
    if isinstance(selector, re.Pattern):
        return selector.fullmatch(name) is not None
    return fnmatch.fnmatchcase(name, selector)


def match_modules(
    root: torch.nn.Module, selectors: tuple[Selector, ...], param: str
) -> list[str]:
    """Qualified names of the modules of ``root`` matched by any selector.

    A selector that matches no module gives an :class:`.AmpWarning` that
    lists close module names.
    """
    named = list(root.named_modules())
    matched: list[str] = []
    for selector in selectors:
        hits = [name for name, module in named if _matches(selector, name, module)]
        if not hits:
            names = [n for n, _ in named if n]
            hint = ""
            if isinstance(selector, str):
                close = difflib.get_close_matches(selector, names, n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            amp_warn(
                f"{param} selector {describe_selector(selector)} matches no module of "
                f"{type(root).__name__}; it has no effect.{hint} Module names: "
                f"{shown or '(none besides the root)'}.",
            )
        matched.extend(h for h in hits if h not in matched)
    return matched
