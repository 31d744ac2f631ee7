"""The C kernels of linear and efficient attention as torch custom operators, for traced code.

``torch.compile`` and ``torch.export`` cannot trace a ctypes call: without this module, traced
code takes the portable bodies (plain torch, which inductor compiles well for most mechanisms,
but causal linear attention's chunked prefix sums run several times slower than the C
recurrence). Here each kernel is a custom operator (``torch.library.custom_op``, torch >= 2.4):
one node of the graph, with a fake implementation that gives the shapes while tracing, and its
backward, itself an operator, registered for autograd.

- ``attnzoo::linear_elu``: non-causal linear attention, φ = elu + 1.
- ``attnzoo::causal_linear_elu``: causal linear attention from a state (S, z).
- ``attnzoo::efficient``: efficient attention.

The traceable overrides below call them for CPU float32 / float64 inputs. An operator runs its
C kernel where it builds, else (no compiler, ``ATTNZOO_NATIVE=0``) the portable body, which the
tests hold both to: an exported program then runs the same wherever attnzoo is imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo.backends.cpu import native
from attnzoo.mechanisms._kernel import _kernel_attention
from attnzoo.mechanisms.efficient import efficient_core
from attnzoo.ops import override

custom_op = getattr(torch.library, "custom_op", None)  # (torch >= 2.4; before: nothing registered)


def _traceable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the operators take these inputs: CPU, float32 or float64 alike, kernels on."""
    return (custom_op is not None and native.enabled() and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64) and k.dtype == q.dtype and v.dtype == q.dtype)


def _portable_grads(fn, inputs: list[Tensor], grads: list[Tensor | None]) -> tuple[Tensor | None, ...]:
    """The gradients of ``fn(*inputs)``'s outputs (given ``grads``) by the portable body."""
    outs, pullback = torch.func.vjp(fn, *inputs)  # (autograd proper is off inside an operator)
    return pullback(tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads, strict=True)))


def _portable_linear(q, k, v, key_mask, eps, state=None):
    """Linear attention (φ = elu + 1) by the portable body: causal from ``state`` where one is given."""
    from attnzoo.mechanisms.linear import LinearOptions, _feature_map

    opts = LinearOptions()
    return _kernel_attention.portable(q, k, v, _feature_map(opts, q.shape[-1]), causal=state is not None,
                                      key_mask=key_mask, eps=eps, chunk=opts.chunk, state=state)


def _portable_efficient(q, k, v, key_mask):
    return efficient_core.portable(q, k, v, key_mask)


def _linear_state(q, v) -> tuple[Tensor, Tensor]:
    """Zero S (B·H, D, Dv), z (B·H, D): the shapes the kernels' backward takes."""
    (B, H, _, D), Dv = q.shape, v.shape[-1]
    return q.new_zeros(B * H, D, Dv), q.new_zeros(B * H, D)


def _efficient_state(q, v) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zero G (B·H, D, Dv), z, c (B·H, D), shift (B·H, Lq)."""
    (B, H, Lq, D), Dv = q.shape, v.shape[-1]
    return q.new_zeros(B * H, D, Dv), q.new_zeros(B * H, D), q.new_zeros(B * H, D), q.new_zeros(B * H, Lq)


if custom_op is not None:

    # --- non-causal linear attention, φ = elu + 1 ------------------------------------------------

    @custom_op("attnzoo::linear_elu", mutates_args=())
    def linear_elu(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """φ(q) (Σ φ(k) vᵀ) / (φ(q)·Σ φ(k) + eps): q, k (B, H, L·, D), v (B, H, Lk, Dv) ->
        (out (B, H, Lq, Dv), and for the backward S (B·H, D, Dv), z (B·H, D))."""
        lib = native._kernels("linear", q, k, v)
        if lib is None:  # (the backward then takes the portable body's: S and z unused)
            return _portable_linear(q, k, v, key_mask, eps)[0], *_linear_state(q, v)
        return native._linear_forward(lib, q, k, v, key_mask, eps)

    @linear_elu.register_fake
    def _(q, k, v, key_mask, eps):
        return q.new_empty(*q.shape[:3], v.shape[-1]), *_linear_state(q, v)

    @custom_op("attnzoo::linear_elu_backward", mutates_args=())
    def linear_elu_backward(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, eps: float,
                            S: Tensor, z: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lib = native._kernels("linear", q, k, v)
        if lib is None:
            return _portable_grads(lambda q, k, v: _portable_linear(q, k, v, key_mask, eps)[:1], [q, k, v],
                                   [grad])
        return native._linear_backward(lib, q, k, v, key_mask, eps, S, z, grad)

    @linear_elu_backward.register_fake
    def _(q, k, v, key_mask, eps, S, z, grad):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _linear_setup(ctx, inputs, output):
        q, k, v, key_mask, ctx.eps = inputs
        ctx.save_for_backward(q, k, v, key_mask, *output[1:])
        ctx.mark_non_differentiable(*output[1:])

    def _linear_backward(ctx, grad, _S, _z):
        return *linear_elu_backward(*ctx.saved_tensors[:4], ctx.eps, *ctx.saved_tensors[4:], grad), None, None

    linear_elu.register_autograd(_linear_backward, setup_context=_linear_setup)

    # --- causal linear attention, φ = elu + 1, from a state ---------------------------------------

    @custom_op("attnzoo::causal_linear_elu", mutates_args=())
    def causal_linear_elu(q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor, key_mask: Tensor | None,
                          eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """(out (B, H, L, Dv), S after (B, H, D, Dv), z after (B, H, D)), query i over keys j <= i
        and the state before, queries and keys aligned."""
        lib = native._kernels("causal_linear", q, k, v, S, z)
        if lib is None:
            out, (S, z) = _portable_linear(q, k, v, key_mask, eps, state=(S, z))
            return out, S, z
        return native._causal_linear_forward(lib, q, k, v, S, z, key_mask, eps)

    @causal_linear_elu.register_fake
    def _(q, k, v, S, z, key_mask, eps):
        return q.new_empty(*q.shape[:3], v.shape[-1]), torch.empty_like(S), torch.empty_like(z)

    @custom_op("attnzoo::causal_linear_elu_backward", mutates_args=())
    def causal_linear_elu_backward(q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor,
                                   key_mask: Tensor | None, eps: float, out: Tensor, g_out: Tensor,
                                   g_S: Tensor, g_z: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        lib = native._kernels("causal_linear", q, k, v, S, z)
        if lib is None:
            def fn(q, k, v, S, z):
                out, (S, z) = _portable_linear(q, k, v, key_mask, eps, state=(S, z))
                return out, S, z
            return _portable_grads(fn, [q, k, v, S, z], [g_out, g_S, g_z])
        return native._causal_linear_backward(lib, q, k, v, S, z, key_mask, eps, out, g_out, g_S, g_z)

    @causal_linear_elu_backward.register_fake
    def _(q, k, v, S, z, key_mask, eps, out, g_out, g_S, g_z):
        return tuple(torch.empty_like(t) for t in (q, k, v, S, z))

    def _causal_setup(ctx, inputs, output):
        q, k, v, S, z, key_mask, ctx.eps = inputs
        ctx.save_for_backward(q, k, v, S, z, key_mask, output[0])

    def _causal_backward(ctx, g_out, g_S, g_z):
        q, k, v, S, z, key_mask, out = ctx.saved_tensors
        g_S = torch.zeros_like(S) if g_S is None else g_S
        g_z = torch.zeros_like(z) if g_z is None else g_z
        grads = causal_linear_elu_backward(q, k, v, S, z, key_mask, ctx.eps, out, g_out, g_S, g_z)
        return *grads, None, None

    causal_linear_elu.register_autograd(_causal_backward, setup_context=_causal_setup)

    # --- efficient attention -------------------------------------------------------------------

    @custom_op("attnzoo::efficient", mutates_args=())
    def efficient(q: Tensor, k: Tensor, v: Tensor,
                  key_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """σ_row(q) (σ_col(k)ᵀ v): q, k (B, H, L·, D), v (B, H, Lk, Dv) -> (out (B, H, Lq, Dv), and
        for the backward G (B·H, D, Dv), z, c (B·H, D), the queries' row shifts (B·H, Lq))."""
        lib = native._kernels("efficient", q, k, v)
        if lib is None:  # (the backward then takes the portable body's: the rest unused)
            return _portable_efficient(q, k, v, key_mask), *_efficient_state(q, v)
        return native._efficient_forward(lib, q, k, v, key_mask, keep_shift=True)

    @efficient.register_fake
    def _(q, k, v, key_mask):
        return q.new_empty(*q.shape[:3], v.shape[-1]), *_efficient_state(q, v)

    @custom_op("attnzoo::efficient_backward", mutates_args=())
    def efficient_backward(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, G: Tensor, z: Tensor,
                           c: Tensor, shift: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lib = native._kernels("efficient", q, k, v)
        if lib is None:
            return _portable_grads(lambda q, k, v: (_portable_efficient(q, k, v, key_mask),), [q, k, v],
                                   [grad])
        return native._efficient_backward(lib, q, k, v, key_mask, G, z, c, shift, grad)

    @efficient_backward.register_fake
    def _(q, k, v, key_mask, G, z, c, shift, grad):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _efficient_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output[1:])
        ctx.mark_non_differentiable(*output[1:])

    def _efficient_grads(ctx, grad, *_):
        return *efficient_backward(*ctx.saved_tensors, grad), None

    efficient.register_autograd(_efficient_grads, setup_context=_efficient_setup)

    # --- the traceable overrides ---------------------------------------------------------------

    @override("kernel_attention", traceable=True)
    def kernel_attention(q, k, v, phi, *, causal, key_mask, eps, chunk, state=None):
        """φ = elu + 1 by the operators: non-causal, and causal with queries and keys aligned."""
        if phi.name != "elu" or not _traceable(q, k, v) or (causal and q.shape[2] != k.shape[2]):
            return NotImplemented
        if not causal:
            return linear_elu(q, k, v, key_mask, eps)[0], None
        (B, H, _, D), Dv = q.shape, v.shape[-1]
        S, z = (q.new_zeros(B, H, D, Dv), q.new_zeros(B, H, D)) if state is None else state
        out, S, z = causal_linear_elu(q, k, v, S.to(q.dtype), z.to(q.dtype), key_mask, eps)
        return out, (S, z)

    @override("efficient_attention", traceable=True)
    def efficient_attention(q, k, v, key_mask):
        return efficient(q, k, v, key_mask)[0] if _traceable(q, k, v) else NotImplemented
