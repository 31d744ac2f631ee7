"""LogSparse attention (Li et al., NeurIPS 2019): exponentially growing steps back in time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.mechanisms._softmax import excluding_nonfinite_values, softmax_scale, wide
from attnzoo.mechanisms._windows import last_rows, pattern_reference, to_frame
from attnzoo.mechanisms.full import masked_softmax
from attnzoo.ops import operation
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class LogSparseOptions:
    local: int = 1  # dense window: offsets 0..local-1, then local-1 + 2^m (1 = the plain pattern)
    restart: int | None = None  # restart the pattern every `restart` positions (subsequences)

    def __post_init__(self):
        if self.local < 1:
            raise ValueError(f"log_sparse: local must be >= 1, got {self.local}")
        if self.restart is not None and self.restart < 1:
            raise ValueError(f"log_sparse: restart must be >= 1, got {self.restart}")


@dataclass(frozen=True)
class LogSparseLayerOptions:
    kernel_size: int = 1  # causal Conv1d for queries and keys in MultiheadAttention (1 = linear)

    def __post_init__(self):
        if self.kernel_size < 1:
            raise ValueError(f"log_sparse: kernel_size must be >= 1, got {self.kernel_size}")

    def build(self, layer) -> None:
        from attnzoo.nn import causal_conv_projection

        causal_conv_projection(layer, self.kernel_size)


def _offsets(opts: LogSparseOptions, N: int) -> list[int]:
    """Backward distances a query attends to: 0..local-1, then local-1 + 1, 2, 4, ... below N."""
    dense = list(range(min(opts.local, N)))
    steps, m = [], 1
    while opts.local - 1 + m < N:
        steps.append(opts.local - 1 + m)
        m *= 2
    return dense + steps


def _signed_offsets(opts: LogSparseOptions, N: int, causal: bool) -> list[int]:
    back = _offsets(opts, N)
    return back if causal else back + [-d for d in back if d > 0]


def log_sparse_attention(q, k, v, opts=LogSparseOptions(), *, causal=False, key_mask=None,
                         scale=None, generator=None):
    """Softmax over the keys j = i - d, d in {0, .., local-1} ∪ {local-1 + 2^m}.

    Plain pattern (local=1): i, i-1, i-2, i-4, ..., i-2^floor(log2 i). With ``restart``
    = R, i and j must lie in the same subsequence of R positions. Causal is the
    paper's setting; non-causal (two-sided: also j = i + d) is our extension for
    encoders. Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) ->
    (B, H, Lq, Dv); with Lq != Lk the queries are the last Lq positions.
    Cost O(L·(local + log L)·D) time and O(L·(local + log L)) memory: one score per
    offset (:func:`offset_attention`), never an L×L mask.
    """
    q, k, v, key_valid, Lq = to_frame(q, k, v, key_mask)
    N = q.shape[2]
    offsets = _signed_offsets(opts, N, causal)
    valid = _offset_valid(offsets, N, opts.restart, key_valid, q.device)
    out = offset_attention(q, k, v, valid, offsets=offsets, scale=softmax_scale(q, scale))
    return last_rows(out, Lq).to(q.dtype)


def _offset_valid(offsets, N, restart, key_valid, device):
    """Which key i − d each query i may attend: (N, n_offsets) bool, or (B, 1, N, n_offsets) with a
    ``key_valid`` (B, N): in the sequence, in i's subsequence, not padding."""
    i = torch.arange(N, device=device)[:, None]
    j = i - torch.tensor(offsets, device=device)  # (N, n_offsets) key positions
    valid = (j >= 0) & (j < N)
    if restart is not None:
        valid = valid & (j // restart == i // restart)
    if key_valid is not None:
        valid = valid & key_valid[:, j.clamp(0, N - 1)][:, None]  # (B, 1, N, n_offsets)
    return valid


@operation("attend_offsets")
def offset_attention(q, k, v, valid, *, offsets, scale):
    """softmax(scale·q_i·k_{i−d}) over the offsets d where ``valid`` allows, applied to v_{i−d}.

    q (B, H, N, D), k (B, H, N, D), v (B, H, N, Dv); ``offsets`` a list of ints (negative: keys
    after the query); valid (N, n_offsets) or (B, 1, N, n_offsets) bool, False wherever i − d
    lies outside 0..N−1. Returns (B, H, N, Dv), float32 for half-precision inputs; a query
    with no valid key gets 0. Each offset's scores and weighted values come from the rows of
    q, k and v shifted against each other (slices, no copies): O(N·n_offsets·(D + Dv)) time,
    O(N·n_offsets) memory kept for the backward.
    """
    N = q.shape[2]
    q = q * scale
    k, v = excluding_nonfinite_values(k, v)  # an offset's values are weighed by 0 where it is not valid
    shifts = [_shift(N, d) for d in offsets]  # (rows, keys) of each offset
    scores = torch.stack([_placed(torch.linalg.vecdot(wide(q[:, :, rows]), wide(k[:, :, keys])), rows, N)
                          for rows, keys in shifts], -1)  # (B, H, N, n_offsets)
    w = masked_softmax(scores, valid)
    return sum(_placed(w[:, :, rows, n, None] * wide(v[:, :, keys]), rows, N)
               for n, (rows, keys) in enumerate(shifts))


def _shift(N: int, d: int) -> tuple[slice, slice]:
    """(rows, keys): the queries i whose key i − d lies in 0..N−1, and those keys (equal lengths)."""
    start = min(max(d, 0), N)
    stop = max(min(N, N + d), start)
    return slice(start, stop), slice(start - d, stop - d)


def _placed(t: torch.Tensor, rows: slice, N: int) -> torch.Tensor:
    """t (B, H, n, ...) of the positions ``rows`` as (B, H, N, ...), zero at the others."""
    return F.pad(t, [0, 0] * (t.dim() - 3) + [rows.start, N - rows.stop])


def log_sparse_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """One score (D multiply-adds) and one weighted value (Dv) per offset and position."""
    N = max(Lq, Lk)
    return 2.0 * B * H * N * len(_signed_offsets(opts, N, causal)) * (D + Dv)


def log_sparse_pattern(length: int, opts: LogSparseOptions, causal: bool) -> torch.Tensor:
    """(L, L) bool: query i attends key j iff i - j is one of the offsets (same subsequence)."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = torch.tensor(_signed_offsets(opts, length, causal))
    mask = torch.isin(i - j, allowed)
    if opts.restart is not None:
        mask = mask & (j // opts.restart == i // opts.restart)
    return mask


register(
    Mechanism(
        name="log_sparse",
        summary="itself and positions at exponentially growing distances (i-1, i-2, i-4, …)",
        options=LogSparseOptions,
        fn=log_sparse_attention,
        reference=pattern_reference(log_sparse_pattern),
        capabilities=Capabilities(causal=True, cross=True, key_mask=True),
        time="O(L log L d)",
        memory="O(L log L)",
        citation="Li et al., Enhancing the Locality and Breaking the Memory Bottleneck of "
        "Transformer on Time Series Forecasting, NeurIPS 2019",
        pattern=log_sparse_pattern,
        flops=log_sparse_flops,
        layer_options=LogSparseLayerOptions,
    )
)
