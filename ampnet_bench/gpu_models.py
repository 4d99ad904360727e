"""Models sized for a GPU, written out (torchvision is not a dependency): a
ResNet-50, a GPT-2-small-sized decoder language model and its per-token
loss, and the decoder's synthetic data. The BERT-base-sized encoder is
:class:`ampnet_bench.workloads.TransformerClassifier` at BERT-base's sizes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet50", "DecoderLM", "TokenCrossEntropy", "next_token_data"]


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1, 3x3 (with the stride) and 1x1
    convolutions with BatchNorm, the last widening by 4, and a 1x1
    convolution with BatchNorm on the shortcut where the shape changes.

    Parameters
    ----------
    c_in : int
      Input channels.

    width : int
      Channels of the inner convolutions (the output has ``4 * width``).

    stride : int
      Stride of the 3x3 convolution (and of the shortcut).
    """

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet-50: a 7x7 stride-2 stem with BatchNorm and max pooling, four
    stages of bottleneck blocks (3, 4, 6, 3), global average pooling and a
    linear classifier (torchvision's ``resnet50(weights=None)`` structure and
    initialization: 25,557,032 parameters with 1000 classes); returns logits.

    Parameters
    ----------
    n_classes : int
      Number of classes.

    widths : tuple of int
      Inner widths of the four stages (ResNet-50: 64, 128, 256, 512).

    blocks : tuple of int
      Bottleneck blocks per stage (ResNet-50: 3, 4, 6, 3).
    """

    def __init__(
        self,
        n_classes: int = 1000,
        widths: tuple[int, ...] = (64, 128, 256, 512),
        blocks: tuple[int, ...] = (3, 4, 6, 3),
    ) -> None:
        super().__init__()
        stem = widths[0]
        self.conv1 = nn.Conv2d(3, stem, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages: list[nn.Module] = []
        c_in = stem
        for i, (width, n_blocks) in enumerate(zip(widths, blocks)):
            stage = []
            for j in range(n_blocks):
                stage.append(Bottleneck(c_in, width, 2 if (j == 0 and i > 0) else 1))
                c_in = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_in, n_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.maxpool(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class DecoderLM(nn.Module):
    """A GPT-2-style decoder language model: token and learned position
    embeddings, ``nn.TransformerEncoder`` layers (``batch_first``, pre-norm,
    GELU) under a causal mask, a final LayerNorm and a linear head over the
    vocabulary (not tied to the embedding); returns logits of shape
    ``(batch, seq_len, vocab)``.

    Parameters
    ----------
    vocab : int
      Vocabulary size.

    seq_len : int
      Sequence length.

    d_model, n_heads, d_ff, n_layers : int
      Decoder sizes (GPT-2 small: 768, 12, 3072, 12).
    """

    def __init__(
        self,
        vocab: int = 50304,
        seq_len: int = 256,
        d_model: int = 768,
        n_heads: int = 12,
        d_ff: int = 3072,
        n_layers: int = 12,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=d_ff, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        n = X.shape[1]
        h = self.embed(X) + self.pos[:n]
        h = self.blocks(h, mask=self.causal_mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


class TokenCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy over every token: logits ``(batch, seq, vocab)`` and
    targets ``(batch, seq)`` flattened to ``nn.CrossEntropyLoss``'s
    ``(N, C)`` and ``(N,)``. A subclass of ``nn.CrossEntropyLoss``, so that
    skorch's ``predict_proba`` takes the softmax over the last dimension."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(input.reshape(-1, input.shape[-1]), target.reshape(-1))


def next_token_data(seed: int, n: int, n_eval: int, vocab: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences and their next tokens: each sequence follows
    ``t[i+1] = (t[i] * 7 + 3) % vocab`` where a coin lands heads (3 of 4
    positions) and is a random token elsewhere, so a model can learn it.

    Returns
    -------
    (X, y) : tuple of torch.Tensor
      int64 tensors of shape ``(n + n_eval, seq_len)``; ``y`` is ``X``
      shifted by one position.
    """
    g = torch.Generator().manual_seed(seed)
    total = n + n_eval
    tokens = torch.empty(total, seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (total,), generator=g)
    noise = torch.randint(0, vocab, (total, seq_len), generator=g)
    follow = torch.rand(total, seq_len, generator=g) < 0.75
    for i in range(seq_len):
        rule = (tokens[:, i] * 7 + 3) % vocab
        tokens[:, i + 1] = torch.where(follow[:, i], rule, noise[:, i])
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
