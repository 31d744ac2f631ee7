"""Drop a mechanism into a model that already exists: :func:`swap_attention`.

``swap_attention(model, "local", window=64)`` replaces every ``torch.nn.MultiheadAttention``
inside ``model`` by a :class:`SwappedMultiheadAttention` that keeps the original's parameters
(the same ``Parameter`` objects, under the same ``state_dict`` names) and takes torch's
forward signature, but computes the attention with the named mechanism.

Torch's masks map onto attnzoo's two: ``key_padding_mask`` (True or -inf = padding) becomes
``key_mask``, and a causal ``attn_mask`` or ``is_causal=True`` becomes ``causal=True``. Any
other ``attn_mask`` is refused: a sub-quadratic mechanism never forms the (Lq, Lk) scores
such a mask would apply to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.registry import attention, get, make_options, mechanisms

__all__ = ["MAX_WEIGHTS", "SwappedMultiheadAttention", "swap_attention"]

# The most elements of the (B, H, Lq, Lk) attention weights need_weights=True may build.
MAX_WEIGHTS = 2**26


def swap_attention(model: nn.Module, mechanism: str, **options: Any) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` in ``model`` (recursively, in place) by a
    :class:`SwappedMultiheadAttention` computing attention with ``mechanism``; returns ``model``.

    The swapped modules keep the originals' parameters, so an optimizer built before the swap
    still trains them and state dicts load across. ``options`` are the mechanism's (see
    ``attnzoo.get(mechanism).options``), checked now. ``nn.TransformerEncoder``'s
    nested-tensor fast path, which would compute attention in torch's own fused kernel without
    calling the swapped module, is turned off in the encoders that hold one.

    Raises ValueError for an unknown mechanism or option, or for an original built with
    ``add_bias_kv=True`` or ``add_zero_attn=True`` (extra keys that no mechanism here takes).
    """
    make_options(get(mechanism), options)
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.MultiheadAttention]
    for parent, name, child in targets:
        setattr(parent, name, SwappedMultiheadAttention(child, mechanism, **options))
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    return model


class SwappedMultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention``'s parameters and forward, attention by an attnzoo mechanism.

    Built from an existing ``nn.MultiheadAttention`` (see :func:`swap_attention`); its
    parameters are taken over, not copied. ``forward(query, key, value, key_padding_mask=None,
    need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)`` as torch's:
    inputs ``(B, L, E)`` with ``batch_first``, else ``(L, B, E)``, or unbatched ``(L, E)``;
    returns ``(output, weights)``, the output in the input's layout.

    - ``key_padding_mask`` ``(B, Lk)``: bool, True = padding, or float, -inf = padding and 0 =
      real key.
    - ``is_causal=True``, or an ``attn_mask`` that is the causal mask ((Lq, Lk), True or -inf
      above the diagonal, lower-right aligned when Lq != Lk) gives ``causal=True``. Any other
      ``attn_mask`` raises ValueError.
    - ``need_weights=True`` (torch's default) also returns the effective attention weights W,
      the (B, Lq, Lk) (averaged over heads) or (B, H, Lq, Lk) matrix with output = W v before
      the output projection. Every mechanism here is linear in v, so W is read off by attending
      to the identity, in Lk / head_dim calls: affordable at small sizes only, and refused
      above ``MAX_WEIGHTS`` elements. Torch's transformer layers pass ``need_weights=False``.
    - Randomized mechanisms draw from a generator seeded from torch's global one, once a
      call: ``torch.manual_seed`` makes a run reproducible, as with dropout.

    Departures from torch's module: dropout (``dropout`` of the original) is applied to the
    attention output before the output projection, in training, since most mechanisms never
    form the weights that torch drops. The scale is the mechanism's default (1/sqrt(head_dim)
    for the softmax mechanisms, as torch's).
    """

    # torch's TransformerEncoderLayer runs a fused fast path in eval under no_grad that reads a
    # MultiheadAttention's weights and never calls its forward; it takes it only where
    # `self_attn._qkv_same_embed_dim` is True. This module's attention is its mechanism's, so it
    # says False whatever the layout of its weights (`in_proj_weight` is None when they are apart).
    _qkv_same_embed_dim = False

    def __init__(self, original: nn.MultiheadAttention, mechanism: str, **options: Any) -> None:
        super().__init__()
        if original.bias_k is not None or original.add_zero_attn:
            raise ValueError("swap_attention: a MultiheadAttention built with add_bias_kv=True or "
                             "add_zero_attn=True adds keys that no attnzoo mechanism takes")
        self.spec = get(mechanism)
        make_options(self.spec, options)
        self.mechanism, self.options = mechanism, options
        self.embed_dim, self.num_heads = original.embed_dim, original.num_heads
        self.head_dim = original.head_dim
        self.kdim, self.vdim, self.batch_first = original.kdim, original.vdim, original.batch_first
        self.dropout = original.dropout
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"):
            self.register_parameter(name, getattr(original, name))
        self.out_proj = original.out_proj

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # (L, 1, E)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = _transposed_alike(query, key, value)  # (L, B, E), as torch's
        Lq, B, _ = query.shape
        Lk = key.shape[0]
        causal = is_causal or _is_causal_mask(attn_mask, Lq, Lk, self.mechanism)
        key_mask = _key_mask(key_padding_mask, B, Lk)
        q, k, v = (t.view(t.shape[0], B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # (B, H, L, Dh)
                   for t in self._in_projection(query, key, value))
        seed = int(torch.randint(2**62, (1,))) if self.spec.randomized else None

        def attend(values: torch.Tensor) -> torch.Tensor:
            generator = None if seed is None else torch.Generator(q.device).manual_seed(seed)
            return attention(q, k, values, self.mechanism, causal=causal, key_mask=key_mask,
                             generator=generator, **self.options)

        out = attend(v)  # (B, H, Lq, Dh)
        out = F.dropout(out, self.dropout, self.training)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(Lq, B, self.embed_dim))  # (Lq, B, E)
        weights = None
        if need_weights:
            weights = _effective_weights(attend, v, Lq)  # (B, H, Lq, Lk)
            weights = weights.mean(1) if average_attn_weights else weights
            weights = weights.squeeze(0) if unbatched else weights
        if unbatched:
            return out.squeeze(1), weights
        return (out.transpose(0, 1) if self.batch_first else out), weights

    def _in_projection(self, query, key, value) -> tuple[torch.Tensor, ...]:
        """Q, K and V (L, B, E) as torch computes them: one product where the inputs are one."""
        if self.in_proj_weight is None:  # separate weights (kdim or vdim != embed_dim)
            b_q, b_k, b_v = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            return (F.linear(query, self.q_proj_weight, b_q), F.linear(key, self.k_proj_weight, b_k),
                    F.linear(value, self.v_proj_weight, b_v))
        w, b = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            return F.linear(query, w, b).chunk(3, dim=-1)
        w_q, w_kv = w.split([self.embed_dim, 2 * self.embed_dim])
        b_q, b_kv = (None, None) if b is None else b.split([self.embed_dim, 2 * self.embed_dim])
        if key is value:
            return (F.linear(query, w_q, b_q), *F.linear(key, w_kv, b_kv).chunk(2, dim=-1))
        w_k, w_v = w_kv.chunk(2)
        b_k, b_v = (None, None) if b_kv is None else b_kv.chunk(2)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, mechanism={self.mechanism!r}, "
                f"options={self.options}, batch_first={self.batch_first}")


def _transposed_alike(query, key, value) -> tuple[torch.Tensor, ...]:
    """(B, L, E) -> (L, B, E) views, keeping which of the inputs are one tensor."""
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = k if value is key else (q if value is query else value.transpose(0, 1))
    return q, k, v


def _key_mask(key_padding_mask: torch.Tensor | None, B: int, Lk: int) -> torch.Tensor | None:
    """torch's key_padding_mask (True or -inf = padding) as attnzoo's key_mask (True = real)."""
    if key_padding_mask is None:
        return None
    if tuple(key_padding_mask.shape) != (B, Lk):
        raise ValueError(f"key_padding_mask must be (B, Lk) = ({B}, {Lk}), "
                         f"got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.dtype == torch.bool:
        return ~key_padding_mask
    padding = key_padding_mask == float("-inf")
    if not (padding | (key_padding_mask == 0)).all():
        raise ValueError("a float key_padding_mask must hold 0 (real key) or -inf (padding) only: "
                         "attnzoo mechanisms take no additive score bias")
    return ~padding


def _is_causal_mask(attn_mask: torch.Tensor | None, Lq: int, Lk: int, mechanism: str) -> bool:
    """Whether ``attn_mask`` is the causal mask (lower-right aligned); ValueError for any other."""
    if attn_mask is None:
        return False
    mask = attn_mask if attn_mask.dim() == 2 else attn_mask.flatten(0, -3)[0]  # (Lq, Lk)
    allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=attn_mask.device).tril(Lk - Lq)
    blocked = mask if mask.dtype == torch.bool else mask == float("-inf")
    real = ~mask if mask.dtype == torch.bool else mask == 0
    same = attn_mask.dim() == 2 or (attn_mask == mask).all()
    if tuple(mask.shape) == (Lq, Lk) and same and (blocked == ~allowed).all() and (real == allowed).all():
        if not get(mechanism).capabilities.causal:
            raise ValueError(f"a causal attn_mask, which {mechanism} cannot honour; mechanisms that "
                             f"can: {', '.join(n for n in mechanisms() if get(n).capabilities.causal)}")
        return True
    raise ValueError("attn_mask other than the causal mask: attnzoo mechanisms honour a causal mask "
                     "(attn_mask or is_causal=True) and key_padding_mask only, never forming the "
                     "(Lq, Lk) scores another mask would apply to; keep torch's MultiheadAttention "
                     "where a model needs one")


def _effective_weights(attend, v: torch.Tensor, Lq: int) -> torch.Tensor:
    """W (B, H, Lq, Lk) with ``attend(v) = W v``, read off by attending to the identity, a block
    of head_dim columns a call (every mechanism here is linear in v for fixed q and k)."""
    B, H, Lk, Dh = v.shape
    if B * H * Lq * Lk > MAX_WEIGHTS:
        raise ValueError(f"need_weights=True: the attention weights (B, H, Lq, Lk) = ({B}, {H}, {Lq}, "
                         f"{Lk}) are over attnzoo.swap.MAX_WEIGHTS = {MAX_WEIGHTS} elements; "
                         "pass need_weights=False")
    width = Dh * -(-Lk // Dh)  # Lk rounded up to whole blocks of Dh
    eye = torch.eye(Lk, width, dtype=v.dtype, device=v.device)  # (Lk, width)
    blocks = [attend(eye[:, j:j + Dh].expand(B, H, Lk, Dh)) for j in range(0, width, Dh)]
    return torch.cat(blocks, dim=-1)[..., :Lk]
