"""The Sparse Transformer's A2 parts on the CPU: a leaner softmax, torch's fused attention
kernel where it fits, and results written into place without autograd.

Overrides, on the CPU in float32 and float64 with finite keys and values (elsewhere the portable
bodies run, which keep a nan or an inf from the queries that may not see it):

- ``attend_summary_cells`` (fixed's summary cells,
  :func:`attnzoo.mechanisms.sparse_transformer.summary_partial`): without autograd, where q, k,
  v :func:`attnzoo.backends.cpu.fused.fits` and the cells' validity is the same for every batch
  entry (no padding keys), chunks of queries go through
  :func:`attnzoo.backends.cpu.fused.fused_partial`, which keeps no weights and is faster than
  scores and a softmax in torch, the more so as L grows; otherwise each chunk's scores go
  through :func:`partial_softmax`.
- ``merge_two_partials`` (the union of A1 and A2,
  :func:`attnzoo.mechanisms.sparse_transformer.merged_output`): into one result, the second
  part added in place, not into the several temporaries of a general merge.
- ``attend_residues`` (strided's residue classes,
  :func:`attnzoo.mechanisms.sparse_transformer.residue_partial`): each chunk of classes through
  :func:`partial_softmax`, and without autograd each written into its place in one result in
  position order as it comes (concatenated, then reordered, they made two large fresh tensors).

:func:`partial_softmax` takes fewer passes over the scores (and keeps fewer for the backward)
than the portable one.
"""

from __future__ import annotations

import torch

from attnzoo.backends.cpu import fused
from attnzoo.backends.cpu.memory import fresh_empty
from attnzoo.mechanisms._softmax import all_finite, finite_or_zero
from attnzoo.ops import needs_grad, override

FUSED_A2_MASK = 2**20  # by the fused kernel: entries of a chunk's (rows, cells) mask, read for every head
SCORES_PER_CHUNK = 2**20  # otherwise: scores (all batches and heads) of a chunk, in cache


def _fits(q: torch.Tensor) -> bool:
    """Whether the overrides may take the call: on the CPU, in float32 or float64."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


@override("attend_summary_cells")
def attend_summary_cells(q, k_sum, v_sum, cells_for):
    """:func:`~attnzoo.mechanisms.sparse_transformer.summary_partial` by chunks of queries, each
    by the fused kernel or by :func:`partial_softmax` (module doc)."""
    if not _fits(q) or not all_finite(k_sum, v_sum):
        return NotImplemented
    (B, H, L, _), n = q.shape, k_sum.shape[2]
    kernel = not needs_grad(q, k_sum, v_sum) and fused.fits(q, k_sum, v_sum)
    rows = max(1, FUSED_A2_MASK // n if kernel else SCORES_PER_CHUNK // (B * H * n))
    parts = []
    # split, not slices: the backward then joins the chunks' gradients in one pass
    for start, q_rows in zip(range(0, L, rows), q.split(rows, 2), strict=True):
        cells, valid = cells_for(start, start + q_rows.shape[2])
        k_cells, v_cells = k_sum[:, :, :cells], v_sum[:, :, :cells]
        if kernel and valid.dim() == 2:  # (a validity by batch entry: padding keys)
            parts.append(fused.fused_partial(q_rows, k_cells, v_cells, valid))
        else:
            parts.append(partial_softmax(q_rows @ k_cells.transpose(-1, -2), valid, v_cells))
    if len(parts) == 1:  # (a cat would copy it)
        return parts[0]
    return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


@override("merge_two_partials")
def merge_two_partials(part_a, part_b):
    """:func:`~attnzoo.mechanisms.sparse_transformer.merged_output`: o_a·w_a + o_b·w_b with
    w = e^lse / (e^lse_a + e^lse_b) (0 where neither part has a key), the second product added in
    place into the first (without autograd in :func:`fresh_empty` memory)."""
    (o_a, lse_a), (o_b, lse_b) = part_a, part_b
    if not _fits(o_a):
        return NotImplemented
    shift = finite_or_zero(torch.maximum(lse_a, lse_b).detach())  # (B, H, L), only for range
    e_a, e_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = e_a + e_b
    total = torch.where(total > 0, total, torch.ones_like(total))
    w_a, w_b = (e_a / total).unsqueeze(-1), (e_b / total).unsqueeze(-1)  # (B, H, L, 1)
    if needs_grad(o_a, o_b, lse_a, lse_b):
        out = o_a * w_a
    else:
        out = torch.mul(o_a, w_a, out=fresh_empty(*o_a.shape, like=o_a))
    return out.addcmul_(o_b, w_b)


@override("attend_residues")
def attend_residues(qr, kr, vr, valid):
    """:func:`~attnzoo.mechanisms.sparse_transformer.residue_partial` by chunks of residue classes,
    each by :func:`partial_softmax` (module doc)."""
    if not _fits(qr) or not all_finite(kr, vr):
        return NotImplemented
    B, H, l, m, _ = qr.shape
    per = max(1, SCORES_PER_CHUNK // (B * H * m * m))  # residue classes at a time
    # split, not slices: the backward then joins the pieces' gradients in one pass
    parts = (partial_softmax(q_r @ k_r.transpose(-1, -2), valid_r, v_r)  # (B, H, n, m, ·)
             for q_r, k_r, v_r, valid_r in zip(qr.split(per, 2), kr.split(per, 2), vr.split(per, 2),
                                               valid.split(per, -3), strict=True))
    if needs_grad(qr, kr, vr):  # residue classes in order -> positions in order (B, H, m·l, ·)
        return tuple(torch.cat(ts, 2).transpose(2, 3).flatten(2, 3) for ts in zip(*parts, strict=True))
    o = fresh_empty(B, H, m * l, vr.shape[-1], like=qr)
    lse = qr.new_empty(B, H, m * l)
    # the same memory by residue class: position a·l + r at [r, a], (B, H, l, m, ·)
    o_r, lse_r = o.view(B, H, m, l, -1).transpose(2, 3), lse.view(B, H, m, l).transpose(2, 3)
    s = 0
    for part_o, part_lse in parts:
        n = part_o.shape[2]
        o_r[:, :, s:s + n], lse_r[:, :, s:s + n] = part_o, part_lse
        s += n
    return o, lse


def partial_softmax(scores: torch.Tensor, valid: torch.Tensor | None, v: torch.Tensor):
    """:func:`attnzoo.mechanisms._softmax.partial_softmax` of ``scores (..., R, n)`` (overwritten:
    callers pass a fresh tensor) in float32 or float64, in fewer passes: -inf only over the span
    of key columns that are not valid in every row, the weights p by torch's fused softmax
    kernel, and the log-sum-exp from the largest weight, max p = exp(m − lse) with m the row's
    largest score (kept for the backward: p alone, which the softmax keeps anyway)."""
    if valid is not None:
        _mask_invalid_(scores, valid)
    m = scores.detach().amax(-1, keepdim=True)  # (..., R, 1)
    empty = m == float("-inf")  # rows with no valid key: softmax would give nan
    empty = empty if bool(empty.any()) else None
    if empty is not None:
        scores = scores.masked_fill_(empty, 0.0)
    p = torch.softmax(scores, -1)
    o, lse = p @ v, _LogSumExp.apply(scores, p, m)  # (..., R, Dv), (..., R, 1)
    if empty is not None:
        o, lse = o.masked_fill(empty, 0.0), lse.masked_fill(empty, float("-inf"))
    return o, lse.squeeze(-1)


class _LogSumExp(torch.autograd.Function):
    """lse of the rows of ``scores`` whose softmax is ``p``: m − log(max p), with gradient p."""

    @staticmethod
    def forward(ctx, scores, p, m):
        ctx.save_for_backward(p)
        return m - p.amax(-1, keepdim=True).log()

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        return grad * p, None, None


def _mask_invalid_(scores: torch.Tensor, valid: torch.Tensor) -> None:
    """-inf into ``scores`` where ``valid`` (broadcastable to it) is False, over the span of key
    columns where any entry is: the summary cells' masks are mostly whole valid columns (only
    those of the query's own blocks are partly valid)."""
    span = slice(None)
    if valid.shape[-1] == scores.shape[-1] > 1:  # (a mask broadcast over the keys has no columns)
        rows = tuple(range(valid.dim() - 1))
        whole = valid.view(torch.uint8)
        whole = whole.amin(rows) if rows else whole  # (n,): 1 where the whole column is valid
        partial = torch.nonzero(whole == 0)  # (n_partial, 1) column indices
        if partial.numel() == 0:
            return
        span = slice(int(partial[0]), int(partial[-1]) + 1)
    fused.minus_inf_where_not_(scores[..., span], valid[..., span])
