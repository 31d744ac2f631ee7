import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import ops
from attnzoo.mechanisms import _windows, sparse_transformer

from mechanism_checks import cases, check_against_reference, check_equals_full, check_gradcheck


def factorized_cases(**extra):
    return cases(H=(2, 4), stride=st.none() | st.integers(1, 9),
                 heads=st.sampled_from(["union", "split"]), **extra)


@settings(max_examples=60, deadline=None)
@given(factorized_cases())
def test_strided_matches_reference(case):
    check_against_reference("strided", **case)


@settings(max_examples=60, deadline=None)
@given(factorized_cases(c=st.just(None) | st.integers(1, 1)))
def test_fixed_matches_reference(case):
    check_against_reference("fixed", **case)


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_a2_in_chunks(monkeypatch, name):
    monkeypatch.setattr(sparse_transformer, "A2_SCORES_PER_CHUNK", 16)  # one row / residue at a time
    options = {"stride": 4, "c": 2} if name == "fixed" else {"stride": 4}
    for causal in (False, True):
        check_against_reference(name, Lq=21, Lk=23, causal=causal, masked=True, options=options)


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_without_autograd(monkeypatch, name):
    """Without autograd, every part in several chunks (A2's residue classes and query rows, the
    band's query blocks), joined and merged: the reference's results."""
    monkeypatch.setattr(sparse_transformer, "A2_SCORES_PER_CHUNK", 16)
    monkeypatch.setattr(_windows, "SCORES_PER_CHUNK", 2 * 3 * 4 * 8)
    with torch.no_grad(), ops.portable():
        for causal, masked, heads in itertools.product((False, True), repeat=3):
            options = {"stride": 4, "heads": "union" if heads else "split"}
            options |= {"c": 2} if name == "fixed" else {}
            check_against_reference(name, Lq=21, Lk=23, D=8, causal=causal, masked=masked,
                                    options=options, backward=False)
            check_against_reference(name, Lq=23, Lk=23, D=8, causal=causal, masked=masked,
                                    options=options, backward=False)


def test_fixed_with_larger_c():
    for causal in (False, True):
        check_against_reference("fixed", Lq=23, Lk=23, causal=causal, masked=True,
                                options={"stride": 6, "c": 3})


def test_strided_connectivity_matches_the_paper_by_hand():
    m = attnzoo.connectivity("strided", length=7, causal=True, stride=3).int()
    # row 6: A1 = {4, 5, 6}, A2 = {0, 3, 6}
    assert m[6].tolist() == [1, 0, 0, 1, 1, 1, 1]
    assert m[2].tolist() == [1, 1, 1, 0, 0, 0, 0]
    split = attnzoo.connectivity("strided", length=7, causal=True, stride=3, heads="split").int()
    assert split.shape == (2, 7, 7)
    assert split[1, 6].tolist() == [1, 0, 0, 1, 0, 0, 1]


def test_fixed_connectivity_matches_the_paper_by_hand():
    m = attnzoo.connectivity("fixed", length=8, causal=True, stride=4, c=1).int()
    # row 6 (block 1): own block up to itself {4, 5, 6}, summary cell of block 0 = {3}
    assert m[6].tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    two_sided = attnzoo.connectivity("fixed", length=8, causal=False, stride=4, c=1).int()
    assert two_sided[1].tolist() == [1, 1, 1, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_stride_covering_the_sequence_equals_full(name):
    for causal in (False, True):
        check_equals_full(name, L=9, causal=causal, options={"stride": 9})


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_gradcheck(name):
    check_gradcheck(name, causal=True, masked=True, Lq=7, Lk=7, options={"stride": 3})
    check_gradcheck(name, Lq=5, Lk=7, options={"stride": 2, "heads": "split"})


def test_bad_options():
    with pytest.raises(ValueError, match="heads"):
        attnzoo.get("strided").options(heads="both")
    with pytest.raises(ValueError, match="exceed"):
        attnzoo.get("fixed").options(stride=4, c=5)
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="at least 2 heads"):
        attnzoo.attention(q, q, q, mechanism="strided", heads="split")
