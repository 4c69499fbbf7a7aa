"""Two models written as a porting user writes them in PyTorch, for the parity tool's tests of
issue 36 (tests/test_parity_false_oks.py): a small ResNet in torchvision's style (one ReLU
module called several times, a max-pool stem) and a small BERT whose LayerNorm is the port's
own class (``variance_epsilon``, as the original BERT code has it). Each takes the keywords of
the broken ports the tests build."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MaskLessReLU(torch.autograd.Function):
    """A hand-written ReLU whose backward forgets the mask (a backward-only bug)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, relu=None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = relu or nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """conv-bn-relu-maxpool stem, two stages of basic blocks, global average pool, fc."""

    def __init__(self, avg_stem: bool = False, momentum: float = 0.1,
                 maskless_relu: bool = False, stem_names: bool = False) -> None:
        super().__init__()
        self.maskless = maskless_relu
        relu = _FunctionRelu() if maskless_relu else None
        conv, bn = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8, momentum=momentum)
        if stem_names:  # a port that names its stem differently
            self.stem = nn.Sequential(conv, bn)
        else:
            self.conv1, self.bn1 = conv, bn
        self.relu = relu or nn.ReLU(inplace=True)
        self.maxpool = nn.AvgPool2d(2) if avg_stem else nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(8, 8, relu=relu), BasicBlock(8, 8, relu=relu))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2, relu=relu))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x) if hasattr(self, "stem") else self.bn1(self.conv1(x))
        x = self.maxpool(self.relu(x))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _FunctionRelu(nn.Module):
    """Not a ReLU module the tool knows: its class is the port's own (kind ``_functionrelu``)
    and its work a hand-written autograd Function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MaskLessReLU.apply(x)


class BertLayerNorm(nn.Module):
    """The original BERT code's LayerNorm: eps inside the square root, as ``variance_epsilon``."""

    def __init__(self, hidden: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - u) / torch.sqrt(s + self.variance_epsilon) + self.bias


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, norm) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.value, self.dense = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.LayerNorm = norm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        split = lambda y: y.view(n, t, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
        context = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(n, t, h)
        return self.LayerNorm(self.dense(context) + x)


class Bert(nn.Module):
    """Embeddings (word, position) + LayerNorm, one encoder layer, pooler, classifier; every
    LayerNorm the port's own ``BertLayerNorm`` unless ``torch_norm``."""

    def __init__(self, vocab: int = 40, hidden: int = 32, eps: float = 1e-12,
                 torch_norm: bool = False) -> None:
        super().__init__()
        norm = (lambda n: nn.LayerNorm(n, eps=eps)) if torch_norm else (
            lambda n: BertLayerNorm(n, eps))
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(16, hidden)
        self.emb_norm = norm(hidden)
        self.attention = Attention(hidden, 2, norm)
        self.intermediate = nn.Linear(hidden, 2 * hidden)
        self.act = nn.GELU()
        self.output = nn.Linear(2 * hidden, hidden)
        self.out_norm = norm(hidden)
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.emb_norm(self.word_embeddings(ids) + self.position_embeddings(positions))
        x = self.attention(x)
        x = self.out_norm(self.output(self.act(self.intermediate(x))) + x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target.long())
