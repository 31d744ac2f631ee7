"""Kernel attention, the engine of linear, taylor and performer: attention through a positive
feature map φ, normalised.

    out_i = φ(q_i)ᵀ S_i / (φ(q_i)ᵀ z_i + eps),  S_i = Σ_j φ(k_j) v_jᵀ,  z_i = Σ_j φ(k_j)

over the keys j that query i may see (Katharopoulos et al., ICML 2020). Non-causal, S and
z are one sum over every real key; causal, they are prefix sums, which the engine takes chunk by
chunk (:func:`_causal_prefix`), so that nothing of size (L, F, Dv) or (Lq, Lk) is built. The
mechanism files only say what φ is (a :class:`FeatureMap`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.masks import causal_offset, dense_mask
from attnzoo.mechanisms._softmax import wide
from attnzoo.ops import operation

__all__ = ["FeatureMap", "kernel_attention", "kernel_flops", "kernel_reference", "no_scale"]


@dataclass(frozen=True)
class FeatureMap:
    """A positive feature map φ for :func:`kernel_attention`, φ(q)·φ(k) the attention weight.

    ``name`` tells a backend which map this is, so that it may run a faster form of it: "elu"
    (elu + 1), "favor" (performer's random features: ``params`` = (W, scale, the keys'
    stabiliser), :func:`~attnzoo.mechanisms.performer.favor_map`), or anything else for a map it
    runs as given.
    """

    name: str
    query: Callable[[torch.Tensor], torch.Tensor]  # x (B, H, L, D) -> φ(x) (B, H, L, F), row by row
    width: int  # F
    # φ of the keys, (k, key_mask) -> (B, H, Lk, F); None: ``query``'s. It may divide every key's
    # features by one constant of its batch entry and head (cancels but for eps: performer's)
    key: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    # an elementwise map's derivative as a function of its value, φ'(x) = derivative(φ(x)), or None
    derivative: Callable[[torch.Tensor], torch.Tensor] | None = None
    params: tuple = ()  # what a backend needs to rebuild a named map

    def keys(self, k: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """φ(k) (B, H, Lk, F), 0 for padded keys (a fill, not a product: their features may overflow)."""
        feat = self.query(k) if self.key is None else self.key(k, key_mask)
        return feat if key_mask is None else feat.masked_fill(~key_mask[:, None, :, None], 0.0)


State = tuple[torch.Tensor, torch.Tensor]  # (S (B, H, F, Dv), z (B, H, F)) after a prefix of keys


def kernel_attention(q, k, v, phi: FeatureMap, *, causal: bool, key_mask, eps: float, chunk: int,
                     state: State | None = None) -> tuple[torch.Tensor, State | None]:
    """Normalised kernel attention: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) ->
    (out (B, H, Lq, Dv), state), the output in q's dtype.

    float16 and bfloat16 inputs are computed in float32 -- the features, the sums S and z over
    up to L keys, the normaliser -- and the state stays float32: in half precision those sums
    overflow or stop growing long before the lengths these mechanisms are for.
    """
    out, state = _kernel_attention(wide(q), wide(k), wide(v), phi, causal=causal, key_mask=key_mask,
                                   eps=eps, chunk=chunk, state=state)
    return out.to(q.dtype), state


@operation("kernel_attention")
def _kernel_attention(q, k, v, phi: FeatureMap, *, causal: bool, key_mask, eps: float, chunk: int,
                      state: State | None = None) -> tuple[torch.Tensor, State | None]:
    """:func:`kernel_attention` in the inputs' own dtype.

    Non-causal: S = φ(K)ᵀV and z = Σ_j φ(k_j) over the real keys (``key_mask`` (B, Lk), False =
    padding), then each query's ratio; state None. Causal: query i sees keys j <= i + Lk − Lq
    (keys before the first query are in every query's state; queries before the first key get
    0), by chunked prefix sums of ``chunk`` queries (:func:`_causal_prefix`), from ``state``
    (S, z) (a prefix decoded before, causal only; None: nothing); returns the state after the
    last key.
    A query that sees no key gets 0 (eps > 0). Time O(L·F·Dv) non-causal, O(L·(chunk + F)·Dv)
    causal; memory O(L·F) for the features, causal also O(L·chunk + (L/chunk)·F·Dv). Plain
    autograd.
    """
    f_q, f_k = phi.query(q), phi.keys(k, key_mask)  # (B, H, Lq, F), (B, H, Lk, F)
    if not causal:
        S, z = f_k.transpose(-1, -2) @ v, f_k.sum(2)  # (B, H, F, Dv), (B, H, F)
        return (f_q @ S) / (f_q @ z.unsqueeze(-1) + eps), None
    off = causal_offset(q.shape[2], k.shape[2])
    blind, start = max(0, -off), max(0, off)  # queries that see no key; keys that every query sees
    if state is None:
        state = q.new_zeros(*q.shape[:2], phi.width, v.shape[-1]), q.new_zeros(*q.shape[:2], phi.width)
    S = state[0] + f_k[:, :, :start].transpose(-1, -2) @ v[:, :, :start]
    z = state[1] + f_k[:, :, :start].sum(2)
    out, S, z = _causal_prefix(f_q[:, :, blind:], f_k[:, :, start:], v[:, :, start:], S, z, chunk, eps)
    return F.pad(out, (0, 0, blind, 0)), (S, z)


def _causal_prefix(f_q, f_k, v, S0, z0, chunk, eps):
    """Causal kernel attention of aligned queries and keys (query i sees keys j <= i) from the state
    (S0, z0) before them: f_q, f_k (B, H, n, F), v (B, H, n, Dv) -> (out (B, H, n, Dv), S, z after).

    The positions in chunks of ``chunk``: within a chunk the masked product A = tril(φq φkᵀ)
    (chunk × chunk); across chunks the state before each, S0 plus the sums of the chunks before.
    """
    n = f_q.shape[2]
    pq, pk, pv = (F.pad(t, (0, 0, 0, -n % chunk)).unflatten(2, (-1, chunk)) for t in (f_q, f_k, v))
    A = (pq @ pk.transpose(-1, -2)).tril()  # (B, H, nc, chunk, chunk): key j <= query i in a chunk
    S_c, z_c = pk.transpose(-1, -2) @ pv, pk.sum(3)  # each chunk's own sums: (B, H, nc, F, Dv), (B, H, nc, F)
    S_before = S0.unsqueeze(2) + _sums_before(S_c)  # (B, H, nc, F, Dv)
    z_before = z0.unsqueeze(2) + _sums_before(z_c)  # (B, H, nc, F)
    num = (A @ pv + pq @ S_before).flatten(2, 3)[:, :, :n]  # (B, H, n, Dv)
    den = (A.sum(-1, keepdim=True) + pq @ z_before.unsqueeze(-1)).flatten(2, 3)  # (B, H, n + pad, 1)
    out = num / (den[:, :, :n] + eps)  # (padding rows dropped first: no 0/0 with eps = 0)
    return out, S_before[:, :, -1] + S_c[:, :, -1], z_before[:, :, -1] + z_c[:, :, -1]


def _sums_before(x: torch.Tensor) -> torch.Tensor:
    """Σ_{c' < c} x[:, :, c'] for each chunk c of x (B, H, nc, ...): the exclusive prefix sum."""
    return torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], 2).cumsum(2)


@operation("kernel_attention_flops")
def kernel_flops(B, H, Lq, Lk, Fdim, Dv, *, causal: bool, chunk: int, map_name: str) -> float:
    """FLOPs of :func:`kernel_attention` for a map named ``map_name``, features given (products, 2
    a multiply-add; sums like z not counted). Non-causal: S = φ(K)ᵀV, then φ(q)S and φ(q)·z.
    Causal: the keys before the first query into the state, then per aligned position (padded
    to whole chunks) the chunk's products 2·chunk·(F + Dv), its part of the chunk state and of
    φ(q)S_before 4·F·Dv, and φ(q)·z 2·F."""
    if not causal:
        return 2.0 * B * H * (Lk * Dv + Lq * (Dv + 1)) * Fdim
    n = -(-min(Lq, Lk) // chunk) * chunk
    prefix = 2.0 * max(Lk - Lq, 0) * Fdim * Dv
    return B * H * (prefix + 2.0 * n * chunk * (Fdim + Dv) + 4.0 * n * Fdim * Dv + 2.0 * n * Fdim)


def kernel_reference(f_q, f_k, v, *, causal, key_mask, eps):
    """Dense: A = φ(Q)φ(K)ᵀ masked to the visible keys (an (Lq, Lk) matrix), out = A V / (A 1 + eps)."""
    A = f_q @ f_k.transpose(-1, -2)  # (B, H, Lq, Lk)
    mask = dense_mask(f_q.shape[2], f_k.shape[2], causal=causal, key_mask=key_mask, device=f_q.device)
    A = A * mask.to(A.dtype)
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


def no_scale(name: str, scale) -> None:
    """Refuse a score scale: the kernel mechanisms' papers use none."""
    if scale is not None:
        raise ValueError(f"{name} has no score scale (its paper uses none); leave scale=None")
