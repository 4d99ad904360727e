"""The probe of ``amp_fp32_modules='auto'`` (see :mod:`ampnet.precision.auto`).

At the start of the first fit, :func:`resolve_auto_fp32` takes a loaded
choice or runs one forward and backward pass on the first training batch
(:func:`ampnet.precision.report.build_report`), then moves the module to
the new layout. It lives apart from :mod:`ampnet.precision.auto` (the
state-dict hooks that carry the choice, which the precision component
installs) so that the imports run one way: ``auto_probe`` -> ``component``,
``report`` -> ``auto``.
"""

from __future__ import annotations

from typing import Any

import torch

from ampnet.io.rng import get_rng_state, set_rng_state
from ampnet.precision.auto import find_auto_hooks
from ampnet.precision.component import Precision, module_root
from ampnet.precision import report as report_module  # looked up at call time: tests count probes

__all__ = ["resolve_auto_fp32", "split_params"]


def split_params(net: Any, fit_params: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that ``fit_loop`` passes to ``train_split``
    for these ``fit_params``: skorch's private ``_routing_method`` (which
    ``fit`` threads through ``partial_fit``) removed, and with scikit-learn's
    metadata routing enabled only what is routed to the splitter, as
    skorch's ``fit_loop`` does."""
    params = dict(fit_params)
    method = params.pop("_routing_method", "partial_fit")
    import sklearn

    if not (sklearn.get_config().get("enable_metadata_routing") and hasattr(net, "get_metadata_routing")):
        return params
    from sklearn.utils.metadata_routing import process_routing

    routed = process_routing(net, method, **params)
    return dict(routed.get("splitter", {"split": {}})["split"])


def resolve_auto_fp32(net: Any, X: Any, y: Any = None, **fit_params: Any) -> None:
    """Resolve ``'auto'`` in ``amp_fp32_modules`` once, at the start of the
    first fit: take a loaded choice, or probe the first training batch;
    then move the module to the new layout. Does nothing when nothing is
    pending."""
    prec = net.precision_
    module = net.__dict__.get("module_")
    if not prec.auto_pending or not isinstance(module, torch.nn.Module):
        return
    hooks = find_auto_hooks(module_root(module))
    choice = hooks.loaded if hooks is not None else None
    if choice is None:
        rng = get_rng_state()
        try:
            dataset, _ = net.get_split_datasets(X, y, **split_params(net, fit_params))
            report = report_module.build_report(net, dataset, None)
        finally:
            set_rng_state(rng)
        choice = tuple(report.recommended_fp32_modules)
        if net.verbose:
            kept = ", ".join(repr(n) for n in choice) if choice else "none"
            print(
                f"amp_fp32_modules='auto': modules kept in float32 (where {report.target_dtype}'s "
                f"range overflows on the first training batch): {kept}"
            )
    new = Precision(prec.settings, prec.scaler)
    new.auto_fp32 = choice
    net.relayout_precision(prec, new, ["amp_fp32_modules"])
    net.__dict__["precision_"] = new
