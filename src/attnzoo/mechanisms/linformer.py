"""Linformer (Wang et al., 2020): keys and values projected along the sequence to proj_len rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.mechanisms._few import attend_few_keys
from attnzoo.mechanisms._softmax import softmax_scale, wide, wide_dtype
from attnzoo.mechanisms.full import softmax_reference
from attnzoo.registry import Capabilities, Mechanism, check_on_device, register


@dataclass(frozen=True)
class LinformerOptions:
    proj_len: int = 256  # the paper's k: rows of E and F (used when they are drawn here)
    share_kv: bool = False  # F = E
    proj_k: torch.Tensor | None = None  # E (proj_len, >= Lk); None = drawn N(0, 1/proj_len)
    proj_v: torch.Tensor | None = None  # F (proj_len, >= Lk); None = drawn, or E when share_kv

    def __post_init__(self):
        if self.proj_len < 1:
            raise ValueError(f"linformer: proj_len must be >= 1, got {self.proj_len}")
        if self.share_kv and self.proj_v is not None:
            raise ValueError("linformer: share_kv=True uses proj_k for the values; do not pass proj_v")
        for name in ("proj_k", "proj_v"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 2):
                raise ValueError(f"linformer: {name} must be a (proj_len, Lk) tensor")


def projections(opts: LinformerOptions, Lk: int, like: torch.Tensor,
                generator) -> tuple[torch.Tensor, torch.Tensor]:
    """E, F of shape (proj_len, Lk), in ``like``'s dtype (float32 for half precision): given
    (first Lk columns, as the paper's code slices) or drawn (on ``like``'s device)."""
    dtype = wide_dtype(like.dtype)

    def take(name, t):
        if t.shape[1] < Lk:
            raise ValueError(f"linformer: {name} has {t.shape[1]} columns but Lk = {Lk}; it needs "
                             f">= Lk (in MultiheadAttention: max_len >= the sequence length)")
        return check_on_device("linformer", name, t, like)[:, :Lk].to(dtype)

    def draw():
        E = torch.randn(opts.proj_len, Lk, generator=generator, device=like.device)
        return (E / opts.proj_len**0.5).to(dtype)

    E = take("proj_k", opts.proj_k) if opts.proj_k is not None else draw()
    if opts.share_kv:
        return E, E
    return E, take("proj_v", opts.proj_v) if opts.proj_v is not None else draw()


def _project(E, F_, k, v, key_mask):
    """(E K, F V): (B, H, proj_len, D), (B, H, proj_len, Dv), in k's dtype; the sums over Lk keys
    in float32 for half-precision k and v."""
    if key_mask is not None:  # padded keys and values are excluded before projecting
        keep = key_mask[:, None, :, None]
        k, v = k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0)
    return (E @ wide(k)).to(k.dtype), (F_ @ wide(v)).to(v.dtype)  # (B, H, proj_len, D), (.., Dv)


def linformer_attention(q, k, v, opts=LinformerOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """softmax(Q (E K)ᵀ · scale) (F V), E, F ∈ R^{proj_len × Lk}.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(Lk·proj_len·D + Lq·proj_len·D) time, O(L·proj_len) memory at most (the queries
    attend to the proj_len projected keys by :func:`~attnzoo.mechanisms._few.attend_few_keys`).
    Padded keys and values are zeroed before projecting. Non-causal only: every
    projected row mixes all positions. Wang et al., Linformer: Self-Attention with
    Linear Complexity, 2020.
    """
    E, F_ = projections(opts, k.shape[2], k, generator)
    EK, FV = _project(E, F_, k, v, key_mask)
    return attend_few_keys(q, EK, FV, softmax_scale(q, scale))


def linformer_reference(q, k, v, opts=LinformerOptions(), *, causal=False, key_mask=None,
                        scale=None, generator=None):
    """The formula written out: softmax(Q (E K)ᵀ scale) (F V)."""
    E, F_ = projections(opts, k.shape[2], k, generator)
    EK, FV = _project(E, F_, k, v, key_mask)
    return softmax_reference(q, EK, FV, None, scale)


def linformer_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    p = opts.proj_k.shape[0] if opts.proj_k is not None else opts.proj_len
    return 2.0 * B * H * (p * Lk + Lq * p) * (D + Dv)


@dataclass(frozen=True)
class LinformerLayerOptions:
    max_len: int | None = None  # longest sequence: E and F are (proj_len, max_len) parameters

    def build(self, layer) -> None:
        if self.max_len is None or self.max_len < 1:
            raise ValueError("linformer in MultiheadAttention needs max_len (the longest sequence), "
                             "e.g. MultiheadAttention(..., mechanism='linformer', max_len=1024)")
        opts = LinformerOptions(**layer.options)
        if opts.proj_k is not None or opts.proj_v is not None:
            raise ValueError("linformer: the layer owns E and F; do not pass proj_k / proj_v")
        std = opts.proj_len**-0.5
        layer.proj_k = nn.Parameter(torch.randn(opts.proj_len, self.max_len) * std)
        layer.proj_v = None if opts.share_kv else nn.Parameter(
            torch.randn(opts.proj_len, self.max_len) * std)

    def forward_options(self, layer, device) -> dict:
        return {"proj_k": layer.proj_k, "proj_v": layer.proj_v}

    def forward(self, layer, x, memory, key_mask):
        """The layer's output, with E and F applied before the key and value projections:
        E(X W_Kᵀ + 1 b_Kᵀ) = (E X) W_Kᵀ + (E 1) b_Kᵀ, the paper's E_i K W_i^K read from the left.
        Of the keys' and values' projections only proj_len rows are computed, not Lk.
        Training self-attention takes q, E X and F X from one ``layer._project`` of x; otherwise
        the queries go through ``layer.in_query_blocks`` (each query attends to the same
        proj_len keys). Both attend by :func:`_attend`. Padded keys
        are zeroed before projecting, as in :func:`linformer_attention`: E's columns of
        padding are zeroed instead.

        x (B, Lq, d_model), memory (B, Lk, d_model) (x itself in self-attention), key_mask
        (B, Lk) or None. Returns (B, Lq, d_model).
        """
        opts = LinformerOptions(**layer._call_options(memory.device))
        E, F_ = projections(opts, memory.shape[1], memory, None)
        E, F_ = E.to(memory.dtype), (None if F_ is E else F_.to(memory.dtype))  # the layer's dtype
        if key_mask is not None:
            keep = key_mask[:, None, :].to(memory.dtype)  # (B, 1, Lk)
            E, F_ = E * keep, (None if F_ is None else F_ * keep)  # (B, proj_len, Lk)
        row_maps = [E] if F_ is None else [E, F_]
        fused = memory is x and torch.is_grad_enabled()
        # q (B, Lq, d_model) or None; PX: E X and F X (B, proj_len, d_model), or E X alone
        q, *PX = (layer._project(x, [layer.q_proj], row_maps) if fused
                  else (None, *layer._project(memory, [], row_maps)))
        k, v = (layer._split(_linear_of_rows(P, PX_, proj)) for P, PX_, proj in
                ((row_maps[0], PX[0], layer.k_proj), (row_maps[-1], PX[-1], layer.v_proj)))
        if fused:
            return layer._merge(_attend(layer._split(q), k, v))
        return layer.in_query_blocks(
            x, lambda rows: _attend(layer._split(layer._project(rows, [layer.q_proj])[0]), k, v))


def _attend(q, k, v):
    """softmax(q kᵀ/√D) v over the proj_len keys (:func:`~attnzoo.mechanisms._few.attend_few_keys`)."""
    return attend_few_keys(q, k, v, softmax_scale(q, None))


def _linear_of_rows(P, PX, linear):
    """P (X Wᵀ + 1 bᵀ) from PX = P X: PX Wᵀ + (P 1) bᵀ, (B, proj_len, d_out)."""
    out = F.linear(PX, linear.weight)
    return out if linear.bias is None else out.addcmul_(P.sum(-1, keepdim=True), linear.bias)


register(
    Mechanism(
        name="linformer",
        summary="project K and V along the sequence to proj_len rows: softmax(Q(EK)ᵀ/√d)(FV)",
        options=LinformerOptions,
        fn=linformer_attention,
        reference=linformer_reference,
        capabilities=Capabilities(causal=False, cross=True, key_mask=True),
        time="O(L k d)",
        memory="O(L k)",
        citation="Wang et al., Linformer: Self-Attention with Linear Complexity, 2020",
        randomized=True,
        reason_not_causal="each projected key mixes every position, future included",
        layer_options=LinformerLayerOptions,
        flops=linformer_flops,
    )
)
