"""Pieces the sparse mechanisms share: partial softmaxes and their merge, blocked windows,
and the position frame that lets a self-attention pattern take Lq != Lk.

A *partial* is ``(o, lse)``: the softmax-weighted average ``o (B, H, Lq, Dv)`` of
the values over some set of keys and the log-sum-exp ``lse (B, H, Lq)`` of the
scores over that set (-inf where the set is empty). Two partials over disjoint
key sets merge exactly into the softmax over their union; this is how the
factorized patterns combine their parts and how LSH combines hash rounds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from attnzoo._pages import Scratch, fresh_as, fresh_empty, fresh_like

LOG2E = 1.0 / math.log(2.0)


def exp_(t: torch.Tensor) -> torch.Tensor:
    """e^t in place (callers pass a fresh tensor); in float32 and float64 as 2^(t·log2 e).

    On the benchmark's CPU torch's float32 ``exp`` is fast where its results are normal (28 µs
    a MiB for t in [−10, 0], against 48 for this), but far slower where they are subnormal or 0
    (t < −87.3): 1.7 ms a MiB for t in [−100, 0] against 0.43 ms here, 277 against 112 µs with
    1 % of t at −100. The softmax weights of far keys land there, so this keeps exp2 (where
    the input can be floored first, exp is faster: linear's elu + 1).
    The price is the rounding of t·log2 e: ≤ |t|·6e-8 relative in float32
    (6e-7 at |t| = 10), ~1e-16·|t| in float64. Half precision takes ``exp_`` itself: there
    the product's rounding (|t|·2^-9 in float16) would cost more than the dtype loses anyway.
    """
    if t.dtype in (torch.float32, torch.float64):
        return t.mul_(LOG2E).exp2_()
    return t.exp_()


def needs_grad(*ts: torch.Tensor) -> bool:
    """Whether autograd will differentiate through any of ``ts`` here."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def given_on_device(mechanism: str, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, a tensor the user gave as an option, once checked to be on the inputs' device (a
    clear error, where moving it would hide a copy in every call)."""
    if t.device != like.device:
        raise ValueError(f"{mechanism}: {name} is on {t.device} but the inputs are on {like.device}")
    return t


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def scaled(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q·scale, or q itself for scale 1 (callers that share q scale it once and pass 1); without
    autograd, contiguous, in huge pages where it is large (:func:`~attnzoo._pages.fresh_empty`)."""
    return q if scale == 1.0 else fresh_product(q, scale)


def fresh_product(a: torch.Tensor, b) -> torch.Tensor:
    """a·b, b a number or broadcasting to a's shape: under autograd as torch makes it; without,
    contiguous, into :func:`~attnzoo._pages.fresh_empty` memory (huge pages where it is large)."""
    if needs_grad(a, *([b] if isinstance(b, torch.Tensor) else [])):
        return a * b
    return torch.mul(a, b, out=fresh_empty(*a.shape, like=a))


def fresh_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for a (..., n, k) and b (..., k, p) of the same batch shape: under autograd as torch
    makes it; without, into :func:`~attnzoo._pages.fresh_empty` memory, from blocks kept
    already faulted in where it is a MiB or more. nystrom's pseudo-inverse, 22 products of 2 MiB
    a forward (m = 256, 8 heads), took ~2k page faults a forward from glibc's heap."""
    if needs_grad(a, b):
        return a @ b
    return torch.matmul(a, b, out=fresh_empty(*a.shape[:-1], b.shape[-1], like=a))


def finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ±inf and nan replaced by 0: a safe shift for rows or blocks with no real key."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def wide(t: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 up to float32 (softmax and its sums accumulate there); others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def partial_softmax(scores: torch.Tensor, valid: torch.Tensor | None, v: torch.Tensor):
    """Softmax of ``scores (..., R, n)`` over the ``valid`` keys, applied to ``v (..., n, Dv)``.

    Returns ``(o (..., R, Dv), lse (..., R))``, in float32 for half-precision inputs; rows
    with no valid key give o = 0, lse = -inf. ``scores`` is overwritten (callers pass a
    fresh tensor). The weights p come from torch's fused softmax kernel, several times
    faster on the CPU than an ``exp_`` pass (above all over masked -inf scores), and the
    log-sum-exp from the largest weight: max p = exp(m − lse), m the row's largest score.
    """
    scores, v = wide(scores), wide(v)
    if valid is not None:
        _mask_invalid_(scores, valid)
    m = scores.detach().amax(-1, keepdim=True)  # (..., R, 1)
    empty = _empty_rows(m)
    if empty is not None:  # a row of -inf has softmax nan: give it zeros, then o = 0, lse = -inf
        scores = scores.masked_fill_(empty, 0.0)
    p = torch.softmax(scores, -1)
    o, lse = p @ v, _LogSumExp.apply(scores, p, m)  # (..., R, Dv), (..., R, 1)
    if empty is not None:
        o, lse = o.masked_fill(empty, 0.0), lse.masked_fill(empty, float("-inf"))
    return o, lse.squeeze(-1)


def fused_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                  scale: float = 1.0):
    """:func:`partial_softmax` of the scores q·kᵀ·``scale`` (by default q taken as scaled) by
    torch's fused CPU kernel, which keeps no weights; for a forward without autograd, or under
    :class:`FewQueries` (the kernel's backward takes no gradient of lse, and merging partials
    gives lse one).

    q (B, H, R, D), k (B, H, n, D), v (B, H, n, D) (the kernel needs Dv = D), ``valid`` (R, n)
    bool, the same for every batch and head, or (B, H, R, n), or None (every key). Returns
    ``(o (B, H, R, D), lse (B, H, R))``; rows with no valid key give o = 0, lse = -inf (the
    kernel itself would give lse 0).
    """
    mask = None
    if valid is not None:
        mask = minus_inf_where_not_(torch.zeros(valid.shape, dtype=q.dtype, device=q.device), valid)
        mask = mask[None, None] if mask.dim() == 2 else mask
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask,
                                                                       scale=scale)[:2]
    if valid is not None:
        empty = ~valid.any(-1)  # (R,) or (B, H, R)
        if bool(empty.any()):
            o, lse = o.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return o, lse


def fused_kernel_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`fused_partial` (and the fused band forward) can run: on the CPU, float32
    or float64, Dv = D, each last dimension of stride 1 (the kernel reads rows as dense: given
    a strided one it computed wrong answers, where the public SDPA copies first)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and v.shape[-1] == q.shape[-1] and all(t.stride(-1) == 1 for t in (q, k, v)))


KEY_BLOCK = 512  # keys per block of FewQueries' backward: (B, H, m, 512) products, 4 MiB at m = 256


class FewQueries(torch.autograd.Function):
    """softmax(Q Kᵀ·s) V for m queries over Lk >> m keys, over the keys ``valid`` (B, H, m, Lk)
    or (B, 1, 1, Lk) bool allows (None: every key): the native kernel's forward where it runs
    (:func:`_few_queries_native`), else :func:`fused_partial`'s, each returning the
    log-sum-exp too, and the native backward where it runs (the same blocks in C,
    :func:`attnzoo._native.few_queries_grad`: nystrom's at L = 4096, 8 heads, 43.5 -> 28.4 ms
    a training step), else one in torch over blocks of KEY_BLOCK keys, each block's
    P = exp(s Q K_bᵀ − lse) recomputed (0 where not valid): dV_b = Pᵀ g,
    dS = P ⊙ (g V_bᵀ − Σ_v g ⊙ O), dQ += s dS K_b, dK_b = s dSᵀ Q. dK and dV are written
    block by block, once, into :func:`~attnzoo._pages.fresh_empty` memory laid out as K and V;
    SDPA's own backward zero-fills both first (at Lk = 16384 in a layer, two 32 MiB tensors
    faulted in) and accumulates into them. Each block's products go into buffers that the
    blocks reuse (:class:`~attnzoo._pages.Scratch`): fresh (B, H, m, 512) tensors were faulted
    in afresh, block after block, in a layer's training step (backward at Lk = 16384 155 ms,
    120 in buffers). A query that sees no key gets 0 and no gradient.
    Needs :func:`fused_kernel_fits`. Measured for 256 queries, 8 heads, Lk = 16384, before the
    buffers: fwd+bwd 227-245 ms against SDPA's 252-258; equal at Lk = 4096. For 50 queries with a causal mask
    (prob_sparse's active ones): 55 ms against 92, with 1k page faults against 33k."""

    @staticmethod
    def forward(q, k, v, valid, scale):
        native = _few_queries_native(q, k, v, valid, scale, keep_lse=True)
        return fused_partial(q, k, v, valid, scale) if native is None else native  # (B, H, m, Dv), (B, H, m)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (apart from forward: torch.func's transforms need it)
        q, k, v, valid, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, valid, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _):
        q, k, v, valid, out, lse = ctx.saved_tensors
        native = _few_queries_native_grad(q, k, v, valid, ctx.scale, g, out, lse)
        if native is not None:
            return *native, None, None
        qs = q * ctx.scale  # (B, H, m, D)
        row = torch.linalg.vecdot(g, out).unsqueeze(-1)  # (B, H, m, 1)
        dq = torch.zeros_like(q)
        dk, dv = fresh_as(k), fresh_as(v)
        scratch = Scratch(q)
        for j in range(0, k.shape[2], KEY_BLOCK):
            keys = slice(j, j + KEY_BLOCK)
            k_b, v_b = k[:, :, keys], v[:, :, keys]  # (B, H, n, D), (B, H, n, Dv)
            scores = (*q.shape[:3], k_b.shape[2])  # (B, H, m, n)
            p = torch.matmul(qs, k_b.transpose(-1, -2), out=scratch("p", scores))
            p = exp_(p.sub_(lse.unsqueeze(-1)))
            if valid is not None:  # (a row with no valid key: lse = -inf, p = inf, all filled)
                p.masked_fill_(~valid[..., keys], 0.0)
            dv[:, :, keys] = torch.matmul(p.transpose(-1, -2), g, out=scratch("dv", v_b.shape))
            ds = torch.matmul(g, v_b.transpose(-1, -2), out=scratch("ds", scores)).sub_(row).mul_(p)
            dq.add_(torch.matmul(ds, k_b, out=scratch("dq", q.shape)))
            dk[:, :, keys] = torch.matmul(ds.transpose(-1, -2), qs, out=scratch("dk", k_b.shape))
        return dq.mul_(ctx.scale), dk, dv, None, None


def few_queries_attention(q, k, v, valid, scale):
    """softmax(q kᵀ·scale) v (B, H, m, Dv) for m queries over Lk >> m keys, over the keys ``valid``
    allows (bool, broadcastable to (B, H, m, Lk); None: every key). Without autograd, by the
    native kernel where it runs and ``valid`` is one mask of keys a batch entry
    (:func:`_few_queries_native`). Under autograd, where the fused kernel fits and ``valid`` is
    None, one mask of keys a batch entry or whole (B, H, m, Lk), :class:`FewQueries` (the native
    or the fused forward, a backward by key blocks, native where it runs). Otherwise SDPA."""
    B, H, m, _ = q.shape
    if not needs_grad(q, k, v):
        native = _few_queries_native(q, k, v, valid, scale, keep_lse=False)
        if native is not None:
            return native[0]
    elif valid is None or valid.shape in ((B, 1, 1, k.shape[2]), (B, H, m, k.shape[2])):
        if fused_kernel_fits(q, k, v):
            return FewQueries.apply(q, k, v, valid, scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=scale)


def _key_mask_of(q, k, valid):
    """``valid`` as one mask of keys a batch entry, (B, Lk), where it is one ((B, 1, 1, Lk));
    None for every key; False where it is not one (a mask a query or a head)."""
    if valid is None:
        return None
    return valid[:, 0, 0] if valid.shape == (q.shape[0], 1, 1, k.shape[2]) else False


def _few_queries_native(q, k, v, valid, scale, keep_lse):
    """(out, lse or None) of :func:`attnzoo._native.few_queries` where it runs and ``valid`` is None
    or one mask of keys a batch entry, (B, 1, 1, Lk); else None."""
    from attnzoo import _native  # (here, not above: _native imports this module)

    key_mask = _key_mask_of(q, k, valid)
    return None if key_mask is False else _native.few_queries(q, k, v, key_mask, scale, keep_lse)


def _few_queries_native_grad(q, k, v, valid, scale, g, out, lse):
    """(dq, dk, dv) of :func:`attnzoo._native.few_queries_grad` where it runs and ``valid`` is as
    :func:`_few_queries_native` takes it; else None."""
    from attnzoo import _native

    key_mask = _key_mask_of(q, k, valid)
    return None if key_mask is False else _native.few_queries_grad(q, k, v, key_mask, scale, g, out, lse)


WHOLE_BYTES_MAX = 32 * 2**20  # few_keys_attention's outputs from this size on go in pieces (FewKeys)
KEYS_PIECE = 2**19  # outputs (all batches and heads) of one piece of FewKeys: 2 MiB in float32


class FewKeys(torch.autograd.Function):
    """softmax(Q Kᵀ·s) V for Lq >> n queries over n keys (nystrom's landmark keys, linformer's
    projected ones), by torch's fused CPU kernel (forward and backward) on pieces of about
    KEYS_PIECE outputs, each written into its place in one result: in
    :func:`~attnzoo._pages.fresh_empty` memory laid out as (B, Lq, H, Dv), as SDPA lays out its
    own, so that a layer's merge of the heads stays a view; dq likewise, dK and dV summed over
    the pieces. SDPA's result at Lq = 16384, 8 heads of 64 (32 MiB: past glibc's largest heap
    block, so mapped afresh by the OS on every call) and its backward's were faulted in 4 KiB
    at a time: ~16k page faults a forward, ~32k a training step (nystrom's kernel 1 alone:
    fwd 52.8-56.0 -> 42.4 ms, with backward 157-221 -> 136 ms; in the layer, nystrom's forward
    269 -> 259 ms, linformer's training step 459 -> 446). Below WHOLE_BYTES_MAX one SDPA call
    is faster (the pieces' copies: ~1 ms a forward at Lq = 4096), see
    :func:`few_keys_attention`. Needs :func:`fused_kernel_fits`."""

    @staticmethod
    def forward(q, k, v, scale):
        (B, H, Lq, _), Dv = q.shape, v.shape[-1]
        out = fresh_empty(B, Lq, H, Dv, like=v).transpose(1, 2)  # (B, H, Lq, Dv)
        lse = q.new_empty(B, H, Lq)
        for rows in _pieces(q, Dv):
            o, lse[:, :, rows] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, rows], k, v, scale=scale)[:2]
            out[:, :, rows] = o
        return out, lse

    @staticmethod
    def setup_context(ctx, inputs, output):  # (apart from forward: torch.func's transforms need it)
        q, k, v, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, Lq, D = q.shape
        dq = fresh_empty(B, Lq, H, D, like=q).transpose(1, 2)  # (B, H, Lq, D)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        for rows in _pieces(q, v.shape[-1]):
            dq[:, :, rows], dk_p, dv_p = backward(g[:, :, rows], q[:, :, rows], k, v, out[:, :, rows],
                                                  lse[:, :, rows], 0.0, False, scale=ctx.scale)
            dk += dk_p
            dv += dv_p
        return dq, dk, dv, None


def _pieces(q: torch.Tensor, Dv: int) -> list[slice]:
    """FewKeys' pieces of q's rows: about KEYS_PIECE outputs each."""
    B, H, Lq = q.shape[:3]
    n = max(1, KEYS_PIECE // (B * H * Dv))
    return [slice(a, a + n) for a in range(0, Lq, n)]


def few_keys_attention(q, k, v, scale):
    """softmax(q kᵀ·scale) v (B, H, Lq, Dv) for many queries over few keys, every key: by the
    native kernel where it runs (:func:`attnzoo._native.few_keys`), else by :class:`FewKeys`
    where the fused kernel fits and the output is WHOLE_BYTES_MAX or more, else by one SDPA
    call."""
    from attnzoo import _native  # (here, not above: _native imports this module)

    native = _native.few_keys(q, k, v, scale)
    if native is not None:
        return native
    large = q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] * v.element_size() >= WHOLE_BYTES_MAX
    if large and fused_kernel_fits(q, k, v):
        return FewKeys.apply(q, k, v, scale)[0]
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


class _LogSumExp(torch.autograd.Function):
    """lse of the rows of ``scores`` whose softmax is ``p``: m − log(max p), with gradient p
    (the scores themselves are not kept for the backward; p is, by the softmax anyway)."""

    @staticmethod
    def forward(ctx, scores, p, m):
        ctx.save_for_backward(p)
        return m - p.amax(-1, keepdim=True).log()

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        return grad * p, None, None


def _mask_invalid_(scores: torch.Tensor, valid: torch.Tensor) -> None:
    """-inf into ``scores`` where ``valid`` (broadcastable to it) is False, over the span of key
    columns where any entry is: patterns whose masks are mostly whole valid columns (fixed's
    summary cells: only the query's own blocks are partly valid) fill a fraction of the scores."""
    span = slice(None)
    if valid.shape[-1] == scores.shape[-1] > 1:  # (a mask broadcast over the keys has no columns)
        rows = tuple(range(valid.dim() - 1))
        whole = valid.view(torch.uint8)
        whole = whole.amin(rows) if rows else whole  # (n,): 1 where the whole column is valid
        partial = torch.nonzero(whole == 0)  # (n_partial, 1) column indices
        if partial.numel() == 0:
            return
        span = slice(int(partial[0]), int(partial[-1]) + 1)
    minus_inf_where_not_(scores[..., span], valid[..., span])


def minus_inf_where_not_(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``t.masked_fill_(~valid, -inf)`` for finite t (valid bool, broadcastable to t), as
    t − (1/valid − 1) with valid read as bytes: 0 where valid, inf where not.

    On this CPU torch's bool kernels are not vectorised: the masked fill took ~8× as long
    (1.9 ms against 0.24 for 2^20 scores; 13× for a mask broadcast over the keys), and a
    bool → float cast ~10× a uint8 → float one.
    """
    return t.sub_(valid.view(torch.uint8).to(t.dtype).reciprocal_().sub_(1))


def _empty_rows(m: torch.Tensor) -> torch.Tensor | None:
    """Rows whose largest score ``m (..., R, 1)`` is -inf (no valid key), or None if none is."""
    empty = m == float("-inf")
    return empty if bool(empty.any()) else None


def merge_partials(parts):
    """Merge partials over disjoint key sets into the softmax over their union."""
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = torch.logaddexp(lse, part_lse)
    safe_lse = finite_or_zero(lse)
    out = None
    for o, part_lse in parts:
        w = torch.exp(part_lse - safe_lse).unsqueeze(-1)  # (B, H, Lq, 1)
        out = fresh_product(o, w) if out is None else out.addcmul_(o, w)  # one (B, H, Lq, Dv) tensor in all
    return out, lse


def join_blocks(blocks, total):
    """Blocks (B, H, n_i, X) in sequence order (Σ n_i = total) joined into (B, H, total, X).

    Under autograd they are concatenated: writing them into slices of one tensor would
    make the backward clone the whole gradient once per block. Without it each goes into
    one preallocated tensor as it comes, so only one block is alive beside the output.
    """
    if torch.is_grad_enabled():
        return torch.cat(list(blocks), 2)
    out, s = None, 0
    for blk in blocks:
        if blk.shape[2] == total:
            return blk
        if out is None:
            out = fresh_empty(*blk.shape[:2], total, blk.shape[-1], like=blk)
        out[:, :, s:s + blk.shape[2]] = blk
        s += blk.shape[2]
    return out


def pad_to(t: torch.Tensor, length: int, dim: int = 2, front: int = 0, value=0.0) -> torch.Tensor:
    """Pad ``t`` along ``dim`` with ``front`` leading entries and trailing ones up to ``length``.
    Without autograd the copy is written into :func:`~attnzoo._pages.fresh_empty` memory and
    only the padding filled (``F.pad`` fills it all first: at L = 16384 a 32 MiB fill, ~40 ms
    of page faults in a training step's backward)."""
    size = t.shape[dim]
    back = length - front - size
    if front == 0 and back == 0 and t.is_contiguous():
        return t  # as it is (F.pad would copy it); callers only read it
    if needs_grad(t) or min(front, back) < 0:
        return F.pad(t, [0, 0] * (t.dim() - 1 - dim % t.dim()) + [front, back], value=value)
    out = fresh_empty(*t.shape[:dim % t.dim()], length, *t.shape[dim % t.dim() + 1:], like=t)
    out.narrow(dim, 0, front).fill_(value)
    out.narrow(dim, front + size, back).fill_(value)
    out.narrow(dim, front, size).copy_(t)
    return out


SCORES_PER_CHUNK = 2**20  # scores (all batches and heads) computed at a time: 4 MiB in float32, in cache
BAND_PIECE = 2**20  # outputs (all batches and heads) of one fused kernel call of a band


def attend_blocks(q_flat, k_flat, v_flat, plan):
    """Softmax attention over gathered blocks: the shared core of the banded mechanisms.

    ``q_flat`` (R, D) (already scaled, unless the plan fuses: below), ``k_flat`` (R', D),
    ``v_flat`` (R', Dv) are rows; for each group g of ``plan.groups`` the queries
    ``plan.q_rows(g)`` (B, H, n, block) attend the keys ``plan.k_rows(g)`` (B, H, n, span),
    and ``plan.prepare(scores, g)`` adjusts the scores in place (biases) and returns which keys
    are valid. Groups hold about SCORES_PER_CHUNK scores, so every pass over them runs in
    cache. Returns ``(o (B, H, slots, Dv), lse (B, H, slots))``, the query slots in group order.

    In float32 / float64 the backward recomputes each group's weights from the rows and the
    saved lse (as flash attention does), so training keeps O(rows·D), not every group's
    weights; half precision goes through autograd. A plan whose ``fused_forward(q_flat,
    k_flat, v_flat)`` returns ``(o, lse)`` (rather than None) has its forward computed that
    way, by a fused kernel that scales the unscaled ``q_flat`` by ``plan.fused_scale`` itself,
    and, when lse then takes no gradient, its backward by ``fused_backward(grad_o, q_flat,
    k_flat, v_flat, o, lse)`` -> (dq, dk, dv).
    """
    if q_flat.dtype in (torch.float16, torch.bfloat16):
        return blocks_forward(q_flat, k_flat, v_flat, plan)
    return _BlockAttention.apply(q_flat, k_flat, v_flat, plan)


def _rows(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (any shape) of ``flat (R, X)``: (*idx.shape, X)."""
    return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, flat.shape[-1])


def _prepare(plan, scores, g):
    """The plan's validity for group g, or None when every key is valid (no masking pass)."""
    valid = plan.prepare(scores, g)
    return None if valid is None or _all_true(valid) else valid


def _all_true(mask: torch.Tensor) -> bool:
    """``bool(mask.all())``, read as bytes: a min over uint8 is vectorised, ``all`` is not (30x)."""
    return mask.numel() == 0 or bool(mask.view(torch.uint8).amin() == 1)


def blocks_forward(q_flat, k_flat, v_flat, plan):
    """``(o, lse)`` of :func:`attend_blocks` by its groups, each a :func:`partial_softmax`: the
    forward of its recomputing backward, and the whole of it in half precision."""
    parts = []
    for g in plan.groups:
        k_rows = plan.k_rows(g)
        scores = _rows(q_flat, plan.q_rows(g)) @ _rows(k_flat, k_rows).transpose(-1, -2)  # (B,H,n,block,span)
        parts.append(partial_softmax(scores, _prepare(plan, scores, g), _rows(v_flat, k_rows)))
    o = torch.cat([o for o, _ in parts], 2)  # (B, H, n_all, block, Dv)
    lse = torch.cat([lse for _, lse in parts], 2)
    return o.flatten(2, 3), lse.flatten(2, 3)


class _BlockAttention(torch.autograd.Function):
    """attend_blocks with a backward that recomputes the weights group by group."""

    @staticmethod
    def forward(ctx, q_flat, k_flat, v_flat, plan):
        fused = plan.fused_forward(q_flat, k_flat, v_flat)
        o, lse = fused or blocks_forward(q_flat, k_flat, v_flat, plan)
        ctx.save_for_backward(q_flat, k_flat, v_flat, o, lse)
        ctx.plan, ctx.fused = plan, fused is not None
        ctx.set_materialize_grads(False)  # an unused lse gives None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q_flat, k_flat, v_flat, o, lse = ctx.saved_tensors
        plan = ctx.plan
        if ctx.fused and grad_lse is None and grad_o is not None:  # the fused forward's own backward
            return (*plan.fused_backward(grad_o, q_flat, k_flat, v_flat, o, lse), None)
        if ctx.fused:  # the groups take q scaled (the kernel scaled it itself) and the keys padded
            q_flat, k_flat, v_flat = plan.group_rows(q_flat, k_flat, v_flat)
        grad_o = torch.zeros_like(o) if grad_o is None else grad_o
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        seen = torch.isfinite(lse)  # rows with a key; the others have no weights and get no gradient
        # d lse / d s = p and d o / d s = p (dP − rowsum(dO·o)): one per-row term for both
        row = torch.where(seen, grad_lse - torch.linalg.vecdot(grad_o, o), 0.0)  # (B, H, slots)
        grads = fresh_like(q_flat, k_flat, v_flat, zero=True)
        start = 0
        for g in plan.groups:
            q_rows = plan.q_rows(g)  # (B, H, n, block)
            n, block = q_rows.shape[2:]
            slots = slice(start, start + n * block)
            start += n * block
            g_o, row_g, seen_g = (t[:, :, slots].unflatten(2, (n, block)) for t in (grad_o, row, seen))
            _add_group_grads(plan, g, q_rows, (q_flat, k_flat, v_flat), grads, g_o, row_g, seen_g)
        if ctx.fused:
            grads = plan.fused_grads(*grads)
        return *grads, None


def _add_group_grads(plan, g, q_rows, flats, grads, grad_o, row, keep):
    """Adds group g's share of a recomputing (flash-style) backward to ``grads`` = (dq, dk, dv),
    flat rows like ``flats`` = (q_flat, k_flat, v_flat), in place; ``q_rows`` is
    ``plan.q_rows(g)`` (B, H, n, block), which the caller has taken already.

    The weights are recomputed as the group's softmax; rows where ``keep`` is False get none.
    With ``grad_o`` (B, H, n, block, Dv) and the per-row term ``row`` (B, H, n, block):
    d scores = p ⊙ (grad_o vᵀ + row).
    """
    k_rows = plan.k_rows(g)  # (B, H, n, span)
    q_g, k_g, v_g = (_rows(t, idx) for t, idx in zip(flats, (q_rows, k_rows, k_rows), strict=True))
    scores = q_g @ k_g.transpose(-1, -2)  # (B, H, n, block, span)
    valid = _prepare(plan, scores, g)
    if valid is not None:
        minus_inf_where_not_(scores, valid)
    p = torch.softmax(scores, -1)  # the forward's weights, by its fused kernel
    if not _all_true(keep):
        p.masked_fill_(keep.logical_not().unsqueeze(-1), 0.0)  # (rows with no key: softmax gave nan)
    ds = (grad_o @ v_g.transpose(-1, -2)).add_(row.unsqueeze(-1)).mul_(p)  # d scores
    dq, dk, dv = grads
    dq.index_add_(0, q_rows.reshape(-1), (ds @ k_g).flatten(0, -2))
    dk.index_add_(0, k_rows.reshape(-1), (ds.transpose(-1, -2) @ q_g).flatten(0, -2))
    dv.index_add_(0, k_rows.reshape(-1), (p.transpose(-1, -2) @ grad_o).flatten(0, -2))


def window_partial(q, k, v, key_valid, *, block, left, right, allowed, scale):
    """Blocked windowed attention: query block b of ``block`` rows sees keys
    [b·block − left, (b+1)·block + right), further restricted by ``allowed(i, j)``.

    q (B, H, L, D), k (B, H, L, D), v (B, H, L, Dv), key_valid (B, L) bool or None.
    ``allowed`` takes broadcastable int tensors of query and key positions and
    returns a bool tensor; it must depend on i and j only through i − j and i mod block
    (a band, the same in every block). Cost O(L·(block + left + right)·D), no L×L
    tensor: query blocks go in groups through :func:`attend_blocks` (in cache;
    recomputed in the backward), over keys padded with ``left`` rows before and ``right``
    after; on the CPU without padding keys the forward is torch's fused SDPA kernel over all
    blocks (the native few-queries kernel for blocks without a mask: :meth:`_Band.fused_forward`)
    on the keys as they are (no padded copy: at
    L = 16384 the copies and their gradients' cost ~5 % of local's training step), and the
    backward recomputes over the same windows (:meth:`_Band.fused_backward`). Returns
    ``(o (B, H, L, Dv), lse (B, H, L))``.
    """
    B, H, L, D = q.shape
    fused = key_valid is None and fused_kernel_fits(q, k, v)  # no padding keys (see _Band.fused_forward)
    band = _Band(B, H, L, block, left, right, allowed, key_valid, q.device, scale if fused else None)
    q_flat = pad_to(q if fused else scaled(q, scale), band.Lp).reshape(-1, D)  # the kernel scales itself;
    # the groups take q scaled once here, not each score
    k_flat, v_flat = ((t if fused else pad_to(t, band.Nk, front=left)).reshape(-1, t.shape[-1])
                      for t in (k, v))  # fused: the keys as they are
    o, lse = attend_blocks(q_flat, k_flat, v_flat, band)
    return o[:, :, :L], lse[:, :, :L]


class _Band:
    """The plan of :func:`window_partial` for :func:`attend_blocks`: padded rows, groups of
    query blocks, and which window keys each query may attend. Fused (``fused_scale`` set),
    the key rows are the sequence's own, B·H·L of them; for the groups, padded (Nk a head)."""

    def __init__(self, B, H, L, block, left, right, allowed, key_valid, device, fused_scale):
        self.L, self.block, self.left, self.right = L, block, left, right
        self.allowed, self.device = allowed, device
        self.fused_scale = fused_scale  # None: the groups of attend_blocks (q comes scaled)
        self.nb = nb = -(-L // block)
        self.Lp, self.span = nb * block, block + left + right
        self.Nk = self.Lp + left + right  # padded keys: left before, right after
        self.bh = torch.arange(B * H, device=device).view(B, H, 1, 1)
        self.kv = None
        if key_valid is not None:
            self.kv = pad_to(key_valid, self.Nk, dim=1, front=left, value=False).unfold(1, self.span, block)
        group = max(1, SCORES_PER_CHUNK // (B * H * block * self.span))  # query blocks at a time
        self.groups = [range(g, min(g + group, nb)) for g in range(0, nb, group)]

    def _starts(self, g):
        return torch.tensor(g, device=self.device).view(-1, 1) * self.block  # (n, 1)

    def q_rows(self, g):
        return self.bh * self.Lp + self._starts(g) + torch.arange(self.block, device=self.device)

    def k_rows(self, g):
        return self.bh * self.Nk + self._starts(g) + torch.arange(self.span, device=self.device)

    def prepare(self, scores, g):
        """(n, block, span) or (B, 1, n, block, span) bool: which window keys a query may attend."""
        i = self._starts(g).unsqueeze(-1) + torch.arange(self.block, device=self.device).view(-1, 1)
        j = self._starts(g).unsqueeze(-1) - self.left + torch.arange(self.span, device=self.device)
        valid = self.allowed(i, j) & (j >= 0) & (j < self.L)  # (n, block, span)
        if self.kv is not None:
            valid = valid & self.kv[:, None, g.start:g.stop, None, :]
        return valid

    def fused_forward(self, q_flat, k_flat, v_flat):
        """(o (B, H, Lp, Dv), lse (B, H, Lp)) by torch's fused CPU SDPA kernel, scaling the
        unscaled q itself, or None (padding keys, half precision, Dv != D or not on the CPU:
        the groups of :func:`attend_blocks`, with q scaled).

        The blocks whose window lies inside the sequence share one relative band, so one small
        additive mask serves them all (none where it allows every key, as block_local's
        two-sided windows: ~7 % of the kernel's time), and their key windows are a strided
        view of the keys (no copy); the few at either end get a mask each (SDPA's kernel
        takes only 4-D masks of the query's dtype) and windows of a zero-padded copy of their
        keys (:meth:`_windows`). Padded queries past L see the padded keys too, so that no row
        is empty (the kernel gives such rows lse 0); their results are discarded. Blocks
        without a mask go to the native few-queries kernel instead, where it runs
        (:meth:`_attend`).

        The kernel runs on pieces of about BAND_PIECE outputs (all heads), each copied into its
        place in one result: the kernel's own result for all the blocks at once, a fresh
        (L, Dv) tensor, was faulted in 4 KiB at a time by its threads (fixed, causal, at
        L = 16384: ~9k page faults and ~5 % of the forward).
        """
        if self.fused_scale is None:
            return None
        qb = q_flat.view(-1, self.nb, self.block, q_flat.shape[-1])  # (B·H, nb, block, D)
        o = fresh_empty(*qb.shape[:3], v_flat.shape[-1], like=q_flat)  # (B·H, nb, block, Dv)
        lse = q_flat.new_empty(qb.shape[:3])  # (B·H, nb, block)
        step = self._blocks_a_piece(qb.shape[0], v_flat.shape[-1])
        for a, b, mask in self._runs(q_flat.dtype):
            shared = mask.shape[1] == 1
            if shared and not bool(mask.any()):  # every window key allowed (block_local): no mask
                mask = None
            for s in range(a, b, step):
                e = min(b, s + step)
                o[:, s:e], lse[:, s:e] = self._attend(qb[:, s:e], self._windows(k_flat, s, e),
                                                      self._windows(v_flat, s, e),
                                                      mask if shared else mask[:, s - a:e - a])
        B, H = self.bh.shape[:2]
        return o.view(B, H, self.Lp, -1), lse.view(B, H, self.Lp)

    def _attend(self, q, k, v, mask):
        """(o, lse) of the windows k, v (B·H, n, span, ·) of the query blocks q (B·H, n, block, D):
        without a mask by the native few-queries kernel (each block's window as a head of its
        own; block_local at L = 4096, 14 blocks of 8 heads: 31.7 ms against the SDPA kernel's
        38.7) where it runs, else by the SDPA kernel with the additive ``mask``."""
        if mask is None:
            native = _few_queries_native(q, k, v, None, self.fused_scale, keep_lse=True)
            if native is not None:
                return native
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask,
                                                                          scale=self.fused_scale)[:2]

    def fused_backward(self, grad_o, q_flat, k_flat, v_flat, o, lse):
        """(dq, dk, dv) of :meth:`fused_forward` (lse unused), recomputing each block's weights
        from the kernel's lse, as flash attention's backward does, over the same windows
        (:meth:`_windows`; the gradients of a padded copy's are added back onto its keys).

        Query block by query block, all heads at once (about SCORES_PER_CHUNK / 2 weights a
        step, in cache): with c = scale·log2 e, P = 2^(c·Q Kᵀ + mask·log2 e − lse·log2 e) by one
        ``baddbmm_`` into the mask less lse, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = scale·dS K,
        and the window's dK = scale·dSᵀ Q and dV = Pᵀ dO are added onto its keys, one add each
        for all heads (one block's window does not overlap itself). P, dS and the window's
        products go into buffers taken once, and rowsum(dO ⊙ O) is taken block by block: fresh
        (h, block, span) tensors were faulted in afresh in some processes, and the whole
        rowsum's (L, Dv) product was a large temporary (local's training step at L = 4096:
        peak 50 -> 29-31 MiB). Runs of blocks without a mask take the native few-queries
        backward where it runs (:meth:`_native_grads`: block_local's training step at
        L = 4096 174-191 -> 139-141 ms). (torch's fused backward took ~25 % longer here, mostly
        zero-filling and summing per-window gradients; a loop over heads, with the windows of
        several blocks folded together, ~5 % longer.)
        """
        qb = q_flat.view(-1, self.nb, self.block, q_flat.shape[-1])
        BH, nb, block, _ = qb.shape
        gb, ob = grad_o.reshape(BH, nb, block, -1), o.reshape(BH, nb, block, -1)
        lse2 = (lse.reshape(BH, nb, block) * LOG2E).unsqueeze(-1)  # (B·H, nb, block, 1)
        dq = fresh_empty(*qb.shape, like=qb)
        dk, dv = (fresh_empty(BH, self.L, t.shape[-1], like=t).zero_()  # (B·H, L, ·)
                  for t in (k_flat, v_flat))
        heads = max(1, SCORES_PER_CHUNK // 2 // (block * self.span))  # heads at a time
        p_buf, ds_buf = (qb.new_empty(min(heads, BH), block, self.span) for _ in range(2))
        kv_buf = qb.new_empty(min(heads, BH), self.span, v_flat.shape[-1])  # dK's and dV's (fused: Dv = D)
        scale = self.fused_scale
        for a, b, mask in self._runs(q_flat.dtype):
            kb, vb = self._windows(k_flat, a, b), self._windows(v_flat, a, b)  # (B·H, b − a, span, ·)
            start, rows, lo, hi = self._key_rows(a, b)
            inside = (lo, hi) == (start, start + rows)
            dk_run, dv_run = ((t[:, start:start + rows] if inside else t.new_zeros(BH, rows, t.shape[-1]))
                              for t in (dk, dv))  # the run's keys' gradients
            if not mask.any() and self._native_grads(gb, ob, lse, qb, kb, vb, a, b, (dq, dk_run, dv_run)):
                continue
            for i in range(a, b):
                bias = mask[0] if mask.shape[1] == 1 else mask[0, i - a]  # (1, block, span) | (block, span)
                window = slice((i - a) * block, (i - a) * block + self.span)  # block i's keys in the run's
                for h in range(0, BH, heads):
                    hs = slice(h, h + heads)
                    q_i, g_i = qb[hs, i], gb[hs, i]  # (h, block, ·)
                    k_i, v_i = kb[hs, i - a], vb[hs, i - a]  # (h, span, ·)
                    row = torch.linalg.vecdot(g_i, ob[hs, i]).unsqueeze(-1)  # rowsum(dO ⊙ O) (h, block, 1)
                    n = q_i.shape[0]  # heads this step (the last may have fewer)
                    p = torch.sub(bias, lse2[hs, i], out=p_buf[:n]).baddbmm_(q_i, k_i.transpose(-1, -2),
                                                                             alpha=scale * LOG2E).exp2_()
                    ds = torch.bmm(g_i, v_i.transpose(-1, -2), out=ds_buf[:n]).sub_(row).mul_(p)
                    torch.mul(torch.bmm(ds, k_i), scale, out=dq[hs, i])
                    dk_run[hs, window].add_(torch.bmm(ds.transpose(-1, -2), q_i, out=kv_buf[:n]), alpha=scale)
                    dv_run[hs, window].add_(torch.bmm(p.transpose(-1, -2), g_i, out=kv_buf[:n]))
            if not inside:  # the padded copy's gradients onto the keys they copied
                dk[:, lo:hi] += dk_run[:, lo - start:hi - start]
                dv[:, lo:hi] += dv_run[:, lo - start:hi - start]
        return dq.view_as(q_flat), dk.view_as(k_flat), dv.view_as(v_flat)

    def _native_grads(self, gb, ob, lse, qb, kb, vb, a, b, grads):
        """Adds the gradients of query blocks a..b−1, unmasked, to ``grads`` = (dq (B·H, nb, block,
        D), the run's dk and dv (B·H, rows, ·)) by the native few-queries backward, each block's
        window a head of its own, in pieces of about BAND_PIECE outputs (a piece's window
        gradients, (B·H, n, span, ·), are added onto the keys they belong to); False where the
        kernels cannot run. lse (B·H, nb, block); the others as in :meth:`fused_backward`."""
        dq, dk_run, dv_run = grads
        lse = lse.view(qb.shape[:3])
        step = self._blocks_a_piece(qb.shape[0], vb.shape[-1])
        for s in range(a, b, step):
            e = min(b, s + step)
            w = slice(s - a, e - a)  # the piece's windows in the run's
            native = _few_queries_native_grad(qb[:, s:e], kb[:, w], vb[:, w], None, self.fused_scale,
                                              gb[:, s:e], ob[:, s:e], lse[:, s:e])
            if native is None:
                return False
            dq[:, s:e], dk_w, dv_w = native  # dk_w, dv_w (B·H, e − s, span, ·)
            for i in range(s, e):
                keys = slice((i - a) * self.block, (i - a) * self.block + self.span)  # block i's in the run's
                dk_run[:, keys] += dk_w[:, i - s]
                dv_run[:, keys] += dv_w[:, i - s]
        return True

    def _blocks_a_piece(self, heads: int, Dv: int) -> int:
        """Query blocks a piece of the fused forward and the native backward: about BAND_PIECE
        outputs of ``heads`` (B·H) heads."""
        return max(1, BAND_PIECE // (heads * self.block * Dv))

    def _key_rows(self, a, b):
        """(start, rows, lo, hi): query blocks a..b−1 see ``rows`` keys from key ``start``
        (< 0 or past L at either end), of which keys lo..hi−1 lie in the sequence."""
        start, rows = a * self.block - self.left, (b - a - 1) * self.block + self.span
        return start, rows, max(start, 0), min(start + rows, self.L)

    def _windows(self, flat, a, b):
        """The key windows (B·H, b − a, span, X) of query blocks a..b−1 over the unpadded rows
        ``flat`` (B·H·L, X): a view where they lie inside the sequence, else windows of a copy
        of their keys zero-padded at either end."""
        t = flat.view(self.bh.numel(), self.L, -1)  # (B·H, L, X)
        start, rows, lo, hi = self._key_rows(a, b)
        piece = t[:, lo:hi]
        if (lo, hi) != (start, start + rows):
            piece = pad_to(piece, rows, dim=1, front=lo - start)
        return piece.unfold(1, self.span, self.block).transpose(-1, -2)

    def group_rows(self, q_flat, k_flat, v_flat):
        """The fused layout's rows as the groups take them: q scaled, keys padded (Nk a head)."""
        k_flat, v_flat = (pad_to(t.view(self.bh.numel(), self.L, -1), self.Nk, dim=1, front=self.left)
                          .reshape(-1, t.shape[-1]) for t in (k_flat, v_flat))
        return scaled(q_flat, self.fused_scale), k_flat, v_flat

    def fused_grads(self, dq, dk, dv):
        """The groups' gradients of :meth:`group_rows`'s rows, as the fused layout's."""
        dk, dv = (t.view(self.bh.numel(), self.Nk, -1)[:, self.left:self.left + self.L]
                  .reshape(-1, t.shape[-1]) for t in (dk, dv))
        return dq.mul_(self.fused_scale), dk, dv

    def _runs(self, dtype):
        """[(first block, end block, 4-D additive mask)]: the blocks whose window starts before
        key 0 or ends past key L get a mask each; those between share one relative band."""
        nb, block = self.nb, self.block
        first = min(nb, -(-self.left // block))
        last = max(first, min(nb, (self.L - self.right - block) // block + 1))
        runs = [(0, first, range(first)), (first, last, range(first, first + 1)), (last, nb, range(last, nb))]
        return [(a, b, self._bias(masked, dtype)[None]) for a, b, masked in runs if b > a]

    def _bias(self, blocks, dtype):
        """(len(blocks), block, span) additive mask of query blocks ``blocks``: 0 or -inf."""
        i = (torch.tensor(blocks, device=self.device) * self.block).view(-1, 1, 1) + torch.arange(
            self.block, device=self.device).view(-1, 1)  # (n, block, 1)
        j = i[:, :1] - self.left + torch.arange(self.span, device=self.device)  # (n, 1, span)
        allowed = self.allowed(i, j) & (j >= 0) & ((j < self.L) | (i >= self.L))  # (n, block, span)
        return minus_inf_where_not_(torch.zeros(allowed.shape, dtype=dtype, device=self.device), allowed)


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


def to_frame(q, k, v, key_mask):
    """Put q and k/v on one frame of N = max(Lq, Lk) positions for self-attention patterns.

    Queries are the last Lq positions and keys the last Lk (the causal
    alignment of ``attnzoo.masks``); missing keys are padding. Returns
    ``(q, k, v, key_valid (B, N) or None, Lq)``; take outputs' last Lq rows by :func:`last_rows`.
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
    """``out[:, :, -Lq:]``, or ``out`` itself where it has Lq rows: a slice's backward fills a
    zero gradient of the whole and copies into it, where self-attention has nothing to cut
    (local's training step at L = 4096: an 8 MiB fill and copy)."""
    return out if out.shape[2] == Lq else out[:, :, -Lq:]


def pattern_reference(pattern):
    """The dense reference of a pattern mechanism: masked softmax with its connectivity.

    ``pattern(N, opts, causal)`` gives the (N, N) mask, or (P, N, N) for
    patterns that differ by head (head h uses pattern h % P).
    """
    from attnzoo.mechanisms.full import softmax_reference

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
