"""Checks every mechanism shares: fast vs reference, gradcheck, input errors.

Each mechanism's test file calls these with one line per case, e.g.::

    check_against_reference("full", Lq=7, Lk=9, causal=True, masked=True)
    check_gradcheck("full", causal=True)
    check_input_errors("full")

Randomized mechanisms get a fresh generator with the same seed for the fast
call and the reference, so both draw the same samples.

The checks run on the CPU; ``ATTNZOO_TEST_DEVICE=cuda`` runs them on a GPU instead (the
inputs are drawn on the CPU, the same numbers on any device, and moved there).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import strategies as st

import attnzoo

DEVICE = torch.device(os.environ.get("ATTNZOO_TEST_DEVICE", "cpu"))
# (D, Dv) for the C kernels' float64 property tests. Each pair is a build of its own for each
# family of kernels (seconds on a cold cache), so the tests draw from five pairs, not every
# pair: D one, short of a vector (AVX-512: 8 doubles), one vector and past it; Dv one, short
# and one vector; a short D beside a full Dv and the other way round. Most are built for other
# tests anyway.
NATIVE_WIDTHS = st.sampled_from([(1, 1), (3, 1), (3, 8), (8, 5), (17, 8)])


def cases(*, causal=True, cross=True, H=(1, 3), L=(1, 40), D=(1, 6), Dv=False, **options):
    """Hypothesis strategy of check_against_reference's keyword arguments: random shapes
    (odd lengths, Lq != Lk unless ``cross=False``, B and H > 1), masks, causality, and the
    mechanism's options drawn from the strategies given as keywords.

    With ``Dv``, Dv is D or D reflected in 1..6 (7 - D, whatever D's range): every width from 1 to 6
    on either side, equal and unequal, from few (D, Dv) pairs, as the native kernels are compiled
    once a pair (seconds each, on every fresh machine)."""
    fields = {
        "B": st.integers(1, 2), "H": st.integers(*H), "Lq": st.integers(*L), "D": st.integers(*D),
        "masked": st.booleans(), "seed": st.integers(0, 999),
        "causal": st.booleans() if causal else st.just(False),
        "options": st.fixed_dictionaries(options),
    }
    if cross:
        fields["Lk"] = st.integers(*L)
    if Dv:
        fields["reflected"] = st.booleans()
    strategy = st.fixed_dictionaries(fields)
    if Dv:
        def with_dv(case):
            reflected = min(max(7 - case["D"], 1), 6)
            return {**{k: x for k, x in case.items() if k != "reflected"},
                    "Dv": reflected if case["reflected"] else case["D"]}

        strategy = strategy.map(with_dv)
    return strategy if cross else strategy.map(lambda case: {**case, "Lk": case["Lq"]})


def seeded(seed: int) -> torch.Generator:
    """A generator on the checks' device, for a randomized mechanism's draws."""
    return torch.Generator(DEVICE).manual_seed(seed)


def random_inputs(B=2, H=3, Lq=7, Lk=9, D=8, Dv=None, *, dtype=torch.float64, seed=0,
                  masked=False, requires_grad=False, empty_row=True, device=None):
    """Gaussian q, k, v and, if ``masked``, a random key_mask (B, Lk), on ``device`` (default:
    the checks' device).

    With ``empty_row`` (and B >= 2) the last batch entry's mask keeps only the
    last key, so under causality most of its queries see nothing.
    """
    g = torch.Generator().manual_seed(seed)
    Dv, device = D if Dv is None else Dv, device or DEVICE
    q = torch.randn(B, H, Lq, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, Lk, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=dtype)
    key_mask = None
    if masked:
        key_mask = torch.rand(B, Lk, generator=g) < 0.7
        key_mask[:, -1] = True
        if empty_row and B >= 2:
            key_mask[-1] = False
            key_mask[-1, -1] = True
        key_mask = key_mask.to(device)
    q, k, v = (t.to(device).requires_grad_(requires_grad) for t in (q, k, v))
    return q, k, v, key_mask


def _call(name, q, k, v, *, reference, causal, key_mask, seed, options):
    gen = torch.Generator(q.device).manual_seed(seed)
    return attnzoo.attention(q, k, v, mechanism=name, causal=causal, key_mask=key_mask,
                             generator=gen, reference=reference, **options)


def check_against_reference(name, *, B=2, H=3, Lq=7, Lk=9, D=8, Dv=None, causal=False,
                            masked=False, seed=0, options=None, atol=1e-10, rtol=1e-8,
                            backward=True, device=None):
    """Fast vs reference in float64: outputs, and grads of q, k, v for one upstream grad.
    (``device="cpu"``: a check of a path that only the CPU takes.)"""
    options = options or {}
    q, k, v, km = random_inputs(B, H, Lq, Lk, D, Dv, seed=seed, masked=masked,
                                requires_grad=backward, device=device)
    kw = dict(causal=causal, key_mask=km, seed=seed, options=options)
    fast = _call(name, q, k, v, reference=False, **kw)
    ref = _call(name, q, k, v, reference=True, **kw)
    assert fast.shape == (B, H, Lq, v.shape[-1]), fast.shape
    assert fast.dtype == q.dtype
    assert torch.isfinite(fast).all(), f"{name}: non-finite output"
    torch.testing.assert_close(fast, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name} output: {m}")
    if not backward:
        return fast
    g = torch.randn(fast.shape, generator=torch.Generator().manual_seed(seed + 1),
                    dtype=fast.dtype).to(fast.device)
    grads_fast = torch.autograd.grad(fast, (q, k, v), g, allow_unused=True)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g, allow_unused=True)
    for label, gf, gr in zip("qkv", grads_fast, grads_ref, strict=True):
        gf = torch.zeros_like(q if label == "q" else k if label == "k" else v) if gf is None else gf
        gr = torch.zeros_like(gf) if gr is None else gr
        assert torch.isfinite(gf).all(), f"{name}: non-finite grad of {label}"
        torch.testing.assert_close(gf, gr, atol=atol * 10, rtol=rtol * 10,
                                   msg=lambda m, label=label: f"{name} grad {label}: {m}")
    return fast


def check_equals_full(name, *, L, causal, options=None, **tolerances):
    """At a limit where the mechanism must be full attention (self-attention of length L, a
    key mask): its output against full's, each first checked against its own reference."""
    a = check_against_reference(name, Lq=L, Lk=L, causal=causal, masked=True, options=options,
                                backward=False)
    b = check_against_reference("full", Lq=L, Lk=L, causal=causal, masked=True, backward=False)
    torch.testing.assert_close(a, b, **tolerances)


def check_gradcheck(name, *, B=1, H=2, Lq=5, Lk=6, D=4, causal=False, masked=False, seed=0,
                    options=None, device=None):
    """torch.autograd.gradcheck of the fast path on small float64 inputs."""
    options = options or {}
    q, k, v, km = random_inputs(B, H, Lq, Lk, D, seed=seed, masked=masked, requires_grad=True,
                                empty_row=False, device=device)

    def fn(q, k, v):
        return _call(name, q, k, v, reference=False, causal=causal, key_mask=km, seed=seed,
                     options=options)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)


def check_input_errors(name, **options):
    """Every malformed input is refused with a ValueError naming the problem."""
    spec = attnzoo.get(name)
    q, k, v, _ = random_inputs(B=2, H=2, Lq=8, Lk=8, D=4)

    def raises(match, *args, **kw):
        kw = {**options, **kw}
        with pytest.raises(ValueError, match=match):
            attnzoo.attention(*args, mechanism=name, **kw)

    raises("4 dims", q[0], k, v)
    raises("share a dtype", q.float(), k, v)
    raises("batch and heads", q, k[:1], v[:1])
    raises("head dim", q, k[..., :3], v)
    raises("same length", q, k, v[:, :, :5])
    raises("floating-point", q.long(), k, v)
    raises("key_mask must be a bool", q, k, v, key_mask=torch.ones(2, 8))
    raises(r"key_mask must have shape", q, k, v, key_mask=torch.ones(2, 7, dtype=torch.bool))
    raises("unknown option", q, k, v, no_such_option=1)
    raises("scale must be", q, k, v, scale=-1.0)
    raises("causal must be a bool", q, k, v, causal="yes")
    if not spec.capabilities.causal:
        raises(f"{name} does not support causal", q, k, v, causal=True)
    if not spec.capabilities.cross:
        raises(f"{name} supports self-attention only", q, k[:, :, :5], v[:, :, :5])
    if not spec.capabilities.key_mask:
        raises(f"{name} does not support key_mask", q, k, v,
               key_mask=torch.ones(2, 8, dtype=torch.bool))


def record_band_calls(monkeypatch) -> list[str]:
    """The CPU backend's fused band (:mod:`attnzoo.backends.cpu.windows`), its ``forward`` and
    ``backward`` named in a list as they run: tests clear it, run a mechanism, and read which
    path it took (none named: the portable windows)."""
    from attnzoo.backends.cpu import windows

    calls = []

    def recording(method):
        original = getattr(windows._Band, method)

        def call(self, *args):
            calls.append(method)
            return original(self, *args)
        return call

    for method in ("forward", "backward"):
        monkeypatch.setattr(windows._Band, method, recording(method))
    return calls


def tied_hash_inputs(dtype):
    """(x (2, 3, 37, 6), rotations (3, 6, 8), the expected buckets) for LSH's hash: ties across
    the halves (x rows of 0: every rotated value 0) and tied columns inside each half, the
    buckets argmax([xR; −xR]) by argmax's first-maximum rule."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 37, 6, generator=g, dtype=dtype)
    x[0, 0, :4] = 0  # every rotated value 0: a tie across the halves
    rotations = torch.randn(3, 6, 8, generator=g)
    rotations[:, :, 5] = rotations[:, :, 2]  # tied columns inside each half
    rotated = torch.einsum("bhld,rdc->bhrlc", x, rotations.to(dtype))
    return x, rotations, torch.cat([rotated, -rotated], -1).argmax(-1)

