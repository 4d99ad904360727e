"""``amp_fp32_modules='auto'``: keep the modules that overflow in float32.

At the start of the first fit (:func:`ampnet.precision.auto_probe.resolve_auto_fp32`, before any
callback's ``on_train_begin``), one forward and backward pass on the first
training batch -- the first ``batch_size`` rows of the training split, not
shuffled -- finds the modules where an activation or gradient overflow of
the low-precision range starts (:func:`ampnet.precision.report.build_report`
recommends them). They are added to the float32 regions through the
precision component, exactly as if they had been listed in
``amp_fp32_modules``. The probe changes no weight, gradient, buffer,
optimizer, random state or history.

The choice is kept in ``amp_layout_.auto_fp32_modules``:

- it pickles with the net, and ``partial_fit`` never probes again;
- the module's ``state_dict`` carries it in its metadata, so that
  ``save_params(f_params=...)`` and checkpoints hold it; loading such
  parameters into a net that has not probed yet makes it take that choice
  instead of probing (a net that resumes with ``LoadInitState`` probes the
  freshly initialized module before the checkpoint is loaded: with the same
  seed and data, as a resumed run has, the probe makes the same choice;
  a different saved choice gives an :class:`.AmpWarning`).
"""

from __future__ import annotations

from typing import Any

import torch

from ampnet.exceptions import amp_warn

__all__ = [
    "METADATA_KEY",
    "choice_problem",
    "shown_names",
    "AutoChoiceHooks",
    "install_auto_hooks",
    "remove_auto_hooks",
    "find_auto_hooks",
]

#: The key of the choice in the root module's ``state_dict`` metadata.
METADATA_KEY = "ampnet_auto_fp32_modules"


class AutoChoiceHooks:
    """The root module's state-dict hooks of ``'auto'``.

    Called as a ``state_dict`` post-hook it writes the resolved choice into
    the root's metadata; :meth:`load` (a ``load_state_dict`` pre-hook) reads
    a saved choice into :attr:`loaded`.
    """

    def __init__(self, choice: tuple[str, ...] | None) -> None:
        self.choice = choice
        self.loaded: tuple[str, ...] | None = None

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if self.choice is not None and prefix == "":
            local_metadata[METADATA_KEY] = list(self.choice)

    def load(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
             unexpected_keys, error_msgs) -> None:
        saved = local_metadata.get(METADATA_KEY) if prefix == "" else None
        if saved is None:
            return
        problem = choice_problem(module, saved)
        if problem:  # load_params refuses such a file before; a direct load_state_dict ignores it
            amp_warn(
                f"The loaded parameters hold an amp_fp32_modules='auto' choice that this module "
                f"cannot take ({problem}); it was ignored.")
            return
        saved = tuple(saved)
        if self.choice is not None and set(saved) != set(self.choice):
            amp_warn(
                f"The loaded parameters were trained with amp_fp32_modules='auto' keeping "
                f"{shown_names(saved)} in float32; this net's probe kept {shown_names(self.choice)}. "
                f"The net keeps its own choice. To use the saved one, pass amp_fp32_modules="
                f"{shown_names(saved)}.")
            return
        self.loaded = saved


#: Names of modules that a message shows at most.
SHOWN_NAMES = 8


def shown_names(names: Any) -> str:
    """``names`` as a list for a message, at most :data:`SHOWN_NAMES` of them."""
    names = list(names)
    if len(names) <= SHOWN_NAMES:
        return repr(names)
    return f"{names[:SHOWN_NAMES]!r}[:{SHOWN_NAMES}] (of {len(names)})"


def choice_problem(root: torch.nn.Module, saved: Any) -> str | None:
    """Why a saved ``'auto'`` choice cannot be taken by ``root``: it must be
    a list of distinct names of ``root``'s modules (as ``named_modules``
    gives them)."""
    if not (isinstance(saved, (list, tuple)) and all(isinstance(n, str) for n in saved)):
        return f"expected a list of module names, got {type(saved).__name__}"
    names = dict(root.named_modules())
    unknown = [n for n in saved if n not in names]
    if unknown:
        return f"{shown_names(unknown)} {'is not a module' if len(unknown) == 1 else 'are not modules'} of {type(root).__name__}"
    if len(set(saved)) != len(saved):
        return "it names a module twice"
    return None


def install_auto_hooks(root: torch.nn.Module, choice: tuple[str, ...] | None) -> None:
    """Register :class:`AutoChoiceHooks` on ``root``."""
    hooks = AutoChoiceHooks(choice)
    post = getattr(root, "register_state_dict_post_hook", root._register_state_dict_hook)
    post(hooks)
    root._register_load_state_dict_pre_hook(hooks.load, with_module=True)


def _is_ours(hook: Any) -> bool:
    hook = getattr(hook, "hook", hook)
    return isinstance(hook, AutoChoiceHooks) or isinstance(getattr(hook, "__self__", None), AutoChoiceHooks)


def find_auto_hooks(root: torch.nn.Module) -> AutoChoiceHooks | None:
    """The :class:`AutoChoiceHooks` of ``root``, if any."""
    for hook in root._state_dict_hooks.values():
        if isinstance(hook, AutoChoiceHooks):
            return hook
    return None


def remove_auto_hooks(root: torch.nn.Module) -> None:
    """Remove the hooks of :func:`install_auto_hooks` from ``root``."""
    for hooks in (root._state_dict_hooks, root._load_state_dict_pre_hooks):
        for key in [k for k, h in hooks.items() if _is_ours(h)]:
            del hooks[key]
