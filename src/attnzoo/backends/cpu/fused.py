"""torch's fused CPU attention kernel, called directly: a private op, guarded.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` is the kernel behind the public
``scaled_dot_product_attention`` on the CPU; called directly it also returns each row's
log-sum-exp, which lets partial softmaxes merge (factorized patterns, blocked windows) and a
hand-written backward recompute the weights. It is private: where it is missing (another
torch) or its preconditions do not hold (:func:`fits`), callers return NotImplemented and
the portable body runs.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)


def _ops():
    """(forward, backward) of the private kernel, or None in a torch without them."""
    try:
        aten = torch.ops.aten
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward)
    except (AttributeError, RuntimeError):
        return None


_OPS = _ops()


def fits(*ts: torch.Tensor, same_width: bool = True) -> bool:
    """Whether the kernel may take q, k, v (and any further tensors): on the CPU, float32 or
    float64, every last dimension of stride 1 (it reads rows as dense: given a strided one it
    computed wrong answers, where the public op copies first), Dv = D with ``same_width``."""
    q, v = ts[0], ts[2] if len(ts) > 2 else ts[-1]
    return (_OPS is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and all(t.device == q.device and t.dtype == q.dtype and t.stride(-1) == 1 for t in ts)
            and (not same_width or v.shape[-1] == q.shape[-1]))


def flash(q, k, v, *, attn_mask=None, scale=None):
    """(out, lse) of the kernel: q (B, H, R, D), k, v (B, H, n, D), an additive float mask
    broadcastable to (B, H, R, n) or None. The caller has checked :func:`fits`."""
    return _OPS[0](q, k, v, attn_mask=attn_mask, scale=scale)[:2]


def flash_backward(g, q, k, v, out, lse, *, scale):
    """(dq, dk, dv) of :func:`flash`'s out for its gradient g, without a mask."""
    return _OPS[1](g, q, k, v, out, lse, 0.0, False, scale=scale)[:3]


def exp_(t: torch.Tensor) -> torch.Tensor:
    """e^t in place (callers pass a fresh tensor), in float32 and float64 as 2^(t·log2 e): torch's
    CPU ``exp`` is slow where its results are subnormal or 0, where far keys' weights land
    (docs/internals.md). The price is the rounding of t·log2 e, ≤ |t|·6e-8 relative in float32."""
    if t.dtype in (torch.float32, torch.float64):
        return t.mul_(LOG2E).exp2_()
    return t.exp_()


def minus_inf_where_not_(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``t.masked_fill_(~valid, -inf)`` for finite t (valid bool, broadcastable to t), as
    t − (1/valid − 1) with valid read as bytes: torch's CPU bool kernels are not vectorised."""
    return t.sub_(valid.view(torch.uint8).to(t.dtype).reciprocal_().sub_(1))


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's additive mask of a bool ``valid`` (True = may attend): 0 or -inf."""
    return minus_inf_where_not_(torch.zeros(valid.shape, dtype=dtype, device=valid.device), valid)


def fused_partial(q, k, v, valid, scale=1.0):
    """(o, lse) of softmax(q kᵀ·scale) over the keys ``valid`` allows ((R, n) shared by every
    batch and head, (B, H, R, n), or None), applied to v, by the kernel; a row with no valid
    key gives o = 0, lse = -inf (the kernel itself would give lse 0). Needs :func:`fits`."""
    mask = None
    if valid is not None:
        mask = additive_mask(valid, q.dtype)
        mask = mask[None, None] if mask.dim() == 2 else mask
    o, lse = flash(q, k, v, attn_mask=mask, scale=scale)
    if valid is not None:
        empty = ~valid.any(-1)  # (R,) or (B, H, R)
        if bool(empty.any()):
            o, lse = o.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return o, lse
