"""Kernel attention on the CPU (linear, taylor, performer): overrides of ``kernel_attention`` and
``kernel_attention_flops`` (:mod:`attnzoo.mechanisms._kernel`, whose portable body is the
mathematics this computes, to rounding).

- φ = elu + 1: the C kernels where they build (:func:`attnzoo.backends.cpu.native.linear`, and
  ``causal_linear``, the paper's recurrence), forward and backward.
- Otherwise an eager engine over blocks of positions, so that a block's features and chunk
  products stay in cache: non-causal, the key state S, z streamed over key blocks, then each
  query block (:func:`stream_kernel`); causal, aligned blocks in order, each by chunked prefix
  sums from the state the one before left (:func:`_causal_prefix`). Training keeps no
  features: the backwards recompute each block (:class:`_StreamedKernel`, :class:`_CausalBlocks`)
  and go back through an elementwise map by its derivative, through performer's by a backward
  written out (:class:`_FavorMap`), through any other by autograd. Without grad mode, a block's
  temporaries go into one :class:`~attnzoo.backends.cpu.memory.Scratch`.

It runs on CPU tensors for the maps it knows: "elu", "favor" (float32, float64) and any map of
each row; not where a map's parameters need gradients (performer's trainable features).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.backends.cpu import native
from attnzoo.backends.cpu.fused import LOG2E
from attnzoo.backends.cpu.memory import Scratch, fresh_empty, fresh_like, scratch_buffer
from attnzoo.masks import causal_offset
from attnzoo.mechanisms._softmax import finite_or_zero
from attnzoo.ops import needs_grad, override

# ---------------------------------------------------------------------------------------------
# Feature maps


@dataclass(frozen=True)
class PointwiseMap:
    """An elementwise feature map φ whose derivative is a function of its value: φ'(x) =
    ``derivative(φ(x))``. Under autograd (the causal engine's keys before the first query) it
    keeps only φ for its backward; the engine's backwards recompute it without a graph and
    take dx = dφ ⊙ φ'(x) (:class:`_Recomputed`), cheaper than autograd through every block's
    map. With ``takes_scratch``, ``fn(x, scratch)`` writes φ and its temporaries into a
    Scratch's buffers (without autograd; None: fresh)."""

    fn: Callable[..., torch.Tensor]  # x -> φ(x), plain (takes_scratch: (x, scratch) -> φ(x))
    derivative: Callable[[torch.Tensor], torch.Tensor]  # φ(x) -> φ'(x)
    takes_scratch: bool = False

    def __call__(self, x: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
        if needs_grad(x):
            return _Pointwise.apply(x, self)
        return self.fn(x, scratch) if self.takes_scratch else self.fn(x)


def apply_map(phi, x: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """φ(x), into ``scratch`` where φ takes one (a true ``takes_scratch`` attribute: called
    ``phi(x, scratch)``); any other map: fresh."""
    return phi(x, scratch) if getattr(phi, "takes_scratch", False) else phi(x)


class _Pointwise(torch.autograd.Function):
    """A :class:`PointwiseMap` keeping only φ for its backward."""

    @staticmethod
    def forward(ctx, x, phi_map):
        phi = phi_map(x)  # (no grad in here: plain)
        ctx.save_for_backward(phi)
        ctx.derivative = phi_map.derivative
        return phi

    @staticmethod
    def backward(ctx, grad):
        (phi,) = ctx.saved_tensors
        return grad * ctx.derivative(phi), None


# log of the smallest normal number: torch's exp is slow below it (subnormal or 0 results)
_EXP_FLOOR = {dtype: math.log(torch.finfo(dtype).tiny) for dtype in (torch.float32, torch.float64)}


def _elu_plus_one(x, scratch=None):
    """φ(x) = elu(x) + 1 = e^min(x, 0) + max(x, 0): two clamps, an exp in place and an add, four
    passes (torch's float32 ``elu`` runs on its slower ``expm1``). In float32 and float64 the
    exponent is first raised to log of the smallest normal number (−87.3 in float32), where
    torch's ``exp`` is slow on subnormal or 0 results; φ moves by less than that number (and
    stays > 0). Its derivative is min(φ, 1): e^x below 0, 1 above."""
    pos = torch.clamp(x, min=0, out=scratch_buffer(scratch, "elu_pos", x.shape))
    neg = torch.clamp(x, min=_EXP_FLOOR.get(x.dtype), max=0, out=scratch_buffer(scratch, "phi", x.shape))
    return neg.exp_().add_(pos)


ELU = PointwiseMap(_elu_plus_one, lambda phi: phi.clamp(max=1.0), takes_scratch=True)


class _FavorMap(torch.autograd.Function):
    """performer's ``(φ(x), c)`` (:func:`~attnzoo.mechanisms.performer.favor_features`) by
    :func:`_base2_features`, with the backward written out: cheaper than autograd through the
    map's elementwise steps. With ``stabilise="row"`` the logits leave out −‖x'‖²/2, which the
    row's max cancels (the same φ, two passes fewer; c is then the max of W x').

    x (B, H, n, D); W (m, D) and Wt = Wᵀ (D, m), both contiguous, neither needing gradients;
    ``stabilise`` "row", "all" (the max over the block's real keys, ``key_mask`` (B, n) or None)
    or "none". Backward, with l the logits: dl = dφ ⊙ φ, plus dc = d c_out − Σ dl (over c's
    span) at the max; dx' = dl W − x' Σ_f dl (no second term for "row"); dx = √s dx'.
    As autograd's amax, dc is split among the positions of the max, found as the largest
    feature (a logit within rounding of the max shares in it too: a subgradient of the max,
    and dc ≈ 0 anyway, c cancelling in the normalised output but for eps).
    """

    @staticmethod
    def forward(ctx, x, W, Wt, root_s, stabilise, key_mask):
        xs = x * root_s  # (B, H, n, D)
        feat, c = _base2_features(xs, Wt, stabilise, key_mask)
        ctx.save_for_backward(xs, W, feat, c)
        row = stabilise == "row"
        ctx.root_s, ctx.key_mask, ctx.row, ctx.dims = root_s, key_mask, row, (-1,) if row else (-1, -2)
        return feat, c

    @staticmethod
    def backward(ctx, d_feat, d_c):
        xs, W, feat, c = ctx.saved_tensors
        dl = d_feat * feat  # d logits through the exp, (B, H, n, m)
        if c is not None:  # c shifts every logit of its span, and is the largest of them
            dc = -dl.sum(ctx.dims, keepdim=True) if d_c is None else d_c - dl.sum(ctx.dims, keepdim=True)
            if bool(dc.any()):  # (exactly 0 where c's shift cancels: the streamed backward's blocks
                # that hold no max, which skip these passes)
                real = feat if ctx.key_mask is None else feat.masked_fill(
                    ~ctx.key_mask[:, None, :, None], 0.0)
                top = real.div(real.amax(ctx.dims, keepdim=True).clamp_(min=torch.finfo(real.dtype).tiny))
                top.floor_()  # 1 where the max is (the largest real feature: features are > 0), else 0;
                # a float mask: torch's CPU kernels of bool ones are not vectorised
                share = dc.div_(top.sum(ctx.dims, keepdim=True)).masked_fill_(~torch.isfinite(c), 0.0)
                dl.addcmul_(top, share)  # (no real key: c is no logit, and gets nothing)
        dxs = dl @ W  # (B, H, n, D)
        if not ctx.row:
            dxs.addcmul_(xs, dl.sum(-1, keepdim=True), value=-1)
        return dxs * ctx.root_s, None, None, None, None, None


def _base2_features(xs, Wt, stabilise, key_mask, scratch=None):
    """:class:`_FavorMap`'s ``(φ, c)`` in three passes over the (n, m) logits: made in base 2 by
    the product itself, l₂ = x'·(Wᵀ log2 e) (the rounding of Wᵀ log2 e is of the order of the
    product's own); c₂ (the row's max of l₂, or the block's of l₂ − ‖x'‖² log2 e / 2), that
    norm and the 1/√m go into one (n, 1) shift, and φ = 2^(l₂ − shift). Returns c in natural
    units (None for "none"). φ and the block's temporaries go into ``scratch``'s buffers if
    given (inference)."""
    out = scratch_buffer(scratch, "logits", (*xs.shape[:-1], Wt.shape[1]))
    logits = torch.matmul(xs, Wt * LOG2E, out=out)  # (B, H, n, m): W x' in base 2
    shift = 0.5 * math.log2(Wt.shape[1])  # the 1/√m
    c = None
    if stabilise == "row":
        c = logits.amax(-1, keepdim=True)  # (B, H, n, 1)
        shift = c + shift
    else:
        squares = torch.mul(xs, xs, out=scratch_buffer(scratch, "squares", xs.shape))
        norm = squares.sum(-1, keepdim=True).mul_(0.5 * LOG2E)  # (B, H, n, 1): ‖x'‖²/2 in base 2
        shift = norm + shift
        if stabilise == "all":  # the largest logit of the block's real keys: (B, H, 1, 1)
            rows = logits.amax(-1, keepdim=True).sub_(norm)  # (B, H, n, 1)
            c = (rows if key_mask is None else rows.masked_fill(~key_mask[:, None, :, None], -torch.inf)
                 ).amax(dim=(-1, -2), keepdim=True)
            shift = shift + finite_or_zero(c)
    feat = logits.sub_(shift).exp2_()
    return feat, None if c is None else c / LOG2E


@dataclass(frozen=True, eq=False)
class _Favor:
    """performer's maps for the engine: called, the query map (x, scratch) -> φ (stabilised by its
    row's max); :meth:`keys`, the key map (x, mask, scratch) -> (φ, c), stabilised as ``stabilise``
    says ("all" or "none"). By :class:`_FavorMap` where there is no scratch, else into it."""

    W: torch.Tensor  # (m, D), contiguous
    Wt: torch.Tensor  # Wᵀ (D, m), contiguous
    root_s: float
    stabilise: str
    takes_scratch = True  # (a class attribute: see apply_map)

    def __call__(self, x, scratch=None):
        return self.features(x, "row", None, scratch)[0]

    def keys(self, x, mask, scratch=None):
        return self.features(x, self.stabilise, mask, scratch)

    def features(self, x, stabilise, mask, scratch):
        if scratch is None:
            return _FavorMap.apply(x, self.W, self.Wt, self.root_s, stabilise, mask)
        xs = torch.mul(x, self.root_s, out=scratch("xs", x.shape))
        return _base2_features(xs, self.Wt, stabilise, mask, scratch)


def _engine_maps(phi, dtype):
    """(query map, key map, the native kernels or None) for the FeatureMap ``phi``, or None where
    this backend does not run it."""
    if phi.name == "elu":
        return ELU, PlainKeyMap(ELU), native
    if phi.name == "favor":
        W, scale, stabilise = phi.params
        if dtype not in (torch.float32, torch.float64) or needs_grad(W):
            return None
        favor = _Favor(W.contiguous(), W.T.contiguous(), math.sqrt(scale), stabilise)
        return favor, favor.keys, None
    safe = phi.name == "taylor" or phi.derivative is not None or not torch.is_grad_enabled()
    if phi.key is None and safe:
        # a map of each row: as given, or by its derivative. A user's map without a derivative only
        # without grad mode: the engine's backward differentiates a map in x alone, and such a map
        # may close over tensors that need gradients of their own
        rows = phi.query if phi.derivative is None else PointwiseMap(phi.query, phi.derivative)
        return rows, PlainKeyMap(rows), None
    return None


# ---------------------------------------------------------------------------------------------
# The overrides


@override("kernel_attention")
def kernel_attention(q, k, v, phi, *, causal, key_mask, eps, chunk, state=None):
    """``kernel_attention`` on CPU tensors (see the module doc); NotImplemented elsewhere."""
    maps = _engine_maps(phi, q.dtype)
    if q.device.type != "cpu" or maps is None:
        return NotImplemented
    phi_q, phi_k, kernels = maps
    if not causal:
        ran = None if kernels is None else kernels.linear(q, k, v, key_mask, eps)
        if ran is None:
            ran = stream_kernel(q, k, v, phi_k, Normalised(phi_q, eps), key_mask=key_mask)
        return ran, None
    return _causal(q, k, v, phi_q, phi_k, kernels, phi.width, key_mask, eps, chunk, state)


@override("kernel_attention_flops")
def kernel_flops(B, H, Lq, Lk, Fdim, Dv, *, causal, chunk, map_name):
    """Where causal elu + 1 runs as the C recurrence: its 4·F·Dv + 2·F a position (after the keys
    before the first query, streamed into the state), no chunk products."""
    if not (causal and map_name == "elu" and native.available()):
        return NotImplemented
    n = min(Lq, Lk)
    return B * H * (2.0 * max(Lk - Lq, 0) * Fdim * Dv + 4.0 * n * Fdim * Dv + 2.0 * n * Fdim)


# ---------------------------------------------------------------------------------------------
# Block sizes


STREAM_POSITIONS = 4096  # non-causal: positions of a block over all batch entries and heads


def stream_rows(t: torch.Tensor) -> int:
    """Positions per block of the non-causal stream: about STREAM_POSITIONS over all batch
    entries and heads of ``t`` (B, H, L, ·), whatever the feature width: the per-block overhead
    of the maps and their backward outweighs the cache, so the best block follows the
    positions."""
    return max(1, STREAM_POSITIONS // (t.shape[0] * t.shape[1]))


CAUSAL_POSITIONS = 2048  # positions of a causal block over all batch entries and heads


def causal_rows(B: int, H: int, chunk: int) -> int:
    """Positions per block of the causal engine: whole chunks, about CAUSAL_POSITIONS over all
    batch entries and heads, whatever the feature width (as :func:`stream_rows`: the chunk
    algebra's per-block overhead outweighs the cache)."""
    return chunk * max(1, CAUSAL_POSITIONS // (B * H) // chunk)


def _backward_rows(t: torch.Tensor) -> int:
    """Query positions per block in the streamed backward: half the forward's (a block's
    features have their gradients beside them), unless that goes below 128 (small matmuls
    run slowly); its key blocks too, unless the key map has a constant c (then they are the
    forward's: see :class:`_StreamedKernel`)."""
    rows = stream_rows(t)
    return max(min(128, rows), rows // 2)


# ---------------------------------------------------------------------------------------------
# Non-causal: the streamed key state, then the query blocks


def key_state(k, v, phi_k, key_mask, scratch=None):
    """S = Σ_j φ(k_j) v_jᵀ (B, H, F, Dv) and z = Σ_j φ(k_j) (B, H, F), streamed over key blocks.

    ``phi_k(k_block, mask_block, scratch=None)`` gives ``(features (B, H, n, F), c)`` (with a
    Scratch, it may write them into its buffers): the block's true features are features·e^c,
    c (B, H, 1, F or 1) or None (no factor). Blocks are merged by rescaling to the largest c
    so far, so S and z share one factor e^(−c_max) (which cancels in every normalised use)
    and no (Lk, F) tensor exists. Padded keys (``key_mask`` False) contribute nothing.
    Returns ``(S, z, c_max)``: block b's features enter S as features·exp(c_b − c_max), a
    non-finite c_max (no real key) counting as 0; (None, None, None) without keys.
    """
    rows = stream_rows(k)
    S = z = c = None
    for k_blk, v_blk, mask in key_blocks(k, v, key_mask, rows):
        feat, c_blk = _key_features(phi_k, k_blk, mask, scratch)  # (B, H, n, F)
        S_blk, z_blk = feat.transpose(-1, -2) @ v_blk, feat.sum(2)
        if S is None:
            S, z, c = S_blk, z_blk, c_blk
        elif c is None:
            S, z = S + S_blk, z + z_blk
        else:
            new = torch.maximum(c, c_blk)
            safe = finite_or_zero(new)
            a, a_blk = torch.exp(c - safe), torch.exp(c_blk - safe)  # (B, H, 1, F or 1)
            S = S * a.transpose(-1, -2) + S_blk * a_blk.transpose(-1, -2)
            z = z * a.squeeze(2) + z_blk * a_blk.squeeze(2)
            c = new
    return S, z, c


def key_blocks(k, v, key_mask, rows):
    """(k, v, mask) blocks of ``rows`` positions (mask None without padding). By ``split``:
    its backward joins the blocks' gradients in one pass, where slicing each block would
    zero-fill a whole-size gradient per block."""
    if k.shape[2] == 0:
        return zip()  # (split would give one empty block)
    masks = [None] * -(-k.shape[2] // rows) if key_mask is None else key_mask.split(rows, 1)
    return zip(k.split(rows, 2), v.split(rows, 2), masks, strict=True)


def stream_kernel(q, k, v, phi_k, finish, *, key_mask):
    """Non-causal kernel attention streamed: S, z, _ = :func:`key_state`, then ``finish(q_block,
    S, z)`` (B, H, n, Dv) for each block of queries.

    ``finish`` is an object: ``finish(q_block, S, z, out, scratch)`` the block's output (written
    into ``out`` unless it is None: :func:`query_blocks`; its temporaries into ``scratch``, a
    Scratch the whole call shares, unless it is None), and ``finish.grad(q_block, g, S, z)`` ->
    (dq, dS, dz) of the block, from that output's gradient g (:class:`Normalised`).

    Under autograd the backward recomputes each block's features instead of keeping them
    (training memory O(L·(D + Dv)), not O(L·F)): query blocks give dS, dz and dq by
    ``finish.grad``; key blocks then take d feature = (v dSᵀ + dz)·e^(c_b − c_max)
    and dv = feature·dS, and dk back through ``phi_k`` (:class:`_Recomputed`; the constants
    included: S and z carry e^(−c_max), which matters where a normaliser's eps does not
    scale with them).
    """
    if needs_grad(q, k, v):
        return _StreamedKernel.apply(q, k, v, key_mask, phi_k, finish)
    scratch = None if torch.is_grad_enabled() else Scratch(q)
    return _stream_forward(q, k, v, key_mask, phi_k, finish, scratch)[0]


def _stream_forward(q, k, v, key_mask, phi_k, finish, scratch=None):
    """(out, S, z, c_max): the key state, then ``finish`` over the query blocks, their features
    and products in ``scratch``'s buffers if given: only without grad mode, where
    :func:`query_blocks` writes each block's output into its slice of the result (no block's
    output stays in the scratch). Inference only: in a training step, whose backward makes
    its own temporaries, a scratch in the forward costs more than it saves."""
    S, z, c = key_state(k, v, phi_k, key_mask, scratch)
    return query_blocks(q, lambda q_blk, out: finish(q_blk, S, z, out, scratch), S), S, z, c


def _sum_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the dims where ``like`` has size 1 (keepdim): (B, H, 1, F) -> c's shape."""
    dims = [d for d in range(t.dim()) if like.shape[d] == 1 and t.shape[d] != 1]
    return t.sum(dims, keepdim=True) if dims else t  # sum([]) would reduce every dim


class _StreamedKernel(torch.autograd.Function):
    """stream_kernel with a backward that recomputes the features block by block."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, phi_k, finish):
        out, S, z, c = _stream_forward(q, k, v, key_mask, phi_k, finish)
        ctx.save_for_backward(q, k, v, key_mask, S, z, c)
        ctx.maps = phi_k, finish
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, key_mask, S, z, c = ctx.saved_tensors
        phi_k, finish = ctx.maps
        dq, dk, dv = fresh_like(q, k, v)
        safe_c = None if c is None else finite_or_zero(c)
        dS, dz = _query_grads(q, grad, S, z, finish, dq, _backward_rows(q))
        dz = dz.unsqueeze(2)  # (B, H, 1, F)
        if c is not None:  # d c_max: (B, H, 1, F)
            d_c_max = -((dS * S).sum(-1) + dz.squeeze(2) * z).unsqueeze(2)
        # with a constant c, the forward's key blocks: c_blk == c below needs their logits bit
        # for bit, and a matmul of another shape may round them otherwise; without, half-size
        # ones (a block's features have their gradients beside them)
        rows, start = _backward_rows(k) if c is None else stream_rows(k), 0
        for k_blk, v_blk, mask in key_blocks(k, v, key_mask, rows):
            n = slice(start, start + k_blk.shape[2])
            start += k_blk.shape[2]
            keys = _Recomputed(phi_k, k_blk, key=True, mask=mask)
            feat, c_blk = keys.features, keys.c  # (B, H, n, F)
            d_feat = torch.baddbmm(dz.flatten(0, 1), v_blk.flatten(0, 1),
                                   dS.transpose(-1, -2).flatten(0, 1)).view(feat.shape)  # v dSᵀ + dz
            d_c = None
            if c is None:
                dv[:, :, n] = feat @ dS
            else:
                a = torch.exp(c_blk - safe_c)  # (B, H, 1, F or 1): the block's factor in S
                dv[:, :, n] = (feat * a) @ dS
                d_feat.mul_(a)
                # e^(c_b − c_max) cancels the block's own c_b in feat; c_max is the c_b of the
                # block that holds the max. Summed in one reduction, as a map sums its d
                # logits: where the block holds no max, the map's d c_b then comes out
                # exactly 0 (performer's skips routing it to the max)
                d_c = _sum_to(d_feat * feat, c_blk)
                d_c += _sum_to(torch.where(c_blk == c, d_c_max, 0.0), c_blk)
            dk[:, :, n] = keys.grad(d_feat, d_c)
        return dq, dk, dv, None, None, None


def _query_grads(q, grad, S, z, finish, dq, rows):
    """The streamed backward's query side, block by block by ``finish.grad``: writes dq in
    place and returns (dS (B, H, F, Dv), dz (B, H, F))."""
    dS = dz = None
    for start in range(0, q.shape[2], rows):
        n = slice(start, start + rows)
        dq[:, :, n], dS_blk, dz_blk = finish.grad(q[:, :, n], grad[:, :, n], S, z)
        dS, dz = (dS_blk, dz_blk) if dS is None else (dS.add_(dS_blk), dz.add_(dz_blk))
    return dS, dz


class _Recomputed:
    """A block's features recomputed in a backward, ``features`` (and the key map's ``c``,
    else None), detached, and :meth:`grad`, the way back to the block. A query map is
    ``phi(x)``; a key map (``key``) ``phi(x, mask) -> (features, c)``. A :class:`PointwiseMap`
    (or a :class:`PlainKeyMap` of one) goes back by its derivative, without a graph; any
    other map by autograd through it."""

    def __init__(self, phi, x, *, key=False, mask=None):
        self.pointwise, self.mask = _pointwise(phi), mask
        self.x = x.detach().requires_grad_(self.pointwise is None)
        with torch.enable_grad():
            out = _key_features(phi, self.x, mask) if key else phi(self.x)
        self.out = out if isinstance(out, tuple) else (out, None)  # (with their graphs)
        self.features, self.c = (None if t is None else t.detach() for t in self.out)

    def grad(self, d_features, d_c=None):
        """dx from d features (and d c, for a key map's c; None: no gradient to c). A pointwise
        map writes dx over ``d_features``: callers pass a fresh tensor they do not use again."""
        if self.pointwise is None:
            has_c = d_c is not None
            torch.autograd.backward(self.out[:1 + has_c], (d_features, d_c)[:1 + has_c])
            return self.x.grad
        dx = d_features.mul_(self.pointwise.derivative(self.features))
        return dx if self.mask is None else dx.masked_fill_(~self.mask[:, None, :, None], 0.0)


def _pointwise(phi):
    """The :class:`PointwiseMap` a query map is, or a key map applies; else None."""
    inner = phi.phi if isinstance(phi, PlainKeyMap) else phi
    return inner if isinstance(inner, PointwiseMap) else None


def _key_features(phi_k, k_blk, mask, scratch=None):
    """``phi_k(k_blk, mask, scratch)`` with padded keys' features set to 0 (a fill, not a product:
    a padded key's feature may overflow)."""
    feat, c = phi_k(k_blk, mask, scratch)
    if mask is not None:
        feat = feat.masked_fill(~mask[:, None, :, None], 0.0)
    return feat, c


@dataclass(frozen=True)
class PlainKeyMap:
    """A key feature map for the engine from a map of each row: no block constant."""

    phi: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, k_blk, mask, scratch=None):
        return apply_map(self.phi, k_blk, scratch), None


def query_blocks(q, fn, like):
    """``fn(q_block, out)`` over blocks of queries, joined along the sequence into (B, H, L, X),
    the dtype and last size of ``like``. Without autograd each block is written into ``out``,
    its slice of one preallocated output (a finish that divides divides into it: no copy);
    under autograd ``out`` is None and the blocks are concatenated (:func:`join_blocks`)."""
    blocks = q.split(stream_rows(q), 2)
    if torch.is_grad_enabled():
        return join_blocks((fn(q_blk, None) for q_blk in blocks), q.shape[2])
    out, s = fresh_empty(*q.shape[:3], like.shape[-1], like=like), 0
    for q_blk in blocks:
        fn(q_blk, out[:, :, s:s + q_blk.shape[2]])
        s += q_blk.shape[2]
    return out


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


@dataclass(frozen=True)
class Normalised:
    """The non-causal finish: a query block's φ(q)S / (φ(q)·z + eps), and its backward written
    out (cheaper than autograd through it)."""

    phi_q: Callable[[torch.Tensor], torch.Tensor]
    eps: float

    def __call__(self, q_blk, S, z, out=None, scratch=None):
        f = apply_map(self.phi_q, q_blk, scratch)  # (B, H, n, F)
        num = torch.matmul(f, S, out=scratch_buffer(scratch, "num", (*f.shape[:-1], S.shape[-1])))
        return torch.div(num, self._den(f, z), out=out)

    def _den(self, f, z):
        """φ(q)·z + eps (B, H, n, 1), as the product of φ(q) and z's column (faster here than
        ``vecdot``'s product and sum)."""
        return torch.matmul(f, z.unsqueeze(-1)).add_(self.eps)

    def grad(self, q_blk, g, S, z):
        """(dq, dS, dz) of a query block from the gradient g of its output: with num = φS,
        den = φ·z + eps, g_num = g/den and g_den = −(g_num·num)/den, dφ = g_num Sᵀ + g_den zᵀ,
        dS = φᵀ g_num, dz = φᵀ g_den; dq back through φ alone (:class:`_Recomputed`). g_num·num
        is read as φ·(g_num Sᵀ), from the product dφ needs anyway: neither num nor the forward's
        output is kept for it."""
        queries = _Recomputed(self.phi_q, q_blk)
        fd = queries.features  # (B, H, n, F)
        den = self._den(fd, z)
        g_num = g / den  # (B, H, n, Dv)
        d_f = g_num @ S.transpose(-1, -2)  # (B, H, n, F)
        g_den = torch.linalg.vecdot(fd, d_f).unsqueeze(-1).div_(den).neg_()  # (B, H, n, 1)
        dS, dz = fd.transpose(-1, -2) @ g_num, (fd * g_den).sum(2)
        return queries.grad(d_f.addcmul_(g_den, z.unsqueeze(-2))), dS, dz


# ---------------------------------------------------------------------------------------------
# Causal: aligned blocks in order, each by chunked prefix sums from the state before it


def _causal(q, k, v, phi_q, phi_k, kernels, width, key_mask, eps, chunk, state):
    """(out, (S, z) after) of causal kernel attention: the keys every query sees (Lk > Lq) into
    the state, the queries that see none (Lq > Lk) zeros, and the aligned rest by the C
    recurrence (``kernels``, where it runs) or blocks of :func:`causal_rows` positions in order
    (training: :class:`_CausalBlocks`, which recomputes them backward from the saved states)."""
    Lq, Lk = q.shape[2], k.shape[2]
    off = causal_offset(Lq, Lk)
    blind, start = max(0, -off), max(0, off)  # queries that see nothing; keys everyone sees
    rows = causal_rows(*q.shape[:2], chunk)
    (q_blind, q_al), (k_before, k_al), (v_before, v_al) = (
        _split_at(q, blind, 2), _split_at(k, start, 2), _split_at(v, start, 2))
    m_before, m_al = (None, None) if key_mask is None else _split_at(key_mask, start, 1)
    S, z, _ = key_state(k_before, v_before, phi_k, m_before)  # keys all see (causal maps: c None)
    if state is not None:
        S, z = state if S is None else (state[0] + S, state[1] + z)
    if S is None:
        S, z = q.new_zeros(*q.shape[:2], width, v.shape[-1]), q.new_zeros(*q.shape[:2], width)

    step = _CausalStep(phi_q, phi_k, chunk, eps)
    out = q_al.new_zeros(*q.shape[:2], 0, v.shape[-1])
    if Lq > blind:
        ran = None if kernels is None else kernels.causal_linear(q_al, k_al, v_al, S, z, m_al, eps)
        if ran is not None:  # natively, with its own backward
            out, S, z = ran
        elif needs_grad(q, k, v, S, z):
            out, S, z = _CausalBlocks.apply(q_al, k_al, v_al, S, z, m_al, step, rows)
        else:  # a scratch only without grad mode, where join_blocks copies each block out before
            # the next overwrites it
            out, S, z = _causal_run(q_al, k_al, v_al, (S, z), m_al, step, rows,
                                    scratch=None if torch.is_grad_enabled() else Scratch(q))
    if blind:  # queries before the first key see nothing
        out = torch.cat([v.new_zeros(*q_blind.shape[:3], v.shape[-1]), out], 2)
    return out, (S, z)


def _split_at(t, n, dim):
    """``t`` split before position n of ``dim``; t itself as the second part when n = 0 (a split's
    backward would copy the whole gradient into a new tensor)."""
    return (t.narrow(dim, 0, 0), t) if n == 0 else t.split([n, t.shape[dim] - n], dim)


def _causal_run(q, k, v, state, key_mask, step, rows, states=None, scratch=None):
    """``step`` over aligned blocks of ``rows`` positions in order, each from the state (S, z)
    the one before left: (out (B, H, L, Dv), S, z after); ``states`` collects the state before each;
    each block's temporaries go into ``scratch`` if given (its output is copied out at once)."""
    final = [state]

    def blocks():
        for q_blk, (k_blk, v_blk, mask) in zip(q.split(rows, 2), key_blocks(k, v, key_mask, rows),
                                               strict=True):
            if states is not None:
                states.append(final[0])
            o, *final[0] = step(q_blk, k_blk, v_blk, mask, *final[0], scratch=scratch)
            yield o

    out = join_blocks(blocks(), q.shape[2])
    return (out, *final[0])


class _CausalBlocks(torch.autograd.Function):
    """The causal engine's aligned blocks with a backward that walks them last to first,
    recomputing each from its saved starting state S (B, H, F, Dv), z (B, H, F) by
    ``step.grad``: training keeps the states, not every block's features and chunk products,
    and dq, dk, dv are written in place."""

    @staticmethod
    def forward(ctx, q, k, v, S, z, key_mask, step, rows):
        states = []
        out, S, z = _causal_run(q, k, v, (S, z), key_mask, step, rows, states)
        ctx.save_for_backward(q, k, v, key_mask, out, *(t for state in states for t in state))
        ctx.step, ctx.rows = step, rows
        return out, S, z

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        q, k, v, key_mask, out, *states = ctx.saved_tensors
        rows = ctx.rows  # (unused outputs' gradients come as zeros: materialize_grads)
        dq, dk, dv = fresh_like(q, k, v)
        blocks = list(zip(q.split(rows, 2), key_blocks(k, v, key_mask, rows), out.split(rows, 2),
                          g_out.split(rows, 2), strict=True))
        for n in reversed(range(len(blocks))):
            q_blk, (k_blk, v_blk, mask), o, g_o = blocks[n]
            at = slice(n * rows, n * rows + q_blk.shape[2])
            dq[:, :, at], dk[:, :, at], dv[:, :, at], g_S, g_z = ctx.step.grad(
                q_blk, k_blk, v_blk, mask, *states[2 * n:2 * n + 2], o, g_o, g_S, g_z)
        return dq, dk, dv, g_S, g_z, None, None, None


@dataclass(frozen=True)
class _CausalStep:
    """One aligned block of the causal engine from the state (S, z) before it (``__call__``),
    and its backward (``grad``): the chunk algebra by :func:`_causal_prefix_grad`, then
    back through the feature maps alone (:class:`_Recomputed`)."""

    phi_q: Callable
    phi_k: Callable
    chunk: int
    eps: float

    def __call__(self, q_blk, k_blk, v_blk, mask, S, z, scratch=None):
        parts = (None, None) if scratch is None else (scratch.part("q"), scratch.part("k"))
        f_q = apply_map(self.phi_q, q_blk, parts[0])  # (each map's buffers of its own: both are alive)
        f_k = _key_features(self.phi_k, k_blk, mask, parts[1])[0]
        return _causal_prefix(f_q, f_k, v_blk, S, z, self.chunk, self.eps, scratch)

    def grad(self, q_blk, k_blk, v_blk, mask, S, z, out, g_out, g_S, g_z):
        """(dq, dk, dv, dS, dz) of the block from its output and the gradients of its (out, S, z)."""
        queries = _Recomputed(self.phi_q, q_blk)
        keys = _Recomputed(self.phi_k, k_blk, key=True, mask=mask)
        d_fq, d_fk, dv, dS, dz = _causal_prefix_grad(queries.features, keys.features, v_blk, S, z,
                                                     self.chunk, self.eps, out, g_out, g_S, g_z)
        return queries.grad(d_fq), keys.grad(d_fk), dv, dS, dz


def _causal_prefix(phi_q, phi_k, v, S0, z0, chunk, eps, scratch=None):
    """Causal normalised kernel attention for aligned queries and keys, from the state before them.

    phi_q, phi_k (B, H, L, F), v (B, H, L, Dv); S0 (B, H, F, Dv) and z0 (B, H, F), the state
    before. Returns (out (B, H, L, Dv), S, z after). Chunked: within a chunk a masked
    (chunk × chunk) product A; across chunks each chunk's queries read the state before it,
    (S0, z0) plus the per-chunk states (B, H, L/chunk, F, Dv) of the chunks before. The
    normaliser is A's row sums plus φ(q)·z: no ones column on v (a product with Dv + 1
    columns runs far below the machine's matmul rate). Memory O(L·chunk + (L/chunk)·F·Dv),
    time O(L·(chunk + F)·Dv). With a Scratch (inference) the chunk terms and the output go
    into its buffers: ``out`` is then a view of one, valid until the next call with that
    scratch.
    """
    L = phi_q.shape[2]
    pq, pk, pv = _chunked((phi_q, phi_k, v), chunk, scratch)
    c = _ChunkTerms(pq, pk, pv, S0, z0, eps, scratch)
    num = _bmm_add(_bmm(c.scores, pv, scratch_buffer(scratch, "num", pv.shape)), pq, c.S_before)
    out = num.div_(c.den.unsqueeze(-1)).flatten(2, 3)[:, :, :L]  # (B, H, L, Dv)
    return out, c.S_before[:, :, -1] + c.S_c[:, :, -1], c.z_before[:, :, -1] + c.z_c[:, :, -1]


def _causal_prefix_grad(phi_q, phi_k, v, S0, z0, chunk, eps, out, g, g_S, g_z):
    """The gradients of :func:`_causal_prefix`'s (out, S, z) by (g, g_S, g_z), written out:
    (d phi_q, d phi_k, dv, dS0, dz0); ``out`` is the forward's output (B, H, L, Dv). With
    g_num = g/den, g_den = −g_num·out and
    dA = tril(g_num pvᵀ + g_den 1ᵀ) in each chunk: dpq = dA pk + g_num S_beforeᵀ + g_den z_beforeᵀ,
    dpk = dAᵀ pq + pv dS_cᵀ + dz_c, dpv = Aᵀ g_num + pk dS_c, where a chunk's own state
    takes the gradients of the states of the chunks after it (dS_c = Σ_later pqᵀ g_num + g_S)."""
    L = phi_q.shape[2]
    pq, pk, pv, pg, po = _chunked((phi_q, phi_k, v, g, out), chunk)
    c = _ChunkTerms(pq, pk, pv, S0, z0, eps)
    den = c.den.flatten(2)
    den[:, :, L:] = 1.0  # padding rows (g = 0 there): no 0/0 when eps = 0
    g_num = pg / c.den.unsqueeze(-1)  # (B, H, nc, chunk, Dv)
    g_den = torch.linalg.vecdot(g_num, po).neg_()  # (B, H, nc, chunk)
    dA = _bmm(g_num, pv.transpose(-1, -2)).add_(g_den.unsqueeze(-1)).tril_()  # (B, H, nc, chunk, chunk)
    d_pq = _bmm_add(_bmm(dA, pk), g_num, c.S_before.transpose(-1, -2)).addcmul_(
        g_den.unsqueeze(-1), c.z_before.unsqueeze(-2))
    dS_before, dz_before = _bmm(pq.transpose(-1, -2), g_num), (pq * g_den.unsqueeze(-1)).sum(3)
    dS_c, dz_c = _running(dS_before, g_S, reverse=True), _running(dz_before, g_z, reverse=True)
    d_pk = _bmm_add(_bmm(pv, dS_c.transpose(-1, -2)), dA.transpose(-1, -2), pq).add_(dz_c.unsqueeze(-2))
    d_pv = _bmm_add(_bmm(pk, dS_c), c.scores.transpose(-1, -2), g_num)
    return (*(t.flatten(2, 3)[:, :, :L] for t in (d_pq, d_pk, d_pv)),
            dS_before.sum(2) + g_S, dz_before.sum(2) + g_z)


def _chunked(ts, chunk, scratch=None):
    """(B, H, L, X) tensors zero-padded to whole chunks, as contiguous (B, H, L/chunk, chunk, X):
    a block sliced from a longer sequence is copied once here, not by each bmm that flattens it
    (into ``scratch``'s buffers if given)."""
    L = ts[0].shape[2]
    n = L + -L % chunk
    return [_contiguous_padded(t, n, scratch_buffer(scratch, f"chunked{i}", (*t.shape[:2], n, t.shape[3])))
            .unflatten(2, (-1, chunk)) for i, t in enumerate(ts)]


def _contiguous_padded(t, n, out=None):
    """``t`` (B, H, L, X) zero-padded to n positions, contiguous: ``t`` itself where it is, else a
    copy (into ``out`` if given)."""
    if t.shape[2] == n and t.is_contiguous():
        return t
    if out is None:
        return F.pad(t, (0, 0, 0, n - t.shape[2])) if n > t.shape[2] else t.contiguous()
    out[:, :, :t.shape[2]] = t
    out[:, :, t.shape[2]:] = 0.0
    return out


def _running(x, x0, reverse=False, out=None):
    """The state before each chunk, x0 + Σ_{c' < c} x[:, :, c'] (B, H, nc, ...); ``reverse``: the
    gradient after each, x0 + Σ_{c' > c} x[:, :, c']. A loop of adds over a block's few chunks
    (as fast as a triangular matmul, and plain sums), stacked into ``out`` if given."""
    order = range(x.shape[2] - 1, 0, -1) if reverse else range(x.shape[2] - 1)
    acc = [x0]
    for c in order:
        acc.append(acc[-1] + x[:, :, c])
    return torch.stack(acc[::-1] if reverse else acc, 2, out=out)


def _bmm(a, b, out=None):
    """a @ b over (B, H, nc, ...) tensors by one bmm over the flattened (B·H·nc) batch (into
    ``out``, contiguous, if given)."""
    flat = None if out is None else out.flatten(0, 2)
    return torch.bmm(a.flatten(0, 2), b.flatten(0, 2), out=flat).unflatten(0, a.shape[:3])


def _bmm_add(t, a, b):
    """t + a @ b over (B, H, nc, ...) tensors, into t (a fresh product) by one baddbmm_."""
    t.flatten(0, 2).baddbmm_(a.flatten(0, 2), b.flatten(0, 2))  # (t is fresh: in place, no copy)
    return t


class _ChunkTerms:
    """The chunked causal pass's terms (see :func:`_causal_prefix`), for its forward and backward:
    scores A (B, H, nc, chunk, chunk), the chunks' states S_c (B, H, nc, F, Dv) and z_c
    (B, H, nc, F), the states before each chunk and den (B, H, nc, chunk). (The numerator
    A pv + pq S_before is the forward's alone: the backward reads the saved output instead.)
    With a ``scratch`` (inference) each is written into its buffer: fresh ones of a block's
    size are faulted in from the OS again and again."""

    def __init__(self, pq, pk, pv, S0, z0, eps, scratch=None):
        chunk, Fdim, Dv = pq.shape[3], pq.shape[-1], pv.shape[-1]

        def buf(name, *size):  # (B, H, nc, *size): the scratch's buffer, or None (fresh)
            return scratch_buffer(scratch, name, (*pq.shape[:3], *size))

        scores = _bmm(pq, pk.transpose(-1, -2), buf("scores", chunk, chunk))
        self.scores = scores.tril_()  # j <= i within the chunk
        self.S_c = _bmm(pk.transpose(-1, -2), pv, buf("S_c", Fdim, Dv))
        self.z_c = torch.sum(pk, 3, out=buf("z_c", Fdim))
        self.S_before = _running(self.S_c, S0, out=buf("S_before", Fdim, Dv))
        self.z_before = _running(self.z_c, z0, out=buf("z_before", Fdim))
        den = _bmm(pq, self.z_before.unsqueeze(-1), buf("den", chunk, 1))  # φ(q)·z as a product
        self.den = den.squeeze(-1).add_(self.scores.sum(-1)).add_(eps)  # (vecdot: a product tensor)
