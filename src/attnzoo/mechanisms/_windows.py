"""Banded windows: the engine of local, block_local and the Sparse Transformer's local parts.

Queries go in blocks of ``block`` rows; query block b sees the keys of one window,
[b·block − left, (b+1)·block + right), of ``span = block + left + right`` keys, and within it
the keys ``allowed(i, j)`` permits. Scores are taken window by window, never (Lq, Lk):
O(L·span·D) time and O(L·span) memory. The result is a *partial* ``(o, lse)``
(:mod:`attnzoo.mechanisms._softmax`), so that a pattern can merge it with another part.

Also here: the frame that lets a self-attention pattern take Lq != Lk (:func:`to_frame`,
:func:`last_rows`) and the dense reference of every pattern mechanism
(:func:`pattern_reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo.mechanisms._softmax import excluding_nonfinite_values, partial_softmax
from attnzoo.mechanisms.full import softmax_reference
from attnzoo.ops import operation

SCORES_PER_CHUNK = 2**20  # window scores (all batches and heads) of one chunk of query blocks


@operation("attend_windows")
def window_partial(q, k, v, key_valid, *, block, left, right, allowed, scale):
    """Blocked windowed attention: query block b (rows [b·block, (b+1)·block)) sees the keys
    [b·block − left, (b+1)·block + right) that lie in the sequence, that ``key_valid`` keeps
    and that ``allowed(i, j)`` permits: softmax(scale·q kᵀ) v over them.

    q (B, H, L, D), k (B, H, L, D), v (B, H, L, Dv), key_valid (B, L) bool or None.
    ``allowed`` takes broadcastable int tensors of query and key positions and returns a bool
    tensor; it must depend on i and j only through i − j and i mod block (a band, the same in
    every block: the CPU backend shares one mask between blocks). Returns the partial
    ``(o (B, H, L, Dv), lse (B, H, L))``, float32 for half-precision inputs; a query that sees
    no key gets o = 0, lse = -inf.

    Cost O(L·span·D) time, O(L·span) memory (span = block + left + right): each query block's
    key window is a view of the padded keys (``unfold``), and the scores go in chunks of query
    blocks of about SCORES_PER_CHUNK.
    """
    B, H, L, _ = q.shape
    nb = -(-L // block)  # query blocks
    span = block + left + right
    k, v = excluding_nonfinite_values(k, v)  # a window holds keys some of its queries may not see
    q_blocks = pad_to(q * scale, nb * block).unflatten(2, (nb, block))  # (B, H, nb, block, D)
    k_win, v_win = (pad_to(t, nb * block + left + right, front=left).unfold(2, span, block).transpose(-1, -2)
                    for t in (k, v))  # (B, H, nb, span, ·)
    valid = _window_valid(L, nb, block, left, span, allowed, key_valid, q.device)
    per = max(1, SCORES_PER_CHUNK // (B * H * block * span))  # query blocks a chunk
    parts = [partial_softmax(q_c @ k_c.transpose(-1, -2), valid_c, v_c)  # (B, H, n, block, ·)
             for q_c, k_c, v_c, valid_c in zip(q_blocks.split(per, 2), k_win.split(per, 2),
                                               v_win.split(per, 2), valid.split(per, -3), strict=True)]
    o = torch.cat([o for o, _ in parts], 2).flatten(2, 3)  # (B, H, nb·block, Dv)
    lse = torch.cat([lse for _, lse in parts], 2).flatten(2, 3)  # (B, H, nb·block)
    return o[:, :, :L], lse[:, :, :L]


def _window_valid(L, nb, block, left, span, allowed, key_valid, device):
    """Which window keys each query may attend: (nb, block, span) bool, or (B, 1, nb, block,
    span) with a ``key_valid`` (B, L)."""
    i = torch.arange(nb * block, device=device).view(nb, block, 1)  # query positions
    j = torch.arange(0, nb * block, block, device=device).view(nb, 1, 1) - left + torch.arange(
        span, device=device)  # (nb, 1, span): key positions of each block's window
    valid = allowed(i, j) & (j >= 0) & (j < L)  # (nb, block, span)
    if key_valid is None:
        return valid
    key_win = pad_to(key_valid, nb * block + span - block, dim=1, front=left, value=False)
    return valid & key_win.unfold(1, span, block)[:, None, :, None, :]  # (B, 1, nb, block, span)


def window_attention(q, k, v, key_mask, *, block, left, right, allowed, scale):
    """One :func:`window_partial` as a mechanism's whole result: q (B, H, Lq, D), k (B, H, Lk, D),
    v (B, H, Lk, Dv) put on the frame of :func:`to_frame` (queries the last Lq positions),
    key_mask (B, Lk) or None -> (B, H, Lq, Dv) in q's dtype. ``scale`` is the softmax's."""
    q_, k_, v_, key_valid, Lq = to_frame(q, k, v, key_mask)
    o, _ = window_partial(q_, k_, v_, key_valid, block=block, left=left, right=right, allowed=allowed,
                          scale=scale)
    return last_rows(o, Lq).to(q.dtype)


def window_flops(N: int, *, block: int, left: int, right: int, D: int, Dv: int) -> float:
    """FLOPs of :func:`window_partial` for one (batch, head): scores and weighted sum per block."""
    nb = -(-N // block)
    return 2.0 * nb * block * (block + left + right) * (D + Dv)


def pad_to(t: torch.Tensor, length: int, dim: int = 2, front: int = 0, value=0.0) -> torch.Tensor:
    """``t`` padded along ``dim`` with ``front`` leading entries of ``value`` and trailing ones up to
    ``length`` (``t`` itself where there is nothing to pad)."""
    back = length - front - t.shape[dim]
    if front == 0 and back == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim % t.dim()) + [front, back], value=value)


def to_frame(q, k, v, key_mask):
    """Put q and k/v on one frame of N = max(Lq, Lk) positions for self-attention patterns.

    Queries are the last Lq positions and keys the last Lk (the causal alignment of
    ``attnzoo.masks``); missing keys are padding. Returns ``(q, k, v, key_valid (B, N) or None,
    Lq)``; take outputs' last Lq rows by :func:`last_rows`.
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


def last_rows(out: torch.Tensor, Lq: int) -> torch.Tensor:
    """``out[:, :, -Lq:]``, or ``out`` itself where it has Lq rows (self-attention): a slice's
    backward would fill a zero gradient of the whole and copy into it, for nothing."""
    return out if out.shape[2] == Lq else out[:, :, -Lq:]


def pattern_reference(pattern):
    """The dense reference of a pattern mechanism: masked softmax with its connectivity.

    ``pattern(N, opts, causal)`` gives the (N, N) mask, or (P, N, N) for patterns that differ
    by head (head h uses pattern h % P).
    """

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
