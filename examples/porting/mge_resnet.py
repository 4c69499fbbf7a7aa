"""ResNet-18 in MegEngine, written the way MegEngine/Models' ResNet is written
(``official/vision/classification/resnet/model.py``).

The conventions a port to PyTorch meets here: activations are functions (``F.relu``), not
modules, so a forward hook never sees them; the shortcut is an ``M.Identity()`` module where it
changes nothing; ``x += identity`` rebinds the tensor object that ``bn2`` returned (a hook that
kept that object sees the sum later); BatchNorm keeps ``(1, C, 1, 1)`` parameters and a momentum
of 0.9 (torch's 0.1); ``named_parameters()`` lists parameters sorted by name, not in the order the
forward uses them. The final pool is a global average, so that small (32 x 32) images work
(MegEngine/Models pools with a fixed 7 x 7 window, made for 224 x 224 images).

``relu_modules=True`` writes each ReLU as an ``M.ReLU()`` module instead (one per block,
called twice, named ``relu`` as torchvision names its own). ``gradmgr.parity`` compares a
ReLU's input on both sides and pins a kink flip there either way: it hooks modules, and
watches ``F.relu`` while it runs a step (docs/porting.md, "Functional calls"). Everything else
stays as MegEngine/Models writes it.
"""

from __future__ import annotations

import math
from typing import List, Type

import megengine.functional as F
import megengine.module as M


class BasicBlock(M.Module):
    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1,
                 norm: Type[M.Module] = M.BatchNorm2d, relu_modules: bool = False) -> None:
        super().__init__()
        self.relu = M.ReLU() if relu_modules else F.relu
        self.conv1 = M.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = M.Conv2d(channels, channels, 3, 1, padding=1, bias=False)
        self.bn2 = norm(channels)
        if in_channels == channels and stride == 1:
            self.downsample = M.Identity()
        else:
            self.downsample = M.Sequential(
                M.Conv2d(in_channels, channels, 1, stride, bias=False), norm(channels)
            )

    def forward(self, x):
        identity = x
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        x += self.downsample(identity)
        return self.relu(x)


class ResNet(M.Module):
    def __init__(self, block: Type[BasicBlock], layers: List[int], num_classes: int = 10,
                 norm: Type[M.Module] = M.BatchNorm2d, relu_modules: bool = False) -> None:
        super().__init__()
        self.relu_modules = relu_modules
        self.relu = M.ReLU() if relu_modules else F.relu
        self.in_channels = 64
        self.conv1 = M.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm(64)
        self.maxpool = M.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0], norm=norm)
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2, norm=norm)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2, norm=norm)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2, norm=norm)
        self.fc = M.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, M.Conv2d):
                M.init.msra_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, M.BatchNorm2d):
                M.init.ones_(m.weight)
                M.init.zeros_(m.bias)
            elif isinstance(m, M.Linear):
                M.init.msra_uniform_(m.weight, a=math.sqrt(5))
                fan_in, _ = M.init.calculate_fan_in_and_fan_out(m.weight)
                M.init.uniform_(m.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def _make_layer(self, block: Type[BasicBlock], channels: int, blocks: int,
                    stride: int = 1, norm: Type[M.Module] = M.BatchNorm2d) -> M.Sequential:
        relu = self.relu_modules
        layers = [block(self.in_channels, channels, stride, norm=norm, relu_modules=relu)]
        self.in_channels = channels * block.expansion
        layers += [block(self.in_channels, channels, norm=norm, relu_modules=relu)
                   for _ in range(1, blocks)]
        return M.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = F.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.fc(x)


def resnet18(num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-18: four stages of two basic blocks (64, 128, 256, 512 channels)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, **kwargs)
