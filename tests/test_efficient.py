import pytest
import torch
from hypothesis import given, settings

import attnzoo

from mechanism_checks import cases, check_against_reference, check_gradcheck, random_inputs

efficient_cases = cases(causal=False, Dv=True)


@settings(max_examples=50, deadline=None)
@given(efficient_cases)
def test_efficient_matches_reference(case):
    check_against_reference("efficient", **case)


def test_efficient_is_the_seed_formula():
    q, k, v, _ = random_inputs(B=1, H=1, Lq=20, Lk=20, D=8)
    Q, K, V = q[0, 0], k[0, 0], v[0, 0]
    expected = torch.softmax(Q, dim=1) @ (torch.softmax(K, dim=0).t() @ V)
    torch.testing.assert_close(attnzoo.attention(q, k, v, mechanism="efficient")[0, 0], expected)


def test_padding_takes_no_part():
    q, k, v, _ = random_inputs(B=1, H=2, Lq=6, Lk=6)
    km = torch.tensor([[True] * 6 + [False] * 3], device=k.device)
    k_pad = torch.cat([k, 50 * torch.randn(1, 2, 3, k.shape[-1], dtype=k.dtype, device=k.device)], 2)
    v_pad = torch.cat([v, 50 * torch.randn(1, 2, 3, v.shape[-1], dtype=v.dtype, device=v.device)], 2)
    torch.testing.assert_close(attnzoo.attention(q, k_pad, v_pad, mechanism="efficient", key_mask=km),
                               attnzoo.attention(q, k, v, mechanism="efficient"))


def test_causal_is_refused_with_the_reason():
    q, k, v, _ = random_inputs()
    with pytest.raises(ValueError, match="efficient does not support causal=True: its column softmax"):
        attnzoo.attention(q, k, v, mechanism="efficient", causal=True)


def test_efficient_gradcheck():
    check_gradcheck("efficient", masked=True, Lq=5, Lk=7)


@pytest.mark.parametrize("masked", [False, True])
def test_saturated_softmaxes_stay_exact(masked):
    """Scores far beyond exp's range (|q|, |k| ~ 1e3): the row shift the forward saves for the
    backward's softmax and the keys' column max keep every exponential finite; outputs and
    gradients equal the dense reference's."""
    q, k, v, km = random_inputs(B=2, H=3, Lq=9, Lk=11, D=8, masked=masked)
    q, k = (1000 * t.detach() for t in (q, k))
    for t in (q, k, v):
        t.requires_grad_(True)
    km = km if masked else None
    fast = attnzoo.attention(q, k, v, mechanism="efficient", key_mask=km)
    ref = attnzoo.attention(q, k, v, mechanism="efficient", key_mask=km, reference=True)
    torch.testing.assert_close(fast, ref, atol=1e-10, rtol=1e-8)
    g = torch.randn_like(fast)
    for got, want in zip(torch.autograd.grad(fast, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g),
                         strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)
