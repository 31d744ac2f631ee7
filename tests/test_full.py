import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo

from mechanism_checks import (
    check_against_reference,
    check_gradcheck,
    check_input_errors,
    random_inputs,
)

shapes = st.fixed_dictionaries({
    "B": st.integers(1, 3), "H": st.integers(1, 3), "Lq": st.integers(1, 17),
    "Lk": st.integers(1, 17), "D": st.integers(1, 9), "Dv": st.integers(1, 9),
    "causal": st.booleans(), "masked": st.booleans(), "seed": st.integers(0, 10_000),
})


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_full_matches_reference_on_random_shapes(case):
    check_against_reference("full", **case)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_full_matches_sdpa_with_explicit_lower_right_mask(case):
    q, k, v, km = random_inputs(case["B"], case["H"], case["Lq"], case["Lk"], case["D"],
                                case["Dv"], seed=case["seed"], masked=case["masked"])
    out = attnzoo.attention(q, k, v, causal=case["causal"], key_mask=km)
    Lq, Lk = q.shape[2], k.shape[2]
    mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
    if case["causal"]:
        mask = mask.tril(Lk - Lq)
    mask = mask[None, None] if km is None else mask & km[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    visible = mask.any(-1, keepdim=True)
    expected = torch.where(visible, expected, torch.zeros((), dtype=q.dtype))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)


def test_causal_lower_right_alignment_by_hand():
    # Lq=2 queries are positions 2, 3 of Lk=4 keys: query 0 sees keys 0..2, query 1 sees all.
    q = torch.zeros(1, 1, 2, 1, dtype=torch.float64)  # equal scores: output = mean of visible v
    k = torch.zeros(1, 1, 4, 1, dtype=torch.float64)
    v = torch.arange(4, dtype=torch.float64).view(1, 1, 4, 1)
    out = attnzoo.attention(q, k, v, causal=True)
    torch.testing.assert_close(out.flatten(), torch.tensor([1.0, 1.5], dtype=torch.float64))


def test_rows_that_see_no_key_are_zero_not_nan():
    q, k, v, _ = random_inputs(B=2, Lq=6, Lk=3, requires_grad=True)
    km = torch.tensor([[False, False, False], [True, True, True]], device=q.device)
    out = attnzoo.attention(q, k, v, causal=True, key_mask=km)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()  # batch 0 has no real key
    assert (out[1, :, :3] == 0).all()  # Lq > Lk: the first Lq - Lk queries precede every key
    assert (out[1, :, 3:] != 0).any()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_scale_is_used():
    q, k, v, _ = random_inputs()
    a = attnzoo.attention(q, k, v, scale=0.1)
    b = attnzoo.attention(q * 0.1 * q.shape[-1] ** 0.5, k, v)
    torch.testing.assert_close(a, b)


def test_float32_close_to_float64():
    q, k, v, km = random_inputs(masked=True)
    out32 = attnzoo.attention(q.float(), k.float(), v.float(), causal=True, key_mask=km)
    out64 = attnzoo.attention(q, k, v, causal=True, key_mask=km)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, atol=1e-5, rtol=1e-5)


def test_full_gradcheck():
    check_gradcheck("full")
    check_gradcheck("full", causal=True, masked=True, Lq=4, Lk=6)


def test_full_input_errors():
    check_input_errors("full")
