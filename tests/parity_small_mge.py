"""The MegEngine side of tests/parity_small_torch.py: the same models as a porting user
writes them in MegEngine (BatchNorm momentum 0.9 is PyTorch's 0.1)."""

from __future__ import annotations

import megengine as mge
import megengine.functional as F
import megengine.module as M


class TransposedLinear(M.Linear):
    """A port that multiplies by the weight as stored (x @ W, not x @ W.T)."""

    def forward(self, x):
        return F.matmul(x, self.weight) + self.bias


class MLP(M.Module):
    def __init__(self, transposed: bool = False, no_bias: bool = False,
                 leaky: bool = False) -> None:
        super().__init__()
        self.fc1 = M.Linear(16, 32)
        self.act1 = M.LeakyReLU(0.1) if leaky else M.ReLU()
        self.fc2 = (TransposedLinear if transposed else M.Linear)(32, 32)
        self.act2 = M.ReLU()
        self.fc3 = M.Linear(32, 4, bias=not no_bias)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class CNN(M.Module):
    def __init__(self, bn_eps: float = 1e-5, padding: int = 1, momentum: float = 0.9) -> None:
        super().__init__()
        self.conv1 = M.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = M.BatchNorm2d(8, momentum=momentum)
        self.relu1 = M.ReLU()
        self.pool = M.MaxPool2d(2)
        self.conv2 = M.Conv2d(8, 16, 3, padding=padding)
        self.bn2 = M.BatchNorm2d(16, eps=bn_eps)
        self.relu2 = M.ReLU()
        self.gap = M.AdaptiveAvgPool2d(1)
        self.fc = M.Linear(16, 10)

    def forward(self, x):
        x = self.pool(self.relu1(self.bn1(self.conv1(x))))
        x = self.gap(self.relu2(self.bn2(self.conv2(x))))
        return self.fc(F.flatten(x, 1))


class Block(M.Module):
    def __init__(self, ln_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = M.LayerNorm(16, eps=ln_eps)
        self.up = M.Linear(16, 64)
        self.act = M.GELU()
        self.down = M.Linear(64, 16)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def cross_entropy(output, target):
    return F.nn.cross_entropy(output, target.astype("int32"))


class TiedLM(M.Module):
    """tests/parity_small_torch.py's TiedLM: the output layer reuses the embedding's weight
    (``tied``), or has its own."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb, self.mid = M.Embedding(10, 8), M.Linear(8, 8)
        self.head = M.Linear(8, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, t):
        return self.head(F.tanh(self.mid(self.emb(t))))


class Shared(M.Module):
    """tests/parity_small_torch.py's Shared: two Linears on one weight (``tied``), each with
    its own bias, or on their own weights."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.a, self.b = M.Linear(8, 8), M.Linear(8, 8)
        if tied:
            self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(F.tanh(self.a(x)))


class SharedLayer(M.Module):
    """tests/parity_small_torch.py's SharedLayer: one Linear under two names (``shared``), or
    two Linears."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.a = M.Linear(8, 8)
        self.b = self.a if shared else M.Linear(8, 8)

    def forward(self, x):
        return self.b(F.tanh(self.a(x)))


def _weight():
    return mge.Parameter(mge.random.normal(0.0, 0.3, (8, 8)))


class TwoAttributes(M.Module):
    """tests/parity_small_torch.py's TwoAttributes: one module holding its weight under two
    attribute names (``tied``), or two weights."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.w = _weight()
        self.w2 = self.w if tied else _weight()

    def forward(self, x):
        return F.matmul(F.tanh(F.matmul(x, self.w, transpose_b=True)), self.w2,
                        transpose_b=True)


class TiedInOneModule(M.Module):
    """tests/parity_small_torch.py's TiedInOneModule."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.core, self.head = TwoAttributes(tied), M.Linear(8, 4)

    def forward(self, x):
        return self.head(self.core(x))


def _block() -> M.Module:
    return M.Sequential(M.Linear(8, 8), M.Sigmoid(), M.Linear(8, 8))


class SharedBlock(M.Module):
    """tests/parity_small_torch.py's SharedBlock: one block under two names (``shared``),
    or two blocks."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.first = _block()
        self.second = self.first if shared else _block()
        self.head = M.Linear(8, 4)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


class BlockCalledTwice(M.Module):
    """tests/parity_small_torch.py's BlockCalledTwice."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.block, self.head = _block(), M.Linear(8, 4)
        self.again = None if shared else _block()

    def forward(self, x):
        again = self.block if self.again is None else self.again
        return self.head(again(self.block(x)))
