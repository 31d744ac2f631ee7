"""LSH attention on the CPU: overrides of :mod:`attnzoo.mechanisms.lsh`'s operations.

- ``lsh_buckets``: the hash by blocks of positions that keep the rotated block in cache, its
  first maximum found in C from (xR)ᵀ (the reductions run across positions, in vector lanes),
  or, without the native kernels, by vectorised reductions instead of an argmax.
- ``lsh_order``: a counting sort in C, O(L + b) a row.
- ``lsh_attend``: without gradients, every round in C (:func:`attnzoo.backends.cpu.native.lsh`);
  otherwise the rounds by groups of sorted chunks gathered into reused buffers, their scores
  in cache (in base 2, with the keys out of a query's reach penalised rather than masked),
  merged in place into one running log-sum-exp, with a backward that recomputes each round's
  weights against the merged log-sum-exp instead of keeping them. Each key counts once by
  meeting codes (:func:`_meeting_codes`): a round penalises the keys its queries met in an
  earlier round.

Each returns NotImplemented off the CPU (the hash where x is not finite, the sort where the kernels
cannot run, the rounds where a key or a value is not finite), and the portable body runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo.backends.cpu import native
from attnzoo.backends.cpu.fused import LOG2E
from attnzoo.backends.cpu.memory import fresh_empty, fresh_like
from attnzoo.mechanisms._softmax import all_finite, wide
from attnzoo.mechanisms.lsh import SELF_PENALTY, hashable, n_buckets_for
from attnzoo.ops import override

HASH_BLOCK = 2**20  # rotated values computed at a time while hashing: the block stays in cache


@override("lsh_buckets")
def hash_buckets(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """argmax([xR; −xR]) by blocks of positions (each block's rotated values stay in cache), in
    C where the native kernels run, else by reductions (:func:`_hash_by_reductions`). Neither finds
    the maximum of a row holding a nan (its bucket would be b, out of range, where argmax gives the
    nan's index): x that is not finite goes to the portable hash."""
    if x.device.type != "cpu" or rotations.shape[-1] == 0 or not all_finite(x):
        return NotImplemented
    x, rotations = hashable(x, rotations)
    B, H, L, _ = x.shape
    R, half = rotations.shape[0], rotations.shape[-1]
    every_round = rotations.permute(1, 0, 2).reshape(-1, R * half)  # (D, R·b/2): one matmul a block
    out = torch.empty(B, H, R, L, dtype=torch.long, device=x.device)
    rows = max(1, HASH_BLOCK // (B * H * R * half))  # positions a block
    buffer = x.new_empty(B * H * min(rows, L) * R * half)  # one for every block (a fresh one faults in)
    lib = native.lsh_kernels(x)
    for s in range(0, L, rows):
        block = x[:, :, s:s + rows]  # (B, H, n, D)
        rotated = buffer[:block.shape[:3].numel() * R * half]
        if lib is None:
            out[..., s:s + rows] = _hash_by_reductions(block, every_round, rotated, half)
            continue
        n = block.shape[2]  # in C, from (xR)ᵀ
        torch.matmul(every_round.t(), block.transpose(-1, -2), out=rotated.view(B, H, R * half, n))
        native.lsh_buckets(lib, rotated.view(B, H, R, half, n), out, s)
    return out


def _hash_by_reductions(x, every_round, buffer, half):
    """(B, H, n, D) -> (B, H, R, n): argmax([xR; −xR]) as the first c with xR_c = max(xR) where
    max(xR) >= −min(xR), else b/2 + the first c with xR_c = min(xR): the same first-maximum tie
    rule without building the concatenation, the first index found as the max over hits of the
    weights b/2 − c (vectorised reductions, where argmax is not). xR is written into ``buffer``."""
    B, H, n, _ = x.shape
    rotated = buffer.view(B, H, n, -1, half)  # (B, H, n, R, b/2)
    torch.matmul(x, every_round, out=rotated.flatten(-2))
    earlier = torch.arange(half, 0, -1, dtype=x.dtype, device=x.device)  # b/2 − c: larger for earlier c
    top, low = rotated.amax(-1, keepdim=True), rotated.amin(-1, keepdim=True)
    positive = top >= -low  # (B, H, n, R, 1): the maximum is in the xR half
    first = half - rotated.eq_(torch.where(positive, top, low)).mul_(earlier).amax(-1)
    return (first.long() + half * positive.squeeze(-1).logical_not()).transpose(-1, -2)


@override("lsh_order")
def bucket_order(buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """The stable sort by a counting sort in C (None from it: a bucket out of range, or no kernels)."""
    order = native.lsh_order(buckets, n_buckets)
    return NotImplemented if order is None else order


@override("lsh_attend")
def attend_rounds(q, k, v, hashed, key_mask, causal, opts, scale):
    """The rounds in C without gradients, else by :class:`_Rounds` (on the CPU, any float dtype).
    Both penalise the scores of keys out of a query's reach and weigh their values by 0, so a nan
    or an inf there would reach queries that do not see it: not for keys or values that are not
    finite."""
    if q.device.type != "cpu" or not all_finite(q if opts.shared_qk else k, v):
        return NotImplemented
    codes = None
    if opts.count_duplicates and opts.n_hashes > 1:
        codes = _meeting_codes(*hashed, opts.bucket_size, opts)
    out = native.lsh(q, k, v, hashed, codes, key_mask, causal, opts.shared_qk, opts.attend_across_buckets,
                     opts.bucket_size, scale * LOG2E, SELF_PENALTY * LOG2E)
    if out is not None:  # (the keys q/‖q‖ scaled as gathered)
        return out
    B, H, L, D = q.shape
    keys = F.normalize(q, dim=-1) if opts.shared_qk else k
    plans = [_Round(r, *hashed, codes, key_mask, causal, opts, wide(q).dtype, scale)
             for r in range(opts.n_hashes)]
    flat_q = wide(q).reshape(B * H * L, D)  # half precision: float32 inside; scaled when gathered
    flat_k, flat_v = wide(keys).reshape(B * H * L, D), wide(v).reshape(B * H * L, -1)
    return _Rounds.apply(flat_q, flat_k, flat_v, plans).to(q.dtype)


GROUP_SCORES = 2**19  # scores a group of chunks: with its buffers, about the size of the L2 caches
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
        out[0].mul_(self.scale * LOG2E)  # scores in base 2: exp2 is cheaper than exp on the CPU
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
    return F.pad(F.pad(by_slot, (0, nc * m - by_slot.shape[-1]), value=fill).reshape(-1), (m, 0), value=fill)


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
    keys and values: (group + 1)·m): fresh ones a group would be faulted in from the OS each
    time, costing as much as the passes over them."""

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
        grads[0].index_add_(0, plan.q_rows[a * m:b * m], dq.flatten(0, 1))  # (scaled above: alpha is slower)
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
