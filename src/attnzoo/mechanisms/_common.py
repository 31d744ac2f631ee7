"""Pieces the sparse mechanisms share: partial softmaxes and their merge, blocked windows,
and the position frame that lets a self-attention pattern take Lq != Lk.

A *partial* is ``(o, lse)``: the softmax-weighted average ``o (B, H, Lq, Dv)`` of
the values over some set of keys and the log-sum-exp ``lse (B, H, Lq)`` of the
scores over that set (-inf where the set is empty). Two partials over disjoint
key sets merge exactly into the softmax over their union; this is how the
factorized patterns combine their parts and how LSH combines hash rounds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def wide(t: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 up to float32 (softmax and its sums accumulate there); others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def partial_softmax(scores: torch.Tensor, valid: torch.Tensor | None, v: torch.Tensor):
    """Softmax of ``scores (..., R, n)`` over the ``valid`` keys, applied to ``v (..., n, Dv)``.

    Returns ``(o (..., R, Dv), lse (..., R))``, in float32 for half-precision inputs; rows
    with no valid key give o = 0, lse = -inf. ``scores`` is overwritten (callers pass a
    fresh tensor): masking, shifting and exp happen in place, and the normaliser divides
    the small ``o`` rather than the weights, so the scores are read and written four times
    in all. The shift m is detached: the softmax and lse do not depend on it.
    """
    scores, v = wide(scores), wide(v)
    if valid is not None:
        scores = scores.masked_fill_(valid.logical_not(), float("-inf"))
    m = scores.detach().amax(-1, keepdim=True)  # (..., R, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty rows: exp(-inf) = 0 below
    weights = scores.sub_(m).exp_()
    total = weights.sum(-1, keepdim=True)  # >= 1 where a key is valid: the max gives exp(0)
    o = (weights @ v) / total.clamp(min=1.0)  # (..., R, Dv); empty rows 0 / 1
    return o, (m + total.log()).squeeze(-1)


def merge_partials(parts):
    """Merge partials over disjoint key sets into the softmax over their union."""
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = torch.logaddexp(lse, part_lse)
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = 0
    for o, part_lse in parts:
        out = out + torch.exp(part_lse - safe_lse).unsqueeze(-1) * o
    return out, lse


def pad_to(t: torch.Tensor, length: int, dim: int = 2, front: int = 0, value=0.0) -> torch.Tensor:
    """Pad ``t`` along ``dim`` with ``front`` leading entries and trailing ones up to ``length``."""
    back = length - front - t.shape[dim]
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [front, back]
    return F.pad(t, pad, value=value)


SCORES_PER_CHUNK = 2**20  # scores (all batches and heads) computed at a time: 4 MiB in float32, in cache


def window_partial(q, k, v, key_valid, *, block, left, right, allowed, scale):
    """Blocked windowed attention: query block b of ``block`` rows sees keys
    [b·block − left, (b+1)·block + right), further restricted by ``allowed(i, j)``.

    q (B, H, L, D), k (B, H, L, D), v (B, H, L, Dv), key_valid (B, L) bool or None.
    ``allowed`` takes broadcastable int tensors of query and key positions and
    returns a bool tensor. Cost O(L·(block + left + right)·D), no L×L tensor; query
    blocks go in groups of about SCORES_PER_CHUNK scores over all batches and heads, so
    the elementwise passes over them run in cache and a forward's temporaries stay that
    small. Returns ``(o (B, H, L, Dv), lse (B, H, L))``.

    In float32 / float64 the backward recomputes each group's weights from q, k, v and
    the saved lse (as flash attention does), so training keeps O(L·D) rather than every
    group's weights; half precision goes through autograd.
    """
    band = _Band(q.shape[2], block, left, right, allowed, key_valid)
    if q.dtype in (torch.float16, torch.bfloat16):
        return band.forward(q * scale, k, v)
    return _BandAttention.apply(q, k, v, band, scale)


class _Band:
    """The geometry of :func:`window_partial`: padding, groups of query blocks, validity."""

    def __init__(self, L, block, left, right, allowed, key_valid):
        self.L, self.block, self.left, self.right, self.allowed = L, block, left, right, allowed
        self.nb = -(-L // block)
        self.Lp, self.span = self.nb * block, block + left + right
        self.kv = None
        if key_valid is not None:
            self.kv = pad_to(key_valid, self.Lp + left + right, dim=1, front=left,
                             value=False).unfold(1, self.span, block)  # (B, nb, span)

    def pad_q(self, t):  # (B, H, L, X) -> (B, H, nb, block, X)
        return pad_to(t, self.Lp).view(*t.shape[:2], self.nb, self.block, -1)

    def pad_k(self, t):  # (B, H, L, X) -> (B, H, Lp + left + right, X)
        return pad_to(t, self.Lp + self.left + self.right, front=self.left)

    def groups(self, B, H):
        group = max(1, SCORES_PER_CHUNK // (B * H * self.block * self.span))  # query blocks at a time
        return [slice(g, min(g + group, self.nb)) for g in range(0, self.nb, group)]

    def valid(self, blocks, device):
        """(n, block, span) or (B, 1, n, block, span) bool: which window keys a query may attend."""
        b = torch.arange(blocks.start, blocks.stop, device=device).view(-1, 1, 1)
        i = b * self.block + torch.arange(self.block, device=device).view(1, self.block, 1)
        j = b * self.block - self.left + torch.arange(self.span, device=device)  # (n, 1, span)
        valid = self.allowed(i, j) & (j >= 0) & (j < self.L)
        if self.kv is not None:
            valid = valid & self.kv[:, None, blocks, None, :]
        return valid

    def key_rows(self, blocks, device):
        """Row of the padded keys of every window slot of ``blocks``: (n·span,)."""
        b = torch.arange(blocks.start, blocks.stop, device=device).view(-1, 1)
        return (b * self.block + torch.arange(self.span, device=device)).reshape(-1)

    def forward(self, q_scaled, k, v):
        B, H = q_scaled.shape[:2]
        q_blk, k_pad, v_pad = self.pad_q(q_scaled), self.pad_k(k), self.pad_k(v)
        parts = []
        for blocks in self.groups(B, H):
            scores = q_blk[:, :, blocks] @ _windows(k_pad, blocks, self.block, self.span).transpose(-1, -2)
            parts.append(partial_softmax(scores, self.valid(blocks, q_scaled.device),
                                         _windows(v_pad, blocks, self.block, self.span)))
        o = torch.cat([o for o, _ in parts], 2).reshape(B, H, self.Lp, -1)[:, :, :self.L]
        lse = torch.cat([lse for _, lse in parts], 2).reshape(B, H, self.Lp)[:, :, :self.L]
        return o, lse


class _BandAttention(torch.autograd.Function):
    """window_partial with a backward that recomputes the weights group by group."""

    @staticmethod
    def forward(ctx, q, k, v, band, scale):
        o, lse = band.forward(q * scale, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.band, ctx.scale = band, scale
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        band, scale = ctx.band, ctx.scale
        B, H, L, D = q.shape
        grad_o = torch.zeros_like(o) if grad_o is None else grad_o
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        # d lse / d s = p and d o / d s = p (dP − rowsum(dO·o)): one per-row term for both
        seen = torch.isfinite(lse)  # rows with a key; the others have no weights and get no gradient
        row = torch.where(seen, grad_lse - (grad_o * o).sum(-1), 0.0).unsqueeze(-1)  # (B, H, L, 1)
        safe_lse = torch.where(seen, lse, torch.inf).unsqueeze(-1)  # exp(s - inf) = 0 on empty rows
        q_blk, g_blk = band.pad_q(q * scale), band.pad_q(grad_o)
        row_blk, lse_blk = band.pad_q(row), band.pad_q(safe_lse)
        k_pad, v_pad = band.pad_k(k), band.pad_k(v)
        dq = torch.empty_like(q_blk)
        dk, dv = torch.zeros_like(k_pad), torch.zeros_like(v_pad)
        for blocks in band.groups(B, H):
            k_win = _windows(k_pad, blocks, band.block, band.span)  # (B, H, n, span, D)
            v_win = _windows(v_pad, blocks, band.block, band.span)
            scores = q_blk[:, :, blocks] @ k_win.transpose(-1, -2)  # (B, H, n, block, span)
            scores.masked_fill_(band.valid(blocks, q.device).logical_not(), float("-inf"))
            p = scores.sub_(lse_blk[:, :, blocks]).exp_()  # the weights; empty rows 0
            g = g_blk[:, :, blocks]  # (B, H, n, block, Dv)
            ds = (g @ v_win.transpose(-1, -2)).add_(row_blk[:, :, blocks]).mul_(p)  # d scores
            dq[:, :, blocks] = ds @ k_win
            rows = band.key_rows(blocks, q.device)
            dk.index_add_(2, rows, (ds.transpose(-1, -2) @ q_blk[:, :, blocks]).flatten(2, 3))
            dv.index_add_(2, rows, (p.transpose(-1, -2) @ g).flatten(2, 3))
        keys = slice(band.left, band.left + L)
        return (dq.flatten(2, 3)[:, :, :L] * scale, dk[:, :, keys], dv[:, :, keys], None, None)


def _windows(t, blocks: slice, block: int, span: int) -> torch.Tensor:
    """The key windows of query blocks ``blocks``: rows [b·block, b·block + span) of the padded
    ``t (B, H, N, X)``, copied to one contiguous (B, H, n, span, X) tensor (a strided view
    multiplies about twice as slowly)."""
    n = blocks.stop - blocks.start
    t = t.contiguous()  # the strides below assume it (a no-op for pad_to's fresh tensors)
    B, H, N, X = t.shape
    view = t.as_strided((B, H, n, span, X), (H * N * X, N * X, block * X, X, 1),
                        t.storage_offset() + blocks.start * block * X)
    return view.contiguous()


def window_flops(N: int, *, block: int, left: int, right: int, D: int, Dv: int) -> float:
    """FLOPs of :func:`window_partial` for one (batch, head): scores and weighted sum per block."""
    nb = -(-N // block)
    return 2.0 * nb * block * (block + left + right) * (D + Dv)


def to_frame(q, k, v, key_mask):
    """Put q and k/v on one frame of N = max(Lq, Lk) positions for self-attention patterns.

    Queries are the last Lq positions and keys the last Lk (the causal
    alignment of ``attnzoo.masks``); missing keys are padding. Returns
    ``(q, k, v, key_valid (B, N) or None, Lq)``; slice outputs with ``[:, :, -Lq:]``.
    """
    B, Lq, Lk = q.shape[0], q.shape[2], k.shape[2]
    N = max(Lq, Lk)
    if Lk < N:
        key_mask = torch.ones(B, Lk, dtype=torch.bool, device=k.device) if key_mask is None else key_mask
        key_mask = pad_to(key_mask, N, dim=1, front=N - Lk, value=False)
        k, v = pad_to(k, N, front=N - Lk), pad_to(v, N, front=N - Lk)
    if Lq < N:
        q = pad_to(q, N, front=N - Lq)
    return q, k, v, key_mask, Lq


def pattern_reference(pattern):
    """The dense reference of a pattern mechanism: masked softmax with its connectivity.

    ``pattern(N, opts, causal)`` gives the (N, N) mask, or (P, N, N) for
    patterns that differ by head (head h uses pattern h % P).
    """
    from attnzoo.mechanisms.full import softmax_reference

    def reference(q, k, v, opts, *, causal=False, key_mask=None, scale=None, generator=None):
        Lq, Lk, H = q.shape[2], k.shape[2], q.shape[1]
        N = max(Lq, Lk)
        mask = pattern(N, opts, causal).to(q.device)[..., N - Lq:, N - Lk:]
        if mask.dim() == 3:  # per-head patterns
            mask = mask[torch.arange(H) % mask.shape[0]]  # (H, Lq, Lk)
        mask = mask.expand(1, H, Lq, Lk)
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :]
        return softmax_reference(q, k, v, mask, scale)

    return reference
