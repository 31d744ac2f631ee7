"""Softmax attention where one side is small: few queries over many keys, or many queries over few
keys (nystrom's landmarks, linformer's projected keys, prob_sparse's active queries).

Both are plain masked softmax attention, here by torch's public ``scaled_dot_product_attention``,
which keeps no (queries, keys) weights; they are operations of :mod:`attnzoo.ops` so that a
backend may run them faster where it can.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo.ops import operation


@operation("attend_few_queries")
def attend_few_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """softmax(q kᵀ·scale) v over the keys ``valid`` allows, for m queries over Lk >> m keys.

    q (B, H, m, D), k (B, H, Lk, D), v (B, H, Lk, Dv), ``valid`` bool broadcastable to
    (B, H, m, Lk), True = may attend, or None (every key) -> (B, H, m, Dv). A query with no
    valid key gets 0 and no gradient. O(m·Lk·(D + Dv)) time.
    """
    if valid is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    seen = valid.any(-1, keepdim=True)  # (B|1, H|1, m|1, 1): the query sees some key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid | ~seen, scale=scale)
    return out.masked_fill(~seen, 0.0)  # (an empty row attended to every key above: no nan anywhere)


@operation("attend_few_keys")
def attend_few_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q kᵀ·scale) v over every key, for Lq queries over n << Lq keys.

    q (B, H, Lq, D), k (B, H, n, D), v (B, H, n, Dv) -> (B, H, Lq, Dv). O(Lq·n·(D + Dv)) time.
    """
    return F.scaled_dot_product_attention(q, k, v, scale=scale)
