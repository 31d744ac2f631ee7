"""Sparse Transformer factorized attention (Child et al., 2019): `strided` and `fixed`.

Each pattern is two sets of keys per query i, with stride l:

- strided: A1 = the previous l positions (i - l < j <= i), A2 = {j : (i - j) mod l = 0}.
- fixed:   A1 = i's own block {j : floor(j/l) = floor(i/l)}, A2 = the last c cells of
  every block {j : j mod l >= l - c}.

Causal (j <= i) is the paper's setting. Non-causal is our two-sided extension for
encoders: strided A1 becomes |i - j| < l, fixed A1 the whole own block, and A2
drops j <= i. The paper's two ways to combine the sets are both offered:
``heads="union"`` (every head attends to A1 ∪ A2, each key once) and
``heads="split"`` (even heads attend to A1, odd heads to A2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnzoo._pages import fresh_empty
from attnzoo.mechanisms._common import (
    fused_kernel_fits,
    fused_partial,
    join_blocks,
    last_rows,
    merge_partials,
    needs_grad,
    pad_to,
    partial_softmax,
    pattern_reference,
    scaled,
    softmax_scale,
    to_frame,
    window_flops,
    window_partial,
)
from attnzoo.registry import Capabilities, Mechanism, register


def _check_common(name: str, stride, heads) -> None:
    if stride is not None and stride < 1:
        raise ValueError(f"{name}: stride must be >= 1, got {stride}")
    if heads not in ("union", "split"):
        raise ValueError(f"{name}: heads must be 'union' or 'split', got {heads!r}")


@dataclass(frozen=True)
class StridedOptions:
    stride: int | None = None  # l; None = round(sqrt(L)), the paper's choice
    heads: str = "union"  # "union": every head A1 ∪ A2; "split": even heads A1, odd heads A2

    def __post_init__(self):
        _check_common("strided", self.stride, self.heads)


@dataclass(frozen=True)
class FixedOptions:
    stride: int | None = None  # l, the block length; None = round(sqrt(L))
    c: int | None = None  # summary cells per block; None = max(1, l // 16) (8 for l = 128)
    heads: str = "union"  # "union" or "split", as for strided

    def __post_init__(self):
        _check_common("fixed", self.stride, self.heads)
        if self.c is not None and self.c < 1:
            raise ValueError(f"fixed: c must be >= 1, got {self.c}")
        if self.c is not None and self.stride is not None and self.c > self.stride:
            raise ValueError(f"fixed: c ({self.c}) cannot exceed the stride ({self.stride})")


def _stride(opts, N: int) -> int:
    return opts.stride or max(1, round(math.sqrt(N)))


def _summary_cells(opts: FixedOptions, l: int) -> int:
    c = opts.c or max(1, l // 16)
    if c > l:
        raise ValueError(f"fixed: c ({c}) cannot exceed the stride ({l})")
    return c


A2_SCORES_PER_CHUNK = 2**20  # strided's and fixed's A2: scores (all batches and heads) at a time
FUSED_A2_MASK = 2**20  # fixed's A2 by the fused kernel: entries of a chunk's (rows, cells) mask


def _by_residue(t: torch.Tensor, l: int) -> torch.Tensor:
    """(B, H, m·l, X) -> (B, H, l, m, X): position a·l + r goes to [r, a]."""
    B, H, Lp, X = t.shape
    return t.view(B, H, Lp // l, l, X).transpose(2, 3)


def _strided_a2(q, k, v, key_valid, l, causal, include_self):
    """Partial over {j : (i - j) mod l = 0}: attention within each residue class mod l (q scaled).

    O(L·L/l·D) time, O(L·L/l) memory. ``include_self=False`` drops j = i (union mode,
    where A1 has it).
    """
    B, H, L, _ = q.shape
    m = -(-L // l)
    Lp = m * l
    qr, kr, vr = (_by_residue(pad_to(t, Lp), l) for t in (q, k, v))  # (B, H, l, m, X)
    a = torch.arange(m, device=q.device)
    a_i, a_j = a[:, None], a[None, :]
    valid = (a_j <= a_i) if causal else torch.ones(m, m, dtype=torch.bool, device=q.device)
    if not include_self:
        valid = valid & (a_j != a_i)
    pos_j = a_j * l + torch.arange(l, device=q.device).view(l, 1, 1)  # (l, 1, m)
    valid = valid & (pos_j < L)  # (l, m, m)
    if key_valid is not None:
        kv = pad_to(key_valid, Lp, dim=1, value=False).view(B, m, l).transpose(1, 2)  # (B, l, m)
        valid = valid & kv[:, None, :, None, :]  # (B, 1, l, m, m)
    per = max(1, A2_SCORES_PER_CHUNK // (B * H * m * m))  # residue classes at a time, in cache
    # split, not slices: the backward then joins the pieces' gradients in one pass
    chunks = zip(qr.split(per, 2), kr.split(per, 2), vr.split(per, 2), strict=True)
    o, lse = _join_residues((partial_softmax(q_r @ k_r.transpose(-1, -2),  # (B, H, n, m, m): a_i, a_j
                                             valid[..., n * per:(n + 1) * per, :, :], v_r)
                             for n, (q_r, k_r, v_r) in enumerate(chunks)), l, m)
    return o[:, :, :L], lse[:, :, :L]


def _join_residues(parts, l, m):
    """The partials of the residue classes mod l in order, (o (B, H, n, m, Dv), lse (B, H, n, m))
    each, as one partial in position order: (o (B, H, m·l, Dv), lse (B, H, m·l)). Without
    autograd each is written into its place as it comes, in one fresh result: concatenated,
    then reordered, they made two (L, Dv) tensors faulted in afresh (strided at L = 16384:
    ~16k page faults a forward). Under autograd they are concatenated and reordered."""
    if torch.is_grad_enabled():
        o, lse = (torch.cat(ts, 2).transpose(2, 3).flatten(2, 3) for ts in zip(*parts, strict=True))
        return o, lse
    o = lse = None
    s = 0
    for part_o, part_lse in parts:
        if o is None:
            B, H, _, _, Dv = part_o.shape
            o, lse = fresh_empty(B, H, m * l, Dv, like=part_o), part_lse.new_empty(B, H, m * l)
        n = part_o.shape[2]
        _by_residue(o, l)[:, :, s:s + n] = part_o
        _by_residue(lse.unsqueeze(-1), l)[:, :, s:s + n] = part_lse.unsqueeze(-1)
        s += n
    return o, lse


def _strided_a1_window(l, causal):
    """(block, left, right) of the banded computation of strided's A1."""
    return min(l, 64), l - 1, 0 if causal else l - 1


def _strided_a1(q, k, v, key_valid, l, causal):
    """Partial over the previous l positions (two-sided: |i - j| < l); q scaled."""
    block, left, right = _strided_a1_window(l, causal)
    return window_partial(q, k, v, key_valid, block=block, left=left, right=right,
                          allowed=lambda i, j: (j > i - l) & (j < i + right + 1), scale=1.0)


def _fixed_a1(q, k, v, key_valid, l, causal, scale):
    """Partial over i's own block (causal: j <= i within it): one block of l keys per query block."""
    allowed = (lambda i, j: j <= i) if causal else (lambda i, j: j >= 0)
    return window_partial(q, k, v, key_valid, block=l, left=0, right=0, allowed=allowed, scale=scale)


def _fixed_a2(q, k, v, key_valid, l, c, causal, include_own_block, scale):
    """Partial over the last c cells of every block: O(L·c·L/l·D) time; the scale goes on
    those cells' keys (c·L/l rows), not on the queries.

    Union mode excludes i's own block (A1 has it); split mode keeps it. Queries go in
    chunks of A2_SCORES_PER_CHUNK / (B·H·c·L/l) rows, so a forward's temporaries stay
    O(2^20) and in cache rather than O(L·c·L/l) (autograd still keeps each chunk's weights).
    Without autograd or padding keys, chunks of FUSED_A2_MASK / (c·L/l) rows go through
    torch's fused kernel instead (:func:`fused_partial`, ~20 % faster at L = 16384).
    Causal: a chunk of queries scores only the cells up to its last query.
    """
    B, H, L, D = q.shape
    m = -(-L // l)
    Lp = m * l
    k_sum = (pad_to(k, Lp).view(B, H, m, l, D)[:, :, :, l - c:] * scale).view(B, H, m * c, D)
    v_sum = pad_to(v, Lp).view(B, H, m, l, -1)[:, :, :, l - c:].reshape(B, H, m * c, -1)
    pos_j = (torch.arange(m, device=q.device)[:, None] * l + l - c
             + torch.arange(c, device=q.device)).reshape(-1)  # (m·c,)
    key_ok = pos_j < L
    if key_valid is not None:
        kv = pad_to(key_valid, Lp, dim=1, value=False).view(B, m, l)[:, :, l - c:].reshape(B, 1, 1, -1)
        key_ok = key_ok & kv  # (B, 1, 1, m·c)
    fused = key_valid is None and not needs_grad(q, k, v) and fused_kernel_fits(q, k, v)
    rows = max(1, FUSED_A2_MASK // (m * c) if fused else A2_SCORES_PER_CHUNK // (B * H * m * c))
    parts = []
    for n, q_rows in enumerate(q.split(rows, 2)):  # split, not slices: one pass joins their gradients
        start = n * rows
        end = q_rows.shape[2] + start
        cells = min(m, -(-end // l)) * c if causal else m * c  # causal: none after the last query
        pos_i = torch.arange(start, end, device=q.device)[:, None]
        valid = key_ok[..., :cells] & ((pos_j[:cells] <= pos_i) if causal else True)
        if not include_own_block:
            valid = valid & ((pos_j[:cells] // l) != (pos_i // l))  # (rows, cells)
        if fused:
            parts.append(fused_partial(q_rows, k_sum[:, :, :cells], v_sum[:, :, :cells],
                                       valid.expand(end - start, cells)))
        else:
            scores = q_rows @ k_sum[:, :, :cells].transpose(-1, -2)  # (B, H, rows, cells)
            parts.append(partial_softmax(scores, valid, v_sum[:, :, :cells]))
    return join_blocks([o for o, _ in parts], L), torch.cat([lse for _, lse in parts], 2)


def _combine(q, k, v, opts, part_a1, part_a2):
    """Union: merge A1 and A2 minus A1 on every head. Split: A1 on even heads, A2 on odd ones.

    ``part_a1(q, k, v)`` and ``part_a2(q, k, v, include_a1_overlap)`` return partials.
    """
    if opts.heads == "union":
        return merge_partials([part_a1(q, k, v), part_a2(q, k, v, False)])[0].to(q.dtype)
    if q.shape[1] < 2:
        raise ValueError("heads='split' needs at least 2 heads (even heads A1, odd heads A2)")
    even, odd = slice(0, None, 2), slice(1, None, 2)
    out_a1 = part_a1(q[:, even], k[:, even], v[:, even])[0]  # (B, ceil(H/2), L, Dv)
    out_a2 = part_a2(q[:, odd], k[:, odd], v[:, odd], True)[0]  # (B, floor(H/2), L, Dv)
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    out[:, even], out[:, odd] = out_a1, out_a2
    return out


def strided_attention(q, k, v, opts=StridedOptions(), *, causal=False, key_mask=None, scale=None,
                      generator=None):
    """Softmax over A1 ∪ A2 (union) or A1 / A2 by head (split), A1 = i-l < j <= i, A2 = l | i-j.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv); with
    Lq != Lk the queries are the last Lq positions. Cost O(L·(l + L/l)·D) time,
    O(L·(l + L/l)) memory: A1 by banded query blocks, A2 as attention within each
    residue class mod l; the two merge by their log-sum-exp. Child et al., 2019.
    """
    q, k, v, key_valid, Lq = to_frame(q, k, v, key_mask)
    l = _stride(opts, q.shape[2])
    q = scaled(q, softmax_scale(q, scale))  # once for both parts
    out = _combine(
        q, k, v, opts,
        lambda q, k, v: _strided_a1(q, k, v, key_valid, l, causal),
        lambda q, k, v, own: _strided_a2(q, k, v, key_valid, l, causal, own),
    )
    return last_rows(out, Lq)


def fixed_attention(q, k, v, opts=FixedOptions(), *, causal=False, key_mask=None, scale=None,
                    generator=None):
    """Softmax over A1 ∪ A2 (union) or A1 / A2 by head (split), A1 = own block of l,
    A2 = the last c cells of every block.

    Shapes as :func:`strided_attention`. Cost O(L·(l + c·L/l)·D) time and
    O(L·l + 2^20) forward memory per (batch, head): A1 as attention within each block,
    A2 as attention to the c·L/l summary cells, by chunks of queries (without autograd, on
    the CPU, by torch's fused kernel). Child et al., 2019.
    """
    q, k, v, key_valid, Lq = to_frame(q, k, v, key_mask)
    l = _stride(opts, q.shape[2])
    s, c = softmax_scale(q, scale), _summary_cells(opts, l)  # (q is not scaled: a new (L, D) tensor)
    out = _combine(
        q, k, v, opts,
        lambda q, k, v: _fixed_a1(q, k, v, key_valid, l, causal, s),
        lambda q, k, v, own: _fixed_a2(q, k, v, key_valid, l, c, causal, own, s),
    )
    return last_rows(out, Lq)


def _by_heads(H, flops_a1, flops_a2, heads):
    """Total FLOPs over heads: every head does both (union) or even A1 and odd A2 (split)."""
    if heads == "union":
        return H * (flops_a1 + flops_a2)
    return -(-H // 2) * flops_a1 + (H // 2) * flops_a2


def strided_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    N = max(Lq, Lk)
    l = _stride(opts, N)
    block, left, right = _strided_a1_window(l, causal)
    m = -(-N // l)
    a1 = window_flops(N, block=block, left=left, right=right, D=D, Dv=Dv)
    a2 = 2.0 * l * m * m * (D + Dv)
    return B * _by_heads(H, a1, a2, opts.heads)


def fixed_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    N = max(Lq, Lk)
    l = _stride(opts, N)
    c = _summary_cells(opts, l)
    a1 = window_flops(N, block=l, left=0, right=0, D=D, Dv=Dv)
    a2 = 2.0 * N * (-(-N // l) * c) * (D + Dv)
    return B * _by_heads(H, a1, a2, opts.heads)


def strided_pattern(length: int, opts: StridedOptions, causal: bool) -> torch.Tensor:
    """(L, L) bool for union, (2, L, L) [A1, A2] for split."""
    l = _stride(opts, length)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    a1 = (i - j).abs() < l
    a2 = (i - j) % l == 0
    return _assemble(a1, a2, i, j, opts, causal)


def fixed_pattern(length: int, opts: FixedOptions, causal: bool) -> torch.Tensor:
    """(L, L) bool for union, (2, L, L) [A1, A2] for split."""
    l = _stride(opts, length)
    c = _summary_cells(opts, l)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    a1 = (j // l) == (i // l)
    a2 = (j % l >= l - c).expand(length, length)
    return _assemble(a1, a2, i, j, opts, causal)


def _assemble(a1, a2, i, j, opts, causal):
    if causal:
        a1, a2 = a1 & (j <= i), a2 & (j <= i)
    return a1 | a2 if opts.heads == "union" else torch.stack([a1, a2])


_COMMON = dict(capabilities=Capabilities(causal=True, cross=True, key_mask=True),
               citation="Child et al., Generating Long Sequences with Sparse Transformers, 2019")

register(
    Mechanism(
        name="strided",
        summary="factorized: the previous l positions and every l-th position (l ≈ √L)",
        options=StridedOptions,
        fn=strided_attention,
        reference=pattern_reference(strided_pattern),
        time="O(L (l + L/l) d) = O(L√L d)",
        memory="O(L√L)",
        pattern=strided_pattern,
        flops=strided_flops,
        **_COMMON,
    )
)

register(
    Mechanism(
        name="fixed",
        summary="factorized: own block of l, and the last c 'summary' cells of every block",
        options=FixedOptions,
        fn=fixed_attention,
        reference=pattern_reference(fixed_pattern),
        time="O(L (l + c L/l) d)",
        memory="O(L (l + c L/l))",
        pattern=fixed_pattern,
        flops=fixed_flops,
        **_COMMON,
    )
)
