"""Close valid names for a misspelled one: "Did you mean amp_enabled (for amp_enable)?"."""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["named_with_hints", "close_names"]


def named_with_hints(prefix: str, unknown: Any, valid: Any) -> str:
    """``prefix__name`` for each of the ``unknown`` names, with the closest
    ``valid`` one where there is one: ``'grad_scaler__growth_factr (did you
    mean grad_scaler__growth_factor?)'``, comma-separated."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(valid), n=1)
        hints.append(f"{prefix}__{key}" + (f" (did you mean {prefix}__{close[0]}?)" if close else ""))
    return ", ".join(hints)

def close_names(unknown: Any, valid: Any) -> str:
    """``' Did you mean amp_enabled (for amp_enable)?'`` for each of the
    ``unknown`` names with a close ``valid`` one (difflib's), ``''`` where
    none has one."""
    valid = list(valid)
    pairs = [(name, difflib.get_close_matches(name, valid, n=1)) for name in unknown]
    found = [f"{close[0]} (for {name})" for name, close in pairs if close]
    return f" Did you mean {', '.join(found)}?" if found else ""
