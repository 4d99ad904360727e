"""float8 training (``amp_dtype='float8'``) through torchao, an optional
extra (``pip install "ampnet[fp8]"``).

The ``nn.Linear`` layers that pass torchao's filter run float8 matmuls
(torchao's ``Float8Linear``: e4m3 forward, e5m2 gradients, dynamic scaling
per ``amp_float8__recipe``); everything else runs in bfloat16 autocast, as
:mod:`~ampnet.precision.kinds.mixed`. The weights stay float32 parameters
(the same ``Parameter`` objects: the optimizer, ``state_dict`` keys and
``save_params`` files are those of a plain net). The first and last linear
layers stay in bfloat16 unless ``amp_float8__keep_first_last=False``.

On a CPU, torchao emulates float8 (``Float8LinearConfig(emulate=True)``):
the numerics of float8 training, not its speed, with a warning saying so.
On CUDA it needs compute capability 8.9 or newer (Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from ampnet.exceptions import amp_warn
from ampnet.precision.component import module_root
from ampnet.precision.kinds.mixed import MixedPrecision
from ampnet.precision.plan import PrecisionLayout, is_inside
from ampnet.precision.selectors import match_modules, parse_selectors
from ampnet.precision.settings import PrecisionSettings

__all__ = ["Float8Precision", "float8_layers", "FIX_INSTALL", "MIN_CAPABILITY"]

#: The fix for a missing torchao.
FIX_INSTALL = 'pip install "ampnet[fp8]" (torchao; Linux x86_64), or amp_dtype=\'bfloat16\''

#: The CUDA compute capability torchao's float8 kernels need.
MIN_CAPABILITY = (8, 9)


def _torchao() -> Any:
    """``torchao.float8``, or an ImportError naming the extra."""
    try:
        import torchao.float8 as float8  # noqa: PLC0415  (optional extra)
        from torchao.float8.float8_linear import Float8Linear  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            f"amp_dtype='float8' trains through torchao, which is not installed ({exc}). Fix: {FIX_INSTALL}."
        ) from exc
    return float8, Float8Linear


def float8_layers(module: torch.nn.Module, keep_first_last: bool, modules: Any = None) -> dict[str, str]:
    """Why each ``nn.Linear`` of ``module`` runs in float8 or not, by name:
    ``'float8'``, or the reason it stays in bfloat16 (outside
    ``amp_float8__modules``, first or last linear layer kept, dimensions
    torchao's kernels do not take: not divisible by 16).

    ``modules``: the ``amp_float8__modules`` selectors (None: every linear
    layer; a linear layer inside a matched module counts as matched)."""
    root = module_root(module)
    linears = [(n, m) for n, m in root.named_modules() if isinstance(m, torch.nn.Linear)]
    chosen = None
    if modules is not None:
        chosen = match_modules(root, parse_selectors(modules, "amp_float8__modules"), "amp_float8__modules")
    out = {}
    for i, (name, layer) in enumerate(linears):
        if chosen is not None and not is_inside(name, chosen):
            out[name] = "kept in bfloat16: not in amp_float8__modules"
        elif keep_first_last and i in (0, len(linears) - 1):
            out[name] = "kept in bfloat16: the " + ("first" if i == 0 else "last") + " linear layer"
        elif layer.in_features % 16 or layer.out_features % 16:
            out[name] = (f"kept in bfloat16: {layer.in_features}x{layer.out_features} is not divisible by 16 "
                         "(torchao's float8 matmul needs it)")
        else:
            out[name] = "float8"
    return out


class Float8Precision(MixedPrecision):
    """bfloat16 autocast with torchao's ``Float8Linear`` in place of the
    linear layers that :func:`float8_layers` names ``'float8'``. Its hooks
    are mixed precision's; :meth:`attach` converts the module and
    :meth:`detach` converts it back (the same parameters)."""

    @staticmethod
    def serves(settings: PrecisionSettings) -> bool:
        """Whether this kind runs ``settings``: ``amp_dtype='float8'``."""
        return settings.policy.enabled and settings.float8 is not None

    def __init__(self, settings: PrecisionSettings, scaler: Any) -> None:
        self.check_machine(settings.policy.device_type)
        super().__init__(settings, scaler)

    @property
    def recipe(self) -> str:
        """``amp_float8__recipe``: torchao's scaling recipe."""
        return dict(self.settings.float8)["recipe"]

    @property
    def keep_first_last(self) -> bool:
        """``amp_float8__keep_first_last``: the first and last linear layers stay in bfloat16."""
        return dict(self.settings.float8)["keep_first_last"]

    @staticmethod
    def check_machine(device_type: str) -> None:
        """Refuse a machine float8 training cannot run on: no torchao (the
        extra), a CUDA device below compute capability 8.9."""
        _torchao()
        if device_type == "cuda":
            capability = torch.cuda.get_device_capability()
            if capability < MIN_CAPABILITY:
                raise ValueError(
                    f"amp_dtype='float8' needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                    f"or newer (Ada, Hopper, Blackwell); {torch.cuda.get_device_name()} has "
                    f"{capability[0]}.{capability[1]}. Fix: amp_dtype='bfloat16'.")

    def config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for the recipe (emulated on a CPU)."""
        float8, _ = _torchao()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self._device_type != "cuda":
            config = dataclasses.replace(config, emulate=True)
        return config

    def attach(self, module: torch.nn.Module, trimmed: bool = False, layout: PrecisionLayout | None = None) -> None:
        """Mixed precision's layout, then the float8 layers converted."""
        super().attach(module, trimmed, layout)
        float8, _ = _torchao()
        root = module_root(module)
        notes = self.layer_notes(root)
        chosen = {n for n, why in notes.items() if why == "float8"}
        if not chosen:
            reasons = "; ".join(f"{n or 'the module'}: {why}" for n, why in notes.items()) or "it has no nn.Linear"
            amp_warn(f"amp_dtype='float8' runs no layer of this module in float8 ({reasons}): it trains as "
                     "amp_dtype='bfloat16' would. Fix: amp_float8__keep_first_last=False, or linear layers whose "
                     "sizes are multiples of 16; net.precision_report(X, y) shows each layer's reason.")
        if self._device_type != "cuda":
            amp_warn("amp_dtype='float8' on a CPU runs torchao's emulation: the numerics of float8 training, "
                     "not its speed (float8 matmuls need a GPU of compute capability 8.9 or newer).")
        float8.convert_to_float8_training(root, config=self.config(), module_filter_fn=lambda m, fqn: fqn in chosen)

    def detach(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Float8 layers back to ``nn.Linear`` (the same parameters), then
        mixed precision's detach."""
        self.to_plain(module)
        super().detach(module, optimizers)

    def to_plain(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with each ``Float8Linear`` replaced by an ``nn.Linear``
        holding the same parameters (an export's copy, :meth:`detach`)."""
        _, Float8Linear = _torchao()
        root = module_root(module)
        for name, layer in list(root.named_modules()):
            if type(layer) is Float8Linear:
                plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                        device="meta")
                plain.weight, plain.bias = layer.weight, layer.bias
                plain.train(layer.training)
                _set_submodule(root, name, plain)
        return module

    @property
    def name(self) -> str:
        """How the net computes, for reports: the recipe, and bfloat16 elsewhere."""
        return f"float8 ({self.recipe}; bfloat16 autocast elsewhere)"

    def layer_notes(self, module: torch.nn.Module) -> dict[str, str]:
        """Per linear layer: ``'float8'`` or why it stays in bfloat16 (:func:`float8_layers`)."""
        return float8_layers(module, self.keep_first_last, dict(self.settings.float8).get("modules"))


def _set_submodule(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)
