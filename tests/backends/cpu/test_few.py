"""The CPU backend's few-queries / few-keys overrides (attnzoo.backends.cpu.few) and the C kernels
they call: each override is taken where it applies and declines elsewhere, and gives the portable
body's function (outputs and gradients); FewQueries' backward by key blocks, FewKeys' pieces and
nystrom's equal segment means against the plain softmax and autograd."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import ops
from attnzoo.backends.cpu import few
from attnzoo.backends.cpu import native as _native
from attnzoo.mechanisms._few import attend_few_keys, attend_few_queries
from attnzoo.mechanisms.full import softmax_reference
from attnzoo.mechanisms.nystrom import segment_means
from backends.cpu.spies import kernel_spy, override_answers

from mechanism_checks import NATIVE_WIDTHS, check_gradcheck


def _fast_and_portable(fn, inputs, grad, *, with_grad=True):
    """(output, *gradients of the inputs that require them) of ``fn(*inputs)`` with the backend,
    then under :func:`attnzoo.ops.portable`; without autograd with ``with_grad=False``."""
    results = []
    for mode in (contextlib.nullcontext(), ops.portable()):
        ins = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with mode, torch.set_grad_enabled(with_grad):
            out = fn(*ins)
            needing = [t for t in ins if t.requires_grad]
            grads = torch.autograd.grad(out, needing, grad) if with_grad and needing else ()
        results.append((out, *grads))
    return results


def _assert_same(fast, plain, rel):
    """Each of ``fast`` within ``rel`` of ``plain``'s largest entry."""
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=rel * max(b.abs().max().item(), 1.0), rtol=rel)


# --- attend_few_queries -------------------------------------------------------------------------


def _few_queries_inputs(B, H, m, Lk, D, Dv, layer, masked, seed, dtype=torch.float64, scores=1.0):
    """q (B, H, m, D) contiguous (nystrom's landmarks), k (B, H, Lk, D) and v (B, H, Lk, Dv) (with
    ``layer``, views of (B, Lk, H, ·): a layer's split of the heads), a key mask (B, Lk) that
    leaves the last batch entry no key (masked), and a seeded gradient of the output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, m, D, dtype=dtype, generator=g) * scores
    if layer:
        k, v = (torch.randn(B, Lk, H, w, dtype=dtype, generator=g).transpose(1, 2) for w in (D, Dv))
    else:
        k, v = (torch.randn(B, H, Lk, w, dtype=dtype, generator=g) for w in (D, Dv))
    key_mask = None
    if masked:
        key_mask = torch.rand(B, Lk, generator=g) > 0.3
        key_mask[-1] = False
    grad = torch.randn(B, H, m, Dv, dtype=dtype, generator=g)
    return q.requires_grad_(), (k * scores).detach().requires_grad_(), v.requires_grad_(), key_mask, grad


def _masks(kind, q, k, key_mask, seed):
    """The masks attend_few_queries is given: None; one of keys a batch entry, (B, 1, 1, Lk)
    (nystrom's); one a query, (B, H, m, Lk), with a query that sees no key (prob_sparse's)."""
    if kind == "none":
        return None
    if kind == "keys":
        return key_mask[:, None, None, :]
    valid = torch.rand(*q.shape[:3], k.shape[2], generator=torch.Generator().manual_seed(seed)) < 0.4
    valid[-1, -1, -1] = False
    return valid


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kind", ["none", "keys", "queries"])
@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_attend_few_queries_override_is_the_portable_body(monkeypatch, dtype, rel, kind, native):
    """The override against the portable SDPA call, output and gradients, without autograd and
    under it: float64 on a small case (keys across the C kernel's blocks of 128), float32 past
    FewQueries' blocks of KEY_BLOCK keys (1100 over blocks of 512); with the C kernels and
    without them (the fused forward and the backward in torch); each mask attend_few_queries
    is given, a query with no key among them (0 and no gradient either way)."""
    if not native:
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    small = dtype == torch.float64
    shape = (2, 3, 5, 300, 8, 8) if small else (2, 3, 50, 1100, 64, 64)
    q, k, v, key_mask, grad = _few_queries_inputs(*shape, layer=True, masked=True, seed=1, dtype=dtype)
    valid = _masks(kind, q, k, key_mask, seed=2)
    answered = override_answers(monkeypatch, "attend_few_queries")
    for with_grad in (False, True):
        fast, plain = _fast_and_portable(lambda *t: attend_few_queries(*t, valid, 0.3), (q, k, v), grad,
                                         with_grad=with_grad)
        _assert_same(fast, plain, rel)
        if valid is not None:
            empty = ~valid.expand(*q.shape[:3], -1).any(-1)  # (B, H, m)
            assert empty.any() and all((t[empty] == 0).all() for t in (fast[0], plain[0]))
            if with_grad:
                assert (fast[1][empty] == 0).all()
    assert answered == [native and kind != "queries", True]


def test_attend_few_queries_override_declines_where_it_does_not_apply(monkeypatch):
    """Under autograd only where the fused kernel fits (not with Dv != D, not in float16) and the
    mask is one it takes (not one a head, (1, H, m, Lk)); without autograd only where the C
    kernel runs (not with ATTNZOO_NATIVE=0, not with a mask a query). Then the portable body."""
    q, k, v, key_mask, _ = _few_queries_inputs(2, 3, 5, 9, 8, 8, False, True, 0)
    answered = override_answers(monkeypatch, "attend_few_queries")
    attend_few_queries(q, k, v[..., :5].detach(), None, 0.5)  # Dv != D
    attend_few_queries(q.half(), k.half(), v.half(), None, 0.5)
    attend_few_queries(q, k, v, torch.ones(1, 3, 5, 9, dtype=torch.bool), 0.5)
    with torch.no_grad():
        attend_few_queries(q, k, v, torch.ones(2, 3, 5, 9, dtype=torch.bool), 0.5)
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
        attend_few_queries(q, k, v, None, 0.5)
    assert answered == [False] * 5
    monkeypatch.delenv("ATTNZOO_NATIVE")
    attend_few_queries(q, k, v, key_mask[:, None, None], 0.5)
    assert answered[-1]


@pytest.mark.parametrize("masked", [False, True])
def test_few_queries_backward_matches_the_reference(monkeypatch, masked):
    """FewQueries' key-blocked backward against the plain softmax's in float64: keys over several
    blocks and a partial last one, k and v laid out as a layer's (views of (B, L, H, ·)), their
    gradients laid out (B, L, H, ·) too; masked: a random mask with a query that sees no key
    (0 and no gradient); gradcheck with blocks of 4 keys. With the native kernels off (their
    tests: below), which otherwise take the unmasked forward and backward."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    monkeypatch.setattr(few, "KEY_BLOCK", 64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=g).requires_grad_()
    kv = torch.randn(2, 150, 3, 16, dtype=torch.float64, generator=g)
    k, v = (t.transpose(1, 2).detach().requires_grad_() for t in kv.split(8, -1))
    valid = None
    if masked:
        valid = torch.rand(2, 3, 5, 150, generator=g) < 0.3
        valid[1, 2, 4] = False
    out = few.FewQueries.apply(q, k, v, valid, 0.3)[0]
    expected = softmax_reference(q, k, v, valid, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-14, rtol=1e-12)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, want, t in zip(grads, torch.autograd.grad(expected, (q, k, v), grad), (q, k, v), strict=True):
        torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-12)
        assert got.transpose(1, 2).is_contiguous() if t is not q else got.is_contiguous()
    if masked:
        assert (out[1, 2, 4] == 0).all() and (grads[0][1, 2, 4] == 0).all()
    monkeypatch.setattr(few, "KEY_BLOCK", 4)
    small = [t[:1, :2, :9].detach().requires_grad_() for t in (q, k, v)]
    small_valid = None if valid is None else valid[:1, :2, :, :9]
    assert torch.autograd.gradcheck(lambda *t: few.FewQueries.apply(*t, small_valid, 0.5)[0], small)


def _few_queries_checked(q, k, v, key_mask, scale, grad, atol, rtol):
    """attend_few_queries through the native kernels (asserted) against the plain softmax
    (float64): without autograd the output alone, under it the output and the gradients
    (FewQueries, where D = Dv: the native forward and backward), and the log-sum-exp itself."""
    valid = None if key_mask is None else key_mask[:, None, None, :]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = softmax_reference(q64, k64, v64, valid, scale)
    want = (expected, *torch.autograd.grad(expected, (q64, k64, v64), grad.double()))
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "few_queries", kernel_spy(_native.few_queries, "few_queries", calls))
        mp.setattr(_native, "few_queries_grad",
                   kernel_spy(_native.few_queries_grad, "few_queries_grad", calls))
        with torch.no_grad():
            plain = attend_few_queries(q, k, v, valid, scale)
        out = attend_few_queries(q, k, v, valid, scale)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)))
    fused = q.shape[-1] == v.shape[-1]  # (FewQueries' condition: else SDPA's forward and backward)
    assert calls == [("few_queries", True)] + [("few_queries", True), ("few_queries_grad", True)] * fused
    for t, dt in zip((k, v) if fused else (), got[2:] if fused else (), strict=True):  # laid out as k, v
        assert (dt.is_contiguous(), dt.transpose(1, 2).is_contiguous()) == (
            t.is_contiguous(), t.transpose(1, 2).is_contiguous())
    for a, b in zip((plain, *got), (expected, *want), strict=True):  # (one key: dq is 0, to rounding)
        torch.testing.assert_close(a.double(), b, atol=atol * max(b.abs().max().item(), 1.0), rtol=rtol)
    scores = (q64 @ k64.transpose(-1, -2) * scale).detach()
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    lse = _native.few_queries(q, k, v, key_mask, scale, keep_lse=True)[1]
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=atol * 10, rtol=rtol)


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), m=st.integers(1, 23),
       Lk=st.sampled_from([1, 5, 127, 128, 129, 300]), widths=NATIVE_WIDTHS, layer=st.booleans(),
       masked=st.booleans(), seed=st.integers(0, 99))
def test_native_few_queries_matches_the_reference(B, H, m, Lk, widths, layer, masked, seed):
    """Few-queries attention in C (nystrom's landmark queries over the keys), forward and, under
    autograd, gradients through FewQueries, against the plain softmax in float64: odd counts of
    queries (past the last four), keys across the blocks of 128 (1, 127, 128, 129, 300), padded
    keys, a batch entry with none (0, lse -inf), k and v in a layer's layout or contiguous."""
    q, k, v, key_mask, grad = _few_queries_inputs(B, H, m, Lk, *widths, layer, masked, seed)
    _few_queries_checked(q, k, v, key_mask, 0.3, grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype, atol, scores", [(torch.float32, 1e-4, 1.0), (torch.float64, 1e-12, 30.0)])
def test_native_few_queries_at_the_benchmarks_widths(dtype, atol, scores):
    """float32 (the polynomial exp; D = 64: the products' rows in registers) within float32
    rounding of the float64 reference, 256 queries over 1000 keys, padded keys; float64 with
    scores of several thousand: the running maximum rescales the sums block after block."""
    q, k, v, key_mask, grad = _few_queries_inputs(2, 3, 256, 1000, 64, 64, True, True, 5, dtype, scores)
    key_mask[-1, ::7] = True
    rtol = 2e-4 if dtype == torch.float32 else 1e-10
    _few_queries_checked(q, k, v, key_mask, 0.125, grad, atol=atol, rtol=rtol)


def test_native_few_queries_gradcheck():
    """The native forward and backward under FewQueries, masked (a batch entry without keys)."""
    q, k, v, key_mask, _ = _few_queries_inputs(2, 2, 5, 9, 3, 3, True, True, 2)
    valid = key_mask[:, None, None, :]
    assert torch.autograd.gradcheck(lambda *t: attend_few_queries(*t, valid, 0.5), (q, k, v))


def test_native_few_queries_without_queries_or_keys():
    q, k, v, _, _ = _few_queries_inputs(2, 3, 4, 9, 8, 5, True, False, 0)
    out, lse = _native.few_queries(q[:, :, :0], k, v, None, 0.5, keep_lse=True)
    assert out.shape == (2, 3, 0, 5) and lse.shape == (2, 3, 0)
    out, lse = _native.few_queries(q, k[:, :, :0], v[:, :, :0], None, 0.5, keep_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_mechanisms_take_few_queries_backward(monkeypatch):
    """nystrom's landmark queries and prob_sparse's active ones (masked and not) go through
    FewQueries under autograd; gradcheck through it."""
    masks, apply = [], few.FewQueries.apply
    monkeypatch.setattr(few.FewQueries, "apply", lambda *a: masks.append(a[3]) or apply(*a))  # a[3]: valid
    check_gradcheck("nystrom", Lq=6, Lk=7, options={"num_landmarks": 3}, device="cpu")
    assert masks == [None] * len(masks) and masks
    masks.clear()
    check_gradcheck("prob_sparse", causal=True, masked=True, Lq=8, Lk=8, seed=1, options={"factor": 1},
                    device="cpu")
    check_gradcheck("prob_sparse", Lq=9, Lk=6, options={"factor": 1}, device="cpu")
    assert any(m is not None for m in masks) and any(m is None for m in masks)


# --- attend_few_keys ----------------------------------------------------------------------------


def _few_keys_inputs(B, H, Lq, n, D, Dv, layer, seed, dtype=torch.float64, scores=1.0):
    """q (B, H, Lq, D) (with ``layer``, a view of (B, Lq, H, D): a layer's split of the heads),
    k (B, H, n, D), v (B, H, n, Dv), all needing gradients; q and k times ``scores``."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Lq, H, D, dtype=dtype, generator=g).transpose(1, 2) if layer
         else torch.randn(B, H, Lq, D, dtype=dtype, generator=g))
    k = torch.randn(B, H, n, D, dtype=dtype, generator=g)
    v = torch.randn(B, H, n, Dv, dtype=dtype, generator=g)
    return (q * scores).detach().requires_grad_(), (k * scores).requires_grad_(), v.requires_grad_()


@pytest.mark.parametrize("path", ["native", "pieces"])
@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_attend_few_keys_override_is_the_portable_body(monkeypatch, dtype, rel, path):
    """The override against the portable SDPA call, output and gradients, without autograd and
    under it: float64 on a small case, float32 at the benchmarks' width (D = 64, n = 200 keys:
    past the C kernel's 64 scores a product) or past FewKeys' pieces (301 queries, 20 a piece:
    ATTNZOO_NATIVE=0, the pieces from any size on); q laid out as a layer's."""
    small = dtype == torch.float64
    if path == "pieces":
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
        monkeypatch.setattr(few, "WHOLE_BYTES_MAX", 0)
    shape = (2, 3, 31, 7, 8, 8) if small else (2, 3, 301, 200, 64, 64)
    monkeypatch.setattr(few, "KEYS_PIECE", shape[0] * shape[1] * shape[5] * 20)
    q, k, v = _few_keys_inputs(*shape, layer=True, seed=4, dtype=dtype)
    grad = torch.randn(q.shape[:3] + (shape[5],), dtype=dtype, generator=torch.Generator().manual_seed(5))
    answered = override_answers(monkeypatch, "attend_few_keys")
    pieces, apply = [], few.FewKeys.apply
    monkeypatch.setattr(few.FewKeys, "apply", lambda *a: pieces.append(1) or apply(*a))
    for with_grad in (False, True):
        fast, plain = _fast_and_portable(lambda *t: attend_few_keys(*t, 0.3), (q, k, v), grad,
                                         with_grad=with_grad)
        _assert_same(fast, plain, rel)
    assert answered == [True, True] and len(pieces) == 2 * (path == "pieces")


def test_attend_few_keys_override_declines_where_it_does_not_apply(monkeypatch):
    """Without the C kernel: below WHOLE_BYTES_MAX (one SDPA call is faster), and where the
    fused kernel does not fit (Dv != D). Then the portable body."""
    q, k, v = _few_keys_inputs(1, 2, 9, 5, 8, 8, False, 0)
    answered = override_answers(monkeypatch, "attend_few_keys")
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    attend_few_keys(q, k, v, 0.5)
    monkeypatch.setattr(few, "WHOLE_BYTES_MAX", 0)
    attend_few_keys(q, k, v[..., :5], 0.5)
    assert answered == [False, False]
    attend_few_keys(q, k, v, 0.5)
    assert answered[-1]


def test_few_keys_in_pieces_matches_the_reference(monkeypatch):
    """FewKeys' pieces (forward and backward) against the plain softmax's in float64: q laid out
    as a layer's (a view of (B, L, H, D)), 101 queries in pieces of 5 rows (the last partial),
    B and H > 1; the output and dq laid out (B, L, H, ·) so that the layer's merge is a view;
    attend_few_keys takes the pieces from WHOLE_BYTES_MAX on, one SDPA call below, where the
    native kernel is off; gradcheck."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    monkeypatch.setattr(few, "KEYS_PIECE", 2 * 3 * 8 * 5)  # B·H·Dv·5: 5 rows a piece
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 101, 3, 8, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    calls = []
    apply = few.FewKeys.apply
    monkeypatch.setattr(few.FewKeys, "apply", lambda *a: calls.append(1) or apply(*a))
    monkeypatch.setattr(few, "WHOLE_BYTES_MAX", q.shape[2] * 2 * 3 * 8 * 8 + 1)
    out = attend_few_keys(q, k, v, 0.4)
    assert not calls
    monkeypatch.setattr(few, "WHOLE_BYTES_MAX", q.shape[2] * 2 * 3 * 8 * 8)
    out = attend_few_keys(q, k, v, 0.4)
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
    monkeypatch.setattr(few, "KEYS_PIECE", 2 * 8 * 4)  # 4 rows a piece
    assert torch.autograd.gradcheck(lambda *t: few.FewKeys.apply(*t, 0.5)[0], small)


def _few_keys_checked(q, k, v, scale, grad, atol, rtol):
    """attend_few_keys through the native kernel (asserted) against the plain softmax (float64),
    output and gradients; both laid out (B, L, H, ·) as SDPA's."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "few_keys", kernel_spy(_native.few_keys, "few_keys", calls))
        out = attend_few_keys(q, k, v, scale)
    assert calls == [("few_keys", True)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = softmax_reference(q64, k64, v64, None, scale)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)))
    want = (expected, *torch.autograd.grad(expected, (q64, k64, v64), grad.double()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=atol * b.abs().max().item(), rtol=rtol)
    assert out.transpose(1, 2).is_contiguous() and got[1].transpose(1, 2).is_contiguous()


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Lq=st.integers(1, 23),
       n=st.sampled_from([1, 5, 63, 64, 65, 130]), widths=NATIVE_WIDTHS, layer=st.booleans(),
       seed=st.integers(0, 99))
def test_native_few_keys_matches_the_reference(B, H, Lq, n, widths, layer, seed):
    """Few-keys attention in C (linformer's projected keys, nystrom's landmarks), forward and
    gradients, against the plain softmax in float64: odd lengths, n across the 64 scores a
    product computes a row (1, 63, 64, 65, 130), q in a layer's layout or contiguous."""
    D, Dv = widths
    q, k, v = _few_keys_inputs(B, H, Lq, n, D, Dv, layer, seed)
    grad = torch.randn(B, H, Lq, Dv, dtype=q.dtype, generator=torch.Generator().manual_seed(seed))
    _few_keys_checked(q, k, v, 0.3, grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype, atol, scores", [(torch.float32, 1e-4, 1.0), (torch.float64, 1e-12, 30.0)])
@pytest.mark.parametrize("n", [256, 200])
def test_native_few_keys_at_the_benchmarks_widths(dtype, atol, scores, n):
    """float32 (the polynomial exp; D = 64: the products' rows in registers) within float32
    rounding of the float64 reference, at n = 256 keys and 200 (a last product of 8 scores a
    row); float64 with scores of several thousand: each row shifted by its own maximum."""
    q, k, v = _few_keys_inputs(2, 3, 301, n, 64, 64, True, 5, dtype, scores)
    grad = torch.randn(2, 3, 301, 64, dtype=dtype, generator=torch.Generator().manual_seed(5))
    _few_keys_checked(q, k, v, 0.125, grad, atol=atol, rtol=2e-4 if dtype == torch.float32 else 1e-10)


def test_native_few_keys_gradcheck_no_keys_and_no_second_derivative():
    q, k, v = _few_keys_inputs(1, 2, 6, 5, 3, 2, True, 3)
    assert torch.autograd.gradcheck(lambda *t: _native.few_keys(*t, 0.5), (q, k, v))
    assert _native.few_keys(q, k[:, :, :0], v[:, :, :0], 0.5) is None  # (the caller's SDPA then)
    (dq,) = torch.autograd.grad(_native.few_keys(q, k, v, 0.5).pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):  # not a silent zero
        dq.sum().backward()


def test_linformer_layer_in_query_blocks_attends_by_the_native_kernel(monkeypatch):
    """Without grad linformer's layer attends blocks of query rows (3 blocks of 4, 4 and 1 here),
    with grad all at once; both by the native few-keys kernel, with the same output."""
    from attnzoo.backends.cpu import projections
    from attnzoo.nn import MultiheadAttention

    monkeypatch.setattr(projections, "QUERY_BLOCK", 4)
    torch.manual_seed(0)
    layer = MultiheadAttention(12, 3, mechanism="linformer", proj_len=5, max_len=16).double()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    blocks, joined = [], MultiheadAttention._heads_joined
    monkeypatch.setattr(MultiheadAttention, "_heads_joined", lambda self, out: blocks.append(out.shape[2])
                        or joined(self, out))
    native, few_keys = [], _native.few_keys  # the queries of each call the kernel answered

    def spy(q, *args):
        out = few_keys(q, *args)
        native.extend([q.shape[2]] * (out is not None))
        return out
    monkeypatch.setattr(_native, "few_keys", spy)
    with torch.no_grad():
        inference = layer(x)
    assert blocks == native == [4, 4, 1]
    training = layer(x.requires_grad_())
    assert blocks == native == [4, 4, 1, 9]
    torch.testing.assert_close(inference, training.detach(), atol=1e-13, rtol=1e-12)


# --- segment_means ------------------------------------------------------------------------------


def test_segment_means_override_is_taken_under_autograd_for_equal_segments(monkeypatch):
    """Taken under autograd, on the CPU, without a key mask, for equal segments; declines without
    autograd (the portable body's forward is the same view), with a mask or unequal segments."""
    x = torch.randn(2, 3, 12, 5, dtype=torch.float64, requires_grad=True)
    answered = override_answers(monkeypatch, "segment_means")
    segment_means(x, 4)
    segment_means(x, 20)  # (m' = L: segments of one row)
    segment_means(x, 5)
    segment_means(x, 4, torch.ones(2, 12, dtype=torch.bool))
    with torch.no_grad():
        segment_means(x, 4)
    assert answered == [True, True, False, False, False]


@pytest.mark.parametrize("dtype, rel, L, m", [(torch.float64, 1e-14, 12, 4),
                                               (torch.float32, 1e-6, 4096, 256)])
def test_segment_means_override_is_the_portable_body(dtype, rel, L, m):
    """Equal segments' backward (one pass, laid out as x) against the portable mean's autograd,
    for x contiguous, as a layer's q (a transposed view) and expanded; gradcheck."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, L, 3, 4, dtype=dtype, generator=g)
    for x in (base.transpose(1, 2).contiguous(), base.transpose(1, 2),
              base[:1, :1].expand(2, L, 3, 4).transpose(1, 2)):
        grad = torch.randn(2, 3, m, 4, dtype=dtype, generator=g)
        fast, plain = _fast_and_portable(lambda t: segment_means(t, m), (x.requires_grad_(),), grad)
        _assert_same(fast, plain, rel)
        assert fast[1].stride() == torch.empty_like(x).stride()  # laid out as x
    x = base[:, :12].transpose(1, 2).double().detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: segment_means(t, 6), (x,))


def test_every_override_names_a_declared_operation():
    assert all(attnzoo.ops.operations()[name] for name in ("attend_few_queries", "attend_few_keys",
                                                           "segment_means"))
