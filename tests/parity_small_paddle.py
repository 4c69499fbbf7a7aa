"""Small real models for the parity tool's tests, PaddlePaddle side: the CNN and the Block of
tests/parity_small_torch.py as a porting user writes them in Paddle (a Linear weight is
[in, out]; BatchNorm momentum 0.9 is PyTorch's 0.1), each bug named by a keyword."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn


class TransposedLinear(nn.Linear):
    """A port that multiplies as PyTorch writes it (x @ W.T), on Paddle's [in, out] weight."""

    def forward(self, x):
        return paddle.matmul(x, self.weight, transpose_y=True) + self.bias


class MLP(nn.Layer):
    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU()
        self.fc2 = (TransposedLinear if transposed else nn.Linear)(32, 32)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class CNN(nn.Layer):
    """Conv + BatchNorm (training mode) + ReLU + pooling + Linear."""

    def __init__(self, bn_eps: float = 1e-5, momentum: float = 0.9) -> None:
        super().__init__()
        self.conv1 = nn.Conv2D(3, 8, 3, padding=1, bias_attr=False)
        self.bn1 = nn.BatchNorm2D(8, momentum=momentum)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2D(2)
        self.conv2 = nn.Conv2D(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2D(16, epsilon=bn_eps)
        self.relu2 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2D(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(self.relu1(self.bn1(self.conv1(x))))
        x = self.gap(self.relu2(self.bn2(self.conv2(x))))
        return self.fc(paddle.flatten(x, 1))


class Block(nn.Layer):
    """A pre-norm MLP block of a Transformer: LayerNorm, Linear, GELU, Linear, residual."""

    def __init__(self, ln_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16, epsilon=ln_eps)
        self.up = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def cross_entropy(output, target):
    return F.cross_entropy(output, target.astype("int64"))


class TiedLinear(nn.Layer):
    """An output layer on an embedding's weight ([vocab, dim]), as Paddle ports write it
    (PaddleNLP's LM heads): ``x @ W.T`` by ``transpose_y``, no nn.Linear ([in, out])."""

    def __init__(self, weight=None) -> None:
        super().__init__()
        self.weight = self.create_parameter([10, 8]) if weight is None else weight

    def forward(self, x):
        return paddle.matmul(x, self.weight, transpose_y=True)


class TiedLM(nn.Layer):
    """tests/parity_small_torch.py's TiedLM: the output layer reuses the embedding's weight
    (``tied``), or has its own."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.head = TiedLinear(self.emb.weight if tied else None)

    def forward(self, t):
        return self.head(paddle.tanh(self.mid(self.emb(t))))


class Shared(nn.Layer):
    """tests/parity_small_torch.py's Shared: two Linears on one weight (``tied``), each with
    its own bias, or on their own weights."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        if tied:
            self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(paddle.tanh(self.a(x)))


class SharedLayer(nn.Layer):
    """tests/parity_small_torch.py's SharedLayer: one Linear under two names (``shared``), or
    two Linears."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = self.a if shared else nn.Linear(8, 8)

    def forward(self, x):
        return self.b(paddle.tanh(self.a(x)))


class TwoAttributes(nn.Layer):
    """tests/parity_small_torch.py's TwoAttributes: one layer holding its weight under two
    attribute names (``tied``), or two weights."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.w = self.create_parameter([8, 8])
        self.w2 = self.w if tied else self.create_parameter([8, 8])

    def forward(self, x):
        return paddle.matmul(paddle.tanh(paddle.matmul(x, self.w, transpose_y=True)), self.w2,
                             transpose_y=True)


class TiedInOneModule(nn.Layer):
    """tests/parity_small_torch.py's TiedInOneModule."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.core, self.head = TwoAttributes(tied), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.core(x))


def _block() -> nn.Layer:
    return nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8))


class SharedBlock(nn.Layer):
    """tests/parity_small_torch.py's SharedBlock: one block under two names (``shared``),
    or two blocks."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.first = _block()
        self.second = self.first if shared else _block()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


class BlockCalledTwice(nn.Layer):
    """tests/parity_small_torch.py's BlockCalledTwice."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.block, self.head = _block(), nn.Linear(8, 4)
        self.again = None if shared else _block()

    def forward(self, x):
        again = self.block if self.again is None else self.again
        return self.head(again(self.block(x)))
