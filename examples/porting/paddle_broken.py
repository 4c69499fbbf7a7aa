"""PyTorch -> Paddle ports with one deliberate bug each, in the style of ``broken``.

The reference is the correct torch model (``torch_resnet`` / ``torch_encoder``); the broken side
is Paddle (a model of ``paddle_resnet`` / ``paddle_encoder`` with one layer written wrongly).
Every bug crashes nothing and every shape still fits. ``kind`` sorts them into issue 40's five
kinds: ``transposed`` (a weight used in the other framework's layout), ``eps`` (a
normalisation's epsilon), ``substituted`` (another layer of the same shapes), ``backward``
(the forward is exact, a hand-written backward is wrong) and ``config`` (one training step's
outputs and gradients agree; only the configuration, here BatchNorm's running statistics,
differs). ResNet-18 has one of each kind but ``transposed`` plus a wrong padding; the encoder
one of each kind but ``config`` plus a wrong attention scale: five per model, each kind at
least once. ``layer`` is the Paddle layer a check must blame (the parameter-holding layers
carry the torch model's names), ``named`` the one written wrongly where that is another.
``tests/test_paddle_ports.py`` checks that each port differs from torch where it says.

Paddle is imported when a port is built, not when this module is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict

from .broken import BrokenPort


@dataclass(frozen=True)
class PaddlePort(BrokenPort):
    kind: str = ""  # "transposed", "eps", "substituted", "backward", "config"; "padding", "scale"
    config_only: bool = False  # outputs and gradients of one step agree; the buffers do not


def encoder_transposed(**config: Any) -> Any:
    """The first layer's attention output projection computes ``x @ W.T + b``, torch's
    ``F.linear`` copied as is: Paddle's weight is already ``[in, out]``, so the transposed
    weight a transfer stores is used transposed. Square (64 x 64), so every shape fits."""
    import paddle
    import paddle.nn.functional as F
    from paddle import nn

    from . import paddle_encoder

    class OutInLinear(nn.Linear):
        def forward(self, x):  # noqa: ANN001, ANN201
            return F.linear(x, paddle.transpose(self.weight, [1, 0]), self.bias)

    cfg = paddle_encoder.EncoderConfig(**config)
    model = paddle_encoder.EncoderClassifier(cfg)
    model.layers[0].attention.out = OutInLinear(cfg.hidden, cfg.hidden)
    return model


def encoder_missing_eps(**config: Any) -> Any:
    """The embeddings' LayerNorm without BERT's ``epsilon=1e-12``: Paddle's default 1e-5, which
    shows on the embeddings' small variance (see ``broken.torch_encoder_missing_eps``)."""
    from paddle import nn

    from . import paddle_encoder

    cfg = paddle_encoder.EncoderConfig(**config)
    model = paddle_encoder.EncoderClassifier(cfg)
    model.embeddings.norm = nn.LayerNorm(cfg.hidden)
    return model


def encoder_relu_for_gelu(**config: Any) -> Any:
    """The first layer's feed-forward activation written as ``nn.ReLU`` where BERT has GELU."""
    from paddle import nn

    from . import paddle_encoder

    model = paddle_encoder.EncoderClassifier(paddle_encoder.EncoderConfig(**config))
    model.layers[0].act = nn.ReLU()
    return model


def encoder_gelu_backward(**config: Any) -> Any:
    """The second layer's GELU as a hand-written ``PyLayer`` whose backward keeps only
    ``Phi(x)`` of the derivative ``Phi(x) + x * phi(x)``: the forward is exact."""
    import paddle
    import paddle.nn.functional as F
    from paddle import nn
    from paddle.autograd import PyLayer

    from . import paddle_encoder

    class HalfGELU(PyLayer):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x)
            return F.gelu(x)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            (x,) = ctx.saved_tensor()
            return grad * 0.5 * (1.0 + paddle.erf(x / math.sqrt(2.0)))

    class FusedGELU(nn.GELU):
        def forward(self, x):  # noqa: ANN001, ANN201
            return HalfGELU.apply(x)

    model = paddle_encoder.EncoderClassifier(paddle_encoder.EncoderConfig(**config))
    model.layers[1].act = FusedGELU()
    return model


def encoder_attention_scale(**config: Any) -> Any:
    """The first layer's attention scores divided by ``sqrt(hidden)`` instead of
    ``sqrt(head_dim)``: the first layer whose output shows it is the attention's dropout
    (p=0), which takes the softmax's output."""
    import paddle

    from . import paddle_encoder

    class WideScaleAttention(paddle_encoder.SelfAttention):
        def scores(self, q, k):  # noqa: ANN001, ANN201
            return paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.heads * self.head_dim)

    cfg = paddle_encoder.EncoderConfig(**config)
    model = paddle_encoder.EncoderClassifier(cfg)
    model.layers[0].attention = WideScaleAttention(cfg)
    return model


def resnet_wrong_eps(**options: Any) -> Any:
    """The first BatchNorm of ``layer2.0`` with ``epsilon=1e-3`` instead of 1e-5."""
    from paddle import nn

    from . import paddle_resnet

    model = paddle_resnet.resnet18(**options)
    model.layer2[0].bn1 = nn.BatchNorm2D(128, epsilon=1e-3)
    return model


def resnet_avg_stem(**options: Any) -> Any:
    """The stem's 3 x 3 max pool written as an average pool of the same size, stride and
    padding."""
    from paddle import nn

    from . import paddle_resnet

    model = paddle_resnet.resnet18(**options)
    model.maxpool = nn.AvgPool2D(kernel_size=3, stride=2, padding=1)
    return model


def resnet_reflect_padding(**options: Any) -> Any:
    """The second conv of ``layer1.1`` pads by reflection instead of with zeros."""
    from paddle import nn

    from . import paddle_resnet

    model = paddle_resnet.resnet18(**options)
    model.layer1[1].conv2 = nn.Conv2D(64, 64, 3, padding=1, bias_attr=False,
                                      padding_mode="reflect")
    return model


def resnet_maskless_relu(**options: Any) -> Any:
    """``layer3.0``'s ReLU as a hand-written memory-saving ``PyLayer`` whose backward forgets
    the mask: the forward is exact, only the gradients before it are wrong."""
    import paddle
    from paddle import nn
    from paddle.autograd import PyLayer

    from . import paddle_resnet

    class PassThroughReLU(PyLayer):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return paddle.clip(x, min=0.0)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            return grad

    class SavingReLU(nn.ReLU):
        def forward(self, x):  # noqa: ANN001, ANN201
            return PassThroughReLU.apply(x)

    model = paddle_resnet.resnet18(**options)
    model.layer3[0].relu = SavingReLU()
    return model


def resnet_copied_momentum(**options: Any) -> Any:
    """Every BatchNorm with torch's ``momentum=0.1`` copied as is: Paddle's momentum is the
    weight of the old running statistic (default 0.9), so the port's running statistics follow
    each batch nine times as fast. One training step's outputs and gradients are unchanged;
    the running mean and variance after it differ."""
    from paddle import nn

    from . import paddle_resnet

    class TorchMomentumBN(nn.BatchNorm2D):
        def __init__(self, num_features: int) -> None:
            super().__init__(num_features, momentum=0.1)

    return paddle_resnet.resnet18(norm_layer=TorchMomentumBN, **options)


PORTS: Dict[str, PaddlePort] = {
    "transposed_weight": PaddlePort(
        "paddle", "encoder", "layers.0.attention.out",
        "torch's x @ W.T kept, so the [in, out] weight is used transposed",
        encoder_transposed, kind="transposed"),
    "missing_eps": PaddlePort(
        "paddle", "encoder", "embeddings.norm",
        "LayerNorm epsilon 1e-5 (Paddle's default) instead of BERT's 1e-12",
        encoder_missing_eps, kind="eps"),
    "relu_for_gelu": PaddlePort(
        "paddle", "encoder", "layers.0.act", "ReLU where BERT has GELU",
        encoder_relu_for_gelu, kind="substituted"),
    "gelu_backward": PaddlePort(
        "paddle", "encoder", "layers.1.act",
        "a hand-written GELU whose backward drops x * phi(x)", encoder_gelu_backward,
        backward_only=True, kind="backward"),
    "attention_scale": PaddlePort(
        "paddle", "encoder", "layers.0.attention.dropout",
        "attention scores over sqrt(hidden) instead of sqrt(head_dim)",
        encoder_attention_scale, named="layers.0.attention", kind="scale"),
    "wrong_eps": PaddlePort(
        "paddle", "resnet18", "layer2.0.bn1", "BatchNorm epsilon 1e-3 instead of 1e-5",
        resnet_wrong_eps, kind="eps"),
    "avg_for_max_pool": PaddlePort(
        "paddle", "resnet18", "maxpool", "the stem's max pool written as an average pool",
        resnet_avg_stem, kind="substituted"),
    "wrong_padding": PaddlePort(
        "paddle", "resnet18", "layer1.1.conv2", "reflection padding instead of zeros",
        resnet_reflect_padding, kind="padding"),
    "maskless_relu": PaddlePort(
        "paddle", "resnet18", "layer3.0.relu",
        "a hand-written ReLU whose backward forgets the mask", resnet_maskless_relu,
        backward_only=True, kind="backward"),
    "copied_momentum": PaddlePort(
        "paddle", "resnet18", "bn1",
        "BatchNorm momentum 0.1 copied from torch (Paddle's is the old statistic's weight)",
        resnet_copied_momentum, kind="config", config_only=True),
}
"""The broken Paddle ports by bug."""
