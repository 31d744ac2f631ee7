"""Performer's FAVOR+ (Choromanski et al., ICLR 2021): positive orthogonal random features."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnzoo.mechanisms._kernel import FeatureMap, kernel_attention, kernel_flops, kernel_reference
from attnzoo.mechanisms._softmax import finite_or_zero, softmax_scale, wide
from attnzoo.registry import Capabilities, Mechanism, check_on_device, register


@dataclass(frozen=True)
class PerformerOptions:
    nb_features: int = 256  # m random features (used when they are drawn here)
    features: torch.Tensor | None = None  # W (m, D); None = drawn from `generator`
    orthogonal: bool = True  # orthogonal blocks (FAVOR+) rather than i.i.d. Gaussian rows
    eps: float = 1e-6  # added to the normaliser
    chunk: int = 64  # causal: queries per chunk of the prefix sums

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
    the softmax-kernel estimate is biased (its error stalls however many features).
    Each column is multiplied by the sign of R's diagonal entry, which makes Q uniform on the
    orthogonal group (Mezzadri 2007), as the paper's construction assumes."""
    if not orthogonal:
        return torch.randn(m, D, generator=generator, device=device)
    g = torch.randn(math.ceil(m / D), D, D, generator=generator, device=device)
    q, r = torch.linalg.qr(g)  # one batched QR (a loop of small ones is far slower on a CPU)
    r_jj = r.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)  # (blocks, 1, D)
    q = torch.where(r_jj < 0, -q, q)  # column j times the sign of R_jj: Haar
    W = q.mT.reshape(-1, D)[:m]  # (m, D): each block's rows orthonormal
    norms = torch.randn(m, D, generator=generator, device=device).norm(dim=1, keepdim=True)
    return W * norms


def favor_features(x: torch.Tensor, W: torch.Tensor, scale: float, *, stabilise: str,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """φ(x) = exp(W x' − ‖x'‖²/2 − c) / √m with x' = x·√scale, so φ(q)·φ(k) ≈ exp(q·k·scale) e^{-c}:
    x (B, H, L, D), W (m, D) -> (B, H, L, m).

    ``stabilise="row"``: c = each row's max (queries: cancels in the ratio);
    ``"all"``: c = the max over every real key of a (batch, head) (a common factor
    that cancels; padding, ``key_mask`` False, does not set it; none real: 0); ``"none"``: c = 0
    (causal keys, so no future key sets the constant; W x' − ‖x'‖²/2 <= ‖w‖²/2
    keeps it finite).
    """
    xs = x * math.sqrt(scale)
    logits = xs @ W.to(x.dtype).T - (xs * xs).sum(-1, keepdim=True) / 2  # (B, H, L, m)
    shift = 0.5 * math.log(W.shape[0])  # the 1/√m
    if stabilise == "row":
        shift = logits.amax(-1, keepdim=True) + shift  # (B, H, L, 1)
    elif stabilise == "all":
        real = logits if key_mask is None else logits.masked_fill(~key_mask[:, None, :, None], -torch.inf)
        shift = finite_or_zero(real.amax(dim=(-1, -2), keepdim=True)) + shift  # (B, H, 1, 1)
    return torch.exp(logits - shift)


def _features(q, opts, generator):
    W = opts.features
    if W is None:
        return draw_features(opts.nb_features, q.shape[-1], orthogonal=opts.orthogonal,
                             generator=generator, device=q.device)
    if W.shape[1] != q.shape[-1]:
        raise ValueError(f"performer: features have {W.shape[1]} columns but D = {q.shape[-1]}")
    return check_on_device("performer", "features", W, q)


def favor_map(W: torch.Tensor, scale: float, *, causal: bool) -> FeatureMap:
    """FAVOR+ as the kernel engine takes it: queries stabilised by their row's max; keys by the
    max over every real key (causal: none, so that no future key sets the constant)."""
    keys = "none" if causal else "all"
    return FeatureMap(
        "favor", lambda x: favor_features(x, W, scale, stabilise="row"), W.shape[0],
        key=lambda x, key_mask: favor_features(x, W, scale, stabilise=keys, key_mask=key_mask),
        params=(W, scale, keys))


def performer_attention(q, k, v, opts=PerformerOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """Softmax attention approximated by positive random features: φ(Q)(φ(K)ᵀV) normalised.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(L·m·(D + Dv)) time, O(L·m) memory; causal by the chunked prefix sums of the
    kernel engine (:func:`~attnzoo.mechanisms._kernel.kernel_attention`). Unbiased for
    exp(q·k·scale) (default scale 1/√D); the error falls as m grows. Features are drawn from
    ``generator`` unless given. Choromanski et al., Rethinking Attention with Performers,
    ICLR 2021.
    """
    W = _features(q, opts, generator).to(wide(q).dtype)  # half precision runs in float32
    phi = favor_map(W, softmax_scale(q, scale), causal=causal)
    out, _ = kernel_attention(q, k, v, phi, causal=causal, key_mask=key_mask, eps=opts.eps, chunk=opts.chunk)
    return out


def performer_reference(q, k, v, opts=PerformerOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """Dense: A = φ(Q)φ(K)ᵀ on the visible keys, out = A V / (A 1 + eps)."""
    phi = favor_map(_features(q, opts, generator), softmax_scale(q, scale), causal=causal)
    return kernel_reference(phi.query(q), phi.keys(k, key_mask), v, causal=causal, key_mask=key_mask,
                            eps=opts.eps)


def performer_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """The features' products, 2·(Lq + Lk)·m·D, and the kernel engine's (:func:`kernel_flops`)."""
    m = opts.features.shape[0] if opts.features is not None else opts.nb_features
    return 2.0 * B * H * (Lq + Lk) * m * D + kernel_flops(B, H, Lq, Lk, m, Dv, causal=causal,
                                                           chunk=opts.chunk, map_name="favor")


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
