"""Informer's official ProbSparse attention (ProbAttention), re-implemented for measurement only.

The official code (zhouhaoyi/Informer2020, models/attn.py and utils/masking.py) is not on
PyPI. This file follows its algorithm step for step, with the same tensor operations, so
that benchmarks/peers.py measures the time and memory a user of that code gets:

1. U_part = factor·ceil(ln Lk) keys are drawn per query with ``torch.randint`` (future and
   every key alike) and gathered from an expanded K: a real (B, H, Lq, U_part, D) copy.
2. M = max_j(Q·K_sample) − sum_j(Q·K_sample) / Lk (divided by Lk, as the official code).
3. The top u = factor·ceil(ln Lq) queries by M get full attention over all keys
   (upper-triangular ProbMask rows under ``mask_flag``); the rest get mean(V), or
   cumsum(V) under ``mask_flag``.
4. The selected rows are written into that context in place.

attnzoo's own ``prob_sparse`` with ``variant="official"`` computes the same thing except
that it samples only visible keys; it is not used here, so the peer stays the peer.
Inputs and output are (B, L, H, D), Informer's AttentionLayer layout.
"""

from __future__ import annotations

import math

import torch


def informer_sizes(Lq: int, Lk: int, factor: int = 5) -> tuple[int, int]:
    """(U_part, u): sampled keys per query and active queries, capped as the official code."""
    return min(factor * math.ceil(math.log(Lk)), Lk), min(factor * math.ceil(math.log(Lq)), Lq)


def prob_attention(queries, keys, values, mask_flag: bool, factor: int = 5):
    """Official ProbAttention.forward without dropout (it is built there but never applied)."""
    B, Lq, H, D = queries.shape
    Lk = keys.shape[1]
    Q, K, V = (t.transpose(2, 1) for t in (queries, keys, values))  # (B, H, L, D)
    U_part, u = informer_sizes(Lq, Lk, factor)

    K_expand = K.unsqueeze(-3).expand(B, H, Lq, Lk, D)
    index_sample = torch.randint(Lk, (Lq, U_part))
    K_sample = K_expand[:, :, torch.arange(Lq).unsqueeze(1), index_sample, :]  # (B, H, Lq, U_part, D)
    Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)
    M = Q_K_sample.max(-1)[0] - torch.div(Q_K_sample.sum(-1), Lk)
    M_top = M.topk(u, sorted=False)[1]  # (B, H, u)
    b_idx, h_idx = torch.arange(B)[:, None, None], torch.arange(H)[None, :, None]
    Q_reduce = Q[b_idx, h_idx, M_top, :]
    scores = torch.matmul(Q_reduce, K.transpose(-2, -1)) / math.sqrt(D)  # (B, H, u, Lk)

    if mask_flag:
        context = V.cumsum(dim=-2)
        tri = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)[None, None].expand(B, H, Lq, Lk)
        scores = scores.masked_fill(tri[b_idx, h_idx, M_top, :].view(scores.shape), -math.inf)
    else:
        context = V.mean(dim=-2).unsqueeze(-2).expand(B, H, Lq, V.shape[-1]).clone()
    context[b_idx, h_idx, M_top, :] = torch.matmul(torch.softmax(scores, dim=-1), V)
    return context.transpose(2, 1).contiguous()
