"""The CPU backend's offsets of log_sparse (attnzoo.backends.cpu.log_sparse): where its override
of ``attend_offsets`` is taken, and that it gives what the portable body gives, outputs and
gradients, in float64 and in float32 past its blocks of positions."""

import pytest
import torch

from attnzoo import ops
from attnzoo.backends.cpu import log_sparse as backend
from attnzoo.mechanisms import log_sparse

from mechanism_checks import check_against_reference


def _spy(monkeypatch):
    """Names of the override's passes ("forward", "backward") as they run."""
    calls = []
    forward, backward = backend._Offsets.forward, backend._OffsetAttention.backward
    monkeypatch.setattr(backend._Offsets, "forward", lambda *a: calls.append("forward") or forward(*a))
    monkeypatch.setattr(backend._OffsetAttention, "backward",
                        staticmethod(lambda *a: calls.append("backward") or backward(*a)))
    return calls


def _inputs(B, H, N, D, dtype, seed, *, causal, local=1, restart=None, masked=False):
    """q, k, v, and the offsets and validity log_sparse gives them."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    key_valid = None
    if masked:
        key_valid = torch.rand(B, N, generator=g) < 0.6
        key_valid[-1] = False  # the last batch entry: one key, most queries see none
        key_valid[-1, N // 2] = True
    opts = log_sparse.LogSparseOptions(local=local, restart=restart)
    offsets = log_sparse._signed_offsets(opts, N, causal)
    return (q, k, v), log_sparse._offset_valid(offsets, N, restart, key_valid, q.device), offsets


def _both_ways(xs, valid, offsets, seed):
    """Output and the gradients of q, k, v for one upstream gradient, by the override and by the
    portable body."""
    results = []
    for portable in (False, True):
        leaves = [t.detach().requires_grad_() for t in xs]
        with ops.portable() if portable else torch.enable_grad():
            out = log_sparse.offset_attention(*leaves, valid, offsets=offsets, scale=0.4)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        results.append((out.detach(), torch.autograd.grad(out, leaves, g)))
    return results


@pytest.mark.parametrize("causal, local, restart, masked", [
    (True, 1, None, False), (False, 1, None, False), (True, 3, 7, True), (False, 2, 5, True)])
@pytest.mark.parametrize("block_scores", [2**20, 2 * 3 * 8 * 3])  # one block; three positions a block
def test_offsets_match_the_portable_body_in_float64(monkeypatch, causal, local, restart, masked,
                                                    block_scores):
    """The override (forward and its recomputing backward) against the portable body in float64:
    one or several blocks of positions, offsets one-sided and two, a dense window, restarts,
    and padding keys with queries that see none (0, and no gradient)."""
    monkeypatch.setattr(backend, "SCORES_PER_CHUNK", block_scores)
    calls = _spy(monkeypatch)
    xs, valid, offsets = _inputs(2, 3, 23, 8, torch.float64, 0, causal=causal, local=local,
                                 restart=restart, masked=masked)
    (fast, fast_grads), (portable, portable_grads) = _both_ways(xs, valid, offsets, seed=1)
    assert calls == ["forward", "backward"]
    torch.testing.assert_close(fast, portable, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(fast_grads, portable_grads, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_offsets_match_the_portable_body_in_float32(monkeypatch, causal):
    """The same in float32 at N = 1500, B·H = 8, in blocks of 200 positions."""
    monkeypatch.setattr(backend, "SCORES_PER_CHUNK", 2 * 4 * 16 * 200)
    calls = _spy(monkeypatch)
    xs, valid, offsets = _inputs(2, 4, 1500, 16, torch.float32, 2, causal=causal, local=2)
    (fast, fast_grads), (portable, portable_grads) = _both_ways(xs, valid, offsets, seed=3)
    assert calls == ["forward", "backward"]
    torch.testing.assert_close(fast, portable, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_grads, portable_grads, atol=2e-5, rtol=1e-4)


def test_offsets_taken_in_every_grad_mode_and_left_where_they_do_not_apply(monkeypatch):
    """log_sparse takes the override in float32 and float64, with autograd or without; half
    precision, and offsets that do not start at 0 (its blocks start from offset 0), go to the
    portable body, with its results."""
    calls = _spy(monkeypatch)
    xs, valid, offsets = _inputs(1, 2, 19, 4, torch.float64, 4, causal=True, local=2)
    for dtype in (torch.float64, torch.float32):
        for grad in (False, True):
            calls.clear()
            leaves = [t.detach().to(dtype).requires_grad_(grad) for t in xs]
            log_sparse.offset_attention(*leaves, valid, offsets=offsets, scale=0.5)
            assert calls == ["forward"]
    cases = [("float16", [t.half() for t in xs], valid, offsets),
             ("offsets from 1", xs, valid[:, 1:], offsets[1:])]
    for name, ts, ok, offs in cases:
        calls.clear()
        fast = log_sparse.offset_attention(*ts, ok, offsets=offs, scale=0.5)
        with ops.portable():
            portable = log_sparse.offset_attention(*ts, ok, offsets=offs, scale=0.5)
        assert calls == [], name
        torch.testing.assert_close(fast, portable, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("scores", [40, 144])  # B·H·D = 48: one position a block; 3 (the last 2)
def test_log_sparse_in_blocks_of_positions(monkeypatch, scores):
    """Blocks reuse one scratch's buffers, a last shorter block its own."""
    monkeypatch.setattr(backend, "SCORES_PER_CHUNK", scores)
    for causal in (False, True):
        check_against_reference("log_sparse", Lq=19, Lk=23, causal=causal, masked=True,
                                options={"local": 2, "restart": 7}, device="cpu")
