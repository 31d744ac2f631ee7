"""An Informer-style encoder-decoder forecaster (Zhou et al., AAAI 2021) over any mechanism.

Encoder: embedding, then self-attention layers with the self-attention distilling
layer (Conv1d, BatchNorm, ELU, max-pool of stride 2) between them, halving the
length each time. Decoder: causal self-attention and cross-attention to the
encoder output, fed the last ``label_len`` known steps plus ``pred_len`` zero
placeholders, predicting all ``pred_len`` steps in one forward pass.

Every attention slot takes a mechanism name and options: ``enc_attn``,
``dec_self_attn`` (always causal) and ``cross_attn``. Informer's own choice is
prob_sparse, prob_sparse and full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from attnzoo.nn import MultiheadAttention


@dataclass
class InformerConfig:
    enc_in: int = 1  # input features
    dec_in: int = 1
    c_out: int = 1  # output features
    seq_len: int = 96  # encoder input length
    label_len: int = 48  # known steps at the start of the decoder input
    pred_len: int = 24  # steps to predict
    d_model: int = 512
    n_heads: int = 8
    e_layers: int = 2
    d_layers: int = 1
    d_ff: int = 2048
    dropout: float = 0.05
    distil: bool = True  # self-attention distilling between encoder layers
    enc_attn: str = "prob_sparse"
    dec_self_attn: str = "prob_sparse"
    cross_attn: str = "full"
    enc_options: dict = field(default_factory=dict)
    dec_self_options: dict = field(default_factory=dict)
    cross_options: dict = field(default_factory=dict)
    seed: int = 0  # seeds the attention layers' generators (sampling, rotations, features)


class DataEmbedding(nn.Module):
    """Value (Conv1d, kernel 3, circular padding) + sinusoidal position + calendar features."""

    def __init__(self, c_in: int, d_model: int, dropout: float, n_marks: int = 4, max_len: int = 5000):
        super().__init__()
        self.value = nn.Conv1d(c_in, d_model, 3, padding=1, padding_mode="circular", bias=False)
        nn.init.kaiming_normal_(self.value.weight, mode="fan_in", nonlinearity="leaky_relu")
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)[:, : d_model // 2]
        self.register_buffer("pe", pe, persistent=False)
        self.time = nn.Linear(n_marks, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
        """x (B, L, c_in), marks (B, L, 4) -> (B, L, d_model)."""
        value = self.value(x.transpose(1, 2)).transpose(1, 2)  # (B, L, d_model)
        return self.dropout(value + self.pe[: x.shape[1]] + self.time(marks))


class DistilLayer(nn.Module):
    """Self-attention distilling: Conv1d (k=3), BatchNorm, ELU, MaxPool (k=3, stride 2): L -> ⌈L/2⌉."""

    def __init__(self, d_model: int):
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, 3, padding=1, padding_mode="circular")
        self.norm = nn.BatchNorm1d(d_model)
        self.act = nn.ELU()
        self.pool = nn.MaxPool1d(3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.norm(self.conv(x.transpose(1, 2)))))  # (B, d_model, ⌈L/2⌉)
        return x.transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(d_ff, d_model))

    def forward(self, x):
        return self.net(x)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: InformerConfig, seed: int):
        super().__init__()
        self.attn = MultiheadAttention(cfg.d_model, cfg.n_heads, cfg.enc_attn, seed=seed,
                                       **cfg.enc_options)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = self.norm1(x + self.dropout(self.attn(x)))
        return self.norm2(x + self.dropout(self.ff(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: InformerConfig, seed: int):
        super().__init__()
        self.self_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, cfg.dec_self_attn, causal=True,
                                            seed=seed, **cfg.dec_self_options)
        self.cross_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, cfg.cross_attn, seed=seed + 1,
                                             **cfg.cross_options)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, memory):
        x = self.norms[0](x + self.dropout(self.self_attn(x)))
        x = self.norms[1](x + self.dropout(self.cross_attn(x, memory)))
        return self.norms[2](x + self.dropout(self.ff(x)))


class Informer(nn.Module):
    """``forward(x_enc, mark_enc, x_dec, mark_dec) -> (B, pred_len, c_out)``.

    Shapes: x_enc (B, seq_len, enc_in), mark_enc (B, seq_len, 4), x_dec
    (B, label_len + pred_len, dec_in), mark_dec (B, label_len + pred_len, 4).
    """

    def __init__(self, cfg: InformerConfig):
        super().__init__()
        self.cfg = cfg
        self.enc_embedding = DataEmbedding(cfg.enc_in, cfg.d_model, cfg.dropout)
        self.dec_embedding = DataEmbedding(cfg.dec_in, cfg.d_model, cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, cfg.seed + 10 * i) for i in range(cfg.e_layers))
        n_distil = cfg.e_layers - 1 if cfg.distil else 0
        self.distil = nn.ModuleList(DistilLayer(cfg.d_model) for _ in range(n_distil))
        self.enc_norm = nn.LayerNorm(cfg.d_model)
        self.decoder = nn.ModuleList(DecoderLayer(cfg, cfg.seed + 1000 + 10 * i)
                                     for i in range(cfg.d_layers))
        self.dec_norm = nn.LayerNorm(cfg.d_model)
        self.projection = nn.Linear(cfg.d_model, cfg.c_out)

    def encode(self, x_enc, mark_enc):
        x = self.enc_embedding(x_enc, mark_enc)  # (B, seq_len, d_model)
        for i, layer in enumerate(self.encoder):
            x = layer(x)
            if i < len(self.distil):
                x = self.distil[i](x)  # halves the length
        return self.enc_norm(x)

    def forward(self, x_enc, mark_enc, x_dec, mark_dec):
        memory = self.encode(x_enc, mark_enc)
        x = self.dec_embedding(x_dec, mark_dec)  # (B, label_len + pred_len, d_model)
        for layer in self.decoder:
            x = layer(x, memory)
        out = self.projection(self.dec_norm(x))  # (B, label_len + pred_len, c_out)
        return out[:, -self.cfg.pred_len:]
