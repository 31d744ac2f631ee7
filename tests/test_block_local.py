import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo

from mechanism_checks import cases, check_against_reference, check_equals_full, check_gradcheck

block_local_cases = cases(window=st.integers(1, 9), look_backward=st.integers(0, 2),
                          look_forward=st.none() | st.just(0))


@settings(max_examples=60, deadline=None)
@given(block_local_cases)
def test_block_local_matches_reference(case):
    check_against_reference("block_local", **case)


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
