"""ResNet-18 in PaddlePaddle, written the way ``paddle.vision.models.resnet`` writes it.

The conventions a port from PyTorch meets here: ``nn.Conv2D`` / ``nn.BatchNorm2D`` (capital D),
``bias_attr=False`` instead of ``bias=False``, BatchNorm's ``epsilon`` and a momentum of 0.9
(the weight of the old running statistic, torch's 0.1 the other way round), ``nn.ReLU()``
without ``inplace``, ``paddle.flatten`` and an ``nn.Linear`` whose weight is ``[in, out]``
(torch's ``(out, in)`` transposed). The parameter-holding layers carry torchvision's names, so
that a checkpoint's keys match, and are defined in the same order.
"""

from __future__ import annotations

from typing import List, Optional, Type

import paddle
from paddle import nn


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2D:
    return nn.Conv2D(in_planes, out_planes, 3, stride=stride, padding=1, bias_attr=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2D:
    return nn.Conv2D(in_planes, out_planes, 1, stride=stride, bias_attr=False)


class BasicBlock(nn.Layer):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Layer] = None,
                 norm_layer: Type[nn.Layer] = nn.BatchNorm2D) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Layer):
    def __init__(self, block: Type[BasicBlock], layers: List[int], num_classes: int = 10,
                 norm_layer: Type[nn.Layer] = nn.BatchNorm2D) -> None:
        super().__init__()
        self._norm_layer = norm_layer
        self.inplanes = 64
        self.conv1 = nn.Conv2D(3, 64, kernel_size=7, stride=2, padding=3, bias_attr=False)
        self.bn1 = norm_layer(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2D(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2D((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block: Type[BasicBlock], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                self._norm_layer(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, self._norm_layer)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, norm_layer=self._norm_layer)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = paddle.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet18(num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-18: four stages of two basic blocks (64, 128, 256, 512 channels)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, **kwargs)
