"""Layers that own parameters: multi-head attention over any registered mechanism.

A mechanism whose layer needs more than the four linear projections declares a
``layer_options`` dataclass in its spec (log_sparse's convolution, lsh's shared
query-key projection, linformer's E/F, performer's random features). Its
``build(layer)`` adds or replaces modules once, and the optional
``forward_options(layer, device)`` gives the extra functional options of a call. The
optional ``forward(layer, x, memory, key_mask)`` computes the layer's output
(B, Lq, d_model) from the unprojected inputs, where the mechanism can do better than
projecting every key (linformer); the layer uses it while its key and value projections
are plain ``nn.Linear`` modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from attnzoo.ops import operation
from attnzoo.registry import attention, get, make_options

__all__ = ["CausalConv1d", "MultiheadAttention"]

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
            q, *kv = (self._split(t) for t in project(x, projections))
            return q, (q if self.k_proj is None else kv[0]), kv[-1]
        q = self._split(project(x, [self.q_proj])[0])  # (B, H, Lq, Dh)
        k, v = (self._split(t) for t in project(memory, [self.k_proj, self.v_proj]))  # (B, H, Lk, Dh)
        return q, k, v  # (cross-attention has k_proj: _check refuses shared_qk there)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        return project(self._heads_joined(out), [self.out_proj])[0]

    def _heads_joined(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, L, Dh) -> (B, L, d_model), dropout applied: the output projection's input."""
        B, _, L, _ = out.shape
        return self.dropout(out.transpose(1, 2).reshape(B, L, self.d_model))

    def in_query_blocks(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layer's output (B, Lq, d_model) from ``attend(x_rows)`` (B, H, n, Dh), the attention
        of query rows x_rows (B, n, d_model) of x, where each query's output depends on its own
        row only (:func:`attend_in_query_blocks`)."""
        return attend_in_query_blocks(self, x, attend)

    def _project(self, x: torch.Tensor, projections: list[nn.Module], row_maps=()):
        """:func:`project`: for mechanisms' layer code (linformer's E X and F X)."""
        return project(x, projections, row_maps)

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
        if forward is not None and all(_plain_linear(p) for p in (self.k_proj, self.v_proj)):
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


def _plain_linear(module: nn.Module | None) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` with no hooks of its own: a mechanism's layer
    code may then apply its map its own way (linformer: E (X Wᵀ + b) as (E X) Wᵀ + (E 1) bᵀ)."""
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


@operation("project")
def project(x: torch.Tensor, projections: list[nn.Module], row_maps=()) -> tuple[torch.Tensor, ...]:
    """Each projection module of ``x`` (B, L, d_in) -> (B, L, d_out), then each row map P, (p, L)
    or (B, p, L), applied along the positions: P x (B, p, d_in) (linformer's E X)."""
    return *(p(x) for p in projections), *(torch.matmul(P, x) for P in row_maps)


@operation("attend_in_query_blocks")
def attend_in_query_blocks(layer: MultiheadAttention, x: torch.Tensor, attend) -> torch.Tensor:
    """The layer's output (B, Lq, d_model) from ``attend(x_rows)`` (B, H, n, Dh), the attention of
    query rows x_rows (B, n, d_model) of x, each query's output depending on its own row only
    (a backend may run it block by block of rows)."""
    return layer._merge(attend(x))


def causal_conv_projection(layer: MultiheadAttention, kernel_size: int) -> None:
    """Make the layer's query and key projections causal Conv1d of ``kernel_size`` (1 = linear)."""
    if kernel_size > 1:
        layer.q_proj = CausalConv1d(layer.d_model, layer.d_model, kernel_size, bias=layer.bias)
        layer.k_proj = CausalConv1d(layer.d_model, layer.d_model, kernel_size, bias=layer.bias)

