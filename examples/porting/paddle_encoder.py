"""The BERT-style encoder classifier of ``torch_encoder`` in PaddlePaddle, as PaddleNLP writes BERT.

The same architecture and configuration (``EncoderConfig``: hidden 64, 4 heads, sequences of
16, post-LN, exact GELU, LayerNorm ``epsilon`` 1e-12, a tanh pooler over the first token), with
Paddle's conventions: ``nn.Layer``, ``epsilon`` instead of ``eps``, ``nn.Linear`` weights
``[in, out]``, ``reshape``/``transpose`` taking lists of axes, ``paddle.matmul(...,
transpose_y=True)``, and weights initialised in ``init_weights`` with ``set_value`` as
PaddleNLP's ``BertPretrainedModel`` does. The parameter-holding layers carry the torch file's
names and are defined in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 100
    max_len: int = 16
    hidden: int = 64
    heads: int = 4
    intermediate: int = 256
    layers: int = 2
    num_classes: int = 3
    dropout: float = 0.0
    eps: float = 1e-12  # BERT's LayerNorm epsilon
    embeddings: bool = True


class Embeddings(nn.Layer):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_len, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden, epsilon=cfg.eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        positions = paddle.arange(ids.shape[1], dtype="int64")
        return self.dropout(self.norm(self.word(ids) + self.position(positions)))


class SelfAttention(nn.Layer):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def _split(self, x: paddle.Tensor) -> paddle.Tensor:  # [B, S, H*D] -> [B, H, S, D]
        return x.reshape([x.shape[0], x.shape[1], self.heads, self.head_dim]).transpose(
            [0, 2, 1, 3])

    def scores(self, q: paddle.Tensor, k: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.head_dim)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        probs = self.dropout(F.softmax(self.scores(q, k), axis=-1))
        context = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape(x.shape)
        return self.out(context)


class EncoderLayer(nn.Layer):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden, epsilon=cfg.eps)
        self.ffn_in = nn.Linear(cfg.hidden, cfg.intermediate)
        self.act = nn.GELU()
        self.ffn_out = nn.Linear(cfg.intermediate, cfg.hidden)
        self.ffn_norm = nn.LayerNorm(cfg.hidden, epsilon=cfg.eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.attn_norm(x + self.dropout(self.attention(x)))
        return self.ffn_norm(x + self.dropout(self.ffn_out(self.act(self.ffn_in(x)))))


class EncoderClassifier(nn.Layer):
    def __init__(self, cfg: EncoderConfig = EncoderConfig()) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg) if cfg.embeddings else None
        self.layers = nn.LayerList([EncoderLayer(cfg) for _ in range(cfg.layers)])
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes)
        self.apply(init_weights)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.embeddings is not None:
            x = self.embeddings(x)
        for layer in self.layers:
            x = layer(x)
        pooled = paddle.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)


def init_weights(layer: nn.Layer) -> None:
    if isinstance(layer, (nn.Linear, nn.Embedding)):
        layer.weight.set_value(paddle.normal(mean=0.0, std=0.02, shape=layer.weight.shape))
    if isinstance(layer, nn.Linear):
        layer.bias.set_value(paddle.zeros_like(layer.bias))
