"""Ports with one deliberate bug each, the kind a port between frameworks really gets wrong.

Each bug crashes nothing and every shape still fits. Measured by ``tests/test_parity_models.py``
(CPU, one batch of its seed 1, the loss near 1.1 for the encoder and 2.5 for ResNet-18): the
transposed weight moves the loss by 1.4e-5 (its layer's output by 0.033), the missing ``eps`` by
2.4e-7 (its layer's output by 0.028), the BatchNorm ``eps`` by 5.5e-6 (its layer's output by
1.5e-3), so a loss that agrees is no evidence of a correct port; the padding moves the loss by
0.25 and its layer's output by 2.8 (a reflected border against a zero pad is an O(1) change on
28 of the 64 pixels of an 8 x 8 map, and a freshly initialised ResNet carries it through). Each
:class:`BrokenPort` names the framework of the broken side, how to build it (a model of the
matching correct module in ``torch_*`` / ``mge_*`` with one layer written wrongly), and
``layer``, the name of the module a parity check must blame: the first module in the forward's
order whose output differs beyond rounding.

``torch_resnet_copied_momentum`` is a slip of another sort: MegEngine's BatchNorm momentum
copied as is. One training step cannot see it (its outputs and gradients agree); only the
configuration does, so it is not in :data:`PORTS`.

Frameworks are imported when a port is built, not when this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict


@dataclass(frozen=True)
class BrokenPort:
    framework: str  # the broken side: "torch" or "megengine"
    model: str  # "resnet18" or "encoder": the correct model of the other framework to compare
    layer: str  # the module a parity check must blame
    what: str  # the bug, in words
    build: Callable[..., Any]  # keyword options go to the model's constructor
    # every forward agrees and a gradient departs: the check names ``layer`` among the
    # suspects whose backward it cannot see into, not as the first forward divergence
    backward_only: bool = False
    # the layer written wrongly where it is not ``layer`` (a port's module whose counterpart
    # is a function): the check must name it in the first divergence's line
    named: str = ""


def torch_encoder_transposed(**config: Any) -> Any:
    """The attention output projection of the first layer computes ``x @ W + b``: written as
    if the weight were stored (in, out) as in a TF checkpoint, so with the (out, in) weight a
    transfer copies it uses ``W.T``. Square (64 x 64), so every shape fits."""
    import torch.nn.functional as F
    from torch import nn

    from . import torch_encoder

    class InOutLinear(nn.Linear):
        def forward(self, x):
            return F.linear(x, self.weight.t(), self.bias)

    cfg = torch_encoder.EncoderConfig(**config)
    model = torch_encoder.EncoderClassifier(cfg)
    model.layers[0].attention.out = InOutLinear(cfg.hidden, cfg.hidden)
    return model


def torch_encoder_missing_eps(**config: Any) -> Any:
    """The embeddings' LayerNorm without BERT's ``eps=1e-12``: torch's default 1e-5. The
    embeddings start with std 0.02, so their sum has a variance near 8e-4 and 1e-5 of it shows
    (about 0.6 % of the normalised output); deeper LayerNorms see a variance near 1 and would hide
    the same slip."""
    from torch import nn

    from . import torch_encoder

    cfg = torch_encoder.EncoderConfig(**config)
    model = torch_encoder.EncoderClassifier(cfg)
    model.embeddings.norm = nn.LayerNorm(cfg.hidden)
    return model


def torch_resnet_reflect_padding(**options: Any) -> Any:
    """The second conv of ``layer1.1`` pads by reflection instead of with zeros (written
    ``padding_mode="reflect"``, as the conv it was copied from): same shapes, the 28 border
    pixels of each 8 x 8 map differ."""
    from torch import nn

    from . import torch_resnet

    model = torch_resnet.resnet18(**options)
    model.layer1[1].conv2 = nn.Conv2d(64, 64, 3, padding=1, bias=False, padding_mode="reflect")
    return model


def mge_resnet_wrong_eps(**options: Any) -> Any:
    """The first BatchNorm of ``layer2.0`` with ``eps=1e-3`` (a Keras default, copied from
    another port) instead of 1e-5: its input's variance is near 1, so the output moves by about
    5e-4 relative, the loss by far less."""
    import megengine.module as M

    from . import mge_resnet

    model = mge_resnet.resnet18(**options)
    model.layer2[0].bn1 = M.BatchNorm2d(128, eps=1e-3)
    return model


def torch_resnet_copied_momentum(**options: Any) -> Any:
    """Every BatchNorm with ``momentum=0.9`` copied from the MegEngine original, where 0.9 is
    the weight of the old running statistic; torch's momentum is the new batch's weight, so the
    port's running statistics follow each batch nine times as fast. One training step's outputs
    and gradients are unchanged (training mode normalises with the batch's own statistics): only
    the configuration shows it, and evaluation after training."""
    from . import torch_resnet

    model = torch_resnet.resnet18(**options)
    for m in model.modules():
        if hasattr(m, "momentum") and hasattr(m, "running_mean"):
            m.momentum = 0.9
    return model


def torch_resnet_avg_stem(**options: Any) -> Any:
    """The stem's 3 x 3 max pool written as an average pool of the same size, stride and
    padding (a substituted layer: same shapes, another function)."""
    from torch import nn

    from . import torch_resnet

    model = torch_resnet.resnet18(**options)
    model.maxpool = nn.AvgPool2d(kernel_size=3, stride=2, padding=1)
    return model


def torch_resnet_maskless_relu(**options: Any) -> Any:
    """``layer3.0``'s ReLU as a hand-written memory-saving autograd Function whose backward
    forgets the mask (passes every gradient through): the forward is exact, only the
    gradients of everything before it are wrong."""
    import torch
    from torch import nn

    from . import torch_resnet

    class PassThroughReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clamp(min=0)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            return grad

    class SavingReLU(nn.ReLU):
        def forward(self, x):  # noqa: ANN001, ANN201
            return PassThroughReLU.apply(x)

    model = torch_resnet.resnet18(**options)
    model.layer3[0].relu = SavingReLU()
    return model


def torch_encoder_relu_for_gelu(**config: Any) -> Any:
    """The first layer's feed-forward activation written as ``nn.ReLU`` where BERT has GELU
    (a substituted layer: same shapes, another function). The MegEngine original calls
    ``F.gelu``, a function the tool does not watch on MegEngine, so the first module whose
    output departs is ``layers.0.ffn_out``; the check names the ReLU as the call its input
    came through with no counterpart."""
    from torch import nn

    from . import torch_encoder

    model = torch_encoder.EncoderClassifier(torch_encoder.EncoderConfig(**config))
    model.layers[0].act = nn.ReLU()
    return model


def torch_encoder_gelu_backward(**config: Any) -> Any:
    """The second layer's GELU as a hand-written autograd Function whose backward keeps only
    ``Phi(x)`` of the derivative ``Phi(x) + x * phi(x)``: the forward is exact, the gradients
    before it are wrong."""
    import math

    import torch
    from torch import nn

    from . import torch_encoder

    class HalfGELU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x)
            return torch.nn.functional.gelu(x)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            (x,) = ctx.saved_tensors
            return grad * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    class FusedGELU(nn.GELU):
        def forward(self, x):  # noqa: ANN001, ANN201
            return HalfGELU.apply(x)

    model = torch_encoder.EncoderClassifier(torch_encoder.EncoderConfig(**config))
    model.layers[1].act = FusedGELU()
    return model


def mge_encoder_attention_scale(**config: Any) -> Any:
    """The first layer's attention scores divided by ``sqrt(hidden)`` instead of
    ``sqrt(head_dim)`` (a constant copied from a single-head version): the softmax is flatter,
    and the first module whose output shows it is the attention's dropout (p=0), which takes
    the softmax's output."""
    import math

    import megengine.functional as F

    from . import mge_encoder

    class WideScaleAttention(mge_encoder.SelfAttention):
        def forward(self, x):  # noqa: ANN001, ANN201
            q, k, v = (self._split(self.query(x)), self._split(self.key(x)),
                       self._split(self.value(x)))
            hidden = self.heads * self.head_dim
            scores = F.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(hidden)
            probs = self.dropout(F.softmax(scores, axis=-1))
            context = F.matmul(probs, v).transpose(0, 2, 1, 3).reshape(x.shape)
            return self.out(context)

    cfg = mge_encoder.EncoderConfig(**config)
    model = mge_encoder.EncoderClassifier(cfg)
    model.layers[0].attention = WideScaleAttention(cfg)
    return model

PORTS: Dict[str, BrokenPort] = {
    "transposed_weight": BrokenPort(
        "torch", "encoder", "layers.0.attention.out",
        "the weight is used transposed", torch_encoder_transposed),
    "missing_eps": BrokenPort(
        "torch", "encoder", "embeddings.norm",
        "LayerNorm eps 1e-5 (torch's default) instead of BERT's 1e-12",
        torch_encoder_missing_eps),
    "wrong_padding": BrokenPort(
        "torch", "resnet18", "layer1.1.conv2",
        "reflection padding instead of zeros", torch_resnet_reflect_padding),
    "wrong_eps": BrokenPort(
        "megengine", "resnet18", "layer2.0.bn1",
        "BatchNorm eps 1e-3 instead of 1e-5", mge_resnet_wrong_eps),
    "avg_for_max_pool": BrokenPort(
        "torch", "resnet18", "maxpool",
        "the stem's max pool written as an average pool", torch_resnet_avg_stem),
    "maskless_relu": BrokenPort(
        "torch", "resnet18", "layer3.0.relu",
        "a hand-written ReLU whose backward forgets the mask", torch_resnet_maskless_relu,
        backward_only=True),
    "relu_for_gelu": BrokenPort(
        "torch", "encoder", "layers.0.ffn_out",
        "ReLU where BERT has GELU", torch_encoder_relu_for_gelu, named="layers.0.act"),
    "gelu_backward": BrokenPort(
        "torch", "encoder", "layers.1.act",
        "a hand-written GELU whose backward drops x * phi(x)", torch_encoder_gelu_backward,
        backward_only=True),
    "attention_scale": BrokenPort(
        "megengine", "encoder", "layers.0.attention.dropout",
        "attention scores over sqrt(hidden) instead of sqrt(head_dim)",
        mge_encoder_attention_scale),
}
"""The broken ports by bug."""
