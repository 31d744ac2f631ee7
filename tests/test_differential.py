"""Differential tests: every mechanism against its dense reference where users run it.

The per-mechanism tests check the fast path against the reference on small float64 inputs in
one grad mode and one layout. Wrong answers hid outside them: a reused buffer read after being
overwritten once a sequence passed two engine blocks, and only when grad mode was on with no
input requiring grad; a private kernel handed inputs whose last dimension was strided. So here
hypothesis draws, for every mechanism:

- B·H of 1, 8 and 32 or more, each with lengths up to what its dense reference affords
  (about 4096 at B·H = 1), crossing the block and chunk boundaries of every engine;
- Lq != Lk where the mechanism takes it, causal and not, a key mask or none;
- every grad mode: ``no_grad``; grad enabled with nothing requiring grad; requires_grad on q,
  on k, on v, on all three;
- layouts: contiguous; (B, L, H, D) storage seen as (B, H, L, D); a last dimension of stride
  2; a batch or head dimension of stride 0 (``expand``).

The fast call is compared with the reference on the same float32 inputs; the tolerance is a
multiple of the float32 reference's own error against the float64 reference (the golden), as
PyTorch's flex-attention tests set theirs. At small sizes the same checks run in float64 with
tight tolerances. Both paths are held to the reference in one process: the default one (the
CPU backend's overrides where they apply) and the portable one (``attnzoo.ops.portable()``,
what a GPU and ``ATTNZOO_FAST=0`` run).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import ops

from mechanism_checks import DEVICE

MECHANISMS = attnzoo.mechanisms()
GRAD_MODES = ["no_grad", "grad_enabled", "q", "k", "v", "qkv"]
LAYOUTS = ["contiguous", "transposed", "last_dim_strided", "expanded"]

# (B, H) and the lengths each affords: the dense reference holds B·H·Lq·Lk scores (float64,
# with its backward's), so the longest sequences run one head.
TIERS = {
    "one head": ([(1, 1)], (1500, 4200)),
    "8 heads": ([(1, 8), (2, 4)], (200, 1100)),
    "32+ heads": ([(4, 8), (3, 11), (1, 33)], (40, 600)),
}


@st.composite
def real_sizes(draw, name):
    """A case at the sizes users run, in float32."""
    spec = attnzoo.get(name)
    caps = spec.capabilities
    bh, (lo, hi) = TIERS[draw(st.sampled_from(sorted(TIERS)))]
    B, H = draw(st.sampled_from(bh))
    Lq = draw(st.integers(lo, hi))
    Lk = draw(st.integers(lo, hi)) if caps.cross and draw(st.booleans()) else Lq
    return dict(
        B=B, H=H, Lq=Lq, Lk=Lk, D=draw(st.sampled_from([4, 16, 32])),
        causal=caps.causal and draw(st.booleans()),
        masked=caps.key_mask and draw(st.booleans()),
        grad_mode=draw(st.sampled_from(GRAD_MODES)), layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**16)), dtype=torch.float32,
    )


@st.composite
def small_sizes(draw, name):
    """A case at small sizes, in float64: every shape corner cheaply."""
    caps = attnzoo.get(name).capabilities
    Lq = draw(st.integers(1, 70))
    # taylor at D = 1: q' and k' are ±1, so a query's weights 1 + q'·k' are all 0 where every key's
    # sign opposes its own, the output is 0 / eps and a gradient is rounding times 1 / eps (7e-9
    # in float64 where it is exactly 0): a degenerate case, not a comparison of two paths.
    D = draw(st.integers(2 if name == "taylor" else 1, 8))
    return dict(
        B=draw(st.integers(1, 3)), H=draw(st.integers(1, 3)), Lq=Lq,
        Lk=draw(st.integers(1, 70)) if caps.cross else Lq, D=D,
        causal=caps.causal and draw(st.booleans()),
        masked=caps.key_mask and draw(st.booleans()),
        grad_mode=draw(st.sampled_from(GRAD_MODES)), layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**16)), dtype=torch.float64,
    )


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (B, H, L, D) with the same values, laid out as ``layout``; differentiable in x."""
    if layout == "transposed":  # (B, L, H, D) storage (contiguous() would keep a size-1 H's stride)
        storage = x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3])
        return storage.copy_(x.transpose(1, 2)).transpose(1, 2)
    if layout == "last_dim_strided":  # every other element of a wider row
        return torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2]
    return x


def leaves(case, generator):
    """The leaf q, k, v (those the grad mode asks requiring grad) and the key mask. Under the
    ``expanded`` layout the leaves have one batch entry (or head) that the call sees expanded."""
    B, H, Lq, Lk, D = (case[n] for n in ("B", "H", "Lq", "Lk", "D"))
    expand_dim = expanded_dim(case)
    shapes = [[B, H, Lq, D], [B, H, Lk, D], [B, H, Lk, D]]
    if expand_dim is not None:
        for s in shapes:
            s[expand_dim] = 1
    q, k, v = (torch.randn(s, generator=generator, dtype=case["dtype"]).to(DEVICE) for s in shapes)
    mode = case["grad_mode"]
    for name, t in zip("qkv", (q, k, v), strict=True):
        t.requires_grad_(mode == "qkv" or mode == name)
    key_mask = None
    if case["masked"]:
        key_mask = torch.rand(B, Lk, generator=generator) < 0.8
        key_mask[:, 0] = True  # (a query that sees no key gets zeros: tested elsewhere)
        key_mask = key_mask.to(DEVICE)
    return (q, k, v), key_mask


def expanded_dim(case) -> int | None:
    """The dim the ``expanded`` layout gives stride 0: heads where H > 1, else batch, else none."""
    if case["layout"] != "expanded":
        return None
    return 1 if case["H"] > 1 else 0 if case["B"] > 1 else None


def call_inputs(xs, case):
    """The tensors the call sees: the leaves expanded and laid out as the case says."""
    dim = expanded_dim(case)
    sizes = (case["B"], case["H"])
    out = []
    for x in xs:
        if dim is not None:
            x = x.expand(*sizes, *x.shape[2:])
        out.append(in_layout(x, case["layout"]))
    return out


def run(name, xs, key_mask, case, *, reference, dtype=None, portable=False):
    """Output and the gradients of the leaves ``xs`` for one upstream gradient (None where the
    grad mode asks none), optionally all in ``dtype`` (the golden's float64); with ``portable``,
    every operation by its portable body (no backend override)."""
    if portable:
        with ops.portable():
            return run(name, xs, key_mask, case, reference=reference, dtype=dtype)
    mode = case["grad_mode"]
    if dtype is not None:
        xs = [x.detach().to(dtype).requires_grad_(x.requires_grad) for x in xs]
    q, k, v = call_inputs(xs, case)
    kw = dict(mechanism=name, causal=case["causal"], key_mask=key_mask, reference=reference,
              generator=torch.Generator(DEVICE).manual_seed(case["seed"]), **case.get("options", {}))
    if reference:
        q, k, v = (t.contiguous() for t in (q, k, v))
    if mode == "no_grad":
        with torch.no_grad():
            return attnzoo.attention(q, k, v, **kw), None
    out = attnzoo.attention(q, k, v, **kw)
    wanted = [x for x in xs if x.requires_grad]
    if not wanted:
        return out.detach(), None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(case["seed"] + 1),
                    dtype=out.dtype).to(out.device)
    return out.detach(), [t.detach() for t in torch.autograd.grad(out, wanted, g)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(name, case):
    """The default path (the backend's overrides where they apply) and the portable one, each
    against the reference: outputs, and the gradients the grad mode asks for."""
    generator = torch.Generator().manual_seed(case["seed"])
    xs, key_mask = leaves(case, generator)
    ref, ref_grads = run(name, xs, key_mask, case, reference=True)
    golden = None
    if case["dtype"] == torch.float32:
        golden = run(name, xs, key_mask, case, reference=True, dtype=torch.float64)
    for path in ("default", "portable"):
        out, grads = run(name, xs, key_mask, case, reference=False, portable=path == "portable")
        B, H, Lq = case["B"], case["H"], case["Lq"]
        assert out.shape == (B, H, Lq, case["D"]) and out.dtype == case["dtype"]
        assert torch.isfinite(out).all(), f"{name} ({path}): non-finite output in {case}"
        _compare(f"{name} ({path})", case, (out, grads), (ref, ref_grads), golden)


def _compare(label, case, got, ref, golden):
    """``got`` = (out, grads) against the reference's: in float64 to tight tolerances; in float32
    within 20x the float32 reference's own error against the float64 ``golden``."""
    pairs = [("output", got[0], ref[0])]
    if got[1] is not None:
        pairs += [(f"grad {i}", f, r) for i, (f, r) in enumerate(zip(got[1], ref[1], strict=True))]
    if golden is None:
        for what, f, r in pairs:
            torch.testing.assert_close(f, r, atol=1e-9, rtol=1e-7,
                                       msg=lambda m, what=what: f"{label} {what} {case}: {m}")
        return
    goldens = [golden[0]] + (golden[1] or [])
    for (what, f, r), gold in zip(pairs, goldens, strict=True):
        own = rel_err(r, gold)  # the float32 reference's own error
        err = rel_err(f, gold)
        assert err <= 20 * own + 1e-5, f"{label} {what}: error {err:.3g} against the golden " \
            f"(the float32 reference's: {own:.3g}) in {case}"


@pytest.mark.parametrize("name", MECHANISMS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_real_sizes(name, data):
    check(name, data.draw(real_sizes(name)))


@pytest.mark.parametrize("tier, grad_mode, layout", [("one head", "grad_enabled", "transposed"),
                                                      ("8 heads", "qkv", "last_dim_strided"),
                                                      ("32+ heads", "no_grad", "expanded")])
def test_lsh_factorized_buckets_at_real_sizes(tier, grad_mode, layout):
    """lsh's default hash is factorized past FACTORIZE_ABOVE buckets (L > 16384, beyond what the
    dense reference affords): here the factors are given, 6·4 buckets read by the backend's sort
    and rounds, at the longest length of each tier."""
    bh, (_, L) = TIERS[tier]
    B, H = bh[-1]
    check("lsh", dict(B=B, H=H, Lq=L, Lk=L, D=16, causal=True, masked=True, grad_mode=grad_mode,
                      layout=layout, seed=3, dtype=torch.float32, options={"n_buckets": (6, 4)}))


@pytest.mark.parametrize("name", MECHANISMS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_small_sizes(name, data):
    check(name, data.draw(small_sizes(name)))


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout(name, layout):
    """Each layout, forward and backward, past 512 positions (beyond the sparse engines' first
    blocks), without a key mask (the CPU backend's fused paths take only such calls)."""
    check(name, dict(B=1, H=2, Lq=640, Lk=640, D=16, causal=False, masked=False, grad_mode="qkv",
                     layout=layout, seed=0, dtype=torch.float32))


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_with_one_head(name, layout):
    """One head and several batch entries, as a layer of one head splits them: a transposed
    (B, L, 1, D) tensor keeps a head stride that torch ignores (a dimension of size 1), and the
    C kernels read heads that far apart (they read the wrong rows of batch entries 1 and up)."""
    check(name, dict(B=3, H=1, Lq=200, Lk=200, D=8, causal=False, masked=False, grad_mode="qkv",
                     layout=layout, seed=2, dtype=torch.float32))


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("grad_mode", GRAD_MODES)
def test_every_grad_mode(name, grad_mode):
    """Each grad mode at B·H = 8, causal where the mechanism can be, past two row blocks of the
    causal engine (its blocks shrink as B·H grows)."""
    causal = attnzoo.get(name).capabilities.causal
    check(name, dict(B=2, H=4, Lq=576, Lk=576, D=8, causal=causal, masked=False, grad_mode=grad_mode,
                     layout="contiguous", seed=1, dtype=torch.float32))


@pytest.mark.parametrize("name", ["taylor", "performer", "linear"])
@pytest.mark.parametrize("grad_mode", GRAD_MODES)
def test_causal_first_row_sees_only_the_first_key(name, grad_mode):
    """Causal row 0 sees key 0 alone, so every causal kernel mechanism gives it v[0] (up to its
    normaliser's eps): at L = 512, B·H = 8, past two blocks of the causal engine."""
    case = dict(B=1, H=8, Lq=512, Lk=512, D=4, causal=True, masked=False, grad_mode=grad_mode,
                layout="contiguous", seed=0, dtype=torch.float32)
    (q, k, v), _ = leaves(case, torch.Generator().manual_seed(0))
    ctx = torch.no_grad() if grad_mode == "no_grad" else torch.enable_grad()
    with ctx:
        out = attnzoo.attention(q, k, v, mechanism=name, causal=True,
                                generator=torch.Generator(DEVICE).manual_seed(0))
    assert math.isclose(float((out[:, :, 0] - v[:, :, 0]).detach().abs().max()), 0.0, abs_tol=1e-3)
