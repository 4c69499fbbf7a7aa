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
