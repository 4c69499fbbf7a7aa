"""A BERT-style encoder classifier in MegEngine, small: hidden 64, 4 heads, sequences of 16.

The same network as ``torch_encoder`` (the same config and module names), written as MegEngine
code is: activations and softmax as functions (``F.gelu``, exact; ``F.softmax``),
``transpose`` with a full permutation, ``M.Dropout(drop_prob)``. Post-LN as BERT, LayerNorm
``eps`` 1e-12, weights normal with std 0.02, dropout present with ``dropout=0.0`` by default.
``embeddings=False`` builds it without embeddings: it then takes hidden states
``(batch, seq, hidden)`` instead of token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import megengine.functional as F
import megengine.module as M


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
    eps: float = 1e-12  # BERT's LayerNorm eps
    embeddings: bool = True


class Embeddings(M.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word = M.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = M.Embedding(cfg.max_len, cfg.hidden)
        self.norm = M.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.dropout = M.Dropout(cfg.dropout)

    def forward(self, ids):
        positions = F.arange(ids.shape[1], dtype="int32", device=ids.device)
        return self.dropout(self.norm(self.word(ids) + self.position(positions)))


class SelfAttention(M.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.query = M.Linear(cfg.hidden, cfg.hidden)
        self.key = M.Linear(cfg.hidden, cfg.hidden)
        self.value = M.Linear(cfg.hidden, cfg.hidden)
        self.out = M.Linear(cfg.hidden, cfg.hidden)
        self.dropout = M.Dropout(cfg.dropout)

    def _split(self, x):  # (B, S, H*D) -> (B, H, S, D)
        batch, seq = x.shape[0], x.shape[1]
        return x.reshape(batch, seq, self.heads, self.head_dim).transpose(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = F.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(self.head_dim)
        probs = self.dropout(F.softmax(scores, axis=-1))
        context = F.matmul(probs, v).transpose(0, 2, 1, 3).reshape(x.shape)
        return self.out(context)


class EncoderLayer(M.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attn_norm = M.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.ffn_in = M.Linear(cfg.hidden, cfg.intermediate)
        self.ffn_out = M.Linear(cfg.intermediate, cfg.hidden)
        self.ffn_norm = M.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.dropout = M.Dropout(cfg.dropout)

    def forward(self, x):
        x = self.attn_norm(x + self.dropout(self.attention(x)))
        return self.ffn_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))


class EncoderClassifier(M.Module):
    def __init__(self, cfg: EncoderConfig = EncoderConfig()) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg) if cfg.embeddings else None
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.layers)]
        self.pooler = M.Linear(cfg.hidden, cfg.hidden)
        self.classifier = M.Linear(cfg.hidden, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, (M.Linear, M.Embedding)):
                M.init.normal_(m.weight, std=0.02)
            if isinstance(m, M.Linear):
                M.init.zeros_(m.bias)

    def forward(self, x):
        if self.embeddings is not None:
            x = self.embeddings(x)
        for layer in self.layers:
            x = layer(x)
        pooled = F.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)
