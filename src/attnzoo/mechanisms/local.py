"""Sliding-window (local) attention: each query sees a window of `window` positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.mechanisms._softmax import softmax_scale
from attnzoo.mechanisms._windows import pattern_reference, window_attention, window_flops
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class LocalOptions:
    window: int = 256  # w: causal sees itself and the w-1 before; two-sided sees w//2 either side
    block: int | None = None  # query block of the blocked computation (default: min(w, 64))

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"local: window must be >= 1, got {self.window}")
        if self.block is not None and self.block < 1:
            raise ValueError(f"local: block must be >= 1, got {self.block}")


def _offsets(opts: LocalOptions, causal: bool) -> tuple[int, int]:
    """(left, right): how far before and after itself a query sees."""
    if causal:
        return opts.window - 1, 0
    return opts.window // 2, opts.window // 2


def local_attention(q, k, v, opts=LocalOptions(), *, causal=False, key_mask=None, scale=None,
                    generator=None):
    """softmax over the keys within the window: causal i-w < j <= i, two-sided |i-j| <= w//2.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv); with
    Lq != Lk the queries are the last Lq positions. Cost O(L·(w + block)·D) time and
    O(L·(w + block)) memory, by query blocks that see a band of keys (never L×L).
    The baseline of the sparse family (Beltagy et al. 2020's sliding window).
    """
    left, right = _offsets(opts, causal)
    return window_attention(q, k, v, key_mask, block=_block(opts), left=left, right=right,
                            allowed=lambda i, j: (j >= i - left) & (j <= i + right),
                            scale=softmax_scale(q, scale))


def _block(opts: LocalOptions) -> int:
    return opts.block or min(opts.window, 64)


def local_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    left, right = _offsets(opts, causal)
    N = max(Lq, Lk)
    return B * H * window_flops(N, block=_block(opts), left=left, right=right, D=D, Dv=Dv)


def local_pattern(length: int, opts: LocalOptions, causal: bool) -> torch.Tensor:
    """(L, L) bool: query i sees key j iff i - left <= j <= i + right."""
    left, right = _offsets(opts, causal)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return (j >= i - left) & (j <= i + right)


register(
    Mechanism(
        name="local",
        summary="sliding window of `window` positions (causal: the w-1 before and itself)",
        options=LocalOptions,
        fn=local_attention,
        reference=pattern_reference(local_pattern),
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L w d)",
        memory="O(L w)",
        citation="baseline; as in Beltagy et al., Longformer, 2020",
        pattern=local_pattern,
        flops=local_flops,
    )
)
