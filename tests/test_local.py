import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.mechanisms import _common

from mechanism_checks import (
    cases,
    check_against_reference,
    check_equals_full,
    check_gradcheck,
    record_band_calls,
)

local_cases = cases(window=st.integers(1, 12), block=st.none() | st.integers(1, 9))


@settings(max_examples=60, deadline=None)
@given(local_cases)
def test_local_matches_reference(case):
    check_against_reference("local", **case)


def test_local_in_groups_of_query_blocks(monkeypatch):
    monkeypatch.setattr(_common, "SCORES_PER_CHUNK", 20)  # one or two query blocks at a time
    for causal in (False, True):
        check_against_reference("local", Lq=19, Lk=23, causal=causal, masked=True,
                                options={"window": 5, "block": 3})


@pytest.mark.parametrize("scores_per_chunk", [2**20, 20])  # backward: all heads at once, one by one
def test_fused_band_equals_the_groups(monkeypatch, scores_per_chunk):
    """window_partial's fused SDPA forward and backward (no padding keys, Dv = D) against the
    reference, in float64: sequence shorter than a window, ragged last block, bands one-sided
    and two; the backward by the fused kernel where lse is unused (local), by the groups where
    it merges (strided, fixed)."""
    monkeypatch.setattr(_common, "SCORES_PER_CHUNK", scores_per_chunk)
    calls = record_band_calls(monkeypatch)
    for Lq, Lk, window, block, causal in [(37, 37, 5, 4, False), (37, 37, 9, 8, True),
                                          (6, 6, 12, 3, False), (19, 29, 7, None, True),
                                          (29, 29, 1, 5, False), (64, 64, 16, 16, True)]:
        calls.clear()
        check_against_reference("local", Lq=Lq, Lk=Lk, causal=causal,
                                options={"window": window, "block": block}, device="cpu")
        assert calls == ["fused_forward", "fused_backward"], calls
    check_gradcheck("local", Lq=6, Lk=6, causal=True, options={"window": 3, "block": 2}, device="cpu")
    for name in ("strided", "fixed"):
        for causal in (False, True):
            calls.clear()
            check_against_reference(name, Lq=33, Lk=33, causal=causal, options={"stride": 4},
                                    device="cpu")
            assert "fused_forward" in calls and "fused_backward" not in calls


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
