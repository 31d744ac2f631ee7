import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import ops
from attnzoo.mechanisms import _windows
from attnzoo.mechanisms._windows import window_partial

from mechanism_checks import cases, check_against_reference, check_equals_full, check_gradcheck

local_cases = cases(window=st.integers(1, 12), block=st.none() | st.integers(1, 9))


@settings(max_examples=60, deadline=None)
@given(local_cases)
def test_local_matches_reference(case):
    check_against_reference("local", **case)


def test_local_in_chunks_of_query_blocks(monkeypatch):
    """The portable engine's scores go in chunks of query blocks: one or two blocks a chunk."""
    monkeypatch.setattr(_windows, "SCORES_PER_CHUNK", 20)
    with ops.portable():
        for causal, masked in [(False, True), (True, True), (False, False), (True, False)]:
            check_against_reference("local", Lq=19, Lk=23, causal=causal, masked=masked,
                                    options={"window": 5, "block": 3})
            check_against_reference("local", Lq=23, Lk=23, causal=causal, masked=masked,
                                    options={"window": 5, "block": 3})


@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_window_partial_with_its_scale_matches_the_dense_band(causal, lse_grad):
    """The engine's partial (o, lse) with a scale against the dense masked softmax of the band, in
    float64, and the gradients of o alone or of o and lse (a factorized pattern merges lse):
    in chunks of several query blocks, a ragged last block."""
    g = torch.Generator().manual_seed(1)
    L, left, right, scale = 37, 6, 0 if causal else 5, 0.3
    q, k, v = (torch.randn(2, 3, L, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    allowed = lambda i, j: (j >= i - left) & (j <= i + right)  # noqa: E731
    with ops.portable():
        o, lse = window_partial(q, k, v, None, block=4, left=left, right=right, allowed=allowed, scale=scale)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed(i, j), float("-inf"))
    o_ref, lse_ref = torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    torch.testing.assert_close((o, lse), (o_ref, lse_ref))
    w_o, w_lse = (torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (o, lse))
    loss = lambda o, lse: (o * w_o).sum() + ((lse * w_lse).sum() if lse_grad else 0)  # noqa: E731
    grads = torch.autograd.grad(loss(o, lse), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(loss(o_ref, lse_ref), (q, k, v)))


def test_window_partial_query_without_keys():
    """A band that leaves a query no key (strictly before itself: query 0) gives it o = 0 and
    lse = -inf, and no gradient, not nan."""
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    o, lse = window_partial(q, k, v, None, block=4, left=3, right=0, allowed=lambda i, j: j < i, scale=0.5)
    assert (o[:, :, 0] == 0).all() and (lse[:, :, 0] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, 1:]).all()
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads) and (grads[0][:, :, 0] == 0).all()


def test_local_window_covering_everything_equals_full():
    for causal in (False, True):
        check_equals_full("local", L=13, causal=causal, options={"window": 40})


def test_local_connectivity_by_hand():
    m = attnzoo.connectivity("local", length=5, causal=True, window=2)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert attnzoo.connectivity("local", length=5, causal=False, window=2)[2].tolist() == [
        False, True, True, True, False]


def test_local_gradcheck():
    check_gradcheck("local", causal=True, masked=True, options={"window": 3, "block": 2})
    check_gradcheck("local", Lq=4, Lk=6, options={"window": 4})


def test_local_bad_options():
    with pytest.raises(ValueError, match="window"):
        attnzoo.get("local").options(window=0)
