"""Softmax pieces the mechanisms share: the default scale, partial softmaxes and their merge.

A *partial* is ``(o, lse)``: the softmax-weighted average ``o (B, H, Lq, Dv)`` of the values
over some set of keys, and the log-sum-exp ``lse (B, H, Lq)`` of the scores over that set
(-inf where the set is empty). Two partials over disjoint key sets merge exactly into the
softmax over their union (:func:`merge_partials`): this is how the factorized patterns join
their parts and how LSH joins its hash rounds. Half-precision inputs give float32 partials
(the sums accumulate there).
"""

from __future__ import annotations

import math

import torch


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """The score scale: ``scale``, or 1/√D by default."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def wide(t: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 up to float32 (softmax and its sums accumulate there); others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ±inf and nan replaced by 0: a safe shift for rows with no key."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def partial_softmax(scores: torch.Tensor, valid: torch.Tensor | None, v: torch.Tensor):
    """Softmax of ``scores (..., R, n)`` over the ``valid`` keys (bool, broadcastable to the
    scores; None: all), applied to ``v (..., n, Dv)``.

    Returns ``(o (..., R, Dv), lse (..., R))``; a row with no valid key gives o = 0, lse = -inf.
    """
    scores, v = wide(scores), wide(v)
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    p, lse = _normalised(scores, -1)
    return p @ v, lse


def merge_partials(parts):
    """Merge partials ``[(o, lse), ...]`` over disjoint key sets into the softmax over their
    union, ``(o, lse)``: part i weighted by exp(lse_i − lse)."""
    w, lse = _normalised(torch.stack([part_lse for _, part_lse in parts]), 0)  # (P, B, H, Lq)
    return sum(o * w_i.unsqueeze(-1) for (o, _), w_i in zip(parts, w, strict=True)), lse


def _normalised(x: torch.Tensor, dim: int):
    """(exp(x) / Σ exp(x), log Σ exp(x)) along ``dim``, by a shift that is only for range; where
    every x is -inf, weights 0 and lse -inf, with zero gradients, not nan (torch's logsumexp
    and logaddexp give nan gradients there)."""
    shift = finite_or_zero(x.detach().amax(dim, keepdim=True))
    e = torch.exp(x - shift)
    total = e.sum(dim, keepdim=True)
    some = total > 0
    weights = e / torch.where(some, total, torch.ones_like(total))
    lse = torch.where(some, shift + torch.log(total.clamp_min(torch.finfo(total.dtype).tiny)),
                      torch.full_like(total, float("-inf")))
    return weights, lse.squeeze(dim)
