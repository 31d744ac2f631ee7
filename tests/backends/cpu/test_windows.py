"""The CPU backend's banded windows (attnzoo.backends.cpu.windows): where its override of
``attend_windows`` is taken, that it gives what the portable windows give (outputs, and
gradients of o and of lse) in float64 and in float32 past its blocks and pieces, and the native
few-queries kernels it hands unmasked blocks to."""

import pytest
import torch

from attnzoo import ops
from attnzoo.backends.cpu import native as _native
from attnzoo.backends.cpu import windows
from attnzoo.mechanisms._windows import window_partial

from mechanism_checks import check_against_reference, check_gradcheck, record_band_calls


def _band(kind, L):
    """(block, left, right, allowed) of the bands the mechanisms ask for (``L`` sets strided's)."""
    if kind == "local causal":
        return 8, 9, 0, lambda i, j: (j >= i - 9) & (j <= i)
    if kind == "local two-sided":
        return 4, 5, 5, lambda i, j: (j >= i - 5) & (j <= i + 5)
    if kind == "block_local two-sided":  # every window key: no mask, the native kernels
        return 5, 5, 5, lambda i, j: torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool)
    if kind == "block_local causal":
        return 6, 12, 0, lambda i, j: j <= i
    if kind == "fixed causal":  # own block only
        return 7, 0, 0, lambda i, j: j <= i
    l = max(2, round(L**0.5))  # strided's A1, two-sided
    return min(l, 64), l - 1, l - 1, lambda i, j: (j > i - l) & (j < i + l)


KINDS = ["local causal", "local two-sided", "block_local two-sided", "block_local causal", "fixed causal",
         "strided"]


def _fast_and_portable(q, k, v, band, scale, lse_grad, seed):
    """Outputs (o, lse) and gradients of q, k, v, by the override and by the portable body, for
    one upstream gradient of o (and of lse with ``lse_grad``)."""
    block, left, right, allowed = band
    g = torch.Generator().manual_seed(seed)
    results = []
    for portable in (False, True):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with ops.portable() if portable else torch.enable_grad():
            o, lse = window_partial(*leaves, None, block=block, left=left, right=right, allowed=allowed,
                                    scale=scale)
        if not results:
            w_o, w_lse = (torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (o, lse))
        loss = (o * w_o).sum() + ((lse * w_lse).sum() if lse_grad else 0)
        results.append(((o, lse), torch.autograd.grad(loss, leaves)))
    return results


@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("piece", [2**20, 2 * 3 * 4 * 4])  # outputs a kernel call: all, one block
def test_band_matches_the_portable_windows_in_float64(monkeypatch, kind, lse_grad, piece):
    """The override (its forward, and its backward, with a gradient of lse too where a pattern
    merges it) against the portable windows, with a scale: sequence of 37, a ragged last block,
    masks of their own for the blocks at either end; the kernel on the whole band or on pieces
    of one query block."""
    monkeypatch.setattr(windows, "BAND_PIECE", piece)
    calls = record_band_calls(monkeypatch)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 37, 4, generator=g, dtype=torch.float64) for _ in range(3))
    (fast, fast_grads), (portable, portable_grads) = _fast_and_portable(q, k, v, _band(kind, 37), 0.3,
                                                                        lse_grad, seed=2)
    assert calls == ["forward", "backward"]
    torch.testing.assert_close(fast, portable, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(fast_grads, portable_grads, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_band_matches_the_portable_windows_in_float32(monkeypatch, kind):
    """The same in float32 at L = 1500, B·H = 8 (tens of query blocks, three runs), the kernel
    in pieces of three blocks and the backward a few heads a step, gradients of o and lse."""
    L, B, H, D = 1500, 2, 4, 16
    block = _band(kind, L)[0]
    monkeypatch.setattr(windows, "BAND_PIECE", B * H * block * D * 3)
    monkeypatch.setattr(windows, "SCORES_PER_CHUNK", 2 * 3 * block * sum(_band(kind, L)[:3]))
    calls = record_band_calls(monkeypatch)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    (fast, fast_grads), (portable, portable_grads) = _fast_and_portable(q, k, v, _band(kind, L), 0.25,
                                                                        True, seed=4)
    assert calls == ["forward", "backward"]
    torch.testing.assert_close(fast, portable, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_grads, portable_grads, atol=2e-5, rtol=1e-4)


def _layouts(q, k, v):
    """Calls the kernel may not take, each as (name, q, k, v)."""
    yield "float16", q.half(), k.half(), v.half()
    yield "Dv != D", q, k, torch.cat([v, v], -1)
    wide = torch.stack([k, torch.zeros_like(k)], -1).flatten(-2)  # every other element of a wider row
    yield "strided last dim", q, wide[..., ::2], v


def test_band_leaves_what_the_kernel_cannot_take_to_the_portable_windows(monkeypatch):
    """Padding keys, half precision, Dv != D, a strided last dimension, and a band that leaves a
    query no key (the kernel would give it lse 0): the portable windows' results, by them."""
    calls = record_band_calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 29, 4, generator=g, dtype=torch.float64) for _ in range(3))
    block, left, right, allowed = _band("local causal", 29)
    kw = dict(block=block, left=left, right=right, allowed=allowed, scale=0.5)
    key_valid = torch.rand(2, 29, generator=g) < 0.7
    cases = [("padding keys", q, k, v, key_valid, kw)]
    cases += [(name, *t, None, kw) for name, *t in _layouts(q, k, v)]
    cases += [("a query without keys", q, k, v, None, {**kw, "allowed": lambda i, j: j < i})]
    for name, q_, k_, v_, valid, options in cases:
        calls.clear()
        fast = window_partial(q_, k_, v_, valid, **options)
        with ops.portable():
            portable = window_partial(q_, k_, v_, valid, **options)
        assert calls == [], name
        torch.testing.assert_close(fast, portable, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("scores_per_chunk", [2**20, 20])  # backward: all heads at once, one by one
def test_band_taken_by_local_and_block_local(monkeypatch, scores_per_chunk):
    """local and block_local without padding keys take the band, forward and backward, and give
    the reference's results in float64: sequence shorter than a window, ragged last block, bands
    one-sided and two, one block only, look forward by two, Lq < Lk (padded queries); with
    padding keys (a key mask, or Lk < Lq) the portable windows."""
    monkeypatch.setattr(windows, "SCORES_PER_CHUNK", scores_per_chunk)
    calls = record_band_calls(monkeypatch)
    for name, Lq, Lk, masked, causal, options in [
            ("local", 37, 37, False, False, {"window": 5, "block": 4}),
            ("local", 37, 37, False, True, {"window": 9, "block": 8}),
            ("local", 6, 6, False, False, {"window": 12, "block": 3}),
            ("local", 19, 29, False, True, {"window": 7}),
            ("local", 29, 19, False, True, {"window": 7}),
            ("local", 29, 29, False, False, {"window": 1, "block": 5}),
            ("local", 64, 64, False, True, {"window": 16, "block": 16}),
            ("block_local", 37, 37, False, False, {"window": 5}),
            ("block_local", 37, 37, False, True, {"window": 8}),
            ("block_local", 6, 6, False, False, {"window": 12}),
            ("block_local", 19, 29, True, True, {"window": 4, "look_backward": 2}),
            ("block_local", 29, 29, True, False, {"window": 3, "look_backward": 0, "look_forward": 2})]:
        calls.clear()
        check_against_reference(name, Lq=Lq, Lk=Lk, causal=causal, masked=masked, options=options,
                                device="cpu")
        taken = not masked and Lk >= Lq  # (Lk < Lq: keys padded to Lq's frame)
        assert calls == (["forward", "backward"] if taken else []), (name, options, calls)
    check_gradcheck("local", Lq=6, Lk=6, causal=True, options={"window": 3, "block": 2}, device="cpu")


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_band_taken_by_the_factorized_patterns(monkeypatch, name):
    """strided's and fixed's A1 take the band, its backward with the gradient of lse (the merge
    with A2 gives it one), against the reference."""
    calls = record_band_calls(monkeypatch)
    for causal in (False, True):
        calls.clear()
        check_against_reference(name, Lq=33, Lk=33, causal=causal, options={"stride": 4}, device="cpu")
        assert calls == ["forward", "backward"], calls


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("L, window", [(37, 5), (40, 5), (12, 4)])
def test_block_local_two_sided_windows_by_the_few_queries_kernels(monkeypatch, native, L, window):
    """Two-sided and unmasked, the blocks whose window lies inside the sequence go through the
    native few-queries kernels, forward and backward, each block's window a head of its own, in
    pieces of two blocks (their windows' gradients added back onto overlapping keys); with the
    kernels off, through the fused kernel and the band's own backward. Both against the
    reference; a ragged last block, blocks in an odd run, and one block inside."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    monkeypatch.setattr(windows, "BAND_PIECE", 2 * 3 * window * 8 * 2)  # B·H·block·Dv·2: two blocks
    calls = []  # (kernel, blocks) of each call the kernels answered

    def spied(name, kernel):
        def spy(*args, **kwargs):
            result = kernel(*args, **kwargs)
            calls.extend([(name, args[0].shape[1])] * (result is not None))
            return result
        return spy

    for name in ("few_queries", "few_queries_grad"):
        monkeypatch.setattr(_native, name, spied(name, getattr(_native, name)))
    check_against_reference("block_local", Lq=L, Lk=L, options={"window": window}, device="cpu")
    inside = (L - 2 * window) // window  # blocks but the first and those whose window passes L
    pieces = [min(2, inside - s) for s in range(0, inside, 2)]
    assert calls == ([("few_queries", n) for n in pieces] + [("few_queries_grad", n) for n in pieces]
                     if native == "1" else [])


def test_band_with_a_gradient_of_lse_leaves_the_native_backward(monkeypatch):
    """The native backward takes no gradient of lse: with one, the unmasked blocks' backward is
    the band's own, and both gradients match the portable windows'."""
    grads = []
    monkeypatch.setattr(_native, "few_queries_grad",
                        lambda *a, grad=_native.few_queries_grad: grads.append(1) or grad(*a))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for lse_grad in (False, True):
        grads.clear()
        (fast, fast_grads), (portable, portable_grads) = _fast_and_portable(
            q, k, v, _band("block_local two-sided", 37), 0.3, lse_grad, seed=7)
        assert bool(grads) == (not lse_grad and _native.enabled())
        torch.testing.assert_close(fast_grads, portable_grads, atol=1e-11, rtol=1e-9)
