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

from attnzoo import _native
from attnzoo._pages import fresh_empty, fresh_like
from attnzoo.mechanisms._common import (
    LOG2E,
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
    (max over hits of weights b/2 − c), several times faster on the CPU than argmax; where
    the native kernels run, in C from (xR)ᵀ, whose reductions run across positions in vector
    lanes (:func:`attnzoo._native.lsh_buckets`).
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
    buffer = x.new_empty(B * H * min(rows, L) * R * half)  # one for every block (a fresh one faults in)
    lib = _native.lsh_kernels(x)
    for s in range(0, L, rows):
        n = min(rows, L - s)
        if lib is not None:  # in C, from (xR)ᵀ: the reductions run across positions, in vector lanes
            rotated = buffer[:B * H * n * R * half].view(B, H, R * half, n)
            torch.matmul(every_round.t(), x[:, :, s:s + n].transpose(-1, -2), out=rotated)
            _native.lsh_buckets(lib, rotated.view(B, H, R, half, n), out, s)
            continue
        rotated = buffer[:B * H * n * R * half].view(B, H, n, R, half)  # (B, H, n, R, b/2)
        torch.matmul(x[:, :, s:s + n], every_round, out=rotated.flatten(-2))
        top, low = rotated.amax(-1, keepdim=True), rotated.amin(-1, keepdim=True)
        positive = top >= -low  # (B, H, rows, R, 1): the maximum is in the xR half
        first = half - rotated.eq_(torch.where(positive, top, low)).mul_(earlier).amax(-1)
        out[..., s:s + n] = (first.long() + half * positive.squeeze(-1).logical_not()).transpose(-1, -2)
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
    q_buckets = hash_buckets(q, rotations)
    k_buckets = q_buckets if opts.shared_qk else hash_buckets(k, rotations)
    q_order = _order(q_buckets, b)
    k_order = q_order if opts.shared_qk else _order(k_buckets, b)
    return q_buckets, k_buckets, q_order, k_order


def _order(buckets, n_buckets):
    """Positions sorted by bucket, stably (by position within a bucket), along the last dim:
    a counting sort in C where it runs, else torch's sort."""
    order = _native.lsh_order(buckets, n_buckets)
    return torch.sort(buckets, dim=-1, stable=True)[1] if order is None else order


def _meets(q_chunk_r, k_chunk_r, q_bucket_r, k_bucket_r, across: bool) -> torch.Tensor:
    """Whether query and key meet in a round: key's chunk is the query's or the one before."""
    met = (k_chunk_r <= q_chunk_r) & (k_chunk_r >= q_chunk_r - 1)
    return met if across else met & (k_bucket_r == q_bucket_r)


def _keys_of(q, k, opts):
    _check_shared(q, k, opts)
    return F.normalize(q, dim=-1) if opts.shared_qk else k


def _check_shared(q, k, opts):
    if opts.shared_qk and k is not q and not torch.equal(k, q):
        raise ValueError("lsh: shared_qk=True makes the keys q/‖q‖; pass k=q")


def lsh_attention(q, k, v, opts=LSHOptions(), *, causal=False, key_mask=None, scale=None,
                  generator=None):
    """Softmax over the keys met in any hash round: same chunk or the one before after sorting
    by (bucket, position), same bucket unless ``attend_across_buckets``.

    Shapes: q, k (B, H, L, D), v (B, H, L, Dv) -> (B, H, L, Dv); self-attention only.
    Cost O(n_hashes·L·bucket_size·D) time (plus n_hashes(n_hashes − 1)·L·bucket_size
    compares for counting each key once) and O(L·(D + Dv) + GROUP_SCORES) memory: each
    round runs over groups of its sorted chunks; a group gathers its queries and the keys
    and values of their windows into reused buffers, computes its scores in cache (in
    base 2, with the keys out of reach penalised) and merges into the output's running
    log-sum-exp. The sort is O(L log L) (a counting sort, O(L + b), where the native
    kernels run). No L×L tensor.
    Choices: rotations are shared by batch and heads; chunk 0 has no chunk before it (no
    wrap-around); with ``shared_qk`` a query's own key scores −1e5, so it is attended only
    when nothing else is, as in the paper.
    Without gradients (float32 or float64 on the CPU) the rounds run in C
    (:func:`attnzoo._native.lsh`): the same softmax over the same keys.
    """
    _check_shared(q, k, opts)
    B, H, L, D = q.shape
    hashed = _buckets_and_order(q, k, opts, generator)  # (shared QK hashes q alone)
    codes = None
    if opts.count_duplicates and opts.n_hashes > 1:
        codes = _meeting_codes(*hashed, opts.bucket_size, opts)
    out = _native.lsh(q, k, v, hashed, codes, key_mask, causal, opts.shared_qk, opts.attend_across_buckets,
                      opts.bucket_size, softmax_scale(q, scale) * LOG2E, SELF_PENALTY * LOG2E)
    if out is not None:  # (without gradients: every round in C, the keys q/‖q‖ scaled as gathered)
        return out
    keys = _keys_of(q, k, opts)
    dtype = wide(q).dtype
    plans = [_Round(r, *hashed, codes, key_mask, causal, opts, dtype, softmax_scale(q, scale))
             for r in range(opts.n_hashes)]
    flat_q = wide(q).reshape(B * H * L, D)  # half precision: float32 inside; scaled when gathered
    flat_k, flat_v = wide(keys).reshape(B * H * L, D), wide(v).reshape(B * H * L, -1)
    return _Rounds.apply(flat_q, flat_k, flat_v, plans).to(q.dtype)


GROUP_SCORES = 2**19  # scores a group of chunks: with its buffers about the L2 caches (2^20: 5-10 % slower)
OUT_OF_REACH = 2.0**60  # score penalty per reason a key is out of a query's reach: exp(−2^59) is 0


class _Round:
    """One hash round in sorted slot space: a padding chunk, then per batch and head the
    round's nc chunks of m sorted slots (the last padded); S = (1 + B·H·nc)·m slots in all.
    Query chunk f sees key slots [(f − 1)m, (f + 1)m): its chunk and the one before (a
    head's first chunk sees the chunk before it in the layout, and none of its keys). A group
    of chunks gathers its rows in this order, so that its chunks and their windows are
    strided views and its scores one batched matmul.

    Which keys a query may attend is added to the scores as −OUT_OF_REACH × (the number of
    reasons it may not), a sum of float terms per (query slot, window slot), 0 or ≥ 1 in all,
    exactly (multiples of 1/4): float passes are vectorised on the CPU, bool compares not.
    """

    def __init__(self, r, q_buckets, k_buckets, q_order, k_order, codes, key_mask, causal, opts, dtype,
                 scale):
        B, H, _, L = q_order.shape
        m = self.m = opts.bucket_size
        nc = -(-L // m)
        self.shared, self.scale = opts.shared_qk, scale
        self.pos = q_order[:, :, r]  # (B, H, L): the position in each sorted slot
        q_pos = _slotted(self.pos, m, nc, -1)  # (S,): position of each query slot, -1 padding
        k_pos = q_pos if k_order is q_order else _slotted(k_order[:, :, r], m, nc, -1)
        first_row = _slotted((torch.arange(B * H, device=q_pos.device) * L).view(B, H, 1).expand(B, H, L),
                             m, nc, 0)
        self.q_rows = first_row + q_pos.clamp(min=0)  # (S,) rows of (B·H·L, D); padding reads row 0
        self.k_rows = self.q_rows if k_pos is q_pos else first_row + k_pos.clamp(min=0)
        self.q_real = q_pos >= 0
        self.out_rows = torch.where(self.q_real, self.q_rows, B * H * L)  # padding: a spare row after all
        n_chunks = 1 + B * H * nc
        group = max(1, GROUP_SCORES // (2 * m * m))  # chunks a group
        self.groups = [(a, min(a + group, n_chunks)) for a in range(1, n_chunks, group)]
        self.codes = [] if codes is None else _earlier_codes(codes, r, self.pos, k_order[:, :, r], m, nc,
                                                             dtype)
        self.K = 2.25 * len(self.codes)  # each earlier round's term (:meth:`reasons`) takes up to 9/4 off
        self.center = self.k_pos = self.window_bad = None
        if not opts.attend_across_buckets:  # the query's bucket (up to itself if causal): a run of slots
            lo, hi = (t.gather(2, self.pos) for t in _bucket_slots(
                q_buckets[:, :, r], k_buckets[:, :, r], k_order[:, :, r], causal, n_buckets_for(L, opts),
                shared=k_order is q_order))
            start = (torch.arange(L, device=lo.device) // m - 1) * m  # window start of each slot's chunk
            lo, hi = ((t - start).clamp_(-1, 2 * m).to(dtype) for t in (lo, hi))  # in window slots; a
            # head's first chunk has lo >= m: none of the keys before it, another head's, are in the run
            self.w = torch.arange(2 * m, dtype=dtype, device=lo.device)
            self.center = _slotted((lo + hi) / 2, m, nc, 0)
            self.half = _slotted((hi - lo) / 2 - self.K, m, nc, -1 - self.K)  # padding: no slot
        elif causal:
            exact = _exact(dtype, L + self.K)
            self.k_pos, self.q_pos = k_pos.to(exact), (q_pos - self.K).to(exact)
        if key_mask is not None or opts.attend_across_buckets:  # (within buckets padding is out of the run)
            ok = torch.ones_like(k_pos, dtype=torch.bool) if key_mask is None else _slotted(
                key_mask[:, None].expand(B, H, L).gather(2, k_order[:, :, r]), m, nc, False)
            bad = (ok & (k_pos >= 0)).logical_not_().to(dtype).unfold(0, 2 * m, m).clone()  # (S/m − 1, 2m)
            bad.view(B * H, nc, 2 * m)[:, 0, :m] = 1.0  # a head's first chunk: the keys before are another's
            self.window_bad = bad  # row f − 1: 1 where query chunk f's window slot holds no key it may see

    def rows(self, t, a, b):
        """Slots of query chunks a..b−1 of t (S, X) or (S,): (n, m, X) or (n, m, 1)."""
        return t[a * self.m:b * self.m].view(b - a, self.m, -1)

    def window(self, t, a, b):
        """Key slots those chunks see, of t (S, X): (n, 2m, X) (a strided view); of t (S,): (n, 1, 2m)."""
        m = self.m
        w = t[(a - 1) * m:b * m].unfold(0, 2 * m, m)  # (n, X, 2m) or (n, 2m)
        return w.transpose(1, 2) if t.dim() == 2 else w.unsqueeze(1)

    def gather(self, flats, a, b, scratch):
        """Query chunks a..b−1 of q (and of the output's gradient) and the windows they see of
        k and v, gathered from ``flats`` = (q, k, v[, g]) rows (B·H·L, X) into the scratch
        buffers (in cache; whole-round copies would be faulted in afresh at every call):
        q_c (n, m, D) (scaled here, by scale·log2 e), k_w (n, 2m, D), v_w (n, 2m, Dv)[, g_c (n, m, Dv)],
        windows as views."""
        m, n = self.m, b - a
        q_idx, k_idx = self.q_rows[a * m:b * m], self.k_rows[(a - 1) * m:b * m]
        out = []
        for t, idx, buf in zip(flats, (q_idx, k_idx, k_idx, q_idx), scratch.rows, strict=False):
            got = torch.index_select(t, 0, idx, out=buf[:idx.shape[0]])
            out.append(got.view(n, m, -1) if idx is q_idx else got.unfold(0, 2 * m, m).transpose(1, 2))
        out[0].mul_(self.scale * LOG2E)  # scores in base 2: exp2 is several times faster than exp here
        return out

    def scores(self, q_c, k_w, a, b, scratch):
        """(n, m, 2m) scores of query chunks a..b−1 against their windows, penalised, in
        ``scratch.scores``: the product is added onto −OUT_OF_REACH × the reasons by one
        ``baddbmm_`` (its beta), so the penalty costs no pass of its own."""
        n = b - a
        reasons = self.reasons(a, b, scratch.scores[:n], scratch.met[:n])
        k_t = k_w.transpose(1, 2)
        if reasons is None:
            scores = torch.bmm(q_c, k_t, out=scratch.scores[:n])
        else:
            scores = reasons.baddbmm_(q_c, k_t, beta=-OUT_OF_REACH)
        if self.window_bad is not None:
            scores.add_(self.window_bad[a - 1:b - 1].unsqueeze(1), alpha=-OUT_OF_REACH)
        if self.shared:  # a query's own key is slot m + i of its window (one order)
            scores[..., self.m:].diagonal(dim1=-2, dim2=-1).sub_(SELF_PENALTY * LOG2E)  # (base 2)
        return scores

    def reasons(self, a, b, out, met_out):
        """(n, m, 2m) in ``out``, or None (every key in reach): the number of reasons a key is
        out of reach (its bucket's run, causality, the earlier rounds that met it), 0 where
        it is in reach and >= 1 where not. Built as K + (how far out of the bucket's run, or
        in the future), less one term per earlier round, d² with d = q_code − 1/2 − k_code
        clipped to ±1.5: 1/4 where they met in that round, else 9/4 (K = 9/4 per round)."""
        rows, window = (lambda t: self.rows(t, a, b)), (lambda t: self.window(t, a, b))
        reasons = None
        if self.center is not None:
            reasons = torch.sub(self.w, rows(self.center), out=out).abs_().sub_(rows(self.half))
            reasons.clamp_(min=self.K)
        elif self.k_pos is not None:
            reasons = torch.sub(window(self.k_pos), rows(self.q_pos), out=out).clamp_(min=self.K)
        elif self.codes:
            reasons = out.fill_(self.K)
        for q_code, k_code in self.codes:
            d = torch.sub(rows(q_code), window(k_code), out=met_out).clamp_(-1.5, 1.5)
            reasons.addcmul_(d, d, value=-1.0)
        return reasons


def _slotted(by_slot, m, nc, fill):
    """(B, H, L) values of the sorted slots -> (S,): a padding chunk, then per head the slots
    padded to nc·m."""
    return F.pad(pad_to(by_slot, nc * m, value=fill).reshape(-1), (m, 0), value=fill)


def _exact(dtype, largest):
    """``dtype``, or float64 where it would not hold the integers and halves up to ``largest``."""
    return dtype if largest < 1 / torch.finfo(dtype).eps else torch.float64  # halves exact below 2^nmant


def _earlier_codes(codes, r, q_order_r, k_order_r, m, nc, dtype):
    """[(q_code − 1/2, k_code) of round t at round r's slots, (S,) each, for t < r]: the query
    and key met in round t iff |q_code − 1/2 − k_code| = 1/2 (see :func:`_meeting_codes`)."""
    q_code, k_code = codes
    exact = _exact(dtype, max(int(q_code.max()), int(k_code.max())) + 1)
    return [(_slotted(q_code[:, :, t].gather(2, q_order_r), m, nc, 0).to(exact).sub_(0.5),
             _slotted(k_code[:, :, t].gather(2, k_order_r), m, nc, 0).to(exact)) for t in range(r)]


class _Scratch:
    """A group's buffers, reused by every group and round: (group, m, 2m) ones for its passes
    over the scores, and ``rows``, one for each of ``flats``' gathered rows (queries: group·m,
    keys and values: (group + 1)·m). Fresh ones are faulted in from the OS each time (~1 ms
    per 4 MiB on this CPU, as much as the passes themselves)."""

    def __init__(self, plan, flats, names):
        a, b = plan.groups[0]  # the largest group
        n, m, like = b - a, plan.m, flats[0]
        for name in names:
            setattr(self, name, like.new_empty(n, m, 2 * m))
        self.rows = [like.new_empty((n + (i in (1, 2))) * m, t.shape[-1]) for i, t in enumerate(flats)]


class _Rounds(torch.autograd.Function):
    """The hash rounds, each by groups of sorted chunks, merged in place into one softmax over
    the union of their keys. The backward recomputes every round's weights against the merged
    log-sum-exp (flash attention's backward over the union), so no round's output is kept and
    the gradients accumulate in one set of tensors."""

    @staticmethod
    def forward(ctx, q_flat, k_flat, v_flat, plans):
        B, H, L = plans[0].pos.shape
        acc = fresh_empty(B * H * L + 1, v_flat.shape[-1], like=q_flat)  # by row, and a spare row for padding
        acc_lse = q_flat.new_empty(B * H * L + 1)  # its log-sum-exp, base 2
        flats = q_flat, k_flat, v_flat
        scratch = _Scratch(plans[0], flats, ("scores", "met"))
        scratch.o = v_flat.new_empty(scratch.rows[0].shape[0], v_flat.shape[-1])  # a group's output
        for r, plan in enumerate(plans):
            _round_forward(plan, flats, acc, acc_lse, scratch, first=r == 0)
        out, lse = acc[:-1], acc_lse[:-1]
        empty = lse < -OUT_OF_REACH / 4  # every key out of reach in every round: no output
        if bool(empty.any()):
            out.masked_fill_(empty.unsqueeze(-1), 0.0)
            lse.masked_fill_(empty, float("-inf"))
        ctx.save_for_backward(q_flat, k_flat, v_flat, out, lse)
        ctx.plans = plans
        return out.view(B, H, L, -1)

    @staticmethod
    def backward(ctx, grad):
        q_flat, k_flat, v_flat, out, lse = ctx.saved_tensors
        grads = fresh_like(q_flat, k_flat, v_flat, zero=True)
        flat_grad = grad.reshape(-1, grad.shape[-1])  # (B·H·L, Dv): rows as q_flat's
        row = -torch.linalg.vecdot(flat_grad, out)  # by row
        total = torch.where(torch.isfinite(lse), lse, float("inf"))  # (base 2) no key: no weight
        flats = q_flat, k_flat, v_flat, flat_grad
        scratch = _Scratch(ctx.plans[0], flats, ("scores", "met", "ds"))
        scratch.dq, scratch.dk, scratch.dv = (torch.empty_like(buf) for buf in scratch.rows[:3])  # a group's
        for plan in ctx.plans:
            shift = torch.where(plan.q_real, total[plan.q_rows], float("inf"))  # (S,): padding gets none
            _round_backward(plan, flats, grads, row[plan.q_rows], shift, scratch)
        return *grads, None


def _round_forward(plan, flats, acc, acc_lse, scratch, first):
    """One round's partial softmax, group by group, merged into ``acc`` (B·H·L + 1, Dv) and its
    log-sum-exp ``acc_lse`` (base 2) by row, in place (the first round writes them). Where
    every key is out of reach the lse is about −OUT_OF_REACH: such a part gets no weight."""
    m = plan.m
    for a, b in plan.groups:
        n = b - a
        q_c, k_w, v_w = plan.gather(flats, a, b, scratch)
        scores = plan.scores(q_c, k_w, a, b, scratch)  # (n, m, 2m), base 2
        top = scores.amax(-1, keepdim=True)  # (n, m, 1)
        weights = scores.sub_(top).exp2_()  # unnormalised: the largest is 1
        total = weights.sum(-1, keepdim=True)  # (n, m, 1)
        o = torch.bmm(weights, v_w, out=scratch.o[:n * m].view(n, m, -1)).div_(total).flatten(0, 1)
        lse = top.add_(total.log2_()).view(-1)  # (n·m,)
        rows = plan.out_rows[a * m:b * m]  # (padding: the spare row)
        if first:
            acc.index_copy_(0, rows, o)
            acc_lse.index_copy_(0, rows, lse)
        else:
            _merge_rows(acc, acc_lse, rows, o, lse)


def _round_backward(plan, flats, grads, row, shift, scratch):
    """Adds one round's share to ``grads`` = (dq, dk, dv), rows like ``flats`` = (q, k, v, g),
    group by group: the weights of the union's softmax recomputed as 2^(scores − ``shift``)
    (S,) (its log-sum-exp in base 2; +inf: none), then d scores = p ⊙ (g vᵀ + row)
    (``row`` (S,))."""
    m = plan.m
    for a, b in plan.groups:
        n = b - a
        q_c, k_w, v_w, g_c = plan.gather(flats, a, b, scratch)
        p = plan.scores(q_c, k_w, a, b, scratch).sub_(plan.rows(shift, a, b)).exp2_()  # (n, m, 2m)
        ds = torch.bmm(g_c, v_w.transpose(1, 2), out=scratch.ds[:n]).add_(plan.rows(row, a, b)).mul_(p)
        dq = torch.bmm(ds, k_w, out=scratch.dq[:n * m].view(n, m, -1)).mul_(plan.scale)  # (q unscaled)
        grads[0].index_add_(0, plan.q_rows[a * m:b * m], dq.flatten(0, 1))  # (an alpha: 3x slower here)
        for d, weights, by, grad, factor in ((scratch.dk, ds, q_c, grads[1], 1 / LOG2E),  # (q_c in base 2)
                                             (scratch.dv, p, g_c, grads[2], 1.0)):
            d = d[:(n + 1) * m]  # (n + 1)·m key rows: the chunk before the group's first, and its chunks
            torch.bmm(weights[..., :m].transpose(1, 2), by, out=d[:n * m].view(n, m, -1))  # the chunk before
            d[n * m:].zero_()
            d[m:].view(n, m, -1).baddbmm_(weights[..., m:].transpose(1, 2), by)  # the chunk itself
            grad.index_add_(0, plan.k_rows[(a - 1) * m:b * m], d if factor == 1 else d.mul_(factor))


def _merge_rows(acc, acc_lse, rows, o, lse):
    """merge_partials, in base 2, of ``acc``'s ``rows`` and a group's ``(o (R, Dv), lse (R,))``
    over other keys, in place (autograd must not record it: it overwrites both)."""
    old = acc_lse.index_select(0, rows)  # (R,)
    new = torch.logaddexp2(old, lse)
    merged = acc.index_select(0, rows).mul_(torch.exp2(old - new).unsqueeze(-1))
    merged.addcmul_(o, torch.exp2(lse - new).unsqueeze(-1))
    acc.index_copy_(0, rows, merged)
    acc_lse.index_copy_(0, rows, new)


def _meeting_codes(q_buckets, k_buckets, q_order, k_order, m, opts):
    """(q_code, k_code), each (B, H, n_hashes, L): query and key meet in a round iff
    0 <= q_code − k_code <= 1. In int16 where the codes fit, else int32 (compact: each round
    gathers the earlier rounds' codes into its slots as float terms, :func:`_earlier_codes`).

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




def _bucket_slots(q_bucket, k_bucket, k_order, causal, n_buckets, shared):
    """(lo, hi), each (B, H, L) by query position: the sorted key slots of the query's bucket
    (causal: only keys up to its position). Keys are sorted by (bucket, position), so they
    are one run of slots: it starts after the keys of the buckets before (counted), and it
    ends where the bucket does, or, causal, at the query's own slot when queries and keys
    share one order (``shared``), else after its last key up to the query (searched)."""
    B, H, L = k_order.shape
    counts = k_order.new_zeros(B, H, n_buckets).scatter_add_(2, k_bucket, torch.ones_like(k_bucket))
    lo = (counts.cumsum(2) - counts).gather(2, q_bucket)  # keys in the buckets before
    if not causal:
        return lo, lo + counts.gather(2, q_bucket) - 1
    positions = torch.arange(L, device=k_order.device)
    if shared:
        return lo, torch.empty_like(k_order).scatter_(2, k_order, positions.expand_as(k_order))
    k_sorted = torch.gather(k_bucket * L + positions, -1, k_order)  # ascending codes
    return lo, torch.searchsorted(k_sorted, q_bucket * L + positions, right=True) - 1




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
