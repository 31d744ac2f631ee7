"""Linear attention (Katharopoulos et al., ICML 2020): kernel attention with φ = elu + 1, and its
recurrent step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnzoo.mechanisms._kernel import FeatureMap, kernel_attention, kernel_flops, kernel_reference, no_scale
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class PointwiseMap:
    """An elementwise feature map φ whose derivative is a function of its value: φ'(x) =
    ``derivative(φ(x))``. Called, it is ``fn`` (plain autograd); a backend may differentiate
    by ``derivative`` instead of keeping the map's graph."""

    fn: Callable[[torch.Tensor], torch.Tensor]  # x -> φ(x)
    derivative: Callable[[torch.Tensor], torch.Tensor]  # φ(x) -> φ'(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1, the paper's positive feature map: e^x for x <= 0, 1 + x above. e^x is
    taken as such, more exact than elu's expm1(x) + 1, which rounds away its digits."""
    return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))


elu_feature_map = PointwiseMap(elu_plus_one, lambda phi: phi.clamp(max=1.0))  # φ' = e^x below 0, 1 above


@dataclass(frozen=True)
class LinearOptions:
    feature_map: Callable[[torch.Tensor], torch.Tensor] | str = "elu"  # "elu" or a callable φ
    eps: float = 1e-6  # added to the normaliser
    chunk: int = 64  # causal: queries per chunk of the prefix sums (speed, not results)

    def __post_init__(self):
        if not (callable(self.feature_map) or self.feature_map == "elu"):
            raise ValueError(f"linear: feature_map must be 'elu' or a callable, got {self.feature_map!r}")
        if self.eps < 0:
            raise ValueError(f"linear: eps must be >= 0, got {self.eps}")
        if self.chunk < 1:
            raise ValueError(f"linear: chunk must be >= 1, got {self.chunk}")


@dataclass
class LinearState:
    """Recurrent state after a prefix of keys: S = Σ φ(k_j) v_jᵀ and z = Σ φ(k_j).

    ``kv`` is (B, H, F, Dv+1): S with z as its last column.
    """

    kv: torch.Tensor


def _feature_map(opts: LinearOptions, D: int) -> FeatureMap:
    """φ of the options as the kernel engine takes it (a user's map: of the same width D)."""
    phi = elu_feature_map if opts.feature_map == "elu" else opts.feature_map
    derivative = phi.derivative if isinstance(phi, PointwiseMap) else None
    return FeatureMap("elu" if phi is elu_feature_map else "custom", phi, D, derivative=derivative)


def linear_attention(q, k, v, opts=LinearOptions(), *, causal=False, key_mask=None, scale=None,
                     generator=None):
    """φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + eps) over the visible keys, φ = elu + 1.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(L·D·Dv) time and O(D·Dv) state non-causal; causal O(L·(chunk + D)·Dv)
    time and O(L·chunk + (L/chunk)·D·Dv) memory by chunked prefix sums
    (:func:`~attnzoo.mechanisms._kernel.kernel_attention`). Katharopoulos et al., ICML 2020.
    The seed notebook's cell computes φ(Q)(φ(K)ᵀV) without the normaliser φ(Q)(φ(K)ᵀ1); we
    implement the paper's.
    """
    no_scale("linear", scale)
    out, _ = kernel_attention(q, k, v, _feature_map(opts, q.shape[-1]), causal=causal, key_mask=key_mask,
                              eps=opts.eps, chunk=opts.chunk)
    return out


def linear_step(q, k, v, state: LinearState | None = None, opts=LinearOptions()):
    """Recurrent decoding: attend T new positions causally, continuing from ``state``.

    q, k (B, H, T, D), v (B, H, T, Dv) -> (out (B, H, T, Dv), new state). Feeding a
    sequence one token at a time gives exactly the causal ``linear_attention``.
    """
    start = None if state is None else (state.kv[..., :-1], state.kv[..., -1])
    out, (S, z) = kernel_attention(q, k, v, _feature_map(opts, q.shape[-1]), causal=True, key_mask=None,
                                   eps=opts.eps, chunk=opts.chunk, state=start)
    return out, LinearState(torch.cat([S, z.unsqueeze(-1)], -1))


def linear_reference(q, k, v, opts=LinearOptions(), *, causal=False, key_mask=None, scale=None,
                     generator=None):
    no_scale("linear", scale)
    phi = _feature_map(opts, q.shape[-1]).query
    return kernel_reference(phi(q), phi(k), v, causal=causal, key_mask=key_mask, eps=opts.eps)


def linear_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """FLOPs of the forward that runs (:func:`~attnzoo.mechanisms._kernel.kernel_flops`): the
    chunked prefix sums', or, where a backend runs causal elu + 1 as the paper's recurrence (the
    CPU backend's C kernel), the recurrence's."""
    return kernel_flops(B, H, Lq, Lk, D, Dv, causal=causal, chunk=opts.chunk,
                        map_name=_feature_map(opts, D).name)


register(
    Mechanism(
        name="linear",
        summary="φ(Q)(φ(K)ᵀV) normalised, φ = elu+1; causal by chunked prefix sums; recurrent step",
        options=LinearOptions,
        fn=linear_attention,
        reference=linear_reference,
        capabilities=Capabilities(causal=True, cross=True, key_mask=True, recurrent=True),
        time="O(L d²)",
        memory="O(L d + d²)",
        citation="Katharopoulos et al., Transformers are RNNs: Fast Autoregressive Transformers "
        "with Linear Attention, ICML 2020",
        step=linear_step,
        flops=linear_flops,
    )
)
