"""The CPU backend's A2 parts of strided and fixed (attnzoo.backends.cpu.sparse_transformer): where
its overrides are taken (``attend_summary_cells`` by the fused kernel or by its own softmax,
``attend_residues``, ``merge_two_partials``), that they give what the portable bodies give,
outputs and gradients, and the factorized patterns without autograd on the backend's pieces and
chunks."""

import itertools

import pytest
import torch

import attnzoo
from attnzoo import ops
from attnzoo.backends.cpu import fused, windows
from attnzoo.backends.cpu import sparse_transformer as backend
from attnzoo.mechanisms import sparse_transformer
from backends.cpu.spies import override_answers

from mechanism_checks import check_against_reference


def _partial_grads(o, lse, leaves, seed):
    """The gradients of ``leaves`` for random weights on a partial's o and (finite) lse."""
    g = torch.Generator().manual_seed(seed)
    w_o, w_lse = (torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (o, lse))
    loss = (o * w_o).sum() + (lse.where(torch.isfinite(lse), 0.0) * w_lse).sum()
    return torch.autograd.grad(loss, leaves)


def _spy(monkeypatch):
    """{"kernel": chunks by the fused kernel, "softmax": chunks by the backend's softmax}."""
    calls = {"kernel": 0, "softmax": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(fused, "fused_partial", counted("kernel", fused.fused_partial))
    monkeypatch.setattr(backend, "partial_softmax", counted("softmax", backend.partial_softmax))
    return calls




def _a2_both_ways(q, k, v, key_valid, *, l, c, causal, own, grad, seed):
    """fixed's A2 partial (o, lse) and the gradients of q, k, v for upstream gradients of o and
    of lse (None without ``grad``), by the override and by the portable body."""
    results = []
    for portable in (False, True):
        with pytest.MonkeyPatch.context() as m:
            if portable:
                m.setattr(sparse_transformer, "summary_partial", sparse_transformer.summary_partial.portable)
            leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            o, lse = sparse_transformer._fixed_a2(*leaves, key_valid, l, c, causal, own, 0.3)
        results.append(((o.detach(), lse.detach()), _partial_grads(o, lse, leaves, seed) if grad else None))
    return results


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("causal, own", [(False, False), (True, False), (False, True), (True, True)])
def test_summary_cells_match_the_portable_body_in_float64(monkeypatch, causal, own, masked, grad):
    """The override against the portable body in float64, outputs and gradients of o and lse:
    without autograd and padding keys by the fused kernel, otherwise by the backend's softmax;
    several chunks either way, a ragged last block, a key mask that leaves a batch entry one
    key (queries with no summary cell: o = 0, lse = -inf)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 23, 8, generator=g, dtype=torch.float64) for _ in range(3))
    key_valid = None
    if masked:
        key_valid = torch.rand(2, 23, generator=g) < 0.6
        key_valid[1] = False
        key_valid[1, -1] = True
    with monkeypatch.context() as m:
        m.setattr(backend, "FUSED_A2_MASK", 30)  # a few rows a chunk
        m.setattr(backend, "SCORES_PER_CHUNK", 2 * 3 * 12 * 5)
        m.setattr(sparse_transformer, "A2_SCORES_PER_CHUNK", 2 * 3 * 12 * 5)
        calls = _spy(m)
        (fast, fast_grads), (portable, portable_grads) = _a2_both_ways(
            q, k, v, key_valid, l=4, c=2, causal=causal, own=own, grad=grad, seed=1)
    kernel = not grad and not masked
    assert (calls["kernel"] > 1, calls["softmax"] > 1) == (kernel, not kernel), calls
    torch.testing.assert_close(fast, portable, atol=1e-12, rtol=1e-10)
    if grad:
        torch.testing.assert_close(fast_grads, portable_grads, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("grad", [False, True])
def test_summary_cells_match_the_portable_body_in_float32(monkeypatch, grad):
    """The same in float32 at L = 2000, B·H = 8, l = 45, c = 3, causal, in chunks of the
    backend's sizes."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 2000, 16, generator=g) for _ in range(3))
    with monkeypatch.context() as m:
        m.setattr(backend, "FUSED_A2_MASK", 2**14)
        m.setattr(backend, "SCORES_PER_CHUNK", 2**16)
        calls = _spy(m)
        (fast, fast_grads), (portable, portable_grads) = _a2_both_ways(
            q, k, v, None, l=45, c=3, causal=True, own=False, grad=grad, seed=3)
    assert calls["softmax" if grad else "kernel"] > 1, calls
    torch.testing.assert_close(fast, portable, atol=2e-5, rtol=1e-4)
    if grad:
        torch.testing.assert_close(fast_grads, portable_grads, atol=2e-5, rtol=1e-4)


def test_summary_cells_leave_strided_rows_to_the_softmax(monkeypatch):
    """A strided last dimension, which the kernel cannot read, goes to the backend's softmax,
    with the portable body's results."""
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    strided_q = torch.stack([q, torch.zeros_like(q)], -1).flatten(-2)[..., ::2]
    with torch.no_grad():
        fast = sparse_transformer._fixed_a2(strided_q, k, v, None, 4, 2, True, False, 0.3)
        with ops.portable():
            portable = sparse_transformer._fixed_a2(strided_q, k, v, None, 4, 2, True, False, 0.3)
    assert calls["kernel"] == 0 and calls["softmax"] > 0
    torch.testing.assert_close(fast, portable)


@pytest.mark.parametrize("mask_entries", [2**20, 24])
def test_fixed_a2_by_the_fused_kernel(monkeypatch, mask_entries):
    """Without autograd and padding keys, fixed's A2 goes through torch's fused kernel (24 mask
    entries: a few rows a chunk), and must give what the reference does; under autograd it
    does not."""
    calls = _spy(monkeypatch)
    monkeypatch.setattr(backend, "FUSED_A2_MASK", mask_entries)
    for causal in (False, True):
        for heads in ("union", "split"):
            for L, stride, c in ((23, 4, 2), (24, 6, 3), (5, 8, 1)):
                options = {"stride": stride, "c": c, "heads": heads}
                check_against_reference("fixed", Lq=L, Lk=L, causal=causal, options=options,
                                        backward=False, device="cpu")
    assert calls["kernel"] >= 12  # every case
    calls["kernel"] = 0
    check_against_reference("fixed", Lq=23, Lk=23, options={"stride": 4}, device="cpu")  # autograd
    assert calls["kernel"] == 0 and calls["softmax"] > 0


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_without_autograd_on_the_backends_pieces(monkeypatch, name):
    """Without autograd each part is written into its place in one result as it comes (the
    band's kernel pieces, the summary cells' chunks) and the parts merged: the reference's
    results, with several parts of each."""
    monkeypatch.setattr(sparse_transformer, "A2_SCORES_PER_CHUNK", 16)
    monkeypatch.setattr(backend, "FUSED_A2_MASK", 24)
    monkeypatch.setattr(backend, "SCORES_PER_CHUNK", 16)
    monkeypatch.setattr(windows, "BAND_PIECE", 2 * 3 * 4 * 8)  # one query block (B·H·4·Dv) a piece
    with torch.no_grad():
        for causal, masked, heads in itertools.product((False, True), repeat=3):
            options = {"stride": 4, "heads": "union" if heads else "split"}
            options |= {"c": 2} if name == "fixed" else {}
            for Lq, Lk in ((21, 23), (23, 23)):
                check_against_reference(name, Lq=Lq, Lk=Lk, D=8, causal=causal, masked=masked,
                                        options=options, backward=False, device="cpu")


def _residues_both_ways(q, k, v, key_valid, *, l, causal, include_self, grad, seed):
    """strided's A2 partial (o, lse) and the gradients of q, k, v for upstream gradients of o and
    of lse (None without ``grad``), by the override and by the portable body."""
    results = []
    for portable in (False, True):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        with ops.portable() if portable else torch.enable_grad():
            o, lse = sparse_transformer._strided_a2(*leaves, key_valid, l, causal, include_self)
        results.append(((o.detach(), lse.detach()), _partial_grads(o, lse, leaves, seed) if grad else None))
    return results


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("causal, include_self", [(False, False), (True, False), (True, True)])
def test_residues_match_the_portable_body_in_float64(monkeypatch, causal, include_self, masked, grad):
    """strided's residue classes by the override against the portable body in float64, outputs and
    gradients of o and lse: a class or two a chunk, a ragged last row of classes, a key mask
    that leaves a batch entry one key; without autograd written into place."""
    answers = override_answers(monkeypatch, "attend_residues")
    monkeypatch.setattr(backend, "SCORES_PER_CHUNK", 2 * 3 * 6 * 6 * 2)  # B·H·m²·2: two classes
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 23, 8, generator=g, dtype=torch.float64) for _ in range(3))
    key_valid = None
    if masked:
        key_valid = torch.rand(2, 23, generator=g) < 0.6
        key_valid[1] = False
        key_valid[1, -1] = True
    (fast, fast_grads), (portable, portable_grads) = _residues_both_ways(
        q, k, v, key_valid, l=4, causal=causal, include_self=include_self, grad=grad, seed=6)
    assert answers == [True]
    torch.testing.assert_close(fast, portable, atol=1e-12, rtol=1e-10)
    if grad:
        torch.testing.assert_close(fast_grads, portable_grads, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("grad", [False, True])
def test_residues_match_the_portable_body_in_float32(monkeypatch, grad):
    """The same in float32 at L = 2000, B·H = 8, l = 45 (classes of 45 positions), causal,
    several chunks of classes."""
    answers = override_answers(monkeypatch, "attend_residues")
    monkeypatch.setattr(backend, "SCORES_PER_CHUNK", 2**16)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 2000, 16, generator=g) for _ in range(3))
    (fast, fast_grads), (portable, portable_grads) = _residues_both_ways(
        q, k, v, None, l=45, causal=True, include_self=False, grad=grad, seed=8)
    assert answers == [True]
    torch.testing.assert_close(fast, portable, atol=2e-5, rtol=1e-4)
    if grad:
        torch.testing.assert_close(fast_grads, portable_grads, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dtype, L", [(torch.float64, 10), (torch.float32, 3000)])
def test_merge_matches_the_portable_body(monkeypatch, dtype, L, grad):
    """The union's merge by the override against the portable merge, output and gradients of
    both parts' o and lse: rows where one part has no key (lse -inf) and where neither has
    (0, and zero gradients, not nan)."""
    answers = override_answers(monkeypatch, "merge_two_partials")
    g = torch.Generator().manual_seed(9)
    o_a, o_b = (torch.randn(2, 3, L, 4, generator=g, dtype=dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 3, L, generator=g, dtype=dtype) * 5 for _ in range(2))
    lse_a[0, 0, :3] = lse_b[0, 0, 1:5] = lse_b[1, 2, -1] = float("-inf")
    results = []
    for portable in (False, True):
        xs = [t.clone().requires_grad_(grad) for t in (o_a, lse_a, o_b, lse_b)]
        with ops.portable() if portable else torch.enable_grad():
            out = sparse_transformer.merged_output((xs[0], xs[1]), (xs[2], xs[3]))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(10), dtype=dtype)
        results.append((out.detach(), torch.autograd.grad(out, xs, w) if grad else None))
    (fast, fast_grads), (portable, portable_grads) = results
    assert answers == [True]
    assert (fast[0, 0, 1:3] == 0).all()
    torch.testing.assert_close(fast, portable)
    if grad:
        assert all(torch.isfinite(t).all() for t in fast_grads)
        torch.testing.assert_close(fast_grads, portable_grads)


def test_a2_parts_leave_half_precision(monkeypatch):
    """Half precision: the A2 parts by the portable bodies; their partials come in float32, which
    the merge takes."""
    answers = {name: override_answers(monkeypatch, name)
               for name in ("attend_residues", "attend_summary_cells", "merge_two_partials")}
    q = torch.randn(1, 2, 20, 8, dtype=torch.float16)
    for name in ("strided", "fixed"):
        attnzoo.attention(q, q, q, mechanism=name, stride=4)
    assert answers == {"attend_residues": [False], "attend_summary_cells": [False],
                       "merge_two_partials": [True, True]}
