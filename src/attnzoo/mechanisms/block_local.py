"""Block-local attention: queries in blocks of `window`, each block sees its own and its neighbours."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.mechanisms._softmax import softmax_scale
from attnzoo.mechanisms._windows import pattern_reference, window_attention, window_flops
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class BlockLocalOptions:
    window: int = 256  # block size: positions [b·window, (b+1)·window) form block b
    look_backward: int = 1  # blocks before a query's own that it sees
    look_forward: int | None = None  # blocks after it; None: 1 two-sided, 0 causal

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"block_local: window must be >= 1, got {self.window}")
        for name in ("look_backward", "look_forward"):
            n = getattr(self, name)
            if n is not None and n < 0:
                raise ValueError(f"block_local: {name} must be >= 0, got {n}")


def _blocks_around(opts: BlockLocalOptions, causal: bool) -> tuple[int, int]:
    """(look_backward, look_forward) in blocks, look_forward resolved for ``causal``."""
    forward = opts.look_forward if opts.look_forward is not None else (0 if causal else 1)
    if causal and forward > 0:
        raise ValueError(f"block_local: causal attention cannot look forward (look_forward={forward})")
    return opts.look_backward, forward


def block_local_attention(q, k, v, opts=BlockLocalOptions(), *, causal=False, key_mask=None,
                          scale=None, generator=None):
    """softmax over the keys of blocks ⌊i/w⌋ − look_backward … ⌊i/w⌋ + look_forward (w = window);
    causal: those keys j <= i.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv); with
    Lq != Lk the queries are the last Lq positions and blocks count from position 0 of
    max(Lq, Lk). Cost O(L·w·(1 + look_backward + look_forward)·D) time and O(L·w) memory,
    never L×L: each query block is one block of
    :func:`~attnzoo.mechanisms._windows.window_partial`.
    Parmar et al., Image Transformer, 2018 (local 1D attention); as lucidrains'
    local-attention ``LocalAttention(window_size=w, look_backward, look_forward)`` with its
    defaults (``exact_windowsize=False``: a causal query sees all of the blocks before it,
    not only its last w·look_backward keys). Unlike ``local``'s sliding window, queries of
    one block share their keys: no band to mask inside the sequence.
    """
    back, forward = _blocks_around(opts, causal)
    w = opts.window
    return window_attention(q, k, v, key_mask, block=w, left=back * w, right=forward * w,
                            allowed=(lambda i, j: j <= i) if causal else _everywhere,
                            scale=softmax_scale(q, scale))


def _everywhere(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Every key of the window, (broadcast i, j) bool."""
    return torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)


def block_local_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    back, forward = _blocks_around(opts, causal)
    w = opts.window
    return B * H * window_flops(max(Lq, Lk), block=w, left=back * w, right=forward * w, D=D, Dv=Dv)


def block_local_pattern(length: int, opts: BlockLocalOptions, causal: bool) -> torch.Tensor:
    """(L, L) bool: query i sees key j iff j's block is at most look_backward before i's and
    look_forward after it (and, causal, j <= i)."""
    back, forward = _blocks_around(opts, causal)
    block = torch.arange(length) // opts.window
    apart = block[None, :] - block[:, None]  # (L, L): j's block − i's block
    seen = (apart >= -back) & (apart <= forward)
    return seen & torch.ones(length, length, dtype=torch.bool).tril() if causal else seen


register(
    Mechanism(
        name="block_local",
        summary="blocks of `window` positions, each seeing its own and `look_backward` / "
        "`look_forward` neighbouring blocks (local-attention's LocalAttention)",
        options=BlockLocalOptions,
        fn=block_local_attention,
        reference=pattern_reference(block_local_pattern),
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L w d)",
        memory="O(L w)",
        citation="Parmar et al., Image Transformer, 2018 (local 1D attention)",
        pattern=block_local_pattern,
        flops=block_local_flops,
    )
)
