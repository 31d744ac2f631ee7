"""Banded windows on the CPU: torch's fused attention kernel over the query blocks' windows, and
a backward that recomputes the weights block by block.

Overrides ``attend_windows`` (:func:`attnzoo.mechanisms._windows.window_partial`) where the fused
kernel may take the call: no key padding, q, k, v that :func:`attnzoo.backends.cpu.fused.fits`
(CPU, float32 or float64, Dv = D, rows of stride 1), every query inside the sequence with a
key to see, and finite keys and values (the kernel computes a window's masked keys too, adding
-inf to their scores and weighing their values by 0: a nan or an inf there would reach queries
that may not see it, which the portable body prevents). Elsewhere it returns NotImplemented and
the portable body runs.

The forward (:meth:`_Band.forward`) gives the kernel each query block with its window of keys as
a batch of small attentions. The blocks whose window lies inside the sequence share one relative
band, so one small additive mask serves them all, or none where the band allows every key
(block_local's two-sided windows), and their key windows are a strided view of the keys, not a
padded copy; the few blocks at either end get a mask each (the kernel takes only 4-D masks of
the query's dtype) and windows of a zero-padded copy of their keys. Runs of blocks without a
mask go to the native few-queries kernel (each block's window a head of its own), which is
faster there than the kernel. The backward (:meth:`_Band.backward`) recomputes the weights from
the forward's log-sum-exp, as flash attention's does, over the same windows, so training keeps
no weights.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from attnzoo.backends.cpu import fused, native
from attnzoo.backends.cpu.memory import fresh_empty
from attnzoo.mechanisms._softmax import all_finite
from attnzoo.mechanisms._windows import pad_to
from attnzoo.ops import override

SCORES_PER_CHUNK = 2**20  # the backward's weights and their gradients of one step (heads at a time), in cache
BAND_PIECE = 2**20  # outputs (all batches and heads) of one kernel call of the forward


@override("attend_windows")
def attend_windows(q, k, v, key_valid, *, block, left, right, allowed, scale):
    """:func:`~attnzoo.mechanisms._windows.window_partial` by the fused kernel (module doc), or
    NotImplemented where it does not apply."""
    if key_valid is not None or not fused.fits(q, k, v):
        return NotImplemented
    B, H, L, D = q.shape
    band = _Band(B * H, L, block, left, right, allowed, q.dtype, q.device, scale)
    if band.has_query_without_keys() or not all_finite(k, v):  # (module doc)
        return NotImplemented
    q_rows = pad_to(q, band.Lp).reshape(B * H, band.Lp, D)
    k_rows, v_rows = (t.reshape(B * H, L, t.shape[-1]) for t in (k, v))  # the keys as they are
    o, lse = _BandAttention.apply(q_rows, k_rows, v_rows, band)  # (B·H, Lp, Dv), (B·H, Lp)
    return o.view(B, H, band.Lp, -1)[:, :, :L], lse.view(B, H, band.Lp)[:, :, :L]


class _BandAttention(torch.autograd.Function):
    """The band's forward and its recomputing backward (:class:`_Band`)."""

    @staticmethod
    def forward(ctx, q, k, v, band):
        o, lse = band.forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.band = band
        ctx.set_materialize_grads(False)  # an unused lse gives None, not zeros
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        grad_o = torch.zeros_like(o) if grad_o is None else grad_o
        return (*ctx.band.backward(grad_o, grad_lse, q, k, v, o, lse), None)


class _Band:
    """The windows of one call over rows (B·H, ·, ·): q (B·H, Lp, D) padded to whole query blocks,
    k and v (B·H, L, ·) as they are, and the additive masks of the runs of query blocks."""

    def __init__(self, BH, L, block, left, right, allowed, dtype, device, scale):
        self.BH, self.L, self.block, self.left, self.right, self.scale = BH, L, block, left, right, scale
        self.nb = -(-L // block)  # query blocks
        self.Lp, self.span = self.nb * block, block + left + right
        self.runs = self._runs(allowed, dtype, device)

    def has_query_without_keys(self) -> bool:
        """Whether a query may attend none of its window's keys (the kernel gives such a row lse 0,
        not -inf). Queries past L see the padded keys: only those inside the sequence can."""
        return any(bool((mask == float("-inf")).all(-1).any()) for _, _, mask in self.runs)

    def forward(self, q, k, v):
        """(o (B·H, Lp, Dv), lse (B·H, Lp)) of every query block over its window, the kernel
        scaling q itself, on pieces of about BAND_PIECE outputs, each written into its place in
        one result (the kernel's own result for all blocks at once was a large fresh tensor)."""
        qb = q.view(self.BH, self.nb, self.block, -1)  # (B·H, nb, block, D)
        o = fresh_empty(*qb.shape[:3], v.shape[-1], like=q)  # (B·H, nb, block, Dv)
        lse = q.new_empty(qb.shape[:3])  # (B·H, nb, block)
        step = self._blocks_a_piece(v.shape[-1])
        for a, b, mask in self.runs:
            shared = mask.shape[1] == 1
            if shared and not bool(mask.any()):  # every window key allowed (block_local): no mask
                mask = None
            for s in range(a, b, step):
                e = min(b, s + step)
                windows = self._windows(k, s, e), self._windows(v, s, e)  # (B·H, e − s, span, ·)
                o[:, s:e], lse[:, s:e] = self._attend(qb[:, s:e], *windows,
                                                      mask if shared else mask[:, s - a:e - a])
        return o.view(self.BH, self.Lp, -1), lse.view(self.BH, self.Lp)

    def _attend(self, q, k, v, mask):
        """(o, lse) of the windows k, v (B·H, n, span, ·) of the query blocks q (B·H, n, block, D):
        without a mask by the native few-queries kernel (each block's window as a head of its
        own) where it runs, else by the fused kernel with the additive ``mask``."""
        if mask is None:
            out = native.few_queries(q, k, v, None, self.scale, keep_lse=True)
            if out is not None:
                return out
        return fused.flash(q, k, v, attn_mask=mask, scale=self.scale)

    def backward(self, grad_o, grad_lse, q, k, v, o, lse):
        """(dq, dk, dv) of :meth:`forward`'s o and lse for their gradients (grad_lse None where
        lse takes none), recomputing each block's weights from lse over the same windows (the
        gradients of a padded copy's keys are added back onto the keys).

        Query block by query block, a few heads at once (about SCORES_PER_CHUNK / 2 weights a
        step, in cache): with c = scale·log2 e, P = 2^(c·Q Kᵀ + mask·log2 e − lse·log2 e) by one
        ``baddbmm_`` into the mask less lse; dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O) + d lse) (the
        gradient of lse by the scores is P), dQ = scale·dS K, and the window's
        dK = scale·dSᵀ Q and dV = Pᵀ dO are added onto its keys, one add each for all heads (one
        block's window does not overlap itself). P, dS and the window's products go into
        buffers taken once, and rowsum(dO ⊙ O) is taken block by block, not as one large
        temporary. Runs of blocks without a mask take the native few-queries backward where it
        runs and lse takes no gradient (:meth:`_native_grads`).
        """
        BH, nb, block, span = self.BH, self.nb, self.block, self.span
        qb = q.view(BH, nb, block, -1)  # (B·H, nb, block, D)
        gb, ob = grad_o.reshape(BH, nb, block, -1), o.view(BH, nb, block, -1)  # (B·H, nb, block, Dv)
        lse2 = (lse.view(BH, nb, block) * fused.LOG2E).unsqueeze(-1)  # (B·H, nb, block, 1)
        gl = None if grad_lse is None else grad_lse.reshape(BH, nb, block, 1)
        dq = fresh_empty(*qb.shape, like=qb)
        dk, dv = (fresh_empty(*t.shape, like=t).zero_() for t in (k, v))  # (B·H, L, ·): added into
        heads = max(1, SCORES_PER_CHUNK // 2 // (block * span))  # heads a step
        p_buf, ds_buf = (qb.new_empty(min(heads, BH), block, span) for _ in range(2))
        kv_buf = qb.new_empty(min(heads, BH), span, v.shape[-1])  # a window's dK or dV (Dv = D)
        for a, b, mask in self.runs:
            kb, vb = self._windows(k, a, b), self._windows(v, a, b)  # (B·H, b − a, span, ·)
            start, rows, lo, hi = self._key_rows(a, b)
            inside = (lo, hi) == (start, start + rows)
            dk_run, dv_run = ((t[:, start:start + rows] if inside else t.new_zeros(BH, rows, t.shape[-1]))
                              for t in (dk, dv))  # the run's keys' gradients
            if gl is None and not mask.any() and self._native_grads(gb, ob, lse, qb, kb, vb, a, b,
                                                                    (dq, dk_run, dv_run)):
                continue
            for i in range(a, b):
                bias = mask[0] if mask.shape[1] == 1 else mask[0, i - a]  # (1, block, span) | (block, span)
                window = slice((i - a) * block, (i - a) * block + span)  # block i's keys in the run's
                for h in range(0, BH, heads):
                    hs = slice(h, h + heads)
                    q_i, g_i = qb[hs, i], gb[hs, i]  # (h, block, ·)
                    k_i, v_i = kb[hs, i - a], vb[hs, i - a]  # (h, span, ·)
                    row = torch.linalg.vecdot(g_i, ob[hs, i]).unsqueeze(-1)  # rowsum(dO ⊙ O) (h, block, 1)
                    if gl is not None:
                        row = row.sub_(gl[hs, i])
                    n = q_i.shape[0]  # heads this step (the last may have fewer)
                    p = torch.sub(bias, lse2[hs, i], out=p_buf[:n]).baddbmm_(
                        q_i, k_i.transpose(-1, -2), alpha=self.scale * fused.LOG2E).exp2_()
                    ds = torch.bmm(g_i, v_i.transpose(-1, -2), out=ds_buf[:n]).sub_(row).mul_(p)
                    torch.mul(torch.bmm(ds, k_i), self.scale, out=dq[hs, i])
                    dk_run[hs, window].add_(torch.bmm(ds.transpose(-1, -2), q_i, out=kv_buf[:n]),
                                            alpha=self.scale)
                    dv_run[hs, window].add_(torch.bmm(p.transpose(-1, -2), g_i, out=kv_buf[:n]))
            if not inside:  # the padded copy's gradients onto the keys they copied
                dk[:, lo:hi] += dk_run[:, lo - start:hi - start]
                dv[:, lo:hi] += dv_run[:, lo - start:hi - start]
        return dq.view_as(q), dk, dv

    def _native_grads(self, gb, ob, lse, qb, kb, vb, a, b, grads):
        """Adds the gradients of query blocks a..b−1, unmasked, to ``grads`` = (dq (B·H, nb, block,
        D), the run's dk and dv (B·H, rows, ·)) by the native few-queries backward, each block's
        window a head of its own, in pieces of about BAND_PIECE outputs (a piece's window
        gradients, (B·H, n, span, ·), are added onto the keys they belong to); False where the
        kernels cannot run. lse (B·H, Lp); the others as in :meth:`backward`."""
        dq, dk_run, dv_run = grads
        lse = lse.view(qb.shape[:3])  # (B·H, nb, block)
        step = self._blocks_a_piece(vb.shape[-1])
        for s in range(a, b, step):
            e = min(b, s + step)
            w = slice(s - a, e - a)  # the piece's windows in the run's
            out = native.few_queries_grad(qb[:, s:e], kb[:, w], vb[:, w], None, self.scale,
                                          gb[:, s:e], ob[:, s:e], lse[:, s:e])
            if out is None:
                return False
            dq[:, s:e], dk_w, dv_w = out  # dk_w, dv_w (B·H, e − s, span, ·)
            for i in range(s, e):
                keys = slice((i - a) * self.block, (i - a) * self.block + self.span)  # block i's in the run's
                dk_run[:, keys] += dk_w[:, i - s]
                dv_run[:, keys] += dv_w[:, i - s]
        return True

    def _blocks_a_piece(self, Dv: int) -> int:
        """Query blocks a piece of the forward and the native backward: about BAND_PIECE outputs."""
        return max(1, BAND_PIECE // (self.BH * self.block * Dv))

    def _key_rows(self, a, b):
        """(start, rows, lo, hi): query blocks a..b−1 see ``rows`` keys from key ``start``
        (< 0 or past L at either end), of which keys lo..hi−1 lie in the sequence."""
        start, rows = a * self.block - self.left, (b - a - 1) * self.block + self.span
        return start, rows, max(start, 0), min(start + rows, self.L)

    def _windows(self, t, a, b):
        """The key windows (B·H, b − a, span, X) of query blocks a..b−1 over the keys t (B·H, L, X):
        a view where they lie inside the sequence, else windows of a copy of their keys
        zero-padded at either end."""
        start, rows, lo, hi = self._key_rows(a, b)
        piece = t[:, lo:hi]
        if (lo, hi) != (start, start + rows):
            piece = pad_to(piece, rows, dim=1, front=lo - start)
        return piece.unfold(1, self.span, self.block).transpose(-1, -2)

    def _runs(self, allowed, dtype, device):
        """[(first block, end block, additive mask (1, n, block, span))]: the blocks whose window
        starts before key 0 or ends past key L get a mask each (n = end − first); those between
        share one relative band (n = 1)."""
        nb, block = self.nb, self.block
        first = min(nb, -(-self.left // block))
        last = max(first, min(nb, (self.L - self.right - block) // block + 1))
        runs = [(0, first, range(first)), (first, last, range(first, first + 1)), (last, nb, range(last, nb))]
        return [(a, b, self._bias(blocks, allowed, dtype, device)[None]) for a, b, blocks in runs if b > a]

    def _bias(self, blocks, allowed, dtype, device):
        """(len(blocks), block, span) additive mask of query blocks ``blocks``: 0 or -inf. Queries
        past L may attend the padded keys past L, so that no row of theirs is empty."""
        i = (torch.tensor(blocks, device=device) * self.block).view(-1, 1, 1) + torch.arange(
            self.block, device=device).view(-1, 1)  # (n, block, 1) query positions
        j = i[:, :1] - self.left + torch.arange(self.span, device=device)  # (n, 1, span) key positions
        ok = allowed(i, j) & (j >= 0) & ((j < self.L) | (i >= self.L))  # (n, block, span)
        return fused.additive_mask(ok, dtype)
