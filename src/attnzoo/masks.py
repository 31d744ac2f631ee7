"""Causal and key-mask helpers shared by every mechanism.

The one convention, everywhere: a boolean mask is True where a query *may*
attend to a key (as in ``torch.nn.functional.scaled_dot_product_attention``).

Causal alignment with ``Lq != Lk``: the queries are the *last* Lq positions
of the key sequence, so query i sees keys ``j <= i + (Lk - Lq)`` (torch's
``causal_lower_right``). For Lq = 3, Lk = 4::

    [[1, 1, 0, 0],
     [1, 1, 1, 0],
     [1, 1, 1, 1]]

A query that sees no key at all gets a zero output row, never NaN.
"""

from __future__ import annotations

import torch


def causal_offset(Lq: int, Lk: int) -> int:
    """Query i of Lq sees keys j <= i + causal_offset(Lq, Lk)."""
    return Lk - Lq


def dense_mask(
    Lq: int,
    Lk: int,
    *,
    causal: bool = False,
    key_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The full ``(B or 1, 1, Lq, Lk)`` bool mask (True = may attend). For references only."""
    if key_mask is not None:
        device = key_mask.device
    mask = torch.ones(1, 1, Lq, Lk, dtype=torch.bool, device=device)
    if causal:
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=device).tril(causal_offset(Lq, Lk))
        mask = mask[None, None]  # (1, 1, Lq, Lk)
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]  # (B, 1, Lq, Lk)
    return mask


def visible_key_count(
    Lq: int, Lk: int, *, causal: bool, key_mask: torch.Tensor | None, device=None
) -> torch.Tensor:
    """How many keys each query may see, ``(B or 1, 1, Lq)`` int64, in O(B·(Lq + Lk)).

    Used to give zero rows to queries that see nothing without building a mask.
    """
    if key_mask is not None:
        device = key_mask.device
        counts = key_mask.long().cumsum(-1)  # (B, Lk): real keys among 0..j
    else:
        counts = torch.arange(1, Lk + 1, device=device)[None]  # (1, Lk)
    if not causal:
        return counts[:, -1:].expand(-1, Lq)[:, None]  # (B, 1, Lq)
    last = torch.arange(Lq, device=device) + causal_offset(Lq, Lk)  # last visible key of query i
    seen = counts[:, last.clamp(min=0, max=Lk - 1)]  # (B, Lq)
    seen = torch.where(last >= 0, seen, torch.zeros_like(seen))
    return seen[:, None]  # (B, 1, Lq)


def has_empty_rows(Lq: int, Lk: int, *, causal: bool, key_mask: torch.Tensor | None) -> bool:
    """Whether some query sees no key (without a data-dependent sync when it cannot happen)."""
    if key_mask is None:
        return causal and Lq > Lk
    return bool((visible_key_count(Lq, Lk, causal=causal, key_mask=key_mask) == 0).any())


def zero_empty_rows(
    out: torch.Tensor, *, causal: bool, key_mask: torch.Tensor | None, Lk: int
) -> torch.Tensor:
    """Set to zero the rows of ``out (B, H, Lq, Dv)`` whose query sees no key."""
    Lq = out.shape[2]
    if not has_empty_rows(Lq, Lk, causal=causal, key_mask=key_mask):
        return out
    seen = visible_key_count(Lq, Lk, causal=causal, key_mask=key_mask, device=out.device)
    return torch.where(seen[..., None] > 0, out, torch.zeros((), dtype=out.dtype, device=out.device))
