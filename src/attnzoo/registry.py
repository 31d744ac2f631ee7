"""The mechanism registry and the one entry point, :func:`attention`.

Every mechanism registers a :class:`Mechanism` spec: its fast function, its
dense reference, its options dataclass and what it can do. :func:`attention`
validates the inputs once for all of them, so a mechanism's own code can
assume well-formed tensors.

A mechanism function has the signature::

    fn(q, k, v, opts, *, causal, key_mask, scale, generator) -> out

with ``q: (B, H, Lq, D)``, ``k: (B, H, Lk, D)``, ``v: (B, H, Lk, Dv)``,
``key_mask: (B, Lk) bool | None`` (True = real key), ``scale: float | None``
(None = the mechanism's default) and ``out: (B, H, Lq, Dv)``. The reference
has the same signature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Capabilities",
    "Mechanism",
    "attention",
    "check_on_device",
    "connectivity",
    "get",
    "make_options",
    "mechanisms",
    "register",
]


@dataclass(frozen=True)
class Capabilities:
    """What a mechanism can honour; anything else is refused with a ValueError."""

    causal: bool = True  # supports causal=True
    cross: bool = True  # supports Lq != Lk (cross-attention)
    key_mask: bool = True  # supports key_mask (padding)
    recurrent: bool = False  # has a token-by-token step API with carried state


@dataclass(frozen=True)
class Mechanism:
    """A registered attention mechanism."""

    name: str
    summary: str  # one line
    options: type  # a dataclass whose fields are the mechanism's options, with defaults
    fn: Callable[..., torch.Tensor]  # the fast implementation
    reference: Callable[..., torch.Tensor]  # the plain dense reference (O(Lq·Lk) memory)
    capabilities: Capabilities
    time: str  # time complexity, self-attention of length L
    memory: str  # memory complexity
    citation: str
    randomized: bool = False  # draws from `generator` (sampling, rotations, features)
    # (length, opts, causal) -> (L, L) bool, True = query i may attend key j; pattern mechanisms only
    pattern: Callable[..., torch.Tensor] | None = None
    # (q, k, opts, causal, key_mask, scale, generator) -> (B, H, Lq, Lk) bool; data-dependent ones
    data_pattern: Callable[..., torch.Tensor] | None = None
    reason_not_causal: str = ""  # shown when causal=True is refused
    # options that belong to MultiheadAttention's projections, not to the functional call
    # (log_sparse's convolution kernel_size, linformer's max_len); a dataclass or None
    layer_options: type | None = None
    # recurrent mechanisms: (q, k, v, state | None, opts) -> (out, state), causal decoding
    step: Callable[..., Any] | None = None
    # (B, H, Lq, Lk, D, Dv, causal, opts) -> floating-point operations of the fast function
    # (2 per multiply-add of its products, block padding included); None = not stated
    flops: Callable[..., float] | None = None

    def option_names(self) -> list[str]:
        # the dataclass's own table, not dataclasses.fields (which torch.compile cannot trace);
        # register() checks the two agree (no ClassVar or InitVar pseudo-fields)
        return list(self.options.__dataclass_fields__)


_REGISTRY: dict[str, Mechanism] = {}
_AUTO: list[Mechanism] = []  # the "auto" spec attnzoo.recommend registers (not in mechanisms())


def register_auto(spec: Mechanism) -> None:
    """Make ``get("auto")`` return ``spec``: a choice made per call, not a mechanism of its own."""
    _AUTO[:] = [spec]


def register(spec: Mechanism) -> Mechanism:
    """Add a mechanism to the registry (its module calls this at import)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"mechanism {spec.name!r} is already registered")
    if not dataclasses.is_dataclass(spec.options):
        raise TypeError(f"{spec.name}: options must be a dataclass type")
    if spec.option_names() != [f.name for f in dataclasses.fields(spec.options)]:
        raise TypeError(f"{spec.name}: options may not declare ClassVar or InitVar fields")
    reserved = {"q", "k", "v", "causal", "key_mask", "scale", "generator", "mechanism"}
    clash = reserved.intersection(spec.option_names())
    if clash:
        raise ValueError(f"{spec.name}: option names {sorted(clash)} clash with attention()'s own")
    _REGISTRY[spec.name] = spec
    return spec


def mechanisms() -> list[str]:
    """Names of every registered mechanism, in registration order."""
    return list(_REGISTRY)


def get(name: str) -> Mechanism:
    """The spec of mechanism ``name``; ValueError listing the known names if unknown. ``"auto"``:
    the choice :func:`attnzoo.recommend.recommend` makes for each call (not in :func:`mechanisms`)."""
    if name == "auto" and _AUTO:
        return _AUTO[0]
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown mechanism {name!r}; known mechanisms: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def make_options(spec: Mechanism, options: dict[str, Any]):
    """Build ``spec.options`` from keyword options, rejecting unknown names clearly."""
    unknown = sorted(set(options) - set(spec.option_names()))
    if unknown:
        known = ", ".join(spec.option_names()) or "none"
        raise ValueError(
            f"{spec.name}: unknown option(s) {', '.join(unknown)}; its options are: {known}"
        )
    return spec.options(**options)


def check_on_device(mechanism: str, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, a tensor the user gave as an option, once checked to be on the inputs' device (a
    clear error, where moving it would hide a copy in every call)."""
    if t.device != like.device:
        raise ValueError(f"{mechanism}: {name} is on {t.device} but the inputs are on {like.device}")
    return t


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (B, H, L, D), got shape {tuple(t.shape)}; "
                "use attnzoo.MultiheadAttention for (B, L, d_model) inputs"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            "q, k, v must share batch and heads (B, H): got "
            f"{tuple(q.shape[:2])}, {tuple(k.shape[:2])}, {tuple(v.shape[:2])}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim D: got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length Lk: got {k.shape[2]} and {v.shape[2]}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"sequence lengths must be >= 1, got Lq={q.shape[2]}, Lk={k.shape[2]}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"head dims must be >= 1, got D={q.shape[-1]} (q, k) and Dv={v.shape[-1]} (v)")


def _check_key_mask(key_mask, k) -> None:
    if key_mask is None:
        return
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
        got = key_mask.dtype if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
        raise ValueError(f"key_mask must be a bool tensor (True = real key), got {got}")
    B, Lk = k.shape[0], k.shape[2]
    if tuple(key_mask.shape) != (B, Lk):
        raise ValueError(f"key_mask must have shape (B, Lk) = ({B}, {Lk}), got {tuple(key_mask.shape)}")
    if key_mask.device != k.device:
        raise ValueError(f"key_mask is on {key_mask.device} but k is on {k.device}")


def _check_capabilities(spec: Mechanism, q, k, causal, key_mask) -> None:
    caps = spec.capabilities
    if causal and not caps.causal:
        why = f": {spec.reason_not_causal}" if spec.reason_not_causal else ""
        raise ValueError(f"{spec.name} does not support causal=True{why}")
    if q.shape[2] != k.shape[2] and not caps.cross:
        raise ValueError(
            f"{spec.name} supports self-attention only (Lq == Lk), got Lq={q.shape[2]}, "
            f"Lk={k.shape[2]}"
        )
    if key_mask is not None and not caps.key_mask:
        raise ValueError(f"{spec.name} does not support key_mask")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    /,
    mechanism: str = "full",
    *,
    causal: bool = False,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    reference: bool = False,
    **options: Any,
) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` by the named mechanism.

    Args:
        q: ``(B, H, Lq, D)`` queries.
        k: ``(B, H, Lk, D)`` keys.
        v: ``(B, H, Lk, Dv)`` values.
        mechanism: a name from :func:`mechanisms`, or ``"auto"``: the fastest one within
            ``max_error`` (an option, default 0.1) normalised error at this length, as
            :func:`attnzoo.recommend.recommend` chooses from measurements.
        causal: query i sees keys j <= i + Lk - Lq (queries are the *last* Lq
            positions, torch's ``causal_lower_right``); a query that sees no
            key gets zeros.
        key_mask: ``(B, Lk)`` bool, True = real key, False = padding.
        scale: score scale; None = the mechanism's default (1/sqrt(D) for the
            softmax mechanisms; the kernel ones follow their papers).
        generator: source of randomness for randomized mechanisms, on q's device.
        reference: run the plain dense reference instead of the fast version.
        **options: the mechanism's options (see ``attnzoo.get(name).options``);
            unknown names raise ValueError.

    float16 and bfloat16 inputs keep every sum that can overflow or stall (softmax
    normalisers, kernel states, projections over the keys) in float32. Under ``torch.autocast``
    the mechanism runs in its inputs' dtype, autocast off inside it.

    Returns:
        ``(B, H, Lq, Dv)``, the dtype of ``q``; empty where B or H is 0. ValueError for
        D = 0, a length of 0, or a scale that is not finite and positive.
    """
    spec = get(mechanism)
    opts = make_options(spec, options)
    _check_qkv(q, k, v)
    _check_key_mask(key_mask, k)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number or None, got {scale!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if spec.randomized and generator is not None and generator.device.type != q.device.type:
        raise ValueError(f"generator is on {generator.device.type} but q on {q.device.type}: "
                         f"{mechanism} draws on q's device, so pass torch.Generator(device=q.device)")
    _check_capabilities(spec, q, k, causal, key_mask)
    if q.shape[0] == 0 or q.shape[1] == 0:  # no batch entries or no heads: torch's empty result
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, H, Lq, Dv), with autograd
    fn = spec.reference if reference else spec.fn
    with _outside_autocast(q.device.type):  # the inputs' dtype decides, by the precision policy
        return fn(q, k, v, opts, causal=causal, key_mask=key_mask, scale=scale, generator=generator)


def _outside_autocast(device_type: str):
    """A context with autocast off on ``device_type`` where it is on: a mechanism keeps its sums in
    float32 for half-precision inputs, and autocast would run its products in half again."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        enabled = torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()
    except RuntimeError:  # a device type autocast does not know (meta)
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def connectivity(
    mechanism: str,
    length: int | None = None,
    *,
    causal: bool = False,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    **options: Any,
) -> torch.Tensor:
    """Which keys each query may attend to, as a bool mask (True = attends).

    Pattern mechanisms (fixed sparsity) take ``length`` and return ``(L, L)``; with
    ``heads="split"`` strided and fixed return ``(2, L, L)``: A1 (even heads), A2 (odd).
    Data-dependent ones (prob_sparse, lsh) take ``q`` and ``k`` and return
    ``(B, H, Lq, Lk)``. Mechanisms with no sparsity pattern (full, the kernel
    and low-rank ones) return the dense causal / full mask of ``length``.
    """
    spec = get(mechanism)
    opts = make_options(spec, options)
    if spec.data_pattern is not None:
        if q is None or k is None:
            raise ValueError(f"{spec.name}'s connectivity depends on the data: pass q and k")
        _check_qkv(q, k, k)
        _check_key_mask(key_mask, k)
        _check_capabilities(spec, q, k, causal, key_mask)
        return spec.data_pattern(q, k, opts, causal, key_mask, scale, generator)
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"{spec.name}: connectivity needs length >= 1, got {length!r}")
    if causal and not spec.capabilities.causal:
        raise ValueError(f"{spec.name} does not support causal=True")
    if spec.pattern is not None:
        return spec.pattern(length, opts, causal)
    from attnzoo.masks import dense_mask

    return dense_mask(length, length, causal=causal)[0, 0]
