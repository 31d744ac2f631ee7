"""Reformer's LSH attention (Kitaev et al., ICLR 2020).

Angular LSH: for each of ``n_hashes`` rounds a random rotation R (D × b/2) gives
h(x) = argmax([xR; −xR]). Factorized (the paper's code, trax, for many buckets): b = b₁·b₂
buckets from two rotations of b₁/2 and b₂/2 columns, h(x) = h₁(x) + b₁·h₂(x), at
O(D·(b₁ + b₂)) a position instead of O(D·b). Queries and keys are sorted by (bucket, position) and cut into
chunks of ``bucket_size``; each chunk attends to itself and the chunk before (look one back).
Each round gives a partial softmax; the rounds merge by their log-sum-exps. Each key counts
once (the paper's N_ij correction): a round leaves out the keys its queries met in an
earlier round, so the rounds' key sets are disjoint and the merge is exactly the softmax over
the union of the keys a query meets in any round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.mechanisms._softmax import (
    excluding_nonfinite_values,
    merge_partials,
    partial_softmax,
    softmax_scale,
    wide,
)
from attnzoo.mechanisms.full import softmax_reference
from attnzoo.ops import operation
from attnzoo.registry import Capabilities, Mechanism, register

SELF_PENALTY = 1e5  # the paper's m(i, i): a position attends to itself only if it has no other key
HASH_BLOCK = 2**22  # rotated values hashed at a time: b grows with L, so the hash goes by blocks of positions
FACTORIZE_ABOVE = 256  # default bucket counts above this hash factorized (b₁·b₂): docs/scale.md


@dataclass(frozen=True)
class LSHOptions:
    bucket_size: int = 64  # m: chunk length after sorting
    n_hashes: int = 4  # hash rounds
    # b (1 or even), or factors (b₁, b₂, ...) each 1 or even hashed apart into b₁·b₂·... buckets;
    # None = about L / bucket_size, as in the paper, factorized in two above FACTORIZE_ABOVE
    n_buckets: int | tuple[int, ...] | None = None
    attend_across_buckets: bool = False  # True: keys of other buckets inside a chunk are kept
    shared_qk: bool = False  # keys = q/‖q‖ (pass k=q), and no attending to itself if avoidable
    count_duplicates: bool = True  # the paper's N_ij: a key met in several rounds counts once;
    # False weights it by the rounds it was met in (reformer-pytorch's allow_duplicate_attention)

    def __post_init__(self):
        if self.bucket_size < 1 or self.n_hashes < 1:
            raise ValueError(f"lsh: bucket_size and n_hashes must be >= 1, got {self.bucket_size}, "
                             f"{self.n_hashes}")
        factors = (self.n_buckets,) if isinstance(self.n_buckets, int) else self.n_buckets
        if factors is not None and (not isinstance(factors, tuple) or not factors or any(
                not isinstance(b, int) or b < 1 or (b > 1 and b % 2) for b in factors)):
            raise ValueError(f"lsh: n_buckets must be 1 or even (h = argmax([xR; -xR])), or a tuple "
                             f"of such factors, got {self.n_buckets!r}")


@dataclass(frozen=True)
class LSHLayerOptions:
    shared_qk: bool = True  # the module's default: one projection for queries and keys, as the paper

    def build(self, layer) -> None:
        if self.shared_qk:
            layer.k_proj = None  # keys come from the query projection, normalised by the mechanism
            layer.options = {**layer.options, "shared_qk": True}


def bucket_factors(L: int, opts: LSHOptions) -> tuple[int, ...]:
    """The factors hashed apart: ``n_buckets`` as given, or b = the even number nearest
    L / bucket_size (at least 2) -- factorized as (b₁, b₂), both even and near √b, once b passes
    FACTORIZE_ABOVE."""
    if opts.n_buckets is not None:
        return (opts.n_buckets,) if isinstance(opts.n_buckets, int) else opts.n_buckets
    b = max(2, 2 * round(L / (2 * opts.bucket_size)))
    if b <= FACTORIZE_ABOVE:
        return (b,)
    b1 = 2 * max(1, round(b**0.5 / 2))
    return b1, 2 * max(1, round(b / b1 / 2))


def n_buckets_for(L: int, opts: LSHOptions) -> int:
    """The number of buckets: the product of :func:`bucket_factors`."""
    return math.prod(bucket_factors(L, opts))


def lsh_attention(q, k, v, opts=LSHOptions(), *, causal=False, key_mask=None, scale=None,
                  generator=None):
    """Softmax over the keys met in any hash round: same chunk or the one before after sorting
    by (bucket, position), same bucket unless ``attend_across_buckets``.

    Shapes: q, k (B, H, L, D), v (B, H, L, Dv) -> (B, H, L, Dv); self-attention only.
    Cost O(n_hashes·L·2m·(D + Dv)) time for the rounds (m = bucket_size), plus
    O(n_hashes²·L·2m) compares to count each key once, O(n_hashes·L·D·(b₁ + b₂ + ...)) for the
    hash (b, or its factors: about 2√b by default past FACTORIZE_ABOVE buckets) and
    O(n_hashes·L log L) for the sort; O(n_hashes·L·m) memory (each round's scores). No L×L tensor.
    Choices: rotations are shared by batch and heads; chunk 0 has no chunk before it (no
    wrap-around); with ``shared_qk`` a query's own key scores −1e5, so it is attended only
    when nothing else is, as in the paper.

    Causal masks the attention (query i attends keys j <= i only), as the paper does, but
    *which* earlier keys a query meets depends on the whole sequence: the sort by bucket, the
    chunk boundaries and n_buckets(L) see every position, so changing a later token may
    change an earlier output. It is not a decoder's causality (no token-by-token generation).
    """
    _check_shared(q, k, opts)
    hashed = _buckets_and_order(q, k, opts, generator)  # (shared QK hashes q alone)
    return attend_rounds(q, k, v, hashed, key_mask, causal, opts, softmax_scale(q, scale))


def _buckets_and_order(q, k, opts, generator):
    """Bucket ids and sort order of queries and keys, the random draw shared by the mechanism
    and its reference.

    Returns ``(q_buckets, k_buckets, q_order, k_order)``, each (B, H, n_hashes, L): order
    lists original positions sorted by (bucket, position).
    """
    L, D = q.shape[2], q.shape[3]
    factors = bucket_factors(L, opts)
    rotations = torch.randn(opts.n_hashes, D, sum(b // 2 for b in factors), generator=generator,
                            device=q.device)  # shared by batch and heads; the factors' side by side
    q_buckets = factorized_hash(q, rotations, factors)
    k_buckets = q_buckets if opts.shared_qk else factorized_hash(k, rotations, factors)
    b = n_buckets_for(L, opts)
    q_order = bucket_order(q_buckets, b)
    k_order = q_order if opts.shared_qk else bucket_order(k_buckets, b)
    return q_buckets, k_buckets, q_order, k_order


def factorized_hash(x: torch.Tensor, rotations: torch.Tensor, factors: tuple[int, ...]) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, n_hashes, L) buckets h₁ + b₁·h₂ + b₁b₂·h₃ + ..., each hᵢ the hash of
    its own b_i/2 columns of ``rotations`` (n_hashes, D, Σ b_i/2); one factor: the plain hash."""
    buckets, first, scale = None, 0, 1
    for b in factors:
        half = b // 2  # (0 for one bucket: hash_buckets gives bucket 0)
        h = hash_buckets(x, rotations[..., first:first + half])
        buckets = h if buckets is None else buckets.add_(h.mul_(scale))
        first, scale = first + half, scale * b
    return buckets


def hashable(x: torch.Tensor, rotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x detached (bucket ids take no gradient) in float32 or float64 (half precision would flip
    buckets), and the rotations in its dtype."""
    x = x.detach()
    x = x if x.dtype == torch.float64 else x.float()
    return x, rotations.to(x.dtype)


@operation("lsh_buckets")
def hash_buckets(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, n_hashes, L) int64 buckets: argmax([xR; −xR]) in every round,
    the first maximum on ties, for ``rotations`` (n_hashes, D, b/2) (b/2 = 0: one bucket).
    O(n_hashes·L·D·b) time, by blocks of positions of at most HASH_BLOCK rotated values."""
    B, H, L, _ = x.shape
    R, half = rotations.shape[0], rotations.shape[-1]
    if half == 0:
        return torch.zeros(B, H, R, L, dtype=torch.long, device=x.device)
    x, rotations = hashable(x, rotations)
    rows = max(1, HASH_BLOCK // (B * H * R * 2 * half))
    return torch.cat([_argmax_hash(x[:, :, s:s + rows], rotations) for s in range(0, L, rows)], dim=-1)


def _argmax_hash(x, rotations):
    rotated = torch.einsum("bhld,rdc->bhrlc", x, rotations)  # (B, H, R, n, b/2)
    return torch.cat([rotated, -rotated], dim=-1).argmax(-1)  # (B, H, R, n)


@operation("lsh_order")
def bucket_order(buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Positions sorted by bucket, stably (by position within a bucket), along the last dim of
    ``buckets`` (..., L) in [0, n_buckets)."""
    return torch.sort(buckets, dim=-1, stable=True)[1]


@operation("lsh_attend")
def attend_rounds(q, k, v, hashed, key_mask, causal, opts, scale):
    """The rounds of :func:`lsh_attention` given their draw ``hashed`` = (q_buckets, k_buckets,
    q_order, k_order), each (B, H, n_hashes, L), and ``scale`` (a number): one partial softmax
    a round, merged. ``k`` is q with ``shared_qk`` (the keys are then q/‖q‖).
    -> (B, H, L, Dv) in q's dtype (half precision computes in float32)."""
    keys = F.normalize(wide(q), dim=-1) if opts.shared_qk else wide(k)
    keys, v = excluding_nonfinite_values(keys, wide(v))  # a chunk's window holds keys it may not see
    q_order, k_order = hashed[2], hashed[3]
    q_slot = _inverse(q_order)  # (B, H, n_hashes, L): the sorted slot of each position
    slots = q_slot, q_slot if k_order is q_order else _inverse(k_order)
    parts = [_round(wide(q), keys, v, r, hashed, slots, key_mask, causal, opts, scale)
             for r in range(opts.n_hashes)]
    return merge_partials(parts)[0].to(q.dtype)


def _round(q, keys, v, r, hashed, slots, key_mask, causal, opts, scale):
    """Round r's partial softmax ``(o (B, H, L, Dv), lse (B, H, L))`` by position: the queries
    in sorted chunks of m, each against the keys of the same chunk and the one before in the
    keys' sorted order."""
    m = opts.bucket_size
    q_pos = _chunks(hashed[2][:, :, r], m)  # (B, H, nc, m): the position in each sorted slot, -1 past L
    k_pos = _look_one_back(_chunks(hashed[3][:, :, r], m))  # (B, H, nc, 2m)
    scores = _rows(q, q_pos) @ _rows(keys, k_pos).transpose(-1, -2) * scale  # (B, H, nc, m, 2m)
    if opts.shared_qk:
        scores = torch.where(k_pos.unsqueeze(-2) == q_pos.unsqueeze(-1), scores - SELF_PENALTY, scores)
    valid = _visible(r, q_pos, k_pos, hashed, slots, key_mask, causal, opts)
    o, lse = partial_softmax(scores, valid, _rows(v, k_pos))  # (B, H, nc, m, Dv), (B, H, nc, m)
    slot = slots[0][:, :, r]  # (B, H, L): unsort, from each position's sorted slot
    o = o.flatten(2, 3).gather(2, slot.unsqueeze(-1).expand(-1, -1, -1, o.shape[-1]))  # (B, H, L, Dv)
    return o, lse.flatten(2).gather(2, slot)


def _visible(r, q_pos, k_pos, hashed, slots, key_mask, causal, opts):
    """(B, H, nc, m, 2m) bool: whether each query may attend each key slot of its window in round
    r: a key (not padding, not before chunk 0) of its bucket unless across buckets, not in its
    future if causal, not padded by ``key_mask``, and (counting each key once) not met in an
    earlier round."""
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    valid = (kp >= 0) & _met(r, q_pos, k_pos, hashed, slots, opts)  # (the window holds its chunks)
    if causal:
        valid = valid & (kp <= qp)
    if key_mask is not None:
        B, H = q_pos.shape[:2]
        valid = valid & _at(key_mask[:, None].expand(B, H, -1), k_pos).unsqueeze(-2)
    if opts.count_duplicates:
        for t in range(r):
            valid = valid & ~_met(t, q_pos, k_pos, hashed, slots, opts)
    return valid


def _met(t, q_pos, k_pos, hashed, slots, opts):
    """(B, H, nc, m, 2m) bool: whether the queries at ``q_pos`` and the keys at ``k_pos`` meet in
    round t (:func:`_meets`)."""
    q_buckets, k_buckets = hashed[0][:, :, t], hashed[1][:, :, t]
    q_chunk, k_chunk = slots[0][:, :, t] // opts.bucket_size, slots[1][:, :, t] // opts.bucket_size
    return _meets(_at(q_chunk, q_pos).unsqueeze(-1), _at(k_chunk, k_pos).unsqueeze(-2),
                  _at(q_buckets, q_pos).unsqueeze(-1), _at(k_buckets, k_pos).unsqueeze(-2),
                  opts.attend_across_buckets)


def _meets(q_chunk_r, k_chunk_r, q_bucket_r, k_bucket_r, across: bool) -> torch.Tensor:
    """Whether query and key meet in a round: key's chunk is the query's or the one before."""
    met = (k_chunk_r <= q_chunk_r) & (k_chunk_r >= q_chunk_r - 1)
    return met if across else met & (k_bucket_r == q_bucket_r)


def _inverse(order):
    """The inverse permutations of ``order`` along its last dim."""
    slots = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, slots)


def _chunks(order_r, m):
    """(B, H, L) sorted positions -> (B, H, nc, m), the last chunk padded with -1."""
    L = order_r.shape[-1]
    return F.pad(order_r, (0, -(-L // m) * m - L), value=-1).unflatten(-1, (-1, m))


def _look_one_back(pos):
    """(B, H, nc, m) -> (B, H, nc, 2m): each chunk's window, the chunk before (none for chunk 0:
    -1) and the chunk itself."""
    return torch.cat([F.pad(pos[:, :, :-1], (0, 0, 1, 0), value=-1), pos], dim=-1)


def _at(t, pos):
    """Values of t (B, H, L) at positions ``pos`` (B, H, n, w) (-1 reads position 0)."""
    return t.gather(2, pos.clamp(min=0).flatten(2)).view(pos.shape)


def _rows(x, pos):
    """Rows of x (B, H, L, X) at positions ``pos`` (B, H, n, w) -> (B, H, n, w, X)."""
    index = pos.clamp(min=0).flatten(2).unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, index).view(*pos.shape, x.shape[-1])


def _keys_of(q, k, opts):
    _check_shared(q, k, opts)
    return F.normalize(q, dim=-1) if opts.shared_qk else k


def _check_shared(q, k, opts):
    if opts.shared_qk and k is not q and not torch.equal(k, q):
        raise ValueError("lsh: shared_qk=True makes the keys q/‖q‖; pass k=q")


def lsh_meetings(q, k, opts, causal, key_mask, scale, generator):
    """(B, H, L, L) int: in how many rounds each query meets each key it may attend (0 = never)."""
    keys = _keys_of(q, k, opts)
    B, H, L, _ = q.shape
    q_buckets, k_buckets, q_order, k_order = _buckets_and_order(q, keys, opts, generator)
    m = opts.bucket_size
    count = torch.zeros(B, H, L, L, dtype=torch.long, device=q.device)
    for r in range(opts.n_hashes):
        qc = (q_order[:, :, r].argsort(-1) // m)[..., :, None]  # (B, H, L, 1) chunk of query i
        kc = (k_order[:, :, r].argsort(-1) // m)[..., None, :]  # (B, H, 1, L) chunk of key j
        count += _meets(qc, kc, q_buckets[:, :, r, :, None], k_buckets[:, :, r, None, :],
                        opts.attend_across_buckets)
    if causal:
        count *= torch.ones(L, L, dtype=torch.long, device=q.device).tril()
    if key_mask is not None:
        count *= key_mask[:, None, None, :]
    return count


def lsh_mask(q, k, opts, causal, key_mask, scale, generator):
    """(B, H, L, L) bool: which keys each query meets in some round (and may attend)."""
    return lsh_meetings(q, k, opts, causal, key_mask, scale, generator) > 0


def lsh_reference(q, k, v, opts=LSHOptions(), *, causal=False, key_mask=None, scale=None,
                  generator=None):
    """Dense softmax over the union of keys met in any round (same draw of rotations)."""
    count = lsh_meetings(q, k, opts, causal, key_mask, scale, generator)
    bias = None
    if not opts.count_duplicates:  # a key met in n rounds weighs n times: + log n
        bias = count.clamp(min=1).to(q.dtype).log()
    if opts.shared_qk:  # the self penalty on the diagonal
        penalty = -SELF_PENALTY * torch.eye(q.shape[2], dtype=q.dtype, device=q.device)
        bias = penalty if bias is None else bias + penalty
    return softmax_reference(q, _keys_of(q, k, opts), v, count > 0, scale, bias=bias)


def lsh_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """Per round: hashing (2·L·D·Σ b_i/2 for q, and for k unless shared) and the chunked scores
    and weighted values (2·Lp·2m·(D + Dv))."""
    L, m = Lq, opts.bucket_size
    columns = sum(b // 2 for b in bucket_factors(L, opts))
    hashes = (1 if opts.shared_qk else 2) * 2.0 * L * D * columns
    chunks = 2.0 * (-(-L // m)) * m * 2 * m * (D + Dv)
    return B * H * opts.n_hashes * (hashes + chunks)


register(
    Mechanism(
        name="lsh",
        summary="angular LSH by random rotations, sort by bucket, attend within chunk and the one before",
        options=LSHOptions,
        fn=lsh_attention,
        reference=lsh_reference,
        capabilities=Capabilities(causal=True, cross=False, key_mask=True),
        time="O(n_hashes L d (bucket_size + √(L/bucket_size)) + L log L)",
        memory="O(n_hashes L bucket_size)",
        citation="Kitaev et al., Reformer: The Efficient Transformer, ICLR 2020",
        randomized=True,
        data_pattern=lsh_mask,
        flops=lsh_flops,
        layer_options=LSHLayerOptions,
    )
)
