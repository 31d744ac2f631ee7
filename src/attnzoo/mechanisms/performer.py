"""Performer's FAVOR+ (Choromanski et al., ICLR 2021): positive orthogonal random features."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnzoo._pages import scratch_buffer
from attnzoo.mechanisms._common import LOG2E, exp_, finite_or_zero, given_on_device, softmax_scale
from attnzoo.mechanisms.linear import (
    kernel_attention,
    kernel_flops,
    kernel_reference,
)
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class PerformerOptions:
    nb_features: int = 256  # m random features (used when they are drawn here)
    features: torch.Tensor | None = None  # W (m, D); None = drawn from `generator`
    orthogonal: bool = True  # orthogonal blocks (FAVOR+) rather than i.i.d. Gaussian rows
    eps: float = 1e-6  # added to the normaliser
    chunk: int = 64  # causal: queries per chunk of the prefix-sum engine

    def __post_init__(self):
        if self.nb_features < 1 or self.chunk < 1 or self.eps < 0:
            raise ValueError("performer: need nb_features >= 1, chunk >= 1, eps >= 0")
        if self.features is not None and (not isinstance(self.features, torch.Tensor)
                                          or self.features.dim() != 2):
            raise ValueError("performer: features must be an (m, D) tensor")


def draw_features(m: int, D: int, *, orthogonal: bool, generator=None, device=None) -> torch.Tensor:
    """W (m, D) with rows ~ N(0, I_D) marginally; orthogonal: rows orthogonal within blocks of D,
    each row rescaled to the norm of a Gaussian vector (the paper's construction).

    Departure from the official code (and performer-pytorch's), which take Q of a Gaussian
    block's QR as it comes: LAPACK's Householder QR leaves R's diagonal signs free, and its Q's
    i-th column has a negative i-th entry, always, so the rows are not N(0, I) marginally and
    the softmax-kernel estimate is biased (its error stalled near 5 % however many features).
    Each column is multiplied by the sign of R's diagonal entry, which makes Q uniform on the
    orthogonal group (Mezzadri 2007), as the paper's construction assumes."""
    if not orthogonal:
        return torch.randn(m, D, generator=generator, device=device)
    blocks = []
    for _ in range(math.ceil(m / D)):
        g = torch.randn(D, D, generator=generator, device=device)
        q, r = torch.linalg.qr(g)
        q = torch.where(r.diagonal() < 0, -q, q)  # (D, D): column j times the sign of R_jj: Haar
        blocks.append(q.T)  # rows orthonormal
    W = torch.cat(blocks)[:m]
    norms = torch.randn(m, D, generator=generator, device=device).norm(dim=1, keepdim=True)
    return W * norms


def favor_logits(x: torch.Tensor, W: torch.Tensor, scale: float) -> torch.Tensor:
    """W x' − ‖x'‖²/2 with x' = x·√scale: (B, H, L, m), the log of the unnormalised features."""
    return _logits(x * math.sqrt(scale), W.to(x.dtype).T.contiguous())


def _logits(xs: torch.Tensor, Wt: torch.Tensor) -> torch.Tensor:
    """W x' − ‖x'‖²/2 for x' = ``xs`` (B, H, L, D) and Wt = Wᵀ (D, m), contiguous (a transposed
    view multiplies markedly slower)."""
    return (xs @ Wt).sub_((xs * xs).sum(-1, keepdim=True).mul_(0.5))  # (B, H, L, m)


def key_constant(logits: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """The max over every real key of a (batch, head): (B, H, 1, 1), -inf where there is none."""
    real = logits if key_mask is None else logits.masked_fill(~key_mask[:, None, :, None], -torch.inf)
    return real.amax(dim=(-1, -2), keepdim=True)


def favor_features(x: torch.Tensor, W: torch.Tensor, scale: float, *, stabilise: str,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """φ(x) = exp(W x' − ‖x'‖²/2 − c) / √m with x' = x·√scale, so φ(q)·φ(k) ≈ exp(q·k·scale) e^{-c}.

    ``stabilise="row"``: c = each row's max (queries: cancels in the ratio);
    ``"all"``: c = the max over every real key of a (batch, head) (a common factor
    that cancels; padding, ``key_mask`` False, does not set it); ``"none"``: c = 0
    (causal keys, so no future key sets the constant; W x' − ‖x'‖²/2 <= ‖w‖²/2
    keeps it finite).
    """
    logits = favor_logits(x, W, scale)
    return favor_exp(logits, _constant(logits, stabilise, key_mask))


def _constant(logits: torch.Tensor, stabilise: str, key_mask: torch.Tensor | None):
    """c of :func:`favor_features`' ``stabilise``: (B, H, L, 1) for "row", (B, H, 1, 1) for
    "all", None for "none"."""
    if stabilise == "row":
        return logits.amax(-1, keepdim=True)
    if stabilise == "all":
        return key_constant(logits, key_mask)
    return None


def favor_exp(logits: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """exp(logits − c) / √m (the 1/√m inside the exp); c None = 0, and a non-finite c (no real
    key) counts as 0."""
    shift = 0.5 * math.log(logits.shape[-1])
    shift = shift if c is None else finite_or_zero(c) + shift
    if torch.is_grad_enabled() and logits.requires_grad:
        return exp_(logits - shift)  # autograd keeps logits (for c's max)
    return exp_(logits.sub_(shift))  # callers pass fresh logits


class _FavorMap(torch.autograd.Function):
    """``(φ(x), c)`` as :func:`favor_features` computes them (the fast path's maps), with the
    backward written out: autograd through the map's dozen elementwise steps made the
    streamed backward about five times its forward. With ``stabilise="row"`` the logits
    leave out −‖x'‖²/2, which the row's max cancels (the same φ, two passes fewer; c is
    then the max of W x').

    In float32 and float64 by :func:`_base2_features`: a max, a subtraction and an exp2 over
    the (n, m) logits, where the steps of :func:`favor_features` take up to five passes.

    x (B, H, n, D); W (m, D) and Wt = Wᵀ (D, m), both contiguous; ``stabilise`` as in
    :func:`favor_features` ("all": the max over the block's real keys, ``key_mask`` (B, n)
    or None).
    Backward, with l the logits: dl = dφ ⊙ φ, plus dc = d c_out − Σ dl (over c's span) at
    the max; dx' = dl W − x' Σ_f dl (no second term for "row"); dx = √s dx'; dWᵀ = Σ x'ᵀ dl.
    As autograd's amax, dc is split among the positions of the max, found as the largest
    feature (a logit within rounding of the max shares in it too: a subgradient of the max,
    and dc ≈ 0 anyway, c cancelling in the normalised output but for eps).
    """

    @staticmethod
    def forward(ctx, x, W, Wt, root_s, stabilise, key_mask):
        xs = x * root_s  # (B, H, n, D)
        row = stabilise == "row"
        if x.dtype in (torch.float32, torch.float64):
            feat, c = _base2_features(xs, Wt, stabilise, key_mask)
        else:  # half precision: the plain steps, by exp itself (see exp_)
            logits = xs @ Wt if row else _logits(xs, Wt)  # (B, H, n, m)
            c = _constant(logits, stabilise, key_mask)
            feat = favor_exp(logits, c)  # (logits are fresh: exp in place)
        ctx.save_for_backward(xs, W, feat, c)
        ctx.root_s, ctx.key_mask, ctx.row, ctx.dims = root_s, key_mask, row, (-1,) if row else (-1, -2)
        return feat, c

    @staticmethod
    def backward(ctx, d_feat, d_c):
        xs, W, feat, c = ctx.saved_tensors
        dl = d_feat * feat  # d logits through the exp, (B, H, n, m)
        if c is not None:  # c shifts every logit of its span, and is the largest of them
            dc = -dl.sum(ctx.dims, keepdim=True) if d_c is None else d_c - dl.sum(ctx.dims, keepdim=True)
            if bool(dc.any()):  # (exactly 0 where c's shift cancels: the streamed backward's blocks
                # that hold no max, five passes fewer)
                real = feat if ctx.key_mask is None else feat.masked_fill(
                    ~ctx.key_mask[:, None, :, None], 0.0)
                top = real.div(real.amax(ctx.dims, keepdim=True).clamp_(min=torch.finfo(real.dtype).tiny))
                top.floor_()  # 1 where the max is (the largest real feature: features are > 0), else 0;
                # a float mask, as bool ones (==, addcmul_ of bool) run about four times slower
                share = dc.div_(top.sum(ctx.dims, keepdim=True)).masked_fill_(~torch.isfinite(c), 0.0)
                dl.addcmul_(top, share)  # (no real key: c is no logit, and gets nothing)
        dxs = dl @ W  # (B, H, n, D)
        if not ctx.row:
            dxs.addcmul_(xs, dl.sum(-1, keepdim=True), value=-1)
        dWt = xs.flatten(0, 2).T @ dl.flatten(0, 2) if ctx.needs_input_grad[2] else None  # (D, m)
        return dxs * ctx.root_s, None, dWt, None, None, None


def _base2_features(xs, Wt, stabilise, key_mask, scratch=None):
    """:class:`_FavorMap`'s ``(φ, c)`` in three passes over the (n, m) logits: made in base 2 by
    the product itself, l₂ = x'·(Wᵀ log2 e) (the rounding of Wᵀ log2 e is of the order of the
    product's own); c₂ (the row's max of l₂, or the block's of l₂ − ‖x'‖² log2 e / 2), that
    norm and the 1/√m go into one (n, 1) shift, and φ = 2^(l₂ − shift). Returns c in natural
    units, as :func:`favor_features`' (None for "none"). φ and the block's temporaries go into
    ``scratch``'s buffers if given (inference)."""
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
            c = key_constant(logits.amax(-1, keepdim=True).sub_(norm), key_mask)  # (rows' max: (B, H, n, 1))
            shift = shift + finite_or_zero(c)
    feat = logits.sub_(shift).exp2_()
    return feat, None if c is None else c / LOG2E


def _features(q, opts, generator):
    W = opts.features
    if W is None:
        return draw_features(opts.nb_features, q.shape[-1], orthogonal=opts.orthogonal,
                             generator=generator, device=q.device)
    if W.shape[1] != q.shape[-1]:
        raise ValueError(f"performer: features have {W.shape[1]} columns but D = {q.shape[-1]}")
    return given_on_device("performer", "features", W, q)


def _features_and_maps(q, k, opts, causal, key_mask, scale, generator):
    W, s = _features(q, opts, generator), softmax_scale(q, scale)
    return (favor_features(q, W, s, stabilise="row"),
            favor_features(k, W, s, stabilise="none" if causal else "all", key_mask=key_mask))


def performer_attention(q, k, v, opts=PerformerOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """Softmax attention approximated by positive random features: φ(Q)(φ(K)ᵀV) normalised.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(L·m·(D + Dv)) time, O(L·m) memory; causal by the chunked prefix sums of
    linear attention. Unbiased for exp(q·k·scale) (default scale 1/√D); the error
    falls as m grows. Features are drawn from ``generator`` unless given.
    Choromanski et al., Rethinking Attention with Performers, ICLR 2021.
    """
    W, root_s = _features(q, opts, generator).to(q.dtype), math.sqrt(softmax_scale(q, scale))
    W, Wt = W.contiguous(), W.T.contiguous()  # once, not per block

    def favor(x, stabilise, mask, scratch):  # (φ, c): into the block's scratch, given one (inference)
        if scratch is None or x.dtype not in (torch.float32, torch.float64):
            return _FavorMap.apply(x, W, Wt, root_s, stabilise, mask)
        return _base2_features(torch.mul(x, root_s, out=scratch("xs", x.shape)), Wt, stabilise, mask, scratch)

    def phi_q(q_blk, scratch=None):
        return favor(q_blk, "row", None, scratch)[0]

    phi_q.takes_scratch = True  # (see apply_map)

    def phi_k(k_blk, mask, scratch=None):  # causal: c = 0, so no future key sets it; else each block's
        return favor(k_blk, "none" if causal else "all", mask, scratch)

    out, _ = kernel_attention(q, k, v, phi_q, phi_k, width=W.shape[0], causal=causal, key_mask=key_mask,
                              eps=opts.eps, chunk=opts.chunk, closes_over=(W,))
    return out


def performer_reference(q, k, v, opts=PerformerOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """Dense: A = φ(Q)φ(K)ᵀ on the visible keys, out = A V / (A 1 + eps)."""
    phi_q, phi_k = _features_and_maps(q, k, opts, causal, key_mask, scale, generator)
    return kernel_reference(phi_q, phi_k, v, causal=causal, key_mask=key_mask, eps=opts.eps)


def performer_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    m = opts.features.shape[0] if opts.features is not None else opts.nb_features
    return 2.0 * B * H * (Lq + Lk) * m * D + kernel_flops(B, H, Lq, Lk, m, Dv, causal, opts.chunk)


@dataclass(frozen=True)
class PerformerLayerOptions:
    """The layer keeps its features as a buffer; ``layer.redraw()`` draws new ones."""

    def build(self, layer) -> None:
        layer.register_buffer("features", self._draw(layer, "cpu"))

    def redraw(self, layer) -> None:
        layer.features = self._draw(layer, layer.features.device)

    def _draw(self, layer, device):
        opts = PerformerOptions(**layer.options)
        return draw_features(opts.nb_features, layer.head_dim, orthogonal=opts.orthogonal,
                             generator=layer.generator(device), device=device)

    def forward_options(self, layer, device) -> dict:
        return {"features": layer.features}


register(
    Mechanism(
        name="performer",
        summary="FAVOR+: positive orthogonal random features approximating softmax attention",
        options=PerformerOptions,
        fn=performer_attention,
        reference=performer_reference,
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L m d)",
        memory="O(L m)",
        citation="Choromanski et al., Rethinking Attention with Performers, ICLR 2021",
        randomized=True,
        layer_options=PerformerLayerOptions,
        flops=performer_flops,
    )
)
