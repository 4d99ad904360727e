"""``amp_fp32_modules='auto'``: keep the modules that overflow in float32.

At the start of the first fit (:func:`resolve_fp32_modules`, called by the
wing's door before any callback's ``on_train_begin``), one forward and
backward pass on the first training batch -- the first ``batch_size`` rows
of the training split, not shuffled -- finds the modules where an
activation or gradient overflow of the low-precision range starts
(:func:`ampnet.diagnostics.report.build_report` recommends them). They are added to the
float32 regions through the precision component, exactly as if they had
been listed in ``amp_fp32_modules``. The probe changes no weight, gradient,
buffer, optimizer, random stream or history.

The choice is kept in ``amp_layout_.auto_fp32_modules``: it pickles with the
net, and ``partial_fit`` never probes again. ``save_params`` (and so every
checkpoint) writes it into the parameters file's metadata, and a net that
has not probed yet takes it from there instead of probing: through
``load_params``, or through the checkpoint that a ``LoadInitState`` will
resume from (:mod:`ampnet.auto.saved`).
"""

from __future__ import annotations

from typing import Any, Callable

import sklearn

from ampnet.auto.switching import apply_fp32_choice
from ampnet.diagnostics.report import build_report
from ampnet.utils.random_state import kept_random_state

__all__ = ["resolve_fp32_modules", "split_params"]


def split_params(net: Any, fit_params: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that ``fit_loop`` passes to ``train_split``
    for these ``fit_params``: skorch's private ``_routing_method`` (which
    ``fit`` threads through ``partial_fit``) removed, and with scikit-learn's
    metadata routing enabled only what is routed to the splitter, as
    skorch's ``fit_loop`` does."""
    params = dict(fit_params)
    method = params.pop("_routing_method", "partial_fit")
    if not (sklearn.get_config().get("enable_metadata_routing") and hasattr(net, "get_metadata_routing")):
        return params
    # scikit-learn < 1.3 has no metadata routing (its config then never enables it)
    from sklearn.utils.metadata_routing import process_routing

    routed = process_routing(net, method, **params)
    return dict(routed.get("splitter", {"split": {}})["split"])


def resolve_fp32_modules(net: Any, X: Any, y: Any = None, probe: Callable[..., Any] = build_report, /,
                         saved: tuple[str, ...] | None = None, **fit_params: Any) -> None:
    """Resolve ``'auto'`` in ``amp_fp32_modules``: take ``saved`` (a choice
    read from the checkpoint being resumed), or probe the first training
    batch; then move the module to the new layout.

    ``probe(net, dataset, None)`` builds the report whose
    ``recommended_fp32_modules`` are kept (:func:`ampnet.diagnostics.report.build_report`
    unless given). It, ``X`` and ``y`` are positional only, so that every other keyword
    is a fit parameter."""
    choice = saved
    if choice is None:
        with kept_random_state():
            dataset, _ = net.get_split_datasets(X, y, **split_params(net, fit_params))
            report = probe(net, dataset, None)
        choice = tuple(report.recommended_fp32_modules)
        if net.verbose:
            kept = ", ".join(repr(n) for n in choice) if choice else "none"
            print(
                f"amp_fp32_modules='auto': modules kept in float32 (where {report.target_dtype}'s "
                f"range overflows on the first training batch): {kept}"
            )
    apply_fp32_choice(net, choice)
