"""ProbSparse self-attention (Informer, Zhou et al., AAAI 2021).

Only the u "active" queries with the largest sparsity measure
M(q_i) = max_j s_ij - mean_j s_ij (on U_part sampled keys) get full attention;
the "lazy" rest get the mean of the values (causal: the mean of the values
they may see), which is what a near-uniform attention row would give.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnzoo.masks import causal_offset, dense_mask, visible_key_count
from attnzoo.mechanisms._few import attend_few_queries
from attnzoo.mechanisms._softmax import softmax_scale, wide
from attnzoo.mechanisms.full import masked_softmax
from attnzoo.ops import compiling
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class ProbSparseOptions:
    factor: int = 5  # c: U_part = c·ceil(ln Lk) sampled keys per query, u = c·ceil(ln Lq) active queries
    variant: str = "paper"  # "paper" or "official" (the Informer repository's arithmetic; see below)
    chunk: int = 1024  # queries per chunk when scoring the samples (cache blocking, not results)

    def __post_init__(self):
        if self.factor < 1:
            raise ValueError(f"prob_sparse: factor must be >= 1, got {self.factor}")
        if self.variant not in ("paper", "official"):
            raise ValueError(f"prob_sparse: variant must be 'paper' or 'official', got {self.variant!r}")
        if self.chunk < 1:
            raise ValueError(f"prob_sparse: chunk must be >= 1, got {self.chunk}")


def sizes(Lq: int, Lk: int, factor: int) -> tuple[int, int]:
    """(u, U_part) = (min(c·ceil(ln Lq), Lq), min(c·ceil(ln Lk), Lk)), each at least 1."""
    u = min(max(1, factor * math.ceil(math.log(Lq))), Lq)
    U_part = min(max(1, factor * math.ceil(math.log(Lk))), Lk)
    return u, U_part


def sample_keys(Lq, Lk, U_part, *, causal, key_mask, generator, device):
    """Draw U_part key indices per query, uniformly with replacement among the keys it may see.

    Returns ``(index (B or 1, Lq, U_part) int64, seen (B or 1, Lq) int64)``, shared across
    heads as in the official code. Sampling among visible keys keeps a query's M free
    of keys it may not attend to (the official code samples every key, future and
    padding included). Rows that see no key get index 0 (unused).
    """
    seen = visible_key_count(Lq, Lk, causal=causal, key_mask=key_mask, device=device)[:, 0]  # (B|1, Lq)
    draws = torch.rand(seen.shape[0], Lq, U_part, generator=generator, device=device)
    rank = (draws * seen[..., None]).long().clamp(max=Lk - 1)  # r-th visible real key
    if key_mask is None:
        return rank, seen  # visible keys are 0..seen-1 in order
    real_first = torch.argsort((~key_mask).to(torch.uint8), dim=-1, stable=True)  # (B, Lk)
    return torch.gather(real_first, 1, rank.flatten(1)).view_as(rank), seen


def sparsity_measure(sampled_scores: torch.Tensor, Lk: int, variant: str) -> torch.Tensor:
    """M = max - mean over the U_part sampled scores, as mean(max - s), which is exactly 0 when
    the samples are equal (max - sum / U_part may round either way); official: max - sum / Lk."""
    top = sampled_scores.amax(-1, keepdim=True)
    if variant == "official":
        return top.squeeze(-1) - sampled_scores.sum(-1) / Lk
    return (top - sampled_scores).sum(-1) / sampled_scores.shape[-1]


def top_queries(M: torch.Tensor, u: int) -> torch.Tensor:
    """Indices (..., u) of the u largest M, ties to the earlier query (a query that sees one key
    has M = 0 exactly: ties are common, and ``topk`` breaks them arbitrarily)."""
    return torch.sort(M, dim=-1, descending=True, stable=True).indices[..., :u]


PREFIX_CHUNK = 32  # rows summed by one triangular matmul in :func:`prefix_sums`


def prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(2)`` for x (B, H, L, X) as a blocked scan: within each chunk of PREFIX_CHUNK
    rows a lower-triangular matmul of ones, then the totals of the chunks before it (a cumsum
    over the L/PREFIX_CHUNK chunk totals) added: matmuls instead of a serial scan along L.
    Rounding: sums of PREFIX_CHUNK terms, then of chunk totals, instead of one running sum."""
    L, pad = x.shape[2], -x.shape[2] % PREFIX_CHUNK
    chunks = (F.pad(x, (0, 0, 0, pad)) if pad else x).unflatten(2, (-1, PREFIX_CHUNK))  # (B, H, nc, chunk, X)
    ones = torch.ones(PREFIX_CHUNK, PREFIX_CHUNK, dtype=x.dtype, device=x.device).tril_()
    within = ones @ chunks  # (B, H, nc, chunk, X): sums inside each chunk
    before = F.pad(within[:, :, :-1, -1:].cumsum(2), (0, 0, 0, 0, 1, 0))  # (B, H, nc, 1, X): chunks before
    return (within + before).flatten(2, 3)[:, :, :L]


def lazy_values(v, *, causal, key_mask, Lq, variant):
    """What lazy queries get: (B, H, Lq, Dv) mean of the visible real values.

    Official variant, causal: the cumulative *sum* of the values (the repository's
    ``V.cumsum``), which grows with i; non-causal it is the mean, as here. The sums run in
    float32 for half-precision values; the result is in v's dtype.
    """
    return _lazy_sums(wide(v), causal=causal, key_mask=key_mask, Lq=Lq, variant=variant).to(v.dtype)


def _lazy_sums(v, *, causal, key_mask, Lq, variant):
    B, H, Lk, Dv = v.shape
    if key_mask is not None:  # (a fill, not a product: a padded value may be nan)
        v = v.masked_fill(~key_mask[:, None, :, None], 0.0)
    if not causal:
        count = visible_key_count(1, Lk, causal=False, key_mask=key_mask, device=v.device)  # (B|1,1,1)
        return (v.sum(2, keepdim=True) / count[..., None].clamp(min=1)).expand(B, H, Lq, Dv)
    out = prefix_sums(v)  # (B, H, Lk, Dv): with Lq = Lk, query i's visible prefix is row i
    if Lq != Lk:
        last = torch.arange(Lq, device=v.device) + causal_offset(Lq, Lk)  # last visible key of each query
        out = out[:, :, last.clamp(0, Lk - 1)] * (last >= 0)[:, None].to(v.dtype)  # (B, H, Lq, Dv)
    if variant == "official":
        return out
    count = visible_key_count(Lq, Lk, causal=True, key_mask=key_mask, device=v.device)  # (B|1, 1, Lq)
    return out / count[..., None].clamp(min=1)


def _sampled_measure(q, k, index, Lk, opts):
    """M (B, H, Lq) from the sampled scores s_ij = q_i·k_j, never as an (Lq, U_part, D) copy of K.

    Queries go in chunks of ``opts.chunk``. A chunk's samples, sorted and each distinct
    (query, key) pair counted as often as it was drawn, form a sparse (chunk, Lk) pattern that
    the heads share (:func:`_sample_pattern`); torch's sampled matmul (SDDMM) computes exactly
    those scores, each one dot product of a query and a key row, with no gathered copy of the
    keys (:func:`_pattern_scores`); each row of them is then reduced to M (:func:`_row_measure`).
    """
    B, H, Lq, _ = q.shape
    M = q.new_empty(B, H, Lq)
    for start in range(0, Lq, opts.chunk):
        at = slice(start, start + opts.chunk)
        patterns = [_sample_pattern(index_b[at], Lk) for index_b in index]  # one, or one a batch entry
        for b in range(B):
            pattern = patterns[min(b, len(patterns) - 1)]
            scores = _pattern_scores(q[b, :, at], k[b], pattern)  # (H, nnz)
            M[b, :, at] = _row_measure(scores, pattern, index.shape[-1], Lk, opts.variant)
    return M


class _Pattern(NamedTuple):
    """The distinct (query, key) pairs of C queries' samples, in row-major order."""

    rows: torch.Tensor  # (nnz,) query of each pair, 0..C-1
    cols: torch.Tensor  # (nnz,) key of each pair
    counts: torch.Tensor  # (nnz,) how often the pair was drawn
    crow: torch.Tensor  # (C + 1,) where each query's pairs start (the CSR layout)


def _sample_pattern(index: torch.Tensor, Lk: int) -> _Pattern:
    """The pattern of the samples ``index`` (C, U_part) of C queries."""
    C = index.shape[0]
    pairs = (torch.arange(C, device=index.device)[:, None] * Lk + index.sort(-1).values).flatten()
    pairs, counts = torch.unique_consecutive(pairs, return_counts=True)
    rows = pairs // Lk
    crow = torch.zeros(C + 1, dtype=torch.long, device=index.device)
    per_row = torch.zeros(C, dtype=torch.long, device=index.device).index_add_(0, rows, torch.ones_like(rows))
    torch.cumsum(per_row, 0, out=crow[1:])  # (a count of known size: bincount's is data-dependent)
    return _Pattern(rows, pairs % Lk, counts, crow)


def _pattern_scores(q: torch.Tensor, k: torch.Tensor, pattern: _Pattern) -> torch.Tensor:
    """The scores (H, nnz) of a pattern's pairs, q (H, C, D) against k (H, Lk, D), by
    ``torch.sparse.sampled_addmm`` on a batched CSR tensor of the pairs (rows in order, no
    pair twice: valid CSR, so its invariants are not checked again)."""
    if compiling():  # sparse tensors do not trace: the same scores from gathered rows (C·U_part·D)
        return torch.linalg.vecdot(q[:, pattern.rows], k[:, pattern.cols])
    H, nnz = q.shape[0], pattern.cols.numel()
    with warnings.catch_warnings():  # torch's notice that sparse CSR is in beta, once a process
        warnings.simplefilter("ignore", UserWarning)
        csr = torch.sparse_csr_tensor(pattern.crow.expand(H, -1), pattern.cols.expand(H, -1),
                                      q.new_zeros(H, nnz), (H, q.shape[1], k.shape[1]),
                                      check_invariants=False)
    return torch.sparse.sampled_addmm(csr, q, k.transpose(-1, -2), beta=0.0).values()


def _row_measure(scores: torch.Tensor, pattern: _Pattern, U_part: int, Lk: int, variant: str):
    """M (H, C) from the pattern's scores (H, nnz), each pair counted as often as it was drawn:
    as :func:`sparsity_measure`, max - mean as mean(max - s) (exactly 0 when the samples are
    equal); official: max - sum / Lk."""
    H, C = scores.shape[0], pattern.crow.numel() - 1
    rows = pattern.rows.expand(H, -1)
    top = scores.new_full((H, C), -torch.inf).scatter_reduce_(1, rows, scores, "amax")
    if variant == "official":
        return top - scores.new_zeros(H, C).index_add_(1, pattern.rows, scores * pattern.counts) / Lk
    gap = torch.gather(top, 1, rows).sub_(scores).mul_(pattern.counts)  # (max - s) · count
    return scores.new_zeros(H, C).index_add_(1, pattern.rows, gap).div_(U_part)


def _active_queries(q, k, opts, *, causal, key_mask, generator):
    """Indices (B, H, u) of the u queries with the largest M, under no_grad (selection only)."""
    Lq, Lk = q.shape[2], k.shape[2]
    u, U_part = sizes(Lq, Lk, opts.factor)
    index, seen = sample_keys(Lq, Lk, U_part, causal=causal, key_mask=key_mask, generator=generator,
                              device=q.device)
    with torch.no_grad():
        M = _sampled_measure(wide(q.detach()), wide(k.detach()), index, Lk, opts)  # rank M in >= float32
        M = M.masked_fill((seen == 0)[:, None], float("-inf"))
    return top_queries(M, u)  # (B, H, u)


def _active_mask(top, Lq, Lk, causal, key_mask):
    """The (B, H, u, Lk) bool mask of the keys each active query, at the positions ``top``
    (B, H, u), may see; None when every query sees every key. (A query that sees no key has a
    row of False: SDPA gives it 0 and no gradient, as the reference.)"""
    if not causal and key_mask is None:
        return None
    last = top + causal_offset(Lq, Lk) if causal else torch.full_like(top, Lk - 1)  # its last key
    valid = torch.arange(Lk, device=top.device) <= last[..., None]  # (B, H, u, Lk)
    return valid if key_mask is None else valid & key_mask[:, None, None, :]


def prob_sparse_attention(q, k, v, opts=ProbSparseOptions(), *, causal=False, key_mask=None,
                          scale=None, generator=None):
    """Full attention for the u queries of largest M = max - mean of sampled scores; mean(V) else.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost: O(Lq·U_part·D + u·Lk·D) time, O(Lq + u·Lk + Lk·Dv) memory per head: the
    sampled scores are reduced to M on the fly, chunk by chunk, never as the
    seed's (Lq, U_part, D) copy of K; the u active queries attend by
    :func:`~attnzoo.mechanisms._few.attend_few_queries`, which keeps no (u, Lk) weights
    (causal or masked, a (u, Lk) mask is the one such tensor). Zhou et al., AAAI 2021.

    Departures and choices, all deliberate:
    - ``variant="paper"`` (default): M uses the mean of the U_part sampled scores,
      and causal lazy queries get the mean of the values they may see.
      ``variant="official"``: the Informer repository divides the sampled sum by Lk
      (under-weighting the mean term) and gives causal lazy queries cumsum(V), a sum.
    - Samples are drawn among the keys each query may see (real keys, j <= i when
      causal); the official code samples every key, which makes causal selection
      depend on the future.
    - u and U_part are at least 1 (the formula gives 0 at length 1).
    - Samples are shared across heads (as officially), one draw per batch entry.
    - Ties in M go to the earlier query (``topk``'s order is arbitrary); M = 0 exactly for a
      query whose samples are all one key.
    - Causal masks what each query attends to (active: j <= i; lazy: the prefix
      mean), but *which* queries are active is the top-u over the whole sequence,
      as in the paper: a later query can displace an earlier one. Use it where the
      whole (decoder) input is known at once, as Informer does; not for
      token-by-token decoding.
    """
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    top = _active_queries(q, k, opts, causal=causal, key_mask=key_mask, generator=generator)
    q_top = torch.gather(q, 2, top[..., None].expand(-1, -1, -1, q.shape[-1]))  # (B, H, u, D)
    mask = _active_mask(top, Lq, Lk, causal, key_mask)  # (B, H, u, Lk) or None
    active_out = attend_few_queries(q_top, k, v, mask, softmax_scale(q, scale))  # (B, H, u, Dv)
    out = lazy_values(v, causal=causal, key_mask=key_mask, Lq=Lq, variant=opts.variant)
    rows = top[..., None].expand(-1, -1, -1, v.shape[-1])  # (B, H, u, Dv)
    if causal:  # a fresh tensor that autograd does not need again: overwrite the active rows in place
        return out.scatter_(2, rows, active_out.to(out.dtype))
    return out.scatter(2, rows, active_out.to(out.dtype))  # (non-causal, out is one row expanded)


def prob_sparse_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """Sampled scores 2·Lq·U_part·D, then full attention of the u active queries; causal, the
    lazy values' prefix sums too (:func:`prefix_sums`: a chunk × chunk matmul a chunk)."""
    u, U_part = sizes(Lq, Lk, opts.factor)
    prefix = -(-Lk // PREFIX_CHUNK) * PREFIX_CHUNK * PREFIX_CHUNK * Dv if causal else 0
    return 2.0 * B * H * (Lq * U_part * D + u * Lk * (D + Dv) + prefix)


def prob_sparse_reference(q, k, v, opts=ProbSparseOptions(), *, causal=False, key_mask=None,
                          scale=None, generator=None):
    """The same selection recomputed densely from the full (Lq, Lk) score matrix."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    u, U_part = sizes(Lq, Lk, opts.factor)
    index, _ = sample_keys(Lq, Lk, U_part, causal=causal, key_mask=key_mask, generator=generator,
                           device=q.device)
    mask = dense_mask(Lq, Lk, causal=causal, key_mask=key_mask, device=q.device).expand(B, H, Lq, Lk)
    s = softmax_scale(q, scale)
    scores = (q @ k.transpose(-1, -2)) * s  # (B, H, Lq, Lk)
    sampled = torch.gather(scores.detach() / s, 3, index[:, None].expand(B, H, Lq, U_part))
    M = sparsity_measure(sampled, Lk, opts.variant)
    M = M.masked_fill(~mask.any(-1), float("-inf"))
    active = torch.zeros(B, H, Lq, dtype=torch.bool, device=q.device)
    active.scatter_(2, top_queries(M, u), True)
    weights = masked_softmax(scores, mask)
    uniform = mask.to(q.dtype)
    if not (opts.variant == "official" and causal):
        uniform = uniform / uniform.sum(-1, keepdim=True).clamp(min=1)
    weights = torch.where(active[..., None], weights, uniform)
    return weights @ v


def prob_sparse_connectivity(q, k, opts, causal, key_mask, scale, generator):
    """(B, H, Lq, Lk) bool: the keys of the active queries' rows; lazy rows are all False."""
    Lq, Lk = q.shape[2], k.shape[2]
    top = _active_queries(q, k, opts, causal=causal, key_mask=key_mask, generator=generator)
    active = torch.zeros(q.shape[:3], dtype=torch.bool, device=q.device).scatter(2, top, True)
    return active[..., None] & dense_mask(Lq, Lk, causal=causal, key_mask=key_mask, device=q.device)


register(
    Mechanism(
        name="prob_sparse",
        summary="top-u 'active' queries by max-minus-mean of sampled scores; lazy ones get mean(V)",
        options=ProbSparseOptions,
        fn=prob_sparse_attention,
        reference=prob_sparse_reference,
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L log L d)",
        memory="O(L log L)",
        citation="Zhou et al., Informer: Beyond Efficient Transformer for Long Sequence "
        "Time-Series Forecasting, AAAI 2021",
        randomized=True,
        data_pattern=prob_sparse_connectivity,
        flops=prob_sparse_flops,
    )
)
