"""``repr(net)``: skorch's, plus the AMP parameters that differ from their
defaults.

skorch's repr lists the module (and, before ``initialize()``, its
``module__*`` parameters). ampnet adds one line per AMP parameter that is not
at its default, and per ``grad_scaler__*`` setting, in the same
``  name=value,`` form, so that a repr with default AMP settings is exactly
skorch's.
"""

from __future__ import annotations

import inspect
from typing import Any

from ampnet.config.no_effect import is_default

__all__ = ["amp_param_names", "add_amp_params"]


def amp_param_names(net: Any) -> list[str]:
    """The keyword parameters of the ``__init__`` in ``net``'s class
    hierarchy that defines ``amp_enabled`` (ampnet's mixin)."""
    for klass in type(net).__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        if "amp_enabled" in params:
            return [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
    return []


def _show(value: Any) -> str:
    text = str(value) if isinstance(value, type) else repr(value)
    return "\n  ".join(text.split("\n"))


def add_amp_params(text: str, net: Any) -> str:
    """Insert the non-default AMP parameters of ``net`` before the closing
    parenthesis of skorch's repr ``text``."""
    lines = [
        f"  {name}={_show(getattr(net, name))},"
        for name in amp_param_names(net)
        if hasattr(net, name) and not is_default(net, name)
    ]
    lines += [
        f"  grad_scaler__{key}={_show(value)},"
        for key, value in sorted(net.get_params_for("grad_scaler").items())
    ]
    if not lines or not text.endswith("\n)"):
        return text
    return text[: -len(")")] + "\n".join(lines) + "\n)"
