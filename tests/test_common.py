"""The shared partial softmax: (o, lse) against the plain masked softmax, for every mask shape
the mechanisms pass (full, broadcast over batch and heads, over keys, per key, none)."""

import pytest
import torch

from attnzoo.mechanisms import _common
from attnzoo.mechanisms._common import (
    FewKeys,
    FewQueries,
    exp_,
    few_keys_attention,
    minus_inf_where_not_,
    partial_softmax,
    window_partial,
)
from attnzoo.mechanisms.full import softmax_reference


def _plain(scores, valid, v):
    s = scores if valid is None else scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows with no key: 0
    return p @ v, lse


def _masks(g):
    R, n = 5, 7
    full = torch.rand(2, 3, R, n, generator=g) < 0.6
    full[0, 1, 2] = False  # a row with no key
    cols = torch.rand(R, n, generator=g) < 0.5
    cols[:, :2] = True  # whole valid columns before and after the partly valid ones
    cols[:, -1] = True
    return {
        "none": None,
        "full": full,
        "broadcast rows": cols,
        "per key": torch.tensor([True, False, True, True, False, True, True]),
        "over keys": (torch.rand(2, 1, R, 1, generator=g) < 0.7).expand(2, 1, R, 1),
        "all valid": torch.ones(R, n, dtype=torch.bool),
        "one bad column": torch.ones(R, n, dtype=torch.bool).index_fill_(1, torch.tensor([3]), False),
    }


@pytest.mark.parametrize("name", list(_masks(torch.Generator().manual_seed(0))))
def test_partial_softmax_matches_the_plain_masked_softmax(name):
    g = torch.Generator().manual_seed(0)
    valid = _masks(g)[name]
    scores = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    o, lse = partial_softmax(scores.clone(), valid, v)
    o_ref, lse_ref = _plain(scores, valid, v)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    # gradients of o and of the finite lse (what the merges use)
    seen = torch.isfinite(lse_ref)
    w_o, w_lse = (torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (o, lse))
    loss = lambda o, lse: (o * w_o).sum() + (lse.where(seen, 0.0) * w_lse).sum()  # noqa: E731
    grads = torch.autograd.grad(loss(o, lse), (scores, v))
    grads_ref = torch.autograd.grad(loss(o_ref, lse_ref), (scores, v))
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("piece", [2**20, 2 * 3 * 4 * 4])
@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_window_partial_with_its_scale_matches_the_dense_band(monkeypatch, causal, lse_grad, piece):
    """The fused kernel scales q itself; when lse takes a gradient the groups' backward runs
    instead and must scale q (and dq) the same way. The kernel runs on the whole band or on
    pieces of one query block (``piece`` outputs), each end block with its own mask."""
    monkeypatch.setattr(_common, "BAND_PIECE", piece)
    g = torch.Generator().manual_seed(1)
    L, left, right, scale = 37, 6, 0 if causal else 5, 0.3
    q, k, v = (torch.randn(2, 3, L, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    allowed = lambda i, j: (j >= i - left) & (j <= i + right)  # noqa: E731
    o, lse = window_partial(q, k, v, None, block=4, left=left, right=right, allowed=allowed, scale=scale)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed(i, j), float("-inf"))
    o_ref, lse_ref = torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    torch.testing.assert_close((o, lse), (o_ref, lse_ref))
    w_o, w_lse = (torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (o, lse))
    loss = lambda o, lse: (o * w_o).sum() + ((lse * w_lse).sum() if lse_grad else 0)  # noqa: E731
    grads = torch.autograd.grad(loss(o, lse), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(loss(o_ref, lse_ref), (q, k, v)))


def test_exp_by_exp2_keeps_its_digits():
    t = torch.linspace(-80, 80, 10001, dtype=torch.float64)
    torch.testing.assert_close(exp_(t.clone()), torch.exp(t), rtol=1e-14, atol=0)
    t32 = t.float()
    err = (exp_(t32.clone()).double() - torch.exp(t32.double())).abs() / torch.exp(t32.double())
    assert bool((err <= t.abs() * 8e-8 + 2e-7).all())  # the rounding of t·log2 e, and exp2's own
    t16 = torch.linspace(-10, 10, 101, dtype=torch.float16)
    assert torch.equal(exp_(t16.clone()), torch.exp(t16))  # half precision: exp itself


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_minus_inf_where_not_is_the_masked_fill(dtype):
    """Bitwise the masked fill it replaces, for a full mask, masks broadcast either way and
    every key invalid in some rows; scores of both signs and zero stay as they were."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 3, 5, 7, generator=g).to(dtype)
    t[0, 0, 0] = 0.0
    for shape in [(2, 3, 5, 7), (2, 3, 5, 1), (5, 7), (7,)]:
        valid = torch.rand(shape, generator=g) > 0.4
        valid.view(-1)[:1] = False
        expected = t.masked_fill(~valid, float("-inf"))
        assert torch.equal(minus_inf_where_not_(t.clone(), valid), expected)


@pytest.mark.parametrize("masked", [False, True])
def test_few_queries_backward_matches_the_reference(monkeypatch, masked):
    """FewQueries' key-blocked backward against the plain softmax's in float64: keys over several
    blocks and a partial last one, k and v laid out as a layer's (views of (B, L, H, ·)), their
    gradients laid out (B, L, H, ·) too; masked: a random mask with a query that sees no key
    (0 and no gradient); gradcheck with blocks of 4 keys. With the native kernels off (their
    tests: test_native.py), which otherwise take the unmasked forward and backward."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    monkeypatch.setattr(_common, "KEY_BLOCK", 64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=g).requires_grad_()
    kv = torch.randn(2, 150, 3, 16, dtype=torch.float64, generator=g)
    k, v = (t.transpose(1, 2).detach().requires_grad_() for t in kv.split(8, -1))
    valid = None
    if masked:
        valid = torch.rand(2, 3, 5, 150, generator=g) < 0.3
        valid[1, 2, 4] = False
    out = FewQueries.apply(q, k, v, valid, 0.3)[0]
    expected = softmax_reference(q, k, v, valid, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-14, rtol=1e-12)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, want, t in zip(grads, torch.autograd.grad(expected, (q, k, v), grad), (q, k, v), strict=True):
        torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-12)
        assert got.transpose(1, 2).is_contiguous() if t is not q else got.is_contiguous()
    if masked:
        assert (out[1, 2, 4] == 0).all() and (grads[0][1, 2, 4] == 0).all()
    monkeypatch.setattr(_common, "KEY_BLOCK", 4)
    small = [t[:1, :2, :9].detach().requires_grad_() for t in (q, k, v)]
    small_valid = None if valid is None else valid[:1, :2, :, :9]
    assert torch.autograd.gradcheck(lambda *t: FewQueries.apply(*t, small_valid, 0.5)[0], small)


def test_few_keys_in_pieces_matches_the_reference(monkeypatch):
    """FewKeys' pieces (forward and backward) against the plain softmax's in float64: q laid out
    as a layer's (a view of (B, L, H, D)), 101 queries in pieces of 5 rows (the last partial),
    B and H > 1; the output and dq laid out (B, L, H, ·) so that the layer's merge is a view;
    few_keys_attention takes the pieces from WHOLE_BYTES_MAX on, one SDPA call below, where the
    native kernel is off (its own tests: test_native.py); gradcheck."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    monkeypatch.setattr(_common, "KEYS_PIECE", 2 * 3 * 8 * 5)  # B·H·Dv·5: 5 rows a piece
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 101, 3, 8, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    calls = []
    monkeypatch.setattr(FewKeys, "apply", lambda *a, apply=FewKeys.apply: calls.append(1) or apply(*a))
    monkeypatch.setattr(_common, "WHOLE_BYTES_MAX", q.shape[2] * 2 * 3 * 8 * 8 + 1)
    out = few_keys_attention(q, k, v, 0.4)
    assert not calls
    monkeypatch.setattr(_common, "WHOLE_BYTES_MAX", q.shape[2] * 2 * 3 * 8 * 8)
    out = few_keys_attention(q, k, v, 0.4)
    assert calls
    assert out.transpose(1, 2).is_contiguous()
    expected = softmax_reference(q, k, v, None, 0.4)
    torch.testing.assert_close(out, expected, atol=1e-14, rtol=1e-12)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), grad), strict=True):
        torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-12)
    assert grads[0].transpose(1, 2).is_contiguous()
    small = [t[:1, :2, :11].detach().requires_grad_() for t in (q, k, v)]
    monkeypatch.setattr(_common, "KEYS_PIECE", 2 * 8 * 4)  # 4 rows a piece
    assert torch.autograd.gradcheck(lambda *t: FewKeys.apply(*t, 0.5)[0], small)
