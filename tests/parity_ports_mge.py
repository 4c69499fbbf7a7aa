"""The MegEngine side of tests/parity_ports_torch.py, written as MegEngine/Models writes its
ResNet (``F.relu`` in the forward, BatchNorm momentum 0.9) and its BERT (``M.LayerNorm``).

``seen=False`` hides the ResNet's ReLUs from the parity tool, which watches ``F.relu`` and
``F.maximum`` while it runs a step: they are called through a ``functools.partial`` made at
import time, which it does not look into (a ReLU watched on the torch side only)."""

from __future__ import annotations

import functools
import math

import megengine.functional as F
import megengine.module as M
import numpy as np
from megengine.autodiff import Function

HIDDEN = {"relu": functools.partial(F.relu), "maximum": functools.partial(F.maximum)}


class MaskLessReLU(Function):
    """A hand-written ReLU whose backward forgets the mask (a backward-only bug)."""

    def __init__(self, seen: bool = True) -> None:
        super().__init__()
        self.maximum = F.maximum if seen else HIDDEN["maximum"]

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.maximum(x, 0)

    def backward(self, grad):  # noqa: ANN001, ANN201
        return grad


def _relu(maskless: bool, seen: bool = True):
    if maskless:
        return lambda x: MaskLessReLU(seen)(x)
    return F.relu if seen else HIDDEN["relu"]


class BasicBlock(M.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, maskless: bool = False,
                 seen: bool = True) -> None:
        super().__init__()
        self.relu = _relu(maskless, seen)
        self.conv1 = M.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = M.BatchNorm2d(cout)
        self.conv2 = M.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = M.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = M.Sequential(M.Conv2d(cin, cout, 1, stride, bias=False),
                                           M.BatchNorm2d(cout))

    def forward(self, x):  # noqa: ANN001, ANN201
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(M.Module):
    def __init__(self, avg_stem: bool = False, momentum: float = 0.9,
                 maskless_relu: bool = False, seen: bool = True) -> None:
        super().__init__()
        self.relu = _relu(maskless_relu, seen)
        self.conv1 = M.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = M.BatchNorm2d(8, momentum=momentum)
        self.maxpool = M.AvgPool2d(2) if avg_stem else M.MaxPool2d(2)
        blocks = {"maskless": maskless_relu, "seen": seen}
        self.layer1 = M.Sequential(BasicBlock(8, 8, **blocks), BasicBlock(8, 8, **blocks))
        self.layer2 = M.Sequential(BasicBlock(8, 16, 2, **blocks))
        self.avgpool = M.AdaptiveAvgPool2d(1)
        self.fc = M.Linear(16, 10)
        for m in self.modules():
            if isinstance(m, M.BatchNorm2d):
                m.momentum = momentum

    def forward(self, x):  # noqa: ANN001, ANN201
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(F.flatten(self.avgpool(x), 1))


class Attention(M.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key = M.Linear(hidden, hidden), M.Linear(hidden, hidden)
        self.value, self.dense = M.Linear(hidden, hidden), M.Linear(hidden, hidden)
        self.LayerNorm = M.LayerNorm(hidden, eps=eps)

    def forward(self, x):  # noqa: ANN001, ANN201
        n, t, h = x.shape
        split = lambda y: y.reshape(n, t, self.heads, h // self.heads).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = F.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(h // self.heads)
        context = F.matmul(F.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(n, t, h)
        return self.LayerNorm(self.dense(context) + x)


class Bert(M.Module):
    def __init__(self, vocab: int = 40, hidden: int = 32, eps: float = 1e-12) -> None:
        super().__init__()
        self.word_embeddings = M.Embedding(vocab, hidden)
        self.position_embeddings = M.Embedding(16, hidden)
        self.emb_norm = M.LayerNorm(hidden, eps=eps)
        self.attention = Attention(hidden, 2, eps)
        self.intermediate = M.Linear(hidden, 2 * hidden)
        self.act = M.GELU()
        self.output = M.Linear(2 * hidden, hidden)
        self.out_norm = M.LayerNorm(hidden, eps=eps)
        self.pooler = M.Linear(hidden, hidden)
        self.classifier = M.Linear(hidden, 3)

    def forward(self, ids):  # noqa: ANN001, ANN201
        positions = F.arange(ids.shape[1], dtype=np.int32)
        x = self.emb_norm(self.word_embeddings(ids) + self.position_embeddings(positions))
        x = self.attention(x)
        x = self.out_norm(self.output(self.act(self.intermediate(x))) + x)
        return self.classifier(F.tanh(self.pooler(x[:, 0])))


def cross_entropy(output, target):  # noqa: ANN001, ANN201
    return F.nn.cross_entropy(output, target.astype("int32"))
