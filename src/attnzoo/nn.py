"""Layers that own parameters: multi-head attention over any registered mechanism.

A mechanism whose layer needs more than the four linear projections declares a
``layer_options`` dataclass in its spec (log_sparse's convolution, lsh's shared
query-key projection, linformer's E/F, performer's random features). Its
``build(layer)`` adds or replaces modules once, and the optional
``forward_options(layer, device)`` gives the extra functional options of a call. The
optional ``forward(layer, x, memory, key_mask)`` computes the layer's output
(B, Lq, d_model) from the unprojected inputs, where the mechanism can do better than
projecting every key (linformer); the layer uses it while its key and value projections
are plain ``nn.Linear`` modules with no hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from attnzoo._pages import fresh_empty
from attnzoo._products import times_t_into
from attnzoo.registry import attention, get, make_options

__all__ = ["CausalConv1d", "MultiheadAttention"]

QUERY_BLOCK = 1024  # query rows per block of MultiheadAttention.in_query_blocks


def _field_names(options_type) -> list[str]:
    return [] if options_type is None else [f.name for f in dataclasses.fields(options_type)]


class CausalConv1d(nn.Module):
    """Conv1d over the sequence that sees only the current and the kernel_size-1 previous steps.

    ``(B, L, C_in) -> (B, L, C_out)``: left padding of kernel_size - 1, so output t
    depends on inputs t-kernel_size+1..t only (LogSparse's convolutional self-attention).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = True):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.pad(x.transpose(1, 2), (self.kernel_size - 1, 0))  # (B, C_in, L + k - 1)
        return self.conv(x).transpose(1, 2)  # (B, L, C_out)


class MultiheadAttention(nn.Module):
    """Multi-head attention whose inner attention is any registered mechanism.

    Batch-first: ``x (B, Lq, d_model)``, optional ``memory (B, Lk, d_model)``
    for cross-attention, ``key_mask (B, Lk)`` bool (True = real key). Returns
    ``(B, Lq, d_model)``. Q, K, V and output are linear projections, as in
    ``torch.nn.MultiheadAttention``; with ``mechanism="full"`` and the same
    weights the two give the same output.

    Args:
        d_model: model width; must be divisible by ``n_heads``.
        n_heads: number of heads; each has ``d_model // n_heads`` features.
        mechanism: a name from ``attnzoo.mechanisms()``.
        dropout: dropout on the attention output, before the output
            projection (not on attention weights, which most mechanisms never
            form).
        bias: whether the projections have biases (the output's: see ``out_bias``).
        causal: causal self-attention (see ``attnzoo.attention``).
        out_bias: whether the output projection has a bias; None (the default):
            as ``bias``. ``bias=False, out_bias=True`` is the layout of the
            linformer and nystrom-attention packages: queries, keys and values
            without biases, the output with one.
        seed: seed of the layer's own generator, used by randomized
            mechanisms so that a run is reproducible; its state is saved in
            ``state_dict``.
        **options: the mechanism's options; unknown names raise ValueError.
            Options of the layer itself (``attnzoo.get(name).layer_options``)
            are taken here:

            - log_sparse ``kernel_size``: queries and keys from a causal Conv1d
              of that kernel (the paper's convolutional self-attention).
            - lsh ``shared_qk`` (default True, the paper's setting): the query
              projection serves the keys too (``k_proj`` is None).
            - linformer ``max_len``: E and F are parameters of (proj_len, max_len);
              shorter inputs use their first columns. Keys and values are
              computed as (E X) W_Kᵀ and (F X) W_Vᵀ: proj_len rows projected, not L.
            - performer: the random features are a buffer, drawn at
              construction; ``layer.redraw()`` draws new ones.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mechanism: str = "full",
        dropout: float = 0.0,
        bias: bool = True,
        *,
        causal: bool = False,
        out_bias: bool | None = None,
        seed: int = 0,
        **options: Any,
    ) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.spec = get(mechanism)
        layer_names = set(_field_names(self.spec.layer_options))
        layer_opts = {n: options.pop(n) for n in list(options) if n in layer_names}
        make_options(self.spec, options)  # reject unknown or invalid options now, not at forward
        if causal and not self.spec.capabilities.causal:
            raise ValueError(f"{mechanism} does not support causal=True")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.mechanism, self.causal, self.options, self.seed = mechanism, causal, options, seed
        self.bias = bias
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj: nn.Module | None = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias if out_bias is None else out_bias)
        self.dropout = nn.Dropout(dropout)
        self._generator: torch.Generator | None = None
        self._saved_generator: dict | None = None  # from load_state_dict, applied on first use
        self.extra = self.spec.layer_options(**layer_opts) if self.spec.layer_options else None
        if self.extra is not None:
            self.extra.build(self)
            make_options(self.spec, self.options)  # what build() added must be valid too

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The layer's seeded generator on ``device`` (None for deterministic mechanisms)."""
        if not self.spec.randomized:
            return None
        device = torch.device(device)
        if self._generator is None or self._generator.device.type != device.type:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
            saved = self._saved_generator
            if saved is not None and saved["device"] == device.type:  # continue a loaded state
                self._generator.set_state(saved["state"].cpu())  # a ByteTensor on the CPU, always
        return self._generator

    def redraw(self) -> None:
        """Draw new random parameters where the mechanism keeps some (performer's features)."""
        if self.extra is not None and hasattr(self.extra, "redraw"):
            self.extra.redraw(self)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        B, L, _ = t.shape
        return t.view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

    def _check(self, x: torch.Tensor, memory: torch.Tensor) -> None:
        for name, t in (("x", x), ("memory", memory)):
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"{name} must be (B, L, d_model={self.d_model}), got {tuple(t.shape)}")
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"x and memory batch sizes differ: {x.shape[0]} vs {memory.shape[0]}")
        if self.k_proj is None and memory is not x:
            raise ValueError(f"{self.mechanism} with shared_qk=True is self-attention only")

    def _qkv(self, x: torch.Tensor, memory: torch.Tensor):
        projections = [p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None]
        if memory is x:  # self-attention: the projections of one input, in one function
            q, *kv = (self._split(t) for t in _project(x, projections))
            return q, (q if self.k_proj is None else kv[0]), kv[-1]
        q = self._split(_project(x, [self.q_proj])[0])  # (B, H, Lq, Dh)
        k, v = (self._split(t) for t in _project(memory, [self.k_proj, self.v_proj]))  # (B, H, Lk, Dh)
        return q, k, v  # (cross-attention has k_proj: _check refuses shared_qk there)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        return _project(self._heads_joined(out), [self.out_proj])[0]

    def _heads_joined(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, L, Dh) -> (B, L, d_model), dropout applied: the output projection's input."""
        B, _, L, _ = out.shape
        return self.dropout(out.transpose(1, 2).reshape(B, L, self.d_model))

    def in_query_blocks(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layer's output (B, Lq, d_model) from ``attend(x_rows)`` (B, H, n, Dh), the attention
        of some query rows x_rows (B, n, d_model) of x, where each query's output depends on its
        own row only. Without autograd, and with plain query and output projections, block by
        block of QUERY_BLOCK rows, each block's output projected into its rows of the result:
        the blocks' temporaries come from the heap again and again, where the (B, Lq, ·)
        tensors of one pass were in some processes faulted in afresh on every call (linformer
        at L = 4096: 6-8k page faults and 43-53 ms a call, against none and ~37 ms in blocks).
        Otherwise ``attend(x)`` at once."""
        if (torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
                or not _plain([self.q_proj, self.out_proj])):
            return self._merge(attend(x))
        w, b = self.out_proj.weight, self.out_proj.bias
        out = fresh_empty(*x.shape[:2], w.shape[0], like=x)  # (B, Lq, d_model)
        for s in range(0, x.shape[1], QUERY_BLOCK):
            joined = self._heads_joined(attend(x[:, s:s + QUERY_BLOCK]))  # (B, n, d_model)
            for out_rows, rows in zip(out[:, s:s + QUERY_BLOCK], joined, strict=True):  # (n, ·) each
                times_t_into(out_rows, rows, w, b)
        return out

    def _call_options(self, device) -> dict:
        forward_options = getattr(self.extra, "forward_options", None)
        extra = {} if forward_options is None else forward_options(self, device)
        return {**self.options, **extra}

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        *,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention over ``x`` or, with ``memory``, cross-attention to it."""
        memory = x if memory is None else memory
        self._check(x, memory)
        forward = getattr(self.extra, "forward", None)
        if forward is not None and _plain([self.k_proj, self.v_proj]):
            return forward(self, x, memory, key_mask)
        q, k, v = self._qkv(x, memory)
        out = attention(q, k, v, mechanism=self.mechanism, causal=self.causal, key_mask=key_mask,
                        generator=self.generator(x.device), **self._call_options(x.device))
        return self._merge(out)  # (B, Lq, d_model)

    def step(self, x: torch.Tensor, state=None):
        """Incremental causal decoding for recurrent mechanisms (``capabilities.recurrent``).

        ``x (B, T, d_model)``: the next T positions (usually 1). Returns
        ``(y (B, T, d_model), state)``; pass the state back with the next
        positions. Step by step, the outputs equal a causal ``forward`` over the
        whole sequence.
        """
        if not self.spec.capabilities.recurrent:
            raise ValueError(f"{self.mechanism} has no recurrent step; recurrent mechanisms: "
                             f"{[n for n in _recurrent_names()]}")
        self._check(x, x)
        q, k, v = self._qkv(x, x)
        out, state = self.spec.step(q, k, v, state, make_options(self.spec, self._call_options(x.device)))
        return self._merge(out), state

    def get_extra_state(self) -> dict:
        """The generator's state, so that a reloaded layer draws what the saved one would have."""
        gen = self._generator
        if gen is None:
            return {"generator": self._saved_generator}
        return {"generator": {"device": gen.device.type, "state": gen.get_state()}}

    def set_extra_state(self, state: dict) -> None:
        # Applied when the generator is next made, on the device of the input then (a state
        # saved on one device type does not carry over to another: that one starts from seed).
        # torch.load's map_location may have moved the state tensor, a CUDA one's too, to a GPU.
        self._saved_generator = state.get("generator")
        self._generator = None

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, mechanism={self.mechanism!r}, "
                f"causal={self.causal}, options={self.options}, layer={self.extra}")


def _recurrent_names() -> list[str]:
    from attnzoo.registry import mechanisms

    return [n for n in mechanisms() if get(n).capabilities.recurrent]


def _plain(projections: list[nn.Module]) -> bool:
    """Whether the projections are plain ``nn.Linear`` modules with no hooks, theirs or global,
    so that the layer may compute their maps its own way: a subclass or a hook may change what
    a call does, or expect to see it."""
    hooked = _module._global_forward_hooks or _module._global_forward_pre_hooks
    return not hooked and all(type(p) is nn.Linear and not (p._forward_hooks or p._forward_pre_hooks)
                              for p in projections)


def _project(x: torch.Tensor, projections: list[nn.Module], row_maps=()) -> tuple[torch.Tensor, ...]:
    """Each projection of ``x`` (B, L, d_in) -> (B, L, d_out), then each row map P, (p, L) or
    (B, p, L), applied along the positions: P x (B, p, d_in) (linformer's E X). :func:`_plain`
    projections without autocast (which would change their dtypes) go through
    :class:`_SharedInputLinear` (one input gradient for all the maps), or without grad through
    :func:`_linears`, their results in :func:`~attnzoo._pages.fresh_empty` memory; others are
    called as modules."""
    if torch.is_autocast_enabled(x.device.type) or not _plain(projections):
        return *(p(x) for p in projections), *(torch.matmul(P, x) for P in row_maps)
    params = [t for p in projections for t in (p.weight, p.bias)]
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in [x, *params, *row_maps]):
        return _SharedInputLinear.apply(x, len(row_maps), *params, *row_maps)
    return _maps(x, params, row_maps)


def _maps(x: torch.Tensor, params, row_maps) -> tuple[torch.Tensor, ...]:
    """x Wᵀ + b by :func:`_linears` for the (W, b) in ``params`` (flat: W, b, W, b, ...), then
    P x for each row map P: the maps of :func:`_project`, without autograd."""
    return (*_linears(x, params[0::2], params[1::2]), *(_row_map(P, x) for P in row_maps))


def _row_map(P: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """P x (B, p, d_in) for P (p, L) or (B, p, L) and x (B, L, d_in); a shared P by
    :func:`~attnzoo._products.times_t_into` (oneDNN's, where it runs) a batch entry, into
    :func:`~attnzoo._pages.fresh_empty` memory."""
    if P.dim() == 3:
        return torch.matmul(P, x)
    out = fresh_empty(x.shape[0], P.shape[0], x.shape[2], like=x)
    for out_b, x_b in zip(out, x, strict=True):
        times_t_into(out_b, P, x_b.t())
    return out


def _linears(x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """x W_iᵀ + b_i for each i, (B, L, d_in) -> (B, L, d_out_i), into fresh memory: one
    (n, B·L, d_out) buffer for all n where their widths agree, in huge pages where it is
    32 MiB or more (:func:`~attnzoo._pages.fresh_empty`: at L = 16384 and d_model 512, ~5 ms
    of 4 KiB page faults a 32 MiB result otherwise). One allocation for q, k and v, not three: glibc
    hands a freed heap top back to the OS when it exceeds twice the largest block it has
    mapped and freed, and the layer's (B, L, d_model) tensors were then faulted in afresh on
    every call (nystrom's forward at L = 4096: ~12k page faults and 69-77 ms a call in some
    processes; none and 61-67 ms with q, k and v in one 24 MiB block)."""
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
    dx = Σ g_i W_i + Σ P_jᵀ g_j, by one matmul and ``addmm_`` in place. Through autograd each
    product and each partial sum is a fresh (B, L, d_in) tensor: at L = 16384 and d_model 512,
    32 MiB tensors faulted in afresh, four more per training step of self-attention (~30k page
    faults); linformer's q, E X and F X took 103-108 ms for their dx that way, 61 ms in one.
    Its results and dx are written into :func:`~attnzoo._pages.fresh_empty` memory
    (:func:`_linears`)."""

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
    a batch entry, [g_1; g_2; ...] xᵀ, into one :func:`~attnzoo._pages.fresh_empty` buffer
    whose rows they are (linformer's dE and dF at L = 4096: two (256 × 512) @ (512 × 4096)
    products 17.0 ms, one of 512 rows 14.0; and at L = 16384 16 MiB each, faulted in afresh on
    every training step in torch's)."""
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


def causal_conv_projection(layer: MultiheadAttention, kernel_size: int) -> None:
    """Make the layer's query and key projections causal Conv1d of ``kernel_size`` (1 = linear)."""
    if kernel_size > 1:
        layer.q_proj = CausalConv1d(layer.d_model, layer.d_model, kernel_size, bias=layer.bias)
        layer.k_proj = CausalConv1d(layer.d_model, layer.d_model, kernel_size, bias=layer.bias)
