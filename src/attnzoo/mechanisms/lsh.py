"""Reformer's LSH attention (Kitaev et al., ICLR 2020).

Angular LSH: for each of ``n_hashes`` rounds a random rotation R (D × b/2) gives
h(x) = argmax([xR; −xR]). Queries and keys are sorted by (bucket, position) and
cut into chunks of ``bucket_size``; each chunk attends to itself and the chunk
before. The rounds are combined by their log-sum-exp weights, each key counted
once (the paper's N_ij correction), so the result is exactly the softmax over
the union of the keys a query meets in any round. Rather than subtracting log N_ij
in every round, a round masks the keys its queries met in an earlier round: the same
softmax, with half the compares and no pass over the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.mechanisms._common import (
    SCORES_PER_CHUNK,
    add_group_grads,
    blocks_forward,
    finite_or_zero,
    pad_to,
    softmax_scale,
    wide,
)
from attnzoo.mechanisms.full import softmax_reference
from attnzoo.registry import Capabilities, Mechanism, register

SELF_PENALTY = 1e5  # the paper's m(i, i): a position attends to itself only if it has no other key


@dataclass(frozen=True)
class LSHOptions:
    bucket_size: int = 64  # m: chunk length after sorting
    n_hashes: int = 4  # hash rounds
    n_buckets: int | None = None  # b (1 or even); None = about L / bucket_size, as in the paper
    attend_across_buckets: bool = False  # True: keys of other buckets inside a chunk are kept
    shared_qk: bool = False  # keys = q/‖q‖ (pass k=q), and no attending to itself if avoidable
    count_duplicates: bool = True  # the paper's N_ij: a key met in several rounds counts once;
    # False weights it by the rounds it was met in (reformer-pytorch's allow_duplicate_attention)

    def __post_init__(self):
        if self.bucket_size < 1 or self.n_hashes < 1:
            raise ValueError(f"lsh: bucket_size and n_hashes must be >= 1, got {self.bucket_size}, "
                             f"{self.n_hashes}")
        if self.n_buckets is not None and (self.n_buckets < 1 or
                                           (self.n_buckets > 1 and self.n_buckets % 2)):
            raise ValueError(f"lsh: n_buckets must be 1 or even (h = argmax([xR; -xR])), "
                             f"got {self.n_buckets}")


@dataclass(frozen=True)
class LSHLayerOptions:
    shared_qk: bool = True  # the module's default: one projection for queries and keys, as the paper

    def build(self, layer) -> None:
        if self.shared_qk:
            layer.k_proj = None  # keys come from the query projection, normalised by the mechanism
            layer.options = {**layer.options, "shared_qk": True}


def n_buckets_for(L: int, opts: LSHOptions) -> int:
    """b: given, or the even number nearest L / bucket_size (at least 2)."""
    if opts.n_buckets is not None:
        return opts.n_buckets
    return max(2, 2 * round(L / (2 * opts.bucket_size)))


def hash_buckets(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, n_hashes, L) buckets: argmax([xR; -xR]) per round.

    Computed as the first c with xR_c = max(xR) where max(xR) >= -min(xR), else b/2 + the
    first c with xR_c = min(xR): the same first-maximum tie rule as the argmax of the
    concatenation, without building it. The first index is found by vectorised reductions
    (max over hits of weights b/2 − c), several times faster on the CPU than argmax.
    """
    if rotations.shape[-1] == 0:  # one bucket
        return torch.zeros(*x.shape[:2], rotations.shape[0], x.shape[2], dtype=torch.long,
                           device=x.device)
    x = x.detach()  # bucket ids take no gradient: autograd would keep every block's rotations
    x = x if x.dtype == torch.float64 else x.float()  # hash in >= float32: half precision flips buckets
    rotations = rotations.to(x.dtype)
    B, H, L, _ = x.shape
    R, half = rotations.shape[0], rotations.shape[-1]
    every_round = rotations.permute(1, 0, 2).reshape(-1, R * half)  # (D, R·b/2): one matmul a block
    earlier = torch.arange(half, 0, -1, dtype=x.dtype, device=x.device)  # b/2 − c: larger for earlier c
    out = torch.empty(B, H, R, L, dtype=torch.long, device=x.device)
    rows = max(1, HASH_BLOCK // (B * H * R * half))  # positions a block: the rotated block stays in cache
    for s in range(0, L, rows):
        rotated = (x[:, :, s:s + rows] @ every_round).unflatten(-1, (R, half))  # (B, H, rows, R, b/2)
        top, low = rotated.amax(-1, keepdim=True), rotated.amin(-1, keepdim=True)
        positive = top >= -low  # (B, H, rows, R, 1): the maximum is in the xR half
        first = half - rotated.eq_(torch.where(positive, top, low)).mul_(earlier).amax(-1)
        out[..., s:s + rows] = (first.long() + half * positive.squeeze(-1).logical_not()).transpose(-1, -2)
    return out


HASH_BLOCK = 2**20  # rotated values computed at a time while hashing


def _buckets_and_order(q, k, opts, generator):
    """Bucket ids and sort order of queries and keys, the random draw shared by fast and reference.

    Returns ``(q_buckets, k_buckets, q_order, k_order)``, each (B, H, n_hashes, L): order
    lists original positions sorted by (bucket, position).
    """
    L, D = q.shape[2], q.shape[3]
    b = n_buckets_for(L, opts)
    rotations = torch.randn(opts.n_hashes, D, b // 2 if b > 1 else 0, generator=generator,
                            device=q.device)  # shared by batch and heads
    positions = torch.arange(L, device=q.device)
    q_buckets = hash_buckets(q, rotations)
    k_buckets = q_buckets if opts.shared_qk else hash_buckets(k, rotations)
    q_order = (q_buckets * L + positions).argsort(-1)
    k_order = q_order if opts.shared_qk else (k_buckets * L + positions).argsort(-1)
    return q_buckets, k_buckets, q_order, k_order


def _meets(q_chunk_r, k_chunk_r, q_bucket_r, k_bucket_r, across: bool) -> torch.Tensor:
    """Whether query and key meet in a round: key's chunk is the query's or the one before."""
    met = (k_chunk_r <= q_chunk_r) & (k_chunk_r >= q_chunk_r - 1)
    return met if across else met & (k_bucket_r == q_bucket_r)


def _keys_of(q, k, opts):
    if not opts.shared_qk:
        return k
    if k is not q and not torch.equal(k, q):
        raise ValueError("lsh: shared_qk=True makes the keys q/‖q‖; pass k=q")
    return F.normalize(q, dim=-1)


def lsh_attention(q, k, v, opts=LSHOptions(), *, causal=False, key_mask=None, scale=None,
                  generator=None):
    """Softmax over the keys met in any hash round: same chunk or the one before after sorting
    by (bucket, position), same bucket unless ``attend_across_buckets``.

    Shapes: q, k (B, H, L, D), v (B, H, L, Dv) -> (B, H, L, Dv); self-attention only.
    Cost O(n_hashes·L·bucket_size·D) time (plus n_hashes(n_hashes − 1)·L·bucket_size integer
    compares for counting each key once) and O(L·(D + Dv) + SCORES_PER_CHUNK) memory: the
    rounds run one after another, each over groups of chunks whose scores stay in
    cache, and merge into a running log-sum-exp. The sort is O(L log L). No L×L tensor.
    Choices: rotations are shared by batch and heads; chunk 0 has no chunk before
    it (no wrap-around); with ``shared_qk`` a query's own key scores −1e5, so it is
    attended only when nothing else is, as in the paper.
    """
    keys = _keys_of(q, k, opts)
    B, H, L, D = q.shape
    m = opts.bucket_size
    q_buckets, k_buckets, q_order, k_order = _buckets_and_order(q, keys, opts, generator)
    q_code, k_code = _meeting_codes(q_buckets, k_buckets, q_order, k_order, m, opts)
    plans = [_Round(r, q_buckets, k_buckets, q_order, k_order, q_code, k_code, key_mask, causal, opts)
             for r in range(opts.n_hashes)]
    flat_q = wide(q * softmax_scale(q, scale)).reshape(B * H * L, D)  # half precision: float32 inside
    flat_k, flat_v = wide(keys).reshape(B * H * L, D), wide(v).reshape(B * H * L, -1)
    return _Rounds.apply(flat_q, flat_k, flat_v, plans).to(q.dtype)


class _Rounds(torch.autograd.Function):
    """The hash rounds, each by groups of sorted chunks, merged in place into one softmax over
    the union of their keys. The backward recomputes every round's weights against the merged
    log-sum-exp (flash attention's backward over the union), so no round's output is kept and
    the gradients accumulate in one set of tensors."""

    @staticmethod
    def forward(ctx, q_flat, k_flat, v_flat, plans):
        B, H, L = plans[0].pos.shape
        out = (q_flat.new_zeros(B, H, L, v_flat.shape[-1]), q_flat.new_full((B, H, L), float("-inf")))
        round_lse = []
        for plan in plans:
            o, lse = blocks_forward(q_flat, k_flat, v_flat, plan)  # (B, H, Lp, Dv), (B, H, Lp): sorted slots
            out = _merge_sorted_into(out, o[:, :, :L], lse[:, :, :L], plan.pos)
            round_lse.append(lse)
        ctx.save_for_backward(q_flat, k_flat, v_flat, *out, *round_lse)
        ctx.plans = plans
        return out[0]

    @staticmethod
    def backward(ctx, grad):
        q_flat, k_flat, v_flat, out, lse, *round_lse = ctx.saved_tensors
        flats = q_flat, k_flat, v_flat
        grads = tuple(torch.zeros_like(t) for t in flats)
        flat_grad = grad.reshape(-1, grad.shape[-1])  # (B·H·L, Dv): rows as q_flat's
        row, total = -torch.linalg.vecdot(grad, out).reshape(-1), lse.reshape(-1)  # by row
        for plan, own_lse in zip(ctx.plans, round_lse, strict=True):
            start = 0
            for g in plan.groups:
                q_rows = plan.q_rows(g)  # (B, H, n, m)
                n, m = q_rows.shape[2:]
                own = own_lse[:, :, start:start + n * m].unflatten(2, (n, m))  # this round's lse
                start += n * m
                keep = (plan.qi[:, :, g] >= 0) & torch.isfinite(own)  # real queries with a key here
                scale = torch.where(keep, torch.exp(own - total[q_rows]), 0.0)  # round -> union
                add_group_grads(plan, g, q_rows, flats, grads, flat_grad[q_rows], row[q_rows], keep, scale)
        return *grads, None


def _merge_sorted_into(out, o, lse, pos):
    """merge_partials of ``out`` (by position) and a round's ``(o, lse)`` (sorted slots, ``pos``
    their positions), in place and without scattering the round first: no whole-size
    temporaries (autograd must not record it: it overwrites both)."""
    acc, acc_lse = out
    new = torch.logaddexp(acc_lse, lse.new_empty(lse.shape).scatter_(2, pos, lse))  # (B, H, L)
    safe = finite_or_zero(new)
    acc.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    weight = torch.exp(lse - safe.gather(2, pos)).unsqueeze(-1)  # (B, H, L, 1), sorted slots
    acc.scatter_add_(2, pos[..., None].expand_as(o), o.mul_(weight))
    return acc, new


class _Round:
    """One hash round as a plan for ``attend_blocks``' groups (``blocks_forward``,
    ``add_group_grads``): sorted chunks of queries, each seeing its chunk and the one before,
    with validity, the N_ij correction and the self penalty."""

    def __init__(self, r, q_buckets, k_buckets, q_order, k_order, q_code, k_code, key_mask, causal, opts):
        B, H, _, L = q_order.shape
        m = opts.bucket_size
        nc = -(-L // m)
        self.r, self.m, self.causal, self.opts, self.q_code, self.k_code = r, m, causal, opts, q_code, k_code
        self.pos = q_order[:, :, r]  # (B, H, L): the position in each sorted slot
        self.bh = torch.arange(B * H, device=q_order.device).view(B, H, 1, 1) * L  # row offsets
        self.qi = pad_to(q_order[:, :, r], nc * m, value=-1).view(B, H, nc, m)  # slot -> position, -1 pad
        kj = pad_to(k_order[:, :, r], (nc + 1) * m, front=m, value=-1)  # a padded chunk before chunk 0
        self.j_win = kj.unfold(2, 2 * m, m)  # (B, H, nc, 2m): keys of the chunk before and the chunk
        self.key_ok = None if key_mask is None else key_mask[:, None].expand(B, H, L)
        if not opts.attend_across_buckets:
            lo, hi = _bucket_slots(q_buckets[:, :, r], k_buckets[:, :, r], k_order[:, :, r], causal)
            self.lo, self.hi = (pad_to(_take_int(t, q_order[:, :, r]), nc * m).view(B, H, nc, m, 1)
                                for t in (lo, hi))
        group = max(1, SCORES_PER_CHUNK // (B * H * 2 * m * m))  # chunks a group: scores stay in cache
        self.groups = [slice(c, min(c + group, nc)) for c in range(0, nc, group)]

    def q_rows(self, cs):
        return self.bh + self.qi[:, :, cs].clamp(min=0)  # (B, H, n, m); padding reads row 0

    def k_rows(self, cs):
        return self.bh + self.j_win[:, :, cs].clamp(min=0)  # (B, H, n, 2m)

    def fused_forward(self, q_flat, k_flat, v_flat):
        """None: every chunk has its own validity, so attend_blocks' groups compute it."""
        return None

    def prepare(self, scores, cs):
        i, j = self.qi[:, :, cs, :, None], self.j_win[:, :, cs, None, :]  # (B, H, n, m, 1), (B, H, n, 1, 2m)
        m, opts = self.m, self.opts
        if opts.attend_across_buckets:
            valid = _valid(i, j, self.key_ok, self.causal)
        else:  # the query's bucket (up to itself if causal) is a run of window slots
            w = torch.arange(2 * m, device=scores.device) + (
                torch.arange(cs.start, cs.stop, device=scores.device).view(-1, 1, 1) - 1) * m  # (n, 1, 2m)
            valid = (w >= self.lo[:, :, cs]) & (w <= self.hi[:, :, cs])
            if self.key_ok is not None:
                valid = valid & _take_int(self.key_ok, j)
        if opts.count_duplicates and self.r > 0:  # the N_ij correction: each key counted once
            valid = valid & _met_earlier(i, j, self.r, self.q_code, self.k_code).logical_not_()
        if opts.shared_qk:  # a query's own key is slot m + a of its window (same order)
            scores[..., m:].diagonal(dim1=-2, dim2=-1).sub_(SELF_PENALTY)
        return valid


def _meeting_codes(q_buckets, k_buckets, q_order, k_order, m, opts):
    """(q_code, k_code), each (B, H, n_hashes, L): query and key meet in a round iff
    0 <= q_code − k_code <= 1. In int16 where the codes fit (a quarter of int64's bytes in
    the compares that count each key once), else int32.

    Across buckets the code is the position's chunk after sorting. Within buckets, with
    shared QK (one order) it is the sorted slot's segment: +1 at each new chunk, +2 at each
    new bucket, so the chunk before in the same bucket is one less and anything else
    differs by two or more; with separate orders it is the chunk plus the bucket times
    n_chunks + 1, more than any chunk difference.
    """
    L = q_order.shape[-1]
    if opts.shared_qk and not opts.attend_across_buckets:
        sorted_buckets = q_buckets.gather(-1, q_order)  # (B, H, n_hashes, L)
        new_chunk = (torch.arange(1, L, device=q_order.device) % m == 0).to(torch.long)  # (L - 1,)
        step = torch.where(sorted_buckets[..., 1:] != sorted_buckets[..., :-1], 2, new_chunk)
        codes = [_by_position(F.pad(step.cumsum(-1), (1, 0)), q_order)]
    else:
        slots = torch.arange(L, device=q_order.device)
        codes = [_by_position(slots // m, order) for order in (q_order, k_order)]  # chunks
        if not opts.attend_across_buckets:
            stride = -(-L // m) + 1  # n_chunks + 1
            codes = [c + b * stride for c, b in zip(codes, (q_buckets, k_buckets), strict=True)]
    small = torch.int16 if max(int(c.max()) for c in codes) < 2**15 else torch.int32
    codes = [c.to(small) for c in codes]
    return codes[0], codes[-1]


def _by_position(by_slot, order):
    """Values of the sorted slots, (B, H, n_hashes, L) or broadcast to it, put back by position."""
    return torch.empty_like(order).scatter_(-1, order, by_slot.expand_as(order))


def _gather_code(code, r, idx):
    """code (B, H, n_hashes, L) of round r at positions idx (B, H, ...) (-1 gives position 0)."""
    return _take_int(code[:, :, r], idx)


def _valid(i, j, key_ok, causal):
    """Which window keys a sorted query may attend, across buckets: real, unmasked, causal."""
    valid = j >= 0  # (B, H, n, 1, 2m)
    if key_ok is not None:
        valid = valid & _take_int(key_ok, j)
    if causal:
        valid = valid & (j <= i)
    return valid


def _bucket_slots(q_bucket, k_bucket, k_order, causal):
    """(lo, hi), each (B, H, L) by query position: the sorted key slots of the query's bucket
    (causal: only keys up to its position). Keys are sorted by (bucket, position), so they
    are one run of slots."""
    L = k_order.shape[-1]
    positions = torch.arange(L, device=k_order.device)
    k_sorted = torch.gather(k_bucket * L + positions, -1, k_order)  # ascending codes
    start = q_bucket * L
    lo = torch.searchsorted(k_sorted, start)
    end = start + positions if causal else start + L - 1  # the last code the query may see
    hi = torch.searchsorted(k_sorted, end, right=True) - 1
    return lo, hi


def _met_earlier(i, j, r, q_code, k_code):
    """(B, H, n, m, 2m) bool: whether query i and key j met in a round before r (a key met
    in several rounds is attended in the first, which is the paper's division by N_ij)."""
    met = None
    for t in range(r):
        d = _gather_code(q_code, t, i) - _gather_code(k_code, t, j)  # (B, H, n, m, 2m)
        in_t = d.bitwise_right_shift_(1) == 0  # d in {0, 1}
        met = in_t if met is None else met.logical_or_(in_t)
    return met


def _take_int(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, H, L) gathered at idx (B, H, ...) of any trailing shape (-1 = padding)."""
    flat = idx.clamp(min=0).reshape(*idx.shape[:2], -1)
    return torch.gather(t, 2, flat).view(idx.shape)


def lsh_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """Per round: hashing (2·L·D·b/2 for q, and for k unless shared) and the chunked scores and
    weighted values (2·Lp·2m·(D + Dv))."""
    L, m = Lq, opts.bucket_size
    b = n_buckets_for(L, opts)
    hashes = (1 if opts.shared_qk else 2) * 2.0 * L * D * (b // 2 if b > 1 else 0)
    chunks = 2.0 * (-(-L // m)) * m * 2 * m * (D + Dv)
    return B * H * opts.n_hashes * (hashes + chunks)


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


register(
    Mechanism(
        name="lsh",
        summary="angular LSH by random rotations, sort by bucket, attend within chunk and the one before",
        options=LSHOptions,
        fn=lsh_attention,
        reference=lsh_reference,
        capabilities=Capabilities(causal=True, cross=False, key_mask=True),
        time="O(n_hashes L bucket_size d + L log L)",
        memory="O(L bucket_size)",
        citation="Kitaev et al., Reformer: The Efficient Transformer, ICLR 2020",
        randomized=True,
        data_pattern=lsh_mask,
        flops=lsh_flops,
        layer_options=LSHLayerOptions,
    )
)
