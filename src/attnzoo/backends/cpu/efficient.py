"""Efficient attention on the CPU: the override of ``efficient_attention``
(:func:`attnzoo.mechanisms.efficient.efficient_core`, whose mathematics this computes, to
rounding), for float32 and float64 CPU tensors.

By the C kernels where they build (:func:`attnzoo.backends.cpu.native.efficient`, forward and
backward), else streamed over blocks of positions (:func:`~attnzoo.backends.cpu.kernel.stream_rows`):
the keys give E = exp(K − c) block by block (c each feature's max over the real keys) and
G = EᵀV / colsum(E) (B, H, D, Dv); then each query block's exponentials, its row sums and one
product, out = exp(q − max) G / rowsum. Both exponentials are 2^(log2 e·x), faster here than
torch's softmax, which also copies each strided block first. Training recomputes the blocks in
the backward (:class:`_Efficient`): no (L, D) tensor is kept but the inputs.
"""

from __future__ import annotations

import torch

from attnzoo.backends.cpu import native
from attnzoo.backends.cpu.fused import LOG2E
from attnzoo.backends.cpu.kernel import key_blocks, stream_rows
from attnzoo.backends.cpu.memory import Scratch, fresh_empty, fresh_like
from attnzoo.mechanisms._softmax import finite_or_zero
from attnzoo.ops import needs_grad, override


@override("efficient_attention")
def efficient_attention(q, k, v, key_mask):
    """σ_row(q) (σ_col(k)ᵀ v) (B, H, Lq, Dv), natively where the kernels run, else by the streamed
    blocks; NotImplemented off the CPU or outside float32 and float64."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        return NotImplemented
    ran = native.efficient(q, k, v, key_mask)
    if ran is not None:
        return ran
    if needs_grad(q, k, v):
        return _Efficient.apply(q, k, v, key_mask)
    return _forward(q, k, v, key_mask, Scratch(q))[0]


def _column_max(k, key_mask):
    """c (B, H, 1, D): each feature's max over the real keys (0 where there is none). A constant
    (detached): the column softmax does not depend on it, it only keeps exp(k − c) <= 1."""
    real = k.detach() if key_mask is None else k.detach().masked_fill(~key_mask[:, None, :, None], -torch.inf)
    return finite_or_zero(real.amax(2, keepdim=True))


def _key_weights(k_blk, mask, c2, scratch):
    """E = exp(k − c) of a key block (B, H, n, D), 0 for padded keys, into ``scratch``;
    ``c2`` = −c·log2 e."""
    e = torch.add(c2, k_blk, alpha=LOG2E, out=scratch("e_k", k_blk.shape)).exp2_()
    return e if mask is None else e.masked_fill_(~mask[:, None, :, None], 0.0)


def _row_weights(q_blk, scratch):
    """(e, s, t): e = exp(q − max) of a query block over its features (B, H, n, D), its row
    sums s and t = −max·log2 e (B, H, n, 1), into ``scratch``."""
    shape = (*q_blk.shape[:-1], 1)
    top = torch.amax(q_blk, -1, keepdim=True, out=scratch("top", shape)).mul_(-LOG2E)
    e = torch.add(top, q_blk, alpha=LOG2E, out=scratch("e_q", q_blk.shape)).exp2_()
    return e, torch.sum(e, -1, keepdim=True, out=scratch("s", shape)), top


def _row_softmax(q_blk, shift, scratch):
    """σ_row(q) = 2^(q·log2 e + shift) of a query block (B, H, n, D), its row shift saved by
    the forward (:func:`_forward`), into ``scratch``: two passes, where the softmax takes five."""
    return torch.add(shift, q_blk, alpha=LOG2E, out=scratch("e_q", q_blk.shape)).exp2_()


def _forward(q, k, v, key_mask, scratch, keep_shift=False):
    """(out, G, z, c2, shift): G = EᵀV / z (B, H, D, Dv) with z = colsum(E) (B, H, D), c2 = −c·log2 e,
    and with ``keep_shift`` (for the backward; else None) the queries' row shifts
    −(max + log s)·log2 e (B, H, Lq, 1), by which σ_row(q) = 2^(q·log2 e + shift)."""
    rows = stream_rows(q)
    c2 = _column_max(k, key_mask).mul_(-LOG2E)  # (B, H, 1, D)
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])  # (B, H, D, Dv)
    z = q.new_zeros(*q.shape[:2], 1, q.shape[-1])  # (B, H, 1, D)
    for k_blk, v_blk, mask in key_blocks(k, v, key_mask, rows):
        e = _key_weights(k_blk, mask, c2, scratch)
        S.add_(e.transpose(-1, -2) @ v_blk)  # (D × Dv products: small)
        z.add_(e.sum(2, keepdim=True))
    z = z.squeeze(2)  # (B, H, D)
    G = S.div_(_clamped(z))
    out = fresh_empty(*q.shape[:3], v.shape[-1], like=q)
    shift = q.new_empty(*q.shape[:3], 1) if keep_shift else None  # (B, H, Lq, 1)
    for start in range(0, q.shape[2], rows):
        at = slice(start, start + rows)
        e, s, top = _row_weights(q[:, :, at], scratch)
        torch.div(torch.matmul(e, G, out=scratch("num", out[:, :, at].shape)), s, out=out[:, :, at])
        if shift is not None:
            torch.sub(top, s.log2_(), out=shift[:, :, at])  # (s is spent)
    return out, G, z, c2, shift


class _Efficient(torch.autograd.Function):
    """Efficient attention with its backward written out, block by block, from the saved
    inputs and G, z, c: with p = σ_row(q), dp = g Gᵀ, dq = p ⊙ (dp − p·dp), dG = Σ pᵀ g;
    dS = dG / z, dz = −Σ_v dG ⊙ G / z (0 where z is clamped: no real key); then per key
    block dE = v dSᵀ + dz, dk = E ⊙ dE (c is a constant: the softmax does not depend on
    it), dv = E dS. dq, dk and dv are written block by block into their results."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask):
        out, G, z, c2, shift = _forward(q, k, v, key_mask, Scratch(q), keep_shift=True)
        ctx.save_for_backward(q, k, v, key_mask, G, z, c2, shift)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, key_mask, G, z, c2, shift = ctx.saved_tensors
        scratch, rows = Scratch(q), stream_rows(q)
        dq, dk, dv = fresh_like(q, k, v)
        dG = torch.zeros_like(G)  # (B, H, D, Dv)
        for start in range(0, q.shape[2], rows):
            at = slice(start, start + rows)
            p = _row_softmax(q[:, :, at], shift[:, :, at], scratch)  # (B, H, n, D)
            dp = torch.matmul(grad[:, :, at], G.transpose(-1, -2), out=scratch("dp", p.shape))
            p_dp = torch.mul(p, dp, out=dq[:, :, at])  # dq = p ⊙ dp − p (p·dp), in its slice
            row = torch.sum(p_dp, -1, keepdim=True, out=scratch("row", (*p.shape[:-1], 1)))  # (B, H, n, 1)
            p_dp.addcmul_(p, row, value=-1)
            dG.add_(p.transpose(-1, -2) @ grad[:, :, at])
        zc = _clamped(z)  # (B, H, D, 1)
        dz = torch.where(z == zc.squeeze(-1), -torch.linalg.vecdot(dG, G) / z, 0.0)  # (B, H, D)
        dS_t = dG.div_(zc).transpose(-1, -2)  # dSᵀ (B, H, Dv, D)
        start = 0
        for k_blk, v_blk, mask in key_blocks(k, v, key_mask, rows):
            at = slice(start, start + k_blk.shape[2])
            start = at.stop
            e = _key_weights(k_blk, mask, c2, scratch)
            d_e = torch.matmul(v_blk, dS_t, out=scratch("d_e", e.shape)).add_(dz.unsqueeze(2))
            torch.mul(d_e, e, out=dk[:, :, at])
            dv[:, :, at] = torch.matmul(e, dS_t.transpose(-1, -2), out=scratch("dv", v_blk.shape))
        return dq, dk, dv, None


def _clamped(z):
    """z (B, H, D) as (B, H, D, 1), at least the smallest normal number (no real key: S = 0 too)."""
    return z.unsqueeze(-1).clamp(min=torch.finfo(z.dtype).tiny)
