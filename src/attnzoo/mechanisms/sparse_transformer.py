"""Sparse Transformer factorized attention (Child et al., 2019): `strided` and `fixed`.

Each pattern is two sets of keys per query i, with stride l:

- strided: A1 = the previous l positions (i - l < j <= i), A2 = {j : (i - j) mod l = 0}.
  The paper writes A1 = {max(0, i - l), ..., i}, one position more: j = i - l, which A2
  holds anyway, so the union is the same; with ``heads="split"`` the even heads' A1 here
  leaves it to the odd heads' A2.
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

from attnzoo.mechanisms._softmax import (
    excluding_nonfinite_values,
    merge_partials,
    partial_softmax,
    softmax_scale,
)
from attnzoo.mechanisms._windows import (
    last_rows,
    pad_to,
    pattern_reference,
    to_frame,
    window_flops,
    window_partial,
)
from attnzoo.ops import operation
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


DEFAULT_C = 8  # the paper's c in {8, 16, 32} (with l = 128): a constant, so a query sees c·L/l summary keys


@dataclass(frozen=True)
class FixedOptions:
    stride: int | None = None  # l, the block length; None = round(sqrt(L))
    c: int | None = None  # summary cells per block; None = min(DEFAULT_C, l), a constant as the paper's
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
    c = opts.c or min(DEFAULT_C, l)
    if c > l:
        raise ValueError(f"fixed: c ({c}) cannot exceed the stride ({l})")
    return c


A2_SCORES_PER_CHUNK = 2**20  # strided's and fixed's A2: scores (all batches and heads) at a time


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
    o, lse = residue_partial(qr, kr, vr, valid)
    return o[:, :, :L], lse[:, :, :L]


@operation("attend_residues")
def residue_partial(qr, kr, vr, valid):
    """The partial of attention within each residue class mod l: qr, kr (B, H, l, m, D), vr (B, H,
    l, m, Dv) hold position a·l + r at [r, a] (:func:`_by_residue`), scores qr·krᵀ (any scale
    already in qr), and ``valid`` (l, m, m) or (B, 1, l, m, m) bool tells which a_j each a_i of
    class r may attend.

    Returns ``(o (B, H, m·l, Dv), lse (B, H, m·l))`` in position order. The classes go in chunks
    of about A2_SCORES_PER_CHUNK scores, so a forward's temporaries stay O(2^20).
    """
    B, H, l, m, _ = qr.shape
    kr, vr = excluding_nonfinite_values(kr, vr)  # a class's keys: some not seen by some of its queries
    per = max(1, A2_SCORES_PER_CHUNK // (B * H * m * m))  # residue classes at a time, in cache
    # split, not slices: the backward then joins the pieces' gradients in one pass
    parts = [partial_softmax(q_r @ k_r.transpose(-1, -2), valid_r, v_r)  # (B, H, n, m, m): a_i, a_j
             for q_r, k_r, v_r, valid_r in zip(qr.split(per, 2), kr.split(per, 2), vr.split(per, 2),
                                               valid.split(per, -3), strict=True)]
    # residue classes in order (B, H, l, m, ·) -> positions a·l + r in order (B, H, m·l, ·)
    o, lse = (torch.cat(ts, 2).transpose(2, 3).flatten(2, 3) for ts in zip(*parts, strict=True))
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
    """Partial over the last c cells of every block (:func:`summary_partial`): O(L·c·L/l·D) time;
    the scale goes on those cells' keys (c·L/l rows), not on the queries.

    Union mode excludes i's own block (A1 has it); split mode keeps it. Causal: a chunk of
    queries scores only the cells up to its last query.
    """
    B, H, L, D = q.shape
    m = -(-L // l)
    k_sum = (pad_to(k, m * l).view(B, H, m, l, D)[:, :, :, l - c:] * scale).reshape(B, H, m * c, D)
    v_sum = pad_to(v, m * l).view(B, H, m, l, -1)[:, :, :, l - c:].reshape(B, H, m * c, -1)
    pos_j = (torch.arange(m, device=q.device)[:, None] * l + l - c
             + torch.arange(c, device=q.device)).reshape(-1)  # (m·c,) the cells' positions
    key_ok = pos_j < L
    if key_valid is not None:
        kv = pad_to(key_valid, m * l, dim=1, value=False).view(B, m, l)[:, :, l - c:].reshape(B, 1, 1, -1)
        key_ok = key_ok & kv  # (B, 1, 1, m·c)

    def cells_for(start, end):
        """(cells, valid): the leading summary cells query rows start..end−1 may see, and which."""
        cells = min(m, -(-end // l)) * c if causal else m * c  # causal: none after the last query
        pos_i = torch.arange(start, end, device=q.device)[:, None]
        seen = torch.ones(end - start, cells, dtype=torch.bool, device=q.device)
        if causal:
            seen = seen & (pos_j[:cells] <= pos_i)
        if not include_own_block:
            seen = seen & ((pos_j[:cells] // l) != (pos_i // l))  # (rows, cells)
        return cells, key_ok[..., :cells] & seen

    return summary_partial(q, k_sum, v_sum, cells_for)


@operation("attend_summary_cells")
def summary_partial(q, k_sum, v_sum, cells_for):
    """The partial of the queries q (B, H, L, D) over summary keys k_sum (B, H, n, D), v_sum
    (B, H, n, Dv), scores q·k_sumᵀ (any scale already in k_sum): query rows s..e−1 see the first
    ``cells`` of them where ``valid`` allows, ``(cells, valid) = cells_for(s, e)``, valid
    (e − s, cells) bool, or (B, 1, e − s, cells) where it differs by batch entry.

    Returns ``(o (B, H, L, Dv), lse (B, H, L))``. Queries go in chunks of A2_SCORES_PER_CHUNK /
    (B·H·n) rows, so a forward's temporaries stay O(2^20) rather than O(L·n) (autograd still
    keeps each chunk's weights).
    """
    B, H, L, _ = q.shape
    k_sum, v_sum = excluding_nonfinite_values(k_sum, v_sum)  # (cells some queries of a chunk may not see)
    rows = max(1, A2_SCORES_PER_CHUNK // (B * H * k_sum.shape[2]))
    parts = []
    # split, not slices: the backward then joins the chunks' gradients in one pass
    for start, q_rows in zip(range(0, L, rows), q.split(rows, 2), strict=True):
        cells, valid = cells_for(start, start + q_rows.shape[2])
        scores = q_rows @ k_sum[:, :, :cells].transpose(-1, -2)  # (B, H, rows, cells)
        parts.append(partial_softmax(scores, valid, v_sum[:, :, :cells]))
    return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def _combine(q, k, v, opts, part_a1, part_a2):
    """Union: merge A1 and A2 minus A1 on every head. Split: A1 on even heads, A2 on odd ones.

    ``part_a1(q, k, v)`` and ``part_a2(q, k, v, include_a1_overlap)`` return partials.
    """
    if opts.heads == "union":
        return merged_output(part_a1(q, k, v), part_a2(q, k, v, False)).to(q.dtype)
    if q.shape[1] < 2:
        raise ValueError("heads='split' needs at least 2 heads (even heads A1, odd heads A2)")
    even, odd = slice(0, None, 2), slice(1, None, 2)
    out_a1 = part_a1(q[:, even], k[:, even], v[:, even])[0]  # (B, ceil(H/2), L, Dv)
    out_a2 = part_a2(q[:, odd], k[:, odd], v[:, odd], True)[0]  # (B, floor(H/2), L, Dv)
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    out[:, even], out[:, odd] = out_a1, out_a2
    return out


@operation("merge_two_partials")
def merged_output(part_a, part_b):
    """The output o (B, H, L, Dv) of two partials over disjoint key sets merged into the softmax
    over their union (:func:`~attnzoo.mechanisms._softmax.merge_partials`)."""
    return merge_partials([part_a, part_b])[0]


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
    q = q * softmax_scale(q, scale)  # once for both parts
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
    A2 as attention to the c·L/l summary cells, by chunks of queries. Child et al., 2019.
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
