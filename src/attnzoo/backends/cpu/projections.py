"""The layer's projections on the CPU: one function for the maps of one input, and writes
into fresh memory.

``MultiheadAttention`` projects by :func:`attnzoo.nn.project`. Here, where the projections
are plain ``nn.Linear`` modules with no hooks (their own or global: a subclass or a hook may
change what a call does, or expect to see it), self-attention's maps of x run as one
autograd function whose backward sums x's gradients in place (autograd makes a fresh
(B, L, d_in) tensor of each product and each partial sum), and without grad the results are
written into one fresh buffer; float32 products go to oneDNN where it is chosen
(:mod:`.products`). docs/internals.md gives the measurements.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from attnzoo.backends.cpu.memory import fresh_empty
from attnzoo.backends.cpu.products import times_t_into
from attnzoo.ops import override


def _plain(projections: list[nn.Module]) -> bool:
    """Whether the projections are plain ``nn.Linear`` modules with no hooks, theirs or global,
    so that the layer may compute their maps its own way: a subclass or a hook may change what
    a call does, or expect to see it."""
    hooked = _module._global_forward_hooks or _module._global_forward_pre_hooks
    return not hooked and all(type(p) is nn.Linear and not (p._forward_hooks or p._forward_pre_hooks)
                              for p in projections)


@override("project")
def project(x: torch.Tensor, projections: list[nn.Module], row_maps=()):
    """The projections of :func:`attnzoo.nn.project` on the CPU: plain ones without autocast
    (which would change their dtypes) go through :class:`_SharedInputLinear` (one input
    gradient for all the maps, summed in place), or without grad through :func:`_linears`,
    written into fresh memory. NotImplemented otherwise: the modules are called."""
    if x.device.type != "cpu" or torch.is_autocast_enabled(x.device.type) or not _plain(projections):
        return NotImplemented
    params = [t for p in projections for t in (p.weight, p.bias)]
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in [x, *params, *row_maps]):
        return _SharedInputLinear.apply(x, len(row_maps), *params, *row_maps)
    return _maps(x, params, row_maps)


QUERY_BLOCK = 1024  # query rows per block of attend_in_query_blocks


@override("attend_in_query_blocks")
def attend_in_query_blocks(layer, x: torch.Tensor, attend):
    """:func:`attnzoo.nn.attend_in_query_blocks` without autograd, with plain query and output
    projections: block by block of QUERY_BLOCK rows, each block's output projected into its rows
    of one result, so that each block's temporaries are reused by the heap rather than whole
    (B, Lq, ·) tensors mapped afresh on every call. NotImplemented otherwise."""
    if (x.device.type != "cpu" or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
            or not _plain([layer.q_proj, layer.out_proj])):
        return NotImplemented
    w, b = layer.out_proj.weight, layer.out_proj.bias
    out = fresh_empty(*x.shape[:2], w.shape[0], like=x)  # (B, Lq, d_model)
    for s in range(0, x.shape[1], QUERY_BLOCK):
        joined = layer._heads_joined(attend(x[:, s:s + QUERY_BLOCK]))  # (B, n, d_model)
        for out_rows, rows in zip(out[:, s:s + QUERY_BLOCK], joined, strict=True):  # (n, ·) each
            times_t_into(out_rows, rows, w, b)
    return out


def _maps(x: torch.Tensor, params, row_maps) -> tuple[torch.Tensor, ...]:
    """x Wᵀ + b by :func:`_linears` for the (W, b) in ``params`` (flat: W, b, W, b, ...), then
    P x for each row map P: the maps of :func:`project`, without autograd."""
    return (*_linears(x, params[0::2], params[1::2]), *(_row_map(P, x) for P in row_maps))


def _row_map(P: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """P x (B, p, d_in) for P (p, L) or (B, p, L) and x (B, L, d_in); a shared P by
    :func:`~attnzoo.backends.cpu.products.times_t_into` (oneDNN's, where it runs) a batch entry, into
    :func:`fresh_empty` memory."""
    if P.dim() == 3:
        return torch.matmul(P, x)
    out = fresh_empty(x.shape[0], P.shape[0], x.shape[2], like=x)
    for out_b, x_b in zip(out, x, strict=True):
        times_t_into(out_b, P, x_b.t())
    return out


def _linears(x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """x W_iᵀ + b_i for each i, (B, L, d_in) -> (B, L, d_out_i), into fresh memory: one
    (n, B·L, d_out) buffer for all n where their widths agree. One allocation for q, k and v, not
    three: glibc hands a freed heap top back to the OS when it exceeds twice the largest block it
    has mapped and freed, and three separate tensors were then faulted in afresh on every call."""
    rows = x.reshape(-1, x.shape[-1])  # (B·L, d_in)
    widths = [w.shape[0] for w in weights]
    outs = (fresh_empty(len(weights), rows.shape[0], widths[0], like=rows) if len(set(widths)) == 1
            else [fresh_empty(rows.shape[0], d_out, like=rows) for d_out in widths])
    return [times_t_into(out, rows, w, b).view(*x.shape[:-1], w.shape[0])
            for out, w, b in zip(outs, weights, biases, strict=True)]


class _SharedInputLinear(torch.autograd.Function):
    """Linear maps of one input x (B, L, d_in): ``x W_iᵀ + b_i`` for each (W_i, b_i) given in
    turn (b_i may be None), then ``P_j x`` for each of the last ``n_rows`` tensors P_j (p, L)
    or (B, p, L), with a backward that sums their input gradients into one tensor,
    dx = Σ g_i W_i + Σ P_jᵀ g_j, by one matmul and ``addmm_`` in place, where autograd would make
    a fresh (B, L, d_in) tensor of each product and each partial sum. Its results and dx are
    written into :func:`fresh_empty` memory (:func:`_linears`)."""

    @staticmethod
    def forward(x, n_rows, *tensors):
        return _maps(x, *_split_maps(tensors, n_rows))

    @staticmethod
    def setup_context(ctx, inputs, output):  # (apart from forward: torch.func's transforms need it)
        x, n_rows, *tensors = inputs
        params, row_maps = _split_maps(tensors, n_rows)
        ctx.save_for_backward(x, *params[0::2], *row_maps)
        ctx.has_bias, ctx.n_rows = [b is not None for b in params[1::2]], n_rows

    @staticmethod
    def backward(ctx, *grads):
        x, *saved = ctx.saved_tensors
        weights, row_maps = _split_maps(saved, ctx.n_rows)
        x_rows = x.reshape(-1, x.shape[-1])  # (B·L, d_in)
        needs = ctx.needs_input_grad[2:]  # (x, n_rows, then the tensors)
        dx, d_params = None, []
        for n, (g, w, has_bias) in enumerate(zip(grads[:len(weights)], weights, ctx.has_bias, strict=True)):
            g_rows = g.reshape(-1, g.shape[-1])  # (B·L, d_out)
            if ctx.needs_input_grad[0]:
                dx = (times_t_into(fresh_empty(g_rows.shape[0], w.shape[1], like=g_rows), g_rows, w.t())
                      if dx is None else dx.addmm_(g_rows, w))
            d_params.append(g_rows.t() @ x_rows if needs[2 * n] else None)
            d_params.append(g_rows.sum(0) if has_bias and needs[2 * n + 1] else None)
        row_grads = grads[len(weights):]
        if ctx.needs_input_grad[0]:
            for P, g in zip(row_maps, row_grads, strict=True):
                dx = _add_row_map_input_grad(dx, P, g, x)
        d_rows = _row_map_grads(row_maps, row_grads, needs[2 * len(weights):], x)
        return (None if dx is None else dx.view(x.shape)), None, *d_params, *d_rows


def _split_maps(tensors, n_rows: int):
    """(the projections' tensors, the last n_rows: the row maps)."""
    cut = len(tensors) - n_rows
    return list(tensors[:cut]), list(tensors[cut:])


def _add_row_map_input_grad(dx, P, g, x):
    """dx (B·L, d_in) += Pᵀ g, batch entry by batch entry, in place (written into fresh memory
    when dx is None); P (p, L) or (B, p, L), g (B, p, d_in), x (B, L, d_in)."""
    B, L, d_in = x.shape
    fresh = dx is None
    if fresh:
        dx = fresh_empty(B * L, d_in, like=x)
    for b, dx_b in enumerate(dx.view(B, L, d_in)):
        P_b = P if P.dim() == 2 else P[b]  # (p, L)
        if fresh:
            torch.mm(P_b.t(), g[b], out=dx_b)
        else:
            dx_b.addmm_(P_b.t(), g[b])
    return dx


def _row_map_grads(row_maps, grads, needs, x):
    """d P of each row map P x: g xᵀ (g (B, p, d_in) its output's gradient), summed over the batch
    where P (p, L) is shared by it; None where ``needs`` says so. The shared maps' in one product
    a batch entry, [g_1; g_2; ...] xᵀ, into one :func:`fresh_empty` buffer whose rows they are
    (one larger product runs faster than two)."""
    d_rows = [torch.matmul(g, x.transpose(1, 2), out=fresh_empty(*P.shape, like=g))  # (B, p, L)
              if need and P.dim() == 3 else None
              for P, g, need in zip(row_maps, grads, needs, strict=True)]
    shared = [j for j, (P, need) in enumerate(zip(row_maps, needs, strict=True)) if need and P.dim() == 2]
    if shared:
        g_all = torch.cat([grads[j] for j in shared], dim=1)  # (B, Σp, d_in)
        dP = times_t_into(fresh_empty(g_all.shape[1], x.shape[1], like=g_all), g_all[0], x[0])  # (Σp, L)
        for b in range(1, x.shape[0]):
            dP.addmm_(g_all[b], x[b].t())
        for j, rows in zip(shared, dP.split([row_maps[j].shape[0] for j in shared]), strict=True):
            d_rows[j] = rows
    return d_rows
