"""Small real models for the parity tool's tests, PyTorch side: each also comes as a broken
port (the bug named by a keyword), written as a porting user would get it wrong."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TransposedLinear(nn.Linear):
    """A port that multiplies by the weight as stored (x @ W, not x @ W.T)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class MLP(nn.Module):
    def __init__(self, transposed: bool = False, no_bias: bool = False, leaky: bool = False,
                 inplace: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.LeakyReLU(0.1) if leaky else nn.ReLU(inplace=inplace)
        self.fc2 = (TransposedLinear if transposed else nn.Linear)(32, 32)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4, bias=not no_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class CNN(nn.Module):
    """Conv + BatchNorm (training mode) + ReLU + pooling + Linear."""

    def __init__(self, bn_eps: float = 1e-5, padding: int = 1, momentum: float = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, momentum=momentum)
        self.relu1 = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=padding)
        self.bn2 = nn.BatchNorm2d(16, eps=bn_eps)
        self.relu2 = nn.ReLU(inplace=True)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu1(self.bn1(self.conv1(x))))
        x = self.gap(self.relu2(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))


class Block(nn.Module):
    """A pre-norm MLP block of a Transformer: LayerNorm, Linear, GELU, Linear, residual."""

    def __init__(self, ln_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16, eps=ln_eps)
        self.up = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target.long())


class TiedLM(nn.Module):
    """An embedding whose weight the output layer reuses (GPT's wte / lm_head: ``tied``), or
    not."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(t))))


class Shared(nn.Module):
    """Two Linears on one weight (``tied``), each with its own bias, or on their own."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        if tied:
            self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class SharedLayer(nn.Module):
    """One Linear under two names, called twice (ALBERT-style sharing: ``self.b = self.a``,
    ``shared``), or two Linears."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = self.a if shared else nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class TwoAttributes(nn.Module):
    """One module holding its weight under two attribute names (``self.w2 = self.w``,
    ``tied``), used once under each, or two weights."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.w2 = self.w if tied else nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w.T) @ self.w2.T


class TiedInOneModule(nn.Module):
    """TwoAttributes (``core``) and a Linear head."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.core, self.head = TwoAttributes(tied), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.core(x))


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8))


class SharedBlock(nn.Module):
    """One block of three layers under two names (``second = first``, ``shared``), called
    once under each, or two blocks; then a head."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.first = _block()
        self.second = self.first if shared else _block()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


class BlockCalledTwice(nn.Module):
    """One block called twice under its one name (``shared``), or a second block
    (``again``) called the second time; then a head."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.block, self.head = _block(), nn.Linear(8, 4)
        self.again = None if shared else _block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        again = self.block if self.again is None else self.again
        return self.head(again(self.block(x)))
