"""Softmax pieces the mechanisms share: the default scale, partial softmaxes and their merge.

A *partial* is ``(o, lse)``: the softmax-weighted average ``o (B, H, Lq, Dv)`` of the values
over some set of keys, and the log-sum-exp ``lse (B, H, Lq)`` of the scores over that set
(-inf where the set is empty). Two partials over disjoint key sets merge exactly into the
softmax over their union (:func:`merge_partials`): this is how the factorized patterns join
their parts and how LSH joins its hash rounds. Half-precision inputs give float32 partials
(the sums accumulate there).

Windows, residue classes, summary cells and LSH's chunks compute masked keys beside attended
ones; their operations pass their keys and values through :func:`excluding_nonfinite_values`
first, so that a nan or an inf in a key or a value reaches only the queries whose pattern
includes that key.
"""

from __future__ import annotations

import math

import torch


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """The score scale: ``scale``, or 1/√D by default."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16 and bfloat16 (softmax and its sums accumulate there); others as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`wide_dtype` of its dtype (no copy where that is its own)."""
    return t.to(wide_dtype(t.dtype))


def finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ±inf and nan replaced by 0: a safe shift for rows with no key."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def excluding_nonfinite_values(k: torch.Tensor, v: torch.Tensor):
    """``(k, v)`` with every key whose value row holds a nan or an inf made nan, and the value's
    nan and inf entries made 0.

    Where keys are computed in blocks (windows, chunks), a query's masked keys get weight 0 and
    0 · nan = nan: a value that is not finite would reach queries whose pattern leaves its key
    out. Moved into the key, it reaches the queries that may attend it, through their scores,
    and no others, since a mask replaces a masked score (nan or not) by -inf. Its queries get
    nan in every column (not only in the value's). k (..., n, D), v (..., n, Dv); a few passes
    over each, none over the scores; finite keys and values come back as they are.
    """
    # a row's max and min are finite iff all of it is (either is nan where the row holds a nan)
    finite = torch.isfinite(v.amax(-1, keepdim=True)) & torch.isfinite(v.amin(-1, keepdim=True))
    nan_where_not = torch.where(finite, 0.0, float("nan")).to(k.dtype)  # (..., n, 1)
    return k + nan_where_not, v.nan_to_num(0.0, 0.0, 0.0)


def all_finite(*ts: torch.Tensor) -> bool:
    """Whether every entry of the tensors is finite, by their sums (one fast pass each; float16's
    in float32, where it would overflow past 65504): a nan or an inf makes a sum non-finite. A
    sum of finite entries may still overflow and say False: for the CPU overrides, which assume
    finite keys and values and leave other calls to the portable bodies, that only sends such a
    call there. (Off the CPU it would wait for the device.)"""
    return all(bool(torch.isfinite(t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()))
               for t in ts)


def partial_softmax(scores: torch.Tensor, valid: torch.Tensor | None, v: torch.Tensor):
    """Softmax of ``scores (..., R, n)`` over the ``valid`` keys (bool, broadcastable to the
    scores; None: all), applied to ``v (..., n, Dv)``.

    Returns ``(o (..., R, Dv), lse (..., R))``; a row with no valid key gives o = 0, lse = -inf.
    A key that is not finite reaches only the rows ``valid`` lets attend it; a value that is not
    finite reaches every row (weight 0 · nan = nan) unless the caller has first moved it into
    its key (:func:`excluding_nonfinite_values`).
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
