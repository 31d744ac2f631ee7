"""Full softmax attention (Vaswani et al., 2017) through PyTorch's fused SDPA kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.masks import dense_mask, visible_key_count, zero_empty_rows
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class FullOptions:
    """Full attention has no options."""


def full_attention(q, k, v, opts=FullOptions(), *, causal=False, key_mask=None, scale=None,
                   generator=None):
    """softmax(q kᵀ · scale) v over every key, via ``F.scaled_dot_product_attention``.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost: O(Lq·Lk·D) time; O(Lq + Lk) extra memory in the fused kernel when no
    mask is needed; an O(Lq·Lk) bool mask when causal with Lq != Lk or causal
    with a key_mask.
    Causal with Lq != Lk is lower-right aligned (query i sees j <= i + Lk - Lq),
    not SDPA's ``is_causal`` (upper-left), so that case passes an explicit mask.
    Scale defaults to 1/sqrt(D). Rows that see no key are zeros.
    """
    Lq, Lk = q.shape[2], k.shape[2]
    if key_mask is None and (not causal or Lq == Lk):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if causal:
        mask = dense_mask(Lq, Lk, causal=True, key_mask=key_mask, device=q.device)  # (B|1, 1, Lq, Lk)
    else:
        mask = key_mask[:, None, None, :]  # (B, 1, 1, Lk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return zero_empty_rows(out, causal=causal, key_mask=key_mask, Lk=Lk)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim restricted to ``mask`` (True = keep); rows with nothing kept are
    zeros, with no NaN in the forward or the backward."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    mask = mask.expand_as(scores)
    empty = ~mask.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(empty, 0.0)
    return torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)


def softmax_reference(q, k, v, mask, scale, bias=None):
    """Plain masked softmax attention; ``mask`` broadcasts to (B, H, Lq, Lk), True = attend,
    ``bias`` (broadcastable) is added to the scores.

    The shared dense reference of every softmax mechanism: rows with no
    allowed key give zeros.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if bias is not None:
        scores = scores + bias
    return masked_softmax(scores, mask) @ v


def full_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """2·(D + Dv) per visible (query, key) pair: the fused kernel skips masked causal blocks."""
    pairs = int(visible_key_count(Lq, Lk, causal=causal, key_mask=None).sum())
    return 2.0 * B * H * pairs * (D + Dv)


def full_reference(q, k, v, opts=FullOptions(), *, causal=False, key_mask=None, scale=None,
                   generator=None):
    """softmax(q kᵀ · scale + mask) v written out densely."""
    mask = dense_mask(q.shape[2], k.shape[2], causal=causal, key_mask=key_mask, device=q.device)
    return softmax_reference(q, k, v, mask, scale)


register(
    Mechanism(
        name="full",
        summary="softmax(QKᵀ/√d)V over every key (PyTorch's fused SDPA kernel)",
        options=FullOptions,
        fn=full_attention,
        reference=full_reference,
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L² d)",
        memory="O(L) fused (O(L²) with a mask)",
        citation="Vaswani et al., Attention Is All You Need, NeurIPS 2017",
        flops=full_flops,
    )
)
