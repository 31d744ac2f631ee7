import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import _native
from attnzoo.mechanisms import _common

from mechanism_checks import (
    cases,
    check_against_reference,
    check_equals_full,
    check_gradcheck,
    record_band_calls,
)

block_local_cases = cases(window=st.integers(1, 9), look_backward=st.integers(0, 2),
                          look_forward=st.none() | st.just(0))


@settings(max_examples=60, deadline=None)
@given(block_local_cases)
def test_block_local_matches_reference(case):
    check_against_reference("block_local", **case)


@pytest.mark.parametrize("scores_per_chunk", [2**20, 20])  # backward: all heads at once, one by one
def test_block_local_fused_and_in_groups(monkeypatch, scores_per_chunk):
    """Without padding keys the fused SDPA band (forward and backward), with them the groups of
    query blocks; ragged last block, one block only, look forward by two."""
    monkeypatch.setattr(_common, "SCORES_PER_CHUNK", scores_per_chunk)
    calls = record_band_calls(monkeypatch)
    for Lq, Lk, masked, causal, options in [
            (37, 37, False, False, {"window": 5}), (37, 37, False, True, {"window": 8}),
            (6, 6, False, False, {"window": 12}), (19, 29, True, True, {"window": 4, "look_backward": 2}),
            (29, 29, True, False, {"window": 3, "look_backward": 0, "look_forward": 2})]:
        calls.clear()
        check_against_reference("block_local", Lq=Lq, Lk=Lk, causal=causal, masked=masked, options=options,
                                device="cpu")
        assert calls == ([] if masked else ["fused_forward", "fused_backward"]), (options, calls)


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("L, window", [(37, 5), (40, 5), (12, 4)])
def test_block_local_two_sided_windows_by_the_few_queries_kernels(monkeypatch, native, L, window):
    """Two-sided and unmasked, the blocks whose window lies inside the sequence go through the
    native few-queries kernels, forward and backward, each block's window a head of its own, in
    pieces of two blocks (their windows' gradients added back onto overlapping keys); with the
    kernels off, through the SDPA kernel and torch's backward. Both against the reference; a
    ragged last block, blocks in an odd run, and one block inside."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    monkeypatch.setattr(_common, "BAND_PIECE", 2 * 3 * window * 8 * 2)  # B·H·block·Dv·2: two blocks
    calls = []  # (kernel, blocks) of each call the kernels answered

    def spied(name, kernel):
        def spy(*args):
            result = kernel(*args)
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


def test_block_local_one_block_equals_full():
    for causal in (False, True):
        check_equals_full("block_local", L=13, causal=causal, options={"window": 13})


def test_block_local_connectivity_by_hand():
    # blocks {0, 1}, {2, 3}, {4}: as local-attention's LocalAttention(window_size=2)
    two_sided = attnzoo.connectivity("block_local", length=5, causal=False, window=2).int()
    assert two_sided.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1],
                                  [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    causal = attnzoo.connectivity("block_local", length=5, causal=True, window=2).int()
    assert causal.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                               [1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    own_block = attnzoo.connectivity("block_local", length=4, causal=False, window=2,
                                     look_backward=0, look_forward=0)
    assert own_block.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_block_local_gradcheck():
    check_gradcheck("block_local", causal=True, masked=True, options={"window": 2})
    check_gradcheck("block_local", Lq=4, Lk=6, options={"window": 3})
    check_gradcheck("block_local", Lq=6, Lk=6, options={"window": 2, "look_backward": 0})


def test_block_local_bad_options():
    with pytest.raises(ValueError, match="window"):
        attnzoo.get("block_local").options(window=0)
    with pytest.raises(ValueError, match="look_backward"):
        attnzoo.get("block_local").options(look_backward=-1)
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="cannot look forward"):
        attnzoo.attention(q, q, q, mechanism="block_local", causal=True, look_forward=1)
