"""Taylor (first-order) linear attention (Li et al., 2020)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.mechanisms._kernel import FeatureMap, kernel_attention, kernel_flops, kernel_reference, no_scale
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class TaylorOptions:
    eps: float = 1e-6  # added to the normaliser (it is >= 0, and 0 only for a query with no key)
    chunk: int = 64  # causal: queries per chunk of the prefix sums

    def __post_init__(self):
        if self.eps < 0 or self.chunk < 1:
            raise ValueError(f"taylor: need eps >= 0 and chunk >= 1, got {self.eps}, {self.chunk}")


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """[1, x/‖x‖]: then φ(q)·φ(k) = 1 + q'·k', the first-order Taylor expansion of exp(q'·k')."""
    return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], -1)


def taylor_attention(q, k, v, opts=TaylorOptions(), *, causal=False, key_mask=None, scale=None,
                     generator=None):
    """(Σ_j v_j + Q'(K'ᵀV)) / (n + Q'(K'ᵀ1)), Q' = Q/‖Q‖, K' = K/‖K‖ per position, n = #keys seen.

    As linear attention with φ(x) = [1, x/‖x‖], so key_mask and causal (chunked
    prefix sums) come from the same engine (:func:`~attnzoo.mechanisms._kernel.kernel_attention`).
    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv). Cost
    O(L·D·Dv). Li et al., Linear Attention Mechanism: An Efficient Attention for Semantic
    Segmentation, 2020 (the project seed notes' formula sums over all N keys; we sum
    over the visible ones).
    """
    no_scale("taylor", scale)
    phi = FeatureMap("taylor", taylor_features, q.shape[-1] + 1)
    out, _ = kernel_attention(q, k, v, phi, causal=causal, key_mask=key_mask, eps=opts.eps, chunk=opts.chunk)
    return out


def taylor_reference(q, k, v, opts=TaylorOptions(), *, causal=False, key_mask=None, scale=None,
                     generator=None):
    """Dense: weights 1 + q'_i·k'_j on the visible keys, normalised by their sum (+ eps)."""
    no_scale("taylor", scale)
    return kernel_reference(taylor_features(q), taylor_features(k), v, causal=causal, key_mask=key_mask,
                            eps=opts.eps)


def taylor_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """FLOPs of the kernel engine's products over D + 1 features (:func:`kernel_flops`)."""
    return kernel_flops(B, H, Lq, Lk, D + 1, Dv, causal=causal, chunk=opts.chunk, map_name="taylor")


register(
    Mechanism(
        name="taylor",
        summary="first-order Taylor of exp on L2-normalised Q, K: weights 1 + q'·k'",
        options=TaylorOptions,
        fn=taylor_attention,
        reference=taylor_reference,
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L d²)",
        memory="O(L d + d²)",
        citation="Li et al., Linear Attention Mechanism: An Efficient Attention for Semantic "
        "Segmentation, 2020",
        flops=taylor_flops,
    )
)
