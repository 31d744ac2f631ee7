"""Efficient attention (Shen et al., WACV 2021; arXiv 2018)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo._pages import scratch_buffer
from attnzoo.mechanisms._common import exp_, finite_or_zero
from attnzoo.mechanisms.linear import PlainKeyMap, PointwiseMap, _no_scale, stream_kernel
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class EfficientOptions:
    """Efficient attention has no options."""


def _column_max(k, key_mask):
    """c (B, H, 1, D): each feature's max over the real keys (0 where there is none). A constant
    (detached): the column softmax does not depend on it, it only keeps exp(k − c) <= 1."""
    real = k.detach() if key_mask is None else k.detach().masked_fill(~key_mask[:, None, :, None], -torch.inf)
    return finite_or_zero(real.amax(2, keepdim=True))


def efficient_attention(q, k, v, opts=EfficientOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """σ_row(Q) (σ_col(K)ᵀ V): softmax of each query over its features, of each key feature
    over the positions.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(L·D·Dv) time, O(D·Dv) extra memory. Padded keys take no part in the
    column softmax; a batch entry with no real key gives zeros. Non-causal only:
    the column softmax normalises over every position, future included, and the
    paper gives no causal form. Shen et al., Efficient Attention: Attention with
    Linear Complexities, WACV 2021.
    """
    _no_scale("efficient", scale)
    c = _column_max(k, key_mask)  # one pass over K, so the key blocks need no rescaling
    key_map = PointwiseMap(lambda k_blk, scratch=None: exp_(torch.sub(
        k_blk, c, out=scratch_buffer(scratch, "phi", k_blk.shape))), lambda phi: phi,
        takes_scratch=True)  # (c a constant)
    return stream_kernel(q, k, v, PlainKeyMap(key_map), _RowSoftmax(), key_mask=key_mask)


class _RowSoftmax:
    """The finish of :func:`efficient_attention` (see :func:`stream_kernel`): a query block's
    σ_row(q) (S / z), S / z = σ_col(K)ᵀV (B, H, D, Dv), and its backward written out:
    with p = σ_row(q) and G = S / z, dp = g Gᵀ, dq = p ⊙ (dp − p·dp), dG = pᵀ g,
    dS = dG / z, dz = −Σ_v dG ⊙ G / z (0 where z is clamped: no real key)."""

    def __call__(self, q_blk, S, z, out=None, scratch=None):
        p = torch.softmax(q_blk, dim=-1)  # (B, H, n, D)
        o = torch.matmul(p, S / _clamped(z), out=scratch_buffer(scratch, "num", (*p.shape[:-1], S.shape[-1])))
        return o if out is None else out.copy_(o)  # (a matmul into out ran slower)

    def grad(self, q_blk, g, S, z):
        p = torch.softmax(q_blk, dim=-1)  # (B, H, n, D)
        zc = _clamped(z)  # (B, H, D, 1)
        G = S / zc
        dp = g @ G.transpose(-1, -2)  # (B, H, n, D)
        dq = dp.sub_(torch.linalg.vecdot(p, dp).unsqueeze(-1)).mul_(p)  # (no graph: autograd cost more)
        dG = p.transpose(-1, -2) @ g  # (B, H, D, Dv)
        dz = torch.where(z == zc.squeeze(-1), -torch.linalg.vecdot(dG, G) / z, 0.0)
        return dq, dG.div_(zc), dz


def _clamped(z):
    """z (B, H, D) as (B, H, D, 1), at least the smallest normal number (no real key: S = 0 too)."""
    return z.unsqueeze(-1).clamp(min=torch.finfo(z.dtype).tiny)


def efficient_reference(q, k, v, opts=EfficientOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """Dense: the (Lq, Lk) matrix σ_row(Q) σ_col(K)ᵀ applied to V."""
    _no_scale("efficient", scale)
    sk = torch.exp(k - k.amax(2, keepdim=True))
    if key_mask is not None:
        sk = sk * key_mask[:, None, :, None].to(sk.dtype)
    sk = sk / sk.sum(2, keepdim=True).clamp(min=torch.finfo(sk.dtype).tiny)
    weights = torch.softmax(q, dim=-1) @ sk.transpose(-1, -2)  # (B, H, Lq, Lk)
    return weights @ v


def efficient_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
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
