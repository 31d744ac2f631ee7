"""LogSparse attention (Li et al., NeurIPS 2019): exponentially growing steps back in time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo._pages import Scratch, fresh_empty, fresh_like, scratch_buffer
from attnzoo.mechanisms._common import SCORES_PER_CHUNK, last_rows, pattern_reference, softmax_scale, to_frame
from attnzoo.mechanisms.full import masked_softmax
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class LogSparseOptions:
    local: int = 1  # dense window: offsets 0..local-1, then local-1 + 2^m (1 = the plain pattern)
    restart: int | None = None  # restart the pattern every `restart` positions (subsequences)

    def __post_init__(self):
        if self.local < 1:
            raise ValueError(f"log_sparse: local must be >= 1, got {self.local}")
        if self.restart is not None and self.restart < 1:
            raise ValueError(f"log_sparse: restart must be >= 1, got {self.restart}")


@dataclass(frozen=True)
class LogSparseLayerOptions:
    kernel_size: int = 1  # causal Conv1d for queries and keys in MultiheadAttention (1 = linear)

    def __post_init__(self):
        if self.kernel_size < 1:
            raise ValueError(f"log_sparse: kernel_size must be >= 1, got {self.kernel_size}")

    def build(self, layer) -> None:
        from attnzoo.nn import causal_conv_projection

        causal_conv_projection(layer, self.kernel_size)


def _offsets(opts: LogSparseOptions, N: int) -> list[int]:
    """Backward distances a query attends to: 0..local-1, then local-1 + 1, 2, 4, ... below N."""
    dense = list(range(min(opts.local, N)))
    steps, m = [], 1
    while opts.local - 1 + m < N:
        steps.append(opts.local - 1 + m)
        m *= 2
    return dense + steps


def _signed_offsets(opts: LogSparseOptions, N: int, causal: bool) -> list[int]:
    back = _offsets(opts, N)
    return back if causal else back + [-d for d in back if d > 0]


def log_sparse_attention(q, k, v, opts=LogSparseOptions(), *, causal=False, key_mask=None,
                         scale=None, generator=None):
    """Softmax over the keys j = i - d, d in {0, .., local-1} ∪ {local-1 + 2^m}.

    Plain pattern (local=1): i, i-1, i-2, i-4, ..., i-2^floor(log2 i). With ``restart``
    = R, i and j must lie in the same subsequence of R positions. Causal is the
    paper's setting; non-causal (two-sided: also j = i + d) is our extension for
    encoders. Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) ->
    (B, H, Lq, Dv); with Lq != Lk the queries are the last Lq positions.
    Cost O(L·(local + log L)·D) time and O(L·(local + log L)) memory: one score per
    offset from shifted views of K and V, never an L×L mask, in blocks of positions
    that stay in cache.
    """
    q, k, v, key_valid, Lq = to_frame(q, k, v, key_mask)
    plan = _Offsets(_signed_offsets(opts, q.shape[2], causal), q.shape[2], opts.restart, key_valid)
    q = q * softmax_scale(q, scale)
    if q.dtype in (torch.float16, torch.bfloat16):
        out = plan.forward(q, k, v)  # through autograd
    else:
        out = _OffsetAttention.apply(q, k, v, plan)
    return last_rows(out, Lq)


class _Offsets:
    """log_sparse's computation: for blocks of positions that stay in cache, one score per
    offset d from the keys shifted by d (i − d), a softmax over the offsets, and the weighted
    shifted values. Each offset reads only the rows where i − d lies in the sequence: a
    block's queries before (or after) them get no key at that offset (a masked score, weight 0),
    and no padded copy of K and V is made (zero-padded by the largest offset on both sides, at
    L = 16384 they were 64 MiB each, zero-filled and faulted in afresh on every call)."""

    def __init__(self, offsets, N, restart, key_valid):
        self.offsets, self.N, self.restart, self.key_valid = offsets, N, restart, key_valid

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

    def weights(self, q_blk, k, s, e, shifts, scratch=None):
        """(B, H, n, n_offsets) softmax over the offsets of the block's queries; rows with no key 0."""
        scores = _offset_dots(q_blk, k, shifts, len(self.offsets), scratch, "scores")
        i = torch.arange(s, e, device=q_blk.device)[:, None]
        j = i - torch.tensor(self.offsets, device=q_blk.device)  # (n, n_offsets) key positions
        valid = (j >= 0) & (j < self.N)
        if self.restart is not None:
            valid = valid & (j // self.restart == i // self.restart)
        if self.key_valid is not None:
            valid = valid & self.key_valid[:, j.clamp(0, self.N - 1)][:, None]  # (B, 1, n, n_offsets)
        return masked_softmax(scores, valid)

    def forward(self, q, k, v, scratch=None):
        """(B, H, N, Dv), block by block; the blocks' temporaries in ``scratch`` if given (not
        under autograd). Offset 0 (always the first) reaches every query: it starts each block."""
        B, H, N, D = q.shape
        out = fresh_empty(B, H, N, v.shape[-1], like=q)
        for s, e, shifts in self.blocks(B, H, D):
            w = self.weights(q[:, :, s:e], k, s, e, shifts, scratch)
            block = torch.mul(w[..., 0, None], v[:, :, s:e],
                              out=scratch_buffer(scratch, "block", (B, H, e - s, v.shape[-1])))
            for n, rows, keys in shifts[1:]:
                block[:, :, rows].addcmul_(w[:, :, rows, n, None], v[:, :, keys])
            out[:, :, s:e] = block
        return out


def _offset_dots(a, b, shifts, n_offsets, scratch, name):
    """(B, H, n, n_offsets): a · b[:, :, keys] over the features for each offset's rows of ``a``
    (``shifts`` as :meth:`_Offsets.blocks` gives them), 0 where an offset reaches no key. With a
    scratch, the products go into one reused buffer and the dots into the scratch's ``name``:
    ``torch.linalg.vecdot`` makes a fresh (B, H, n, D) product each call, at L = 16384 ~0.5 GiB
    of them a forward, which in some processes were faulted in afresh (70k-280k page faults,
    most of a 175-450 ms forward in kernel time). Without one (autograd), fresh tensors."""
    if scratch is None:
        dots = [a.new_zeros(a.shape[:-1])] * n_offsets
        for n, rows, keys in shifts:
            dots[n] = F.pad(torch.linalg.vecdot(a[:, :, rows], b[:, :, keys]),
                            (rows.start, a.shape[2] - rows.stop))
        return torch.stack(dots, -1)
    dots = scratch(name, (n_offsets, *a.shape[:-1])).zero_()  # (n_offsets, B, H, n)
    prod = scratch("prod", a.shape)  # (B, H, n, D)
    for n, rows, keys in shifts:
        r = prod[:, :, :rows.stop - rows.start]
        torch.sum(torch.mul(a[:, :, rows], b[:, :, keys], out=r), -1, out=dots[n, :, :, rows])
    return dots.permute(1, 2, 3, 0)


class _OffsetAttention(torch.autograd.Function):
    """log_sparse with a backward that recomputes each block's weights and adds the gradients
    of the shifted keys and values into place (autograd would zero-fill a whole-size gradient
    for every offset and block)."""

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


def log_sparse_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """One score (D multiply-adds) and one weighted value (Dv) per offset and position."""
    N = max(Lq, Lk)
    return 2.0 * B * H * N * len(_signed_offsets(opts, N, causal)) * (D + Dv)


def log_sparse_pattern(length: int, opts: LogSparseOptions, causal: bool) -> torch.Tensor:
    """(L, L) bool: query i attends key j iff i - j is one of the offsets (same subsequence)."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = torch.tensor(_signed_offsets(opts, length, causal))
    mask = torch.isin(i - j, allowed)
    if opts.restart is not None:
        mask = mask & (j // opts.restart == i // opts.restart)
    return mask


register(
    Mechanism(
        name="log_sparse",
        summary="itself and positions at exponentially growing distances (i-1, i-2, i-4, …)",
        options=LogSparseOptions,
        fn=log_sparse_attention,
        reference=pattern_reference(log_sparse_pattern),
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L log L d)",
        memory="O(L log L)",
        citation="Li et al., Enhancing the Locality and Breaking the Memory Bottleneck of "
        "Transformer on Time Series Forecasting, NeurIPS 2019",
        pattern=log_sparse_pattern,
        flops=log_sparse_flops,
        layer_options=LogSparseLayerOptions,
    )
)
