"""CPU overrides of softmax attention where one side is small, and of nystrom's segment means.

- ``attend_few_queries`` (m queries over Lk >> m keys: nystrom's landmark queries, prob_sparse's
  active ones): the C kernel (:func:`attnzoo.backends.cpu.native.few_queries`) without autograd;
  under it :class:`FewQueries`, whose forward is the C kernel or torch's fused CPU kernel and
  whose backward is the C kernel's or one in torch over blocks of keys.
- ``attend_few_keys`` (many queries over n few keys: nystrom's landmark keys, linformer's
  projected ones): the C kernel (:func:`attnzoo.backends.cpu.native.few_keys`, with its own
  backward), else, for large outputs, :class:`FewKeys`, the fused kernel on pieces of the queries.
- ``segment_means`` (nystrom's landmarks) of equal segments under autograd: a backward that
  writes each row's gradient once, laid out as the input.

Each returns NotImplemented where its preconditions do not hold, and the portable body runs.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from attnzoo.backends.cpu import fused, native
from attnzoo.backends.cpu.memory import Scratch, fresh_as, fresh_empty
from attnzoo.ops import needs_grad, override

KEY_BLOCK = 512  # keys per block of FewQueries' backward in torch: (B, H, m, 512) products
WHOLE_BYTES_MAX = 32 * 2**20  # attend_few_keys' outputs from this size on go in pieces (FewKeys)
KEYS_PIECE = 2**19  # outputs (all batches and heads) of one piece of FewKeys


@override("attend_few_queries")
def attend_few_queries(q, k, v, valid, scale):
    """Without autograd the C kernel, where it runs and ``valid`` is None or one mask of keys a
    batch entry, (B, 1, 1, Lk). Under autograd :class:`FewQueries`, where the fused kernel fits
    (:func:`attnzoo.backends.cpu.fused.fits`: float32 / float64 on the CPU, stride-1 rows, Dv = D)
    and ``valid`` is None, (B, 1, 1, Lk) or (B, H, m, Lk). NotImplemented otherwise."""
    if not needs_grad(q, k, v):
        out = _few_queries_native(q, k, v, valid, scale, keep_lse=False)
        return NotImplemented if out is None else out[0]
    (B, H, m, _), Lk = q.shape, k.shape[2]
    if (valid is None or valid.shape in ((B, 1, 1, Lk), (B, H, m, Lk))) and fused.fits(q, k, v):
        return FewQueries.apply(q, k, v, valid, scale)[0]
    return NotImplemented


class FewQueries(torch.autograd.Function):
    """softmax(Q Kᵀ·s) V for m queries over Lk >> m keys, over the keys ``valid`` (B, H, m, Lk)
    or (B, 1, 1, Lk) bool allows (None: every key), with the log-sum-exp of each row.

    Forward: the C kernel where it runs (:func:`_few_queries_native`), else the fused kernel
    (:func:`attnzoo.backends.cpu.fused.fused_partial`). Backward: the C kernel's where it runs,
    else one in torch over blocks of KEY_BLOCK keys, each block's P = exp(s Q K_bᵀ − lse)
    recomputed (0 where not valid): dV_b = Pᵀ g, dS = P ⊙ (g V_bᵀ − Σ_v g ⊙ O),
    dQ += s dS K_b, dK_b = s dSᵀ Q. dK and dV are written block by block, once, laid out as K
    and V (SDPA's backward zero-fills both and accumulates into them), and each block's
    products go into buffers the blocks reuse (:class:`~attnzoo.backends.cpu.memory.Scratch`),
    so that no (m, Lk) tensor and no fresh block-sized one is made. A query that sees no key
    gets 0 and no gradient. Needs :func:`attnzoo.backends.cpu.fused.fits`.
    """

    @staticmethod
    def forward(q, k, v, valid, scale):
        out = _few_queries_native(q, k, v, valid, scale, keep_lse=True)
        return fused.fused_partial(q, k, v, valid, scale) if out is None else out  # (B, H, m, Dv), (B, H, m)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (apart from forward: torch.func's transforms need it)
        q, k, v, valid, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, valid, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _):
        q, k, v, valid, out, lse = ctx.saved_tensors
        key_mask = _key_mask_of(q, k, valid)
        if key_mask is not False:
            grads = native.few_queries_grad(q, k, v, key_mask, ctx.scale, g, out, lse)
            if grads is not None:
                return *grads, None, None
        return *_blocked_grads(q, k, v, valid, ctx.scale, g, out, lse), None, None


def _blocked_grads(q, k, v, valid, scale, g, out, lse):
    """(dq, dk, dv) of :class:`FewQueries` in torch, over blocks of KEY_BLOCK keys."""
    qs = q * scale  # (B, H, m, D)
    row = torch.linalg.vecdot(g, out).unsqueeze(-1)  # (B, H, m, 1)
    dq = torch.zeros_like(q)
    dk, dv = fresh_as(k), fresh_as(v)
    scratch = Scratch(q)
    for j in range(0, k.shape[2], KEY_BLOCK):
        keys = slice(j, j + KEY_BLOCK)
        k_b, v_b = k[:, :, keys], v[:, :, keys]  # (B, H, n, D), (B, H, n, Dv)
        scores = (*q.shape[:3], k_b.shape[2])  # (B, H, m, n)
        p = torch.matmul(qs, k_b.transpose(-1, -2), out=scratch("p", scores))
        p = fused.exp_(p.sub_(lse.unsqueeze(-1)))
        if valid is not None:  # (a row with no valid key: lse = -inf, p = inf, all filled)
            p.masked_fill_(~valid[..., keys], 0.0)
        dv[:, :, keys] = torch.matmul(p.transpose(-1, -2), g, out=scratch("dv", v_b.shape))
        ds = torch.matmul(g, v_b.transpose(-1, -2), out=scratch("ds", scores)).sub_(row).mul_(p)
        dq.add_(torch.matmul(ds, k_b, out=scratch("dq", q.shape)))
        dk[:, :, keys] = torch.matmul(ds.transpose(-1, -2), qs, out=scratch("dk", k_b.shape))
    return dq.mul_(scale), dk, dv


def _key_mask_of(q, k, valid):
    """``valid`` as one mask of keys a batch entry, (B, Lk), where it is one ((B, 1, 1, Lk));
    None for every key; False where it is not one (a mask a query or a head)."""
    if valid is None:
        return None
    return valid[:, 0, 0] if valid.shape == (q.shape[0], 1, 1, k.shape[2]) else False


def _few_queries_native(q, k, v, valid, scale, keep_lse):
    """(out, lse or None) of :func:`attnzoo.backends.cpu.native.few_queries` where it runs and
    ``valid`` is None or one mask of keys a batch entry, (B, 1, 1, Lk); else None."""
    key_mask = _key_mask_of(q, k, valid)
    return None if key_mask is False else native.few_queries(q, k, v, key_mask, scale, keep_lse)


@override("attend_few_keys")
def attend_few_keys(q, k, v, scale):
    """The C kernel where it runs (:func:`attnzoo.backends.cpu.native.few_keys`, forward and
    backward), else :class:`FewKeys` where the fused kernel fits and the output is
    WHOLE_BYTES_MAX or more; NotImplemented otherwise (one SDPA call is faster on smaller
    outputs, where the pieces' copies cost more than they save)."""
    out = native.few_keys(q, k, v, scale)
    if out is not None:
        return out
    large = q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] * v.element_size() >= WHOLE_BYTES_MAX
    if large and fused.fits(q, k, v):
        return FewKeys.apply(q, k, v, scale)[0]
    return NotImplemented


class FewKeys(torch.autograd.Function):
    """softmax(Q Kᵀ·s) V for Lq >> n queries over n keys by the fused kernel (forward and
    backward) on pieces of about KEYS_PIECE outputs, each written into its place in one result
    laid out (B, Lq, H, Dv), as SDPA lays out its own, so that a layer's merge of the heads
    stays a view; dq likewise, dK and dV summed over the pieces. The result and dq come from
    :func:`~attnzoo.backends.cpu.memory.fresh_empty`: SDPA's own, past glibc's largest heap
    block, are mapped afresh by the OS on every call and faulted in a page at a time.
    Needs :func:`attnzoo.backends.cpu.fused.fits`."""

    @staticmethod
    def forward(q, k, v, scale):
        (B, H, Lq, _), Dv = q.shape, v.shape[-1]
        out = fresh_empty(B, Lq, H, Dv, like=v).transpose(1, 2)  # (B, H, Lq, Dv)
        lse = q.new_empty(B, H, Lq)
        for rows in _pieces(q, Dv):
            out[:, :, rows], lse[:, :, rows] = fused.flash(q[:, :, rows], k, v, scale=scale)
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
        for rows in _pieces(q, v.shape[-1]):
            piece = (g[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows])
            dq[:, :, rows], dk_p, dv_p = fused.flash_backward(*piece, scale=ctx.scale)
            dk += dk_p
            dv += dv_p
        return dq, dk, dv, None


def _pieces(q: torch.Tensor, Dv: int) -> list[slice]:
    """FewKeys' pieces of q's rows: about KEYS_PIECE outputs each."""
    B, H, Lq = q.shape[:3]
    n = max(1, KEYS_PIECE // (B * H * Dv))
    return [slice(a, a + n) for a in range(0, Lq, n)]


@override("segment_means")
def segment_means(x, m, key_mask=None):
    """Under autograd, without a key mask, on the CPU, with L a multiple of m' = min(m, L):
    :class:`EqualSegmentMeans`; NotImplemented otherwise (the portable body's forward is the same)."""
    L = x.shape[2]
    if key_mask is not None or x.device.type != "cpu" or L % min(m, L) or not needs_grad(x):
        return NotImplemented
    return EqualSegmentMeans.apply(x, min(m, L))


class EqualSegmentMeans(torch.autograd.Function):
    """x (B, H, L, D) -> (B, H, m, D), the means of m segments of L/m rows, with a backward that
    writes g/(L/m) to each segment's rows in one pass, into a gradient laid out as x. Through
    autograd, mean then view make a scaled copy and, for a layer's q (a transposed view), a
    contiguous clone of it."""

    @staticmethod
    def forward(x, m):
        return x.unflatten(2, (m, x.shape[2] // m)).mean(3)  # (B, H, m, D)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, m = inputs
        ctx.x_meta, ctx.m = torch.empty_like(x, device="meta"), m  # x's shape and strides only

    @staticmethod
    def backward(ctx, g):
        meta, m = ctx.x_meta, ctx.m
        B, H, L, D = meta.shape
        dx = fresh_empty(*meta.shape, like=g, stride=meta.stride())  # (B, H, L, D), laid out as x
        dx.view(B, H, m, L // m, D).copy_((g / (L // m)).unsqueeze(3).expand(B, H, m, L // m, D))
        return dx, None
