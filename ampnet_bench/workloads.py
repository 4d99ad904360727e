"""The benchmark's workloads: a model, synthetic data and a batch size each.

Every workload is deterministic given a seed: the data are generated with a
private :class:`torch.Generator` and the modules are built after
``torch.manual_seed``, so every contender (and every memory-probe
subprocess) sees bitwise identical data and initial weights.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch import nn

__all__ = [
    "Data",
    "Target",
    "Workload",
    "WORKLOAD_NAMES",
    "MLP",
    "ConvNet",
    "TransformerClassifier",
    "TinyTransformer",
    "ResNet18",
    "RNNClassifier",
    "resnet18_module",
    "torchvision_available",
    "get_workload",
    "MODEL_WORKLOADS",
    "MODEL_DIMS",
    "GPU_WORKLOADS",
    "OVERHEAD_STEPS",
]

#: Names accepted by ``--workload`` (besides ``all``), in run order.
WORKLOAD_NAMES = ("mlp", "cnn", "transformer", "resnet", "rnn", "overhead", "predict")

#: The training workloads that stand for a kind of model (the others measure overhead and
#: prediction): the docs show one section each, and ``--check`` runs them all.
MODEL_WORKLOADS = ("mlp", "cnn", "transformer", "resnet", "rnn")

#: Workloads sized for a GPU (synthetic data): a ResNet-50 at 224 px, a BERT-base-sized encoder and a
#: GPT-2-small-sized decoder. Not in ``--workload all`` (a CPU would take minutes a step); ``--check`` runs
#: them first. ``--quick`` gives each a miniature of the same structure.
GPU_WORKLOADS = ("resnet50", "encoder", "decoder")

#: Training steps per epoch of the ``overhead`` workload (full size; ``--quick``: 20).
OVERHEAD_STEPS = 400


# ---- models ---------------------------------------------------------------


class MLP(nn.Module):
    """A ReLU multi-layer perceptron returning logits.

    Parameters
    ----------
    sizes : tuple of int
      Layer widths from input to output, e.g. ``(1024, 2048, 2048, 10)``.
    """

    def __init__(self, sizes: tuple[int, ...] = (1024, 2048, 2048, 10)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.layers(X)


class ConvNet(nn.Module):
    """Conv-BatchNorm-ReLU-MaxPool blocks, global average pooling and a
    linear classifier, returning logits.

    Parameters
    ----------
    channels : tuple of int
      Output channels of the convolution blocks.

    n_classes : int
      Number of classes.

    channels_last : bool
      Convert the input to ``torch.channels_last`` in ``forward`` (the
      weights are converted by :meth:`Workload.build_module`). Done inside
      the module so that every contender gets the same layout, whatever
      its batching.
    """

    def __init__(
        self,
        channels: tuple[int, ...] = (32, 64, 128),
        n_classes: int = 10,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c_in = 3
        for c_out in channels:
            blocks += [
                nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, n_classes)
        self.channels_last = channels_last

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        h = self.features(X)
        return self.head(h.mean(dim=(2, 3)))


class TransformerClassifier(nn.Module):
    """Token and position embeddings, a Transformer encoder (``batch_first``,
    pre-norm, GELU; its attention runs on ``F.scaled_dot_product_attention``),
    mean pooling and a linear classifier, returning logits.

    Parameters
    ----------
    vocab : int
      Vocabulary size.

    seq_len : int
      Sequence length.

    d_model, n_heads, d_ff, n_layers : int
      Encoder sizes.

    n_classes : int
      Number of classes.
    """

    def __init__(
        self,
        vocab: int = 1000,
        seq_len: int = 128,
        d_model: int = 256,
        n_heads: int = 4,
        d_ff: int = 1024,
        n_layers: int = 4,
        n_classes: int = 10,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=d_ff, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(X) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


#: The earlier name of :class:`TransformerClassifier`.
TinyTransformer = TransformerClassifier


def _to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the input in ``torch.channels_last`` (a module-level
    function, so that the module still pickles)."""
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


class _BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and a
    1x1 convolution with BatchNorm on the shortcut where the shape changes
    (the attribute names are torchvision's, so the state dicts match)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 written out: the structure, parameter names and
    initialization of torchvision's ``resnet18(weights=None)`` (a 7x7
    stride-2 stem with BatchNorm and max pooling, four stages of basic
    blocks, global average pooling, a linear classifier), for machines
    without torchvision; returns logits.

    Parameters
    ----------
    n_classes : int
      Number of classes.

    widths : tuple of int
      Channels of the four stages (torchvision: 64, 128, 256, 512).

    blocks : tuple of int
      Basic blocks per stage (torchvision: 2, 2, 2, 2).
    """

    def __init__(
        self,
        n_classes: int = 10,
        widths: tuple[int, ...] = (64, 128, 256, 512),
        blocks: tuple[int, ...] = (2, 2, 2, 2),
    ) -> None:
        super().__init__()
        stem = widths[0]
        self.conv1 = nn.Conv2d(3, stem, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        c_in = stem
        for i, (width, n_blocks) in enumerate(zip(widths, blocks)):
            stage = []
            for j in range(n_blocks):
                stage.append(_BasicBlock(c_in, width, 2 if (j == 0 and i > 0) else 1))
                c_in = width
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.n_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_in, n_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.n_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_available() -> bool:
    """Whether torchvision can be imported (found on the path; not imported)."""
    return importlib.util.find_spec("torchvision") is not None


def resnet18_module(
    n_classes: int = 10,
    widths: tuple[int, ...] = (64, 128, 256, 512),
    blocks: tuple[int, ...] = (2, 2, 2, 2),
    channels_last: bool = False,
    use_torchvision: bool | None = None,
) -> nn.Module:
    """A ResNet-18 without pretrained weights: torchvision's
    ``resnet18(weights=None, num_classes=n_classes)`` where torchvision is
    installed and the sizes are ResNet-18's, else :class:`ResNet18`.

    Parameters
    ----------
    n_classes : int
      Number of classes.

    widths, blocks : tuple of int
      Stage widths and blocks per stage; other than ResNet-18's (tiny test
      sizes) always the written-out module.

    channels_last : bool
      Convert the input to ``torch.channels_last`` in a forward pre-hook
      (the weights are converted by :meth:`Workload.build_module`).

    use_torchvision : bool or None
      None: torchvision where available; True: torchvision (ImportError
      without it); False: the written-out module.

    Returns
    -------
    torch.nn.Module
    """
    standard = tuple(widths) == (64, 128, 256, 512) and tuple(blocks) == (2, 2, 2, 2)
    if use_torchvision is None:
        use_torchvision = standard and torchvision_available()
    if use_torchvision:
        if not standard:
            raise ValueError("torchvision's resnet18 has ResNet-18's widths and blocks only")
        from torchvision.models import resnet18

        module = resnet18(weights=None, num_classes=n_classes)
    else:
        module = ResNet18(n_classes, tuple(widths), tuple(blocks))
    if channels_last:
        module.register_forward_pre_hook(_to_channels_last)
    return module


class RNNClassifier(nn.Module):
    """Token embedding, a multi-layer LSTM or GRU (``batch_first``), mean
    pooling over time and a linear classifier, returning logits.

    Parameters
    ----------
    vocab : int
      Vocabulary size.

    d_embed, hidden, n_layers : int
      Embedding width, recurrent state width and recurrent layers.

    cell : str
      ``'lstm'`` or ``'gru'``.

    n_classes : int
      Number of classes.
    """

    def __init__(
        self,
        vocab: int = 1000,
        d_embed: int = 128,
        hidden: int = 256,
        n_layers: int = 2,
        cell: str = "lstm",
        n_classes: int = 10,
    ) -> None:
        super().__init__()
        rnn_cls = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.embed = nn.Embedding(vocab, d_embed)
        self.rnn = rnn_cls(d_embed, hidden, num_layers=n_layers, batch_first=True)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(X))
        return self.head(out.mean(dim=1))


# ---- data -----------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    """Pre-generated tensors shared by all contenders.

    Attributes
    ----------
    X, y : torch.Tensor
      Training features and int64 labels (for ``predict`` workloads: the
      rows that are predicted).

    X_eval, y_eval : torch.Tensor
      Held-out rows for the accuracy of trained models.
    """

    X: torch.Tensor
    y: torch.Tensor
    X_eval: torch.Tensor
    y_eval: torch.Tensor


def _split(X: torch.Tensor, y: torch.Tensor, n: int) -> Data:
    return Data(X[:n], y[:n], X[n:], y[n:])


def _cluster_data(
    seed: int, n: int, n_eval: int, n_features: int, n_classes: int
) -> Data:
    """Gaussian clusters, one random mean per class (learnable in a few
    hundred steps); the means are about four standard deviations apart."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(n_classes, n_features, generator=g) * (3.0 / n_features**0.5)
    y = torch.randint(0, n_classes, (n + n_eval,), generator=g)
    X = means[y] + torch.randn(n + n_eval, n_features, generator=g)
    return _split(X, y, n)


def _image_data(
    seed: int, n: int, n_eval: int, size: int, n_classes: int
) -> Data:
    """Noisy images of one smooth random template per class."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(n_classes, 3, 8, 8, generator=g)
    templates = nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")
    y = torch.randint(0, n_classes, (n + n_eval,), generator=g)
    X = templates[y] + torch.randn(n + n_eval, 3, size, size, generator=g)
    return _split(X, y, n)


def _token_data(
    seed: int, n: int, n_eval: int, vocab: int, seq_len: int, n_classes: int
) -> Data:
    """Random token sequences; the label's marker token (its class index)
    is planted at a quarter of the positions."""
    g = torch.Generator().manual_seed(seed)
    total = n + n_eval
    X = torch.randint(n_classes, vocab, (total, seq_len), generator=g)
    y = torch.randint(0, n_classes, (total,), generator=g)
    n_marks = max(1, seq_len // 4)
    positions = torch.rand(total, seq_len, generator=g).argsort(dim=1)[:, :n_marks]
    X.scatter_(1, positions, y[:, None].expand(-1, n_marks))
    return _split(X, y, n)


def _lm_data(seed: int, n: int, n_eval: int, vocab: int, seq_len: int) -> Data:
    """The decoder's data (see :func:`ampnet_bench.gpu_models.next_token_data`)."""
    from ampnet_bench.gpu_models import next_token_data

    X, y = next_token_data(seed, n, n_eval, vocab, seq_len)
    return _split(X, y, n)


# ---- workloads ------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A speed target (see the README's Benchmark section), checked against a comparison.

    Attributes
    ----------
    comparison : str
      Key of the comparison (see :data:`ampnet_bench.runner.COMPARISONS`).

    op : str
      ``'>='``, ``'<='``, ``'<'`` or ``'>'``.

    value : float
      The threshold.
    """

    comparison: str
    op: str
    value: float

    def met(self, measured: float) -> bool:
        """Whether ``measured`` meets the target."""
        return {
            ">=": measured >= self.value,
            "<=": measured <= self.value,
            ">": measured > self.value,
            "<": measured < self.value,
        }[self.op]

    def text(self) -> str:
        """The target as text, e.g. ``'>= 2.0'``."""
        return f"{self.op} {self.value:g}"


@dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Attributes
    ----------
    name : str
      Key used by ``--workload``.

    title : str
      Human-readable description for the report.

    task : str
      ``'train'`` (time training epochs) or ``'predict'`` (time
      ``predict_proba`` calls over all rows).

    batch_size : int
      Batch size (training, or prediction for ``predict``).

    n_samples : int
      Rows per epoch (or per ``predict_proba`` call).

    n_eval : int
      Held-out rows for the accuracy.

    module_factory : callable
      Builds the module (called after ``torch.manual_seed``).

    data_factory : callable
      ``data_factory(seed, n_samples, n_eval) -> Data``.

    channels_last : bool
      Whether the module's weights are converted to channels_last.

    targets : tuple of Target
      The speed targets that apply to this workload (not checked in quick mode).

    criterion : callable
      Builds the loss module (``nn.CrossEntropyLoss``; the decoder's:
      :class:`ampnet_bench.gpu_models.TokenCrossEntropy`).
    """

    name: str
    title: str
    task: str
    batch_size: int
    n_samples: int
    n_eval: int
    module_factory: Callable[[], nn.Module]
    data_factory: Callable[[int, int, int], Data]
    channels_last: bool = False
    targets: tuple[Target, ...] = field(default=())
    criterion: Callable[[], nn.Module] = nn.CrossEntropyLoss

    @property
    def n_batches(self) -> int:
        """Batches per epoch (the last one may be short)."""
        return -(-self.n_samples // self.batch_size)

    def build_module(self, seed: int) -> nn.Module:
        """A freshly initialized module; the same weights for the same seed."""
        torch.manual_seed(seed)
        module = self.module_factory()
        if self.channels_last:
            module = module.to(memory_format=torch.channels_last)
        return module

    def make_data(self, seed: int) -> Data:
        """The workload's data; the same tensors for the same seed."""
        return self.data_factory(seed, self.n_samples, self.n_eval)


_AMP_VS_RAW = Target("ampnet_mixed_vs_raw_amp", "<=", 1.03)
_PURE_VS_MIXED = Target("pure_vs_mixed", "<", 1.0)
#: Issue 12's speed targets (stated for AdamW; where the contender cannot run, e.g. torch's
#: fused CPU SGD with bf16 weights, the comparison has no median and is not judged).
_BEST_VS_PEERS = Target("pure_comp_fused_vs_fastest_peer", ">=", 1.15)
_COMP_VS_MIXED = Target("pure_comp_vs_mixed", "<=", 0.90)
#: Issue 20's targets: AmpNet with AMP on and default settings, and amp_enabled='auto' (its
#: probe included), at least 1.3x the fastest peer and at least 0.97x the best hand-written loop.
_FAST_DEFAULTS = (
    Target("ampnet_mixed_vs_fastest_peer", ">=", 1.3), Target("ampnet_mixed_vs_best_loop", "<=", 1 / 0.97),
    Target("ampnet_auto_vs_fastest_peer", ">=", 1.3), Target("ampnet_auto_vs_best_loop", "<=", 1 / 0.97),
)


#: Issue 27's targets for the workloads people train with AMP: AmpNet with default settings at
#: least as fast as the fastest peer and at least 0.95x the fused autocast loop; ``amp_enabled='auto'``
#: (its probe included) at least 0.97x the fastest of the float32 loop and the fused autocast loop.
_NEW_WORKLOAD_TARGETS = (
    Target("ampnet_mixed_vs_fastest_peer", ">=", 1.0), Target("ampnet_mixed_vs_best_loop", "<=", 1 / 0.95),
    Target("ampnet_auto_vs_fastest_loop", ">=", 0.97),
)

# Rows per epoch of the transformer, the ResNet and the RNN (full sizes) are chosen so that one
# workload's docs measurement (9 contenders x 3 rounds, each run a fresh process of 1 warm-up and 2
# measured epochs) takes a few minutes on a quiet 2-core CPU with AVX512-BF16 (no AMX), where one
# float32 step took about 0.6 s (transformer, batch 16), 0.25 s (ResNet-18, batch 32) and 0.06 s
# (LSTM, batch 32; about 1.2 s under bf16 autocast): 2, 4 and 2 batches per epoch. On a GPU, pass
# --n-samples (``--check`` runs 4x these rows).

#: Model sizes of the workloads built from a dict of sizes: ``(full, quick)`` per workload.
#: ``get_workload(..., dims={...})`` (``--dims key=value,...``) overrides single entries.
MODEL_DIMS: "Mapping[str, tuple[Mapping[str, Any], Mapping[str, Any]]]" = MappingProxyType({
    "transformer": (
        MappingProxyType(dict(vocab=1000, seq_len=128, d_model=256, n_heads=4, d_ff=1024, n_layers=4)),
        MappingProxyType(dict(vocab=200, seq_len=16, d_model=32, n_heads=2, d_ff=64, n_layers=1)),
    ),
    "resnet": (
        MappingProxyType(dict(size=64, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2))),
        MappingProxyType(dict(size=16, widths=(8, 16, 32, 64), blocks=(1, 1, 1, 1))),
    ),
    "rnn": (
        MappingProxyType(dict(vocab=1000, seq_len=64, d_embed=128, hidden=256, n_layers=2, cell="lstm")),
        MappingProxyType(dict(vocab=200, seq_len=12, d_embed=16, hidden=32, n_layers=1, cell="lstm")),
    ),
    "resnet50": (
        MappingProxyType(dict(size=224, widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3))),
        MappingProxyType(dict(size=32, widths=(4, 8, 16, 32), blocks=(1, 1, 1, 1))),
    ),
    "encoder": (
        MappingProxyType(dict(vocab=30522, seq_len=128, d_model=768, n_heads=12, d_ff=3072, n_layers=12)),
        MappingProxyType(dict(vocab=200, seq_len=16, d_model=32, n_heads=2, d_ff=64, n_layers=1)),
    ),
    "decoder": (
        MappingProxyType(dict(vocab=50304, seq_len=256, d_model=768, n_heads=12, d_ff=3072, n_layers=12)),
        MappingProxyType(dict(vocab=256, seq_len=16, d_model=32, n_heads=2, d_ff=64, n_layers=1)),
    ),
})

#: Issue 37's targets on the GPU workloads: AmpNet with default settings at most 1.03x the careful loop's
#: time (the best hand-written loop), and on the ResNet-50 and the encoder AMP at least 1.5x faster than
#: float32 with IEEE matmuls and convolutions (TF32 off).
_GPU_TARGETS = (Target("ampnet_mixed_vs_careful", "<=", 1.03),)
_AMP_PAYS = Target("ampnet_mixed_vs_careful_ieee", ">=", 1.5)
#: Issue 37's targets on the overhead workload: AmpNet's default at most 1.10x the careful loop's time
#: and faster than skorch (float32); AmpNet with AMP off faster than skorch.
_OVERHEAD_TARGETS = (
    Target("ampnet_mixed_vs_careful", "<=", 1.10), Target("ampnet_mixed_vs_skorch", ">", 1.0),
    Target("ampnet_fp32_vs_skorch", "<", 1.0),
)


def _dims(name: str, quick: bool, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model sizes of a workload: its full or quick defaults with ``overrides`` applied."""
    defaults = dict(MODEL_DIMS[name][1 if quick else 0])
    unknown = sorted(set(overrides or ()) - set(defaults))
    if unknown:
        raise ValueError(
            f"workload {name!r} has no size {', '.join(map(repr, unknown))}; its sizes are "
            f"{', '.join(sorted(defaults))}"
        )
    for key, value in (overrides or {}).items():
        default = defaults[key]
        if isinstance(default, tuple):
            parts = value.split("-") if isinstance(value, str) else value
            defaults[key] = tuple(int(v) for v in parts)
        else:
            defaults[key] = type(default)(value)
    return defaults


def _resnet_implementation(widths: tuple[int, ...], blocks: tuple[int, ...]) -> str:
    if tuple(widths) == (64, 128, 256, 512) and tuple(blocks) == (2, 2, 2, 2):
        return "torchvision resnet18" if torchvision_available() else "ResNet-18 written out"
    return f"ResNet written out ({'-'.join(map(str, blocks))} blocks)"


def _no_dims(name: str, dims: Mapping[str, Any] | None) -> None:
    if dims:
        raise ValueError(f"workload {name!r} takes no sizes (--dims); {', '.join(MODEL_DIMS)} do")


def get_workload(
    name: str,
    quick: bool = False,
    batch_size: int | None = None,
    n_samples: int | None = None,
    channels_last: bool = False,
    dims: Mapping[str, Any] | None = None,
) -> Workload:
    """Build a workload by name.

    Parameters
    ----------
    name : str
      One of :data:`WORKLOAD_NAMES` or :data:`GPU_WORKLOADS`.

    quick : bool
      Tiny sizes (CI and smoke tests); no speed target is checked.

    batch_size, n_samples : int or None
      Override the workload's defaults.

    channels_last : bool
      Use the channels_last memory format (``cnn`` and ``resnet``; ignored elsewhere).

    dims : mapping or None
      Model sizes that override the workload's defaults (:data:`MODEL_DIMS`:
      ``transformer``, ``resnet`` and ``rnn``); e.g. ``{"d_model": 128}``,
      ``{"widths": "8-16-32-64"}``; values may be strings (the command line's).

    Returns
    -------
    Workload
    """
    if name in ("mlp", "cnn", "predict"):
        _no_dims(name, dims)
    if name == "mlp":
        sizes = (256, 512, 512, 10) if quick else (1024, 2048, 2048, 10)
        wl = Workload(
            name="mlp",
            title=f"MLP {'-'.join(map(str, sizes))}",
            task="train",
            batch_size=256,
            n_samples=1024 if quick else 8192,
            n_eval=512 if quick else 2048,
            module_factory=functools.partial(MLP, sizes),
            data_factory=functools.partial(
                _cluster_data, n_features=sizes[0], n_classes=sizes[-1]
            ),
            targets=(Target("ampnet_mixed_speedup", ">=", 2.0), _AMP_VS_RAW, _PURE_VS_MIXED,
                     _BEST_VS_PEERS, _COMP_VS_MIXED, *_FAST_DEFAULTS),
        )
    elif name == "cnn":
        size = 16 if quick else 64
        channels = (8, 16, 32) if quick else (32, 64, 128)
        wl = Workload(
            name="cnn",
            title=(
                f"CNN with BatchNorm, 3x{size}x{size} images, channels "
                f"{'-'.join(map(str, channels))}"
                + (", channels_last" if channels_last else "")
            ),
            task="train",
            batch_size=64,
            n_samples=256 if quick else 1024,
            n_eval=128 if quick else 512,
            module_factory=functools.partial(
                ConvNet, channels, 10, channels_last
            ),
            data_factory=functools.partial(_image_data, size=size, n_classes=10),
            channels_last=channels_last,
            targets=(_AMP_VS_RAW, _PURE_VS_MIXED, _BEST_VS_PEERS, _COMP_VS_MIXED),
        )
    elif name == "transformer":
        d = _dims(name, quick, dims)
        wl = Workload(
            name="transformer",
            title=(
                f"Transformer encoder classifier, {d['n_layers']} layer{'s' if d['n_layers'] > 1 else ''}, "
                f"d_model {d['d_model']}, {d['n_heads']} heads, seq {d['seq_len']}"
            ),
            task="train",
            batch_size=32 if quick else 16,
            n_samples=128 if quick else 32,
            n_eval=64,
            module_factory=functools.partial(TransformerClassifier, n_classes=10, **d),
            data_factory=functools.partial(
                _token_data, vocab=d["vocab"], seq_len=d["seq_len"], n_classes=10
            ),
            targets=(_AMP_VS_RAW, _PURE_VS_MIXED, *_NEW_WORKLOAD_TARGETS),
        )
    elif name == "resnet":
        d = _dims(name, quick, dims)
        size = d.pop("size")
        implementation = _resnet_implementation(d["widths"], d["blocks"])
        wl = Workload(
            name="resnet",
            title=(
                f"{implementation} (BatchNorm), 3x{size}x{size} images, widths "
                f"{'-'.join(map(str, d['widths']))}" + (", channels_last" if channels_last else "")
            ),
            task="train",
            batch_size=32,
            n_samples=128,
            n_eval=64,
            module_factory=functools.partial(resnet18_module, 10, channels_last=channels_last, **d),
            data_factory=functools.partial(_image_data, size=size, n_classes=10),
            channels_last=channels_last,
            targets=(_AMP_VS_RAW, _PURE_VS_MIXED, *_NEW_WORKLOAD_TARGETS),
        )
    elif name == "rnn":
        d = _dims(name, quick, dims)
        seq_len = d.pop("seq_len")
        wl = Workload(
            name="rnn",
            title=(
                f"{d['cell'].upper()} classifier, {d['n_layers']} layer{'s' if d['n_layers'] > 1 else ''}, "
                f"hidden {d['hidden']}, embedding {d['d_embed']}, seq {seq_len}"
            ),
            task="train",
            batch_size=32,
            n_samples=128 if quick else 64,
            n_eval=64,
            module_factory=functools.partial(RNNClassifier, n_classes=10, **d),
            data_factory=functools.partial(
                _token_data, vocab=d["vocab"], seq_len=seq_len, n_classes=10
            ),
            targets=(_AMP_VS_RAW, _PURE_VS_MIXED, *_NEW_WORKLOAD_TARGETS),
        )
    elif name == "overhead":
        _no_dims(name, dims)
        sizes = (20, 32, 2)
        steps = 20 if quick else OVERHEAD_STEPS
        wl = Workload(
            name="overhead",
            title=f"Trainer overhead: MLP 20-32-2, {steps} steps an epoch (the compute is negligible)",
            task="train",
            batch_size=32,
            n_samples=32 * steps,
            n_eval=512,
            module_factory=functools.partial(MLP, sizes),
            data_factory=functools.partial(_cluster_data, n_features=20, n_classes=2),
            targets=_OVERHEAD_TARGETS,
        )
    elif name == "resnet50":
        from ampnet_bench.gpu_models import ResNet50

        d = _dims(name, quick, dims)
        size = d.pop("size")
        wl = Workload(
            name="resnet50",
            title=(f"ResNet-50 written out (bottleneck blocks {'-'.join(map(str, d['blocks']))}, BatchNorm), "
                   f"3x{size}x{size} images, widths {'-'.join(map(str, d['widths']))}"
                   + (", channels_last" if channels_last else "")),
            task="train",
            batch_size=16 if quick else 64,
            n_samples=32 if quick else 64 * 16,
            n_eval=16 if quick else 64,
            # 1000 outputs (ImageNet's head); the synthetic images have 10 classes
            module_factory=functools.partial(ResNet50, 1000 if not quick else 10, **d),
            data_factory=functools.partial(_image_data, size=size, n_classes=10),
            channels_last=channels_last,
            targets=(*_GPU_TARGETS, _AMP_PAYS),
        )
    elif name == "encoder":
        d = _dims(name, quick, dims)
        wl = Workload(
            name="encoder",
            title=(f"BERT-base-sized encoder (nn.TransformerEncoder), {d['n_layers']} layers, d_model "
                   f"{d['d_model']}, {d['n_heads']} heads, seq {d['seq_len']}, vocabulary {d['vocab']}"),
            task="train",
            batch_size=16 if quick else 32,
            n_samples=32 if quick else 32 * 16,
            n_eval=16 if quick else 64,
            module_factory=functools.partial(TransformerClassifier, n_classes=2, **d),
            data_factory=functools.partial(_token_data, vocab=d["vocab"], seq_len=d["seq_len"], n_classes=2),
            targets=(*_GPU_TARGETS, _AMP_PAYS),
        )
    elif name == "decoder":
        from ampnet_bench.gpu_models import DecoderLM, TokenCrossEntropy

        d = _dims(name, quick, dims)
        wl = Workload(
            name="decoder",
            title=(f"GPT-2-small-sized decoder (causal mask, next-token loss), {d['n_layers']} layers, d_model "
                   f"{d['d_model']}, {d['n_heads']} heads, seq {d['seq_len']}, vocabulary {d['vocab']}"),
            task="train",
            batch_size=8 if quick else 16,
            n_samples=16 if quick else 16 * 16,
            n_eval=8,
            module_factory=functools.partial(DecoderLM, **d),
            data_factory=functools.partial(_lm_data, vocab=d["vocab"], seq_len=d["seq_len"]),
            targets=_GPU_TARGETS,
            criterion=TokenCrossEntropy,
        )
    elif name == "predict":
        sizes = (256, 512, 512, 10) if quick else (1024, 2048, 2048, 10)
        wl = Workload(
            name="predict",
            title=f"predict_proba, MLP {'-'.join(map(str, sizes))}",
            task="predict",
            batch_size=1024,
            n_samples=2048 if quick else 16384,
            n_eval=0,
            module_factory=functools.partial(MLP, sizes),
            data_factory=functools.partial(
                _cluster_data, n_features=sizes[0], n_classes=sizes[-1]
            ),
            targets=(Target("ampnet_mixed_speedup", ">=", 1.5),),
        )
    else:
        raise ValueError(
            f"Unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES + GPU_WORKLOADS)} or 'all'."
        )
    changes = {}
    if batch_size is not None:
        changes["batch_size"] = batch_size
    if n_samples is not None:
        changes["n_samples"] = n_samples
    if changes:
        wl = replace(wl, **changes)
    return wl
