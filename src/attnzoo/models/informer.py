"""An Informer-style encoder-decoder forecaster (Zhou et al., AAAI 2021) over any mechanism.

Encoder: embedding, then self-attention layers with the self-attention distilling
layer (Conv1d, BatchNorm, ELU, max-pool of stride 2) between them, halving the
length each time. Decoder: causal self-attention and cross-attention to the
encoder output, fed the last ``label_len`` known steps plus ``pred_len`` zero
placeholders, predicting all ``pred_len`` steps in one forward pass.

Every attention slot takes a mechanism name and options: ``enc_attn``,
``dec_self_attn`` (always causal) and ``cross_attn``. Informer's own choice is
prob_sparse, prob_sparse and full. ``revin=True`` wraps the model in reversible instance
normalisation (:class:`RevIN`).
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
    revin: bool = False  # reversible instance normalisation of each window (Kim et al., ICLR 2022)
    target_cols: list = field(default_factory=list)  # input channel of each output (empty: the last c_out)


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


class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al., ICLR 2022).

    Each input window is normalised by its own mean and deviation over time, per channel, then
    mapped by a learnt affine (γ, β): x̂ = γ (x - μ) / σ + β. The forecast goes back the other
    way with the same statistics, so the model sees every window at one level and scale while
    its output keeps the window's own. ``target_cols[j]`` is the input channel of output j.
    Shapes: x_enc (B, L, C), x_dec (B, label_len + pred_len, C), y (B, pred_len, c_out).
    """

    def __init__(self, n_channels: int, target_cols: list[int], eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_channels))
        self.bias = nn.Parameter(torch.zeros(n_channels))
        self.register_buffer("targets", torch.tensor(target_cols, dtype=torch.long), persistent=False)

    def normalise(self, x_enc, x_dec, label_len: int):
        """-> (x_enc, x_dec, (μ, σ)) with the decoder's known steps normalised by the encoder
        window's statistics and its placeholders left at zero."""
        mean = x_enc.mean(1, keepdim=True).detach()  # (B, 1, C)
        std = torch.sqrt(x_enc.var(1, keepdim=True, correction=0) + self.eps).detach()
        x_enc = (x_enc - mean) / std * self.weight + self.bias
        known = (x_dec[:, :label_len] - mean) / std * self.weight + self.bias
        x_dec = torch.cat([known, torch.zeros_like(x_dec[:, label_len:])], dim=1)
        return x_enc, x_dec, (mean, std)

    def restore(self, y, stats):
        """The forecast y (B, pred_len, c_out) back in the window's level and scale."""
        mean, std = (s[..., self.targets] for s in stats)
        weight, bias = self.weight[self.targets], self.bias[self.targets]
        return (y - bias) / (weight + self.eps**2) * std + mean


def _revin(cfg: InformerConfig) -> RevIN:
    targets = cfg.target_cols or list(range(cfg.enc_in - cfg.c_out, cfg.enc_in))
    if cfg.dec_in != cfg.enc_in or len(targets) != cfg.c_out or not all(0 <= t < cfg.enc_in for t in targets):
        raise ValueError(f"revin needs dec_in == enc_in and target_cols naming one of the {cfg.enc_in} "
                         f"input channels for each of the {cfg.c_out} outputs; got dec_in={cfg.dec_in}, "
                         f"target_cols={targets}")
    return RevIN(cfg.enc_in, targets)


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
        self.revin = _revin(cfg) if cfg.revin else None

    def encode(self, x_enc, mark_enc):
        x = self.enc_embedding(x_enc, mark_enc)  # (B, seq_len, d_model)
        for i, layer in enumerate(self.encoder):
            x = layer(x)
            if i < len(self.distil):
                x = self.distil[i](x)  # halves the length
        return self.enc_norm(x)

    def forward(self, x_enc, mark_enc, x_dec, mark_dec):
        if self.revin is not None:
            x_enc, x_dec, stats = self.revin.normalise(x_enc, x_dec, self.cfg.label_len)
        memory = self.encode(x_enc, mark_enc)
        x = self.dec_embedding(x_dec, mark_dec)  # (B, label_len + pred_len, d_model)
        for layer in self.decoder:
            x = layer(x, memory)
        out = self.projection(self.dec_norm(x))[:, -self.cfg.pred_len:]  # (B, pred_len, c_out)
        return out if self.revin is None else self.revin.restore(out, stats)
