"""log_sparse's offsets on the CPU: blocks of positions that stay in cache, reused buffers, and a
backward that recomputes the weights.

Overrides ``attend_offsets`` (:func:`attnzoo.mechanisms.log_sparse.offset_attention`) on the
CPU in float32 and float64 where the first offset is 0 (it reaches every query, so it starts
each block's result). For blocks of positions, one score per offset d from the keys shifted by
d (only the rows where i − d lies in the sequence: no padded copy of K and V), a softmax over
the offsets and the weighted shifted values, the blocks' temporaries in buffers that every
block reuses (:class:`~attnzoo.backends.cpu.memory.Scratch`): fresh ones were faulted in from
the OS block after block in some processes. The backward recomputes each block's weights and
adds the gradients of the shifted keys and values into place, where autograd would zero-fill
a whole-size gradient for every offset. Elsewhere the portable body runs.
"""

from __future__ import annotations

import torch

from attnzoo.backends.cpu.memory import Scratch, fresh_empty, fresh_like
from attnzoo.mechanisms._softmax import all_finite
from attnzoo.mechanisms.full import masked_softmax
from attnzoo.ops import override

SCORES_PER_CHUNK = 2**20  # a block's products (all batches and heads): B·H·D per position, in cache


@override("attend_offsets")
def attend_offsets(q, k, v, valid, *, offsets, scale):
    """:func:`~attnzoo.mechanisms.log_sparse.offset_attention` by blocks of positions (module
    doc), or NotImplemented where it does not apply."""
    # (keys or values that are not finite: the portable body keeps them to the rows that see them)
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64)
            or not offsets or offsets[0] != 0 or not all_finite(k, v)):
        return NotImplemented
    return _OffsetAttention.apply(q * scale, k, v, _Offsets(offsets, q.shape[2], valid))


class _Offsets:
    """The blocks of positions of one call, and the offsets each block's queries reach."""

    def __init__(self, offsets, N, valid):
        self.offsets, self.N, self.valid = offsets, N, valid

    def blocks(self, B, H, D):
        """(s, e, shifts) for each block of positions s..e−1: shifts lists, for each offset that
        reaches a key from the block, (n, rows, keys), n the offset's index, rows its queries
        within the block and keys their keys i − d (slices of equal length)."""
        rows = max(1, SCORES_PER_CHUNK // (B * H * D))  # positions a block
        for s in range(0, self.N, rows):
            e = min(self.N, s + rows)
            shifts = []
            for n, d in enumerate(self.offsets):
                lo, hi = max(s, d), min(e, self.N + d)  # the block's queries whose key i − d exists
                if lo < hi:
                    shifts.append((n, slice(lo - s, hi - s), slice(lo - d, hi - d)))
            yield s, e, shifts

    def weights(self, q_blk, k, s, e, shifts, scratch):
        """(B, H, n, n_offsets) softmax over the offsets of the block's queries; rows with no key 0."""
        scores = _offset_dots(q_blk, k, shifts, len(self.offsets), scratch, "scores")
        return masked_softmax(scores, self.valid[..., s:e, :])

    def forward(self, q, k, v, scratch):
        """(B, H, N, Dv), block by block, the blocks' temporaries in ``scratch``. Offset 0 (the
        first) reaches every query: it starts each block."""
        B, H, N, D = q.shape
        out = fresh_empty(B, H, N, v.shape[-1], like=q)
        for s, e, shifts in self.blocks(B, H, D):
            w = self.weights(q[:, :, s:e], k, s, e, shifts, scratch)  # (B, H, n, n_offsets)
            block = torch.mul(w[..., 0, None], v[:, :, s:e], out=scratch("block", (B, H, e - s, v.shape[-1])))
            for n, rows, keys in shifts[1:]:
                block[:, :, rows].addcmul_(w[:, :, rows, n, None], v[:, :, keys])
            out[:, :, s:e] = block
        return out


def _offset_dots(a, b, shifts, n_offsets, scratch, name):
    """(B, H, n, n_offsets): a · b[:, :, keys] over the features for each offset's rows of ``a``
    (``shifts`` as :meth:`_Offsets.blocks` gives them), 0 where an offset reaches no key; the
    products go into one reused buffer and the dots into the scratch's ``name``
    (``torch.linalg.vecdot`` would make a fresh (B, H, n, D) product each call)."""
    dots = scratch(name, (n_offsets, *a.shape[:-1])).zero_()  # (n_offsets, B, H, n)
    prod = scratch("prod", a.shape)  # (B, H, n, D)
    for n, rows, keys in shifts:
        r = prod[:, :, :rows.stop - rows.start]
        torch.sum(torch.mul(a[:, :, rows], b[:, :, keys], out=r), -1, out=dots[n, :, :, rows])
    return dots.permute(1, 2, 3, 0)


class _OffsetAttention(torch.autograd.Function):
    """The offsets' forward by blocks, and a backward that recomputes each block's weights and
    adds the gradients of the shifted keys and values into place."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        ctx.save_for_backward(q, k, v)
        ctx.plan = plan
        return plan.forward(q, k, v, Scratch(q))

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        plan = ctx.plan
        dq, (dk, dv) = torch.empty_like(q), fresh_like(k, v, zero=True)  # dk, dv: added into
        scratch = Scratch(q)
        for s, e, shifts in plan.blocks(*q.shape[:2], q.shape[-1]):
            q_blk, g = q[:, :, s:e], grad_out[:, :, s:e]
            w = plan.weights(q_blk, k, s, e, shifts, scratch)  # (B, H, n, n_offsets)
            dw = _offset_dots(g, v, shifts, len(plan.offsets), scratch, "dw")
            ds = w * (dw - (w * dw).sum(-1, keepdim=True))  # softmax backward
            dq_blk = ds[..., 0, None] * k[:, :, s:e]  # offset 0: every query
            for n, rows, keys in shifts:
                if n:
                    dq_blk[:, :, rows].addcmul_(ds[:, :, rows, n, None], k[:, :, keys])
                dk[:, :, keys].addcmul_(ds[:, :, rows, n, None], q_blk[:, :, rows])
                dv[:, :, keys].addcmul_(w[:, :, rows, n, None], g[:, :, rows])
            dq[:, :, s:e] = dq_blk
        return dq, dk, dv, None
