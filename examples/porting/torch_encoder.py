"""A BERT-style encoder classifier in PyTorch, small: hidden 64, 4 heads, sequences of 16.

Post-LN as BERT: each sub-layer is ``LayerNorm(x + dropout(sublayer(x)))``; attention is
written out with ``Linear`` query/key/value/out projections and a softmax; the feed-forward
uses an exact (erf) ``nn.GELU``; LayerNorm's ``eps`` is BERT's 1e-12 and weights start as BERT
starts them (normal, std 0.02), which is why a forgotten ``eps`` shows (see ``broken``). Dropout
is present with ``dropout=0.0`` by default, so that two frameworks see the same function; a
classification head (BERT's tanh pooler over the first token, then a Linear) ends it.
``embeddings=False`` builds the encoder without its embeddings: it then takes hidden states
``(batch, seq, hidden)`` instead of token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


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


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_len, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.norm(self.word(ids) + self.position(positions)))


class SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H*D) -> (B, H, S, D)
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        probs = self.dropout(scores.softmax(dim=-1))
        context = (probs @ v).transpose(1, 2).reshape(x.shape)
        return self.out(context)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.ffn_in = nn.Linear(cfg.hidden, cfg.intermediate)
        self.act = nn.GELU()
        self.ffn_out = nn.Linear(cfg.intermediate, cfg.hidden)
        self.ffn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.dropout(self.attention(x)))
        return self.ffn_norm(x + self.dropout(self.ffn_out(self.act(self.ffn_in(x)))))


class EncoderClassifier(nn.Module):
    def __init__(self, cfg: EncoderConfig = EncoderConfig()) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg) if cfg.embeddings else None
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.layers)])
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes)
        self.apply(_bert_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeddings is not None:
            x = self.embeddings(x)
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)


def _bert_init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)
