"""Efficient attention (Shen et al., WACV 2021; arXiv 2018)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.mechanisms._kernel import no_scale
from attnzoo.mechanisms._softmax import finite_or_zero, wide
from attnzoo.ops import operation
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class EfficientOptions:
    """Efficient attention has no options."""


def efficient_attention(q, k, v, opts=EfficientOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """σ_row(Q) (σ_col(K)ᵀ V): softmax of each query over its features, of each key feature
    over the positions.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(L·D·Dv) time, O(L·D + D·Dv) memory. Padded keys take no part in the
    column softmax; a batch entry with no real key gives zeros. Non-causal only:
    the column softmax normalises over every position, future included, and the
    paper gives no causal form. Half precision is computed in float32. Shen et al.,
    Efficient Attention: Attention with Linear Complexities, WACV 2021.
    """
    no_scale("efficient", scale)
    out_dtype, (q, k, v) = q.dtype, (wide(t) for t in (q, k, v))
    return efficient_core(q, k, v, key_mask).to(out_dtype)


@operation("efficient_attention")
def efficient_core(q, k, v, key_mask):
    """σ_row(q) G with G = EᵀV / Σ_j E_j (B, H, D, Dv), E = exp(k − c) (B, H, Lk, D), 0 for padded
    keys (``key_mask`` (B, Lk) False), c each feature's max over the real keys: a constant, which
    the column softmax does not depend on (it keeps E <= 1)."""
    real = k if key_mask is None else k.masked_fill(~key_mask[:, None, :, None], -torch.inf)
    E = torch.exp(real - finite_or_zero(real.detach().amax(2, keepdim=True)))  # (B, H, Lk, D)
    z = E.sum(2).unsqueeze(-1).clamp(min=torch.finfo(E.dtype).tiny)  # (B, H, D, 1); no real key: G = 0
    return torch.softmax(q, dim=-1) @ ((E.transpose(-1, -2) @ v) / z)


def efficient_reference(q, k, v, opts=EfficientOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """Dense: the (Lq, Lk) matrix σ_row(Q) σ_col(K)ᵀ applied to V."""
    no_scale("efficient", scale)
    real = k if key_mask is None else k.masked_fill(~key_mask[:, None, :, None], -torch.inf)
    sk = torch.exp(real - finite_or_zero(real.amax(2, keepdim=True)))  # padded keys: e^−inf = 0
    sk = sk / sk.sum(2, keepdim=True).clamp(min=torch.finfo(sk.dtype).tiny)
    weights = torch.softmax(q, dim=-1) @ sk.transpose(-1, -2)  # (B, H, Lq, Lk)
    return weights @ v


def efficient_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """EᵀV and σ(q)G: 2·(Lk + Lq)·D·Dv."""
    return 2.0 * B * H * (Lk + Lq) * D * Dv


register(
    Mechanism(
        name="efficient",
        summary="softmax over Q's features, over K's positions: σ(Q)(σ(K)ᵀV)",
        options=EfficientOptions,
        fn=efficient_attention,
        reference=efficient_reference,
        capabilities=Capabilities(causal=False, cross=True, key_mask=True),
        time="O(L d²)",
        memory="O(L d + d²)",
        citation="Shen et al., Efficient Attention: Attention with Linear Complexities, WACV 2021",
        flops=efficient_flops,
        reason_not_causal="its column softmax normalises every key over all positions, future "
        "included, and the paper defines no causal form",
    )
)
