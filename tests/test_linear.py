import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.mechanisms.linear import LinearOptions, PointwiseMap, elu_feature_map, linear_step

from mechanism_checks import cases, check_against_reference, check_gradcheck, random_inputs

linear_cases = cases(Dv=True, chunk=st.integers(1, 9))


@settings(max_examples=60, deadline=None)
@given(linear_cases)
def test_linear_matches_reference(case):
    check_against_reference("linear", **case)


def test_normaliser_is_there_unlike_the_seed_notebook():
    q, k, v, _ = random_inputs(B=1, H=1, Lq=9, Lk=9, D=4)
    out = attnzoo.attention(q, k, v, mechanism="linear")
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    seed_cell = phi(q) @ (phi(k).transpose(-1, -2) @ v)  # the notebook's un-normalised form
    normaliser = phi(q) @ phi(k).sum(2, keepdim=True).transpose(-1, -2)
    torch.testing.assert_close(out, seed_cell / (normaliser + 1e-6))
    # Each output is a convex combination of the values: inside their range.
    assert (out <= v.amax(2, keepdim=True) + 1e-12).all() and (out >= v.amin(2, keepdim=True) - 1e-12).all()


def test_elu_feature_map_is_elu_plus_one_and_more_exact_below_zero():
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64, requires_grad=True)
    elu1 = torch.nn.functional.elu(x) + 1
    phi = elu_feature_map(x)
    torch.testing.assert_close(phi, elu1, atol=1e-15, rtol=1e-14)  # (elu1 rounds e^x to ~1e-16)
    g = torch.randn_like(phi)
    torch.testing.assert_close(torch.autograd.grad(phi, x, g)[0], torch.autograd.grad(elu1, x, g)[0],
                               atol=1e-15, rtol=1e-14)
    x32 = x.detach().float()  # float32: within a few roundings of e^x, where expm1(x) + 1 is not
    exact = torch.nn.functional.elu(x32.double()) + 1
    assert ((elu_feature_map(x32).double() - exact).abs() / exact).max() < 1e-6
    assert ((torch.nn.functional.elu(x32).double() + 1 - exact).abs() / exact).max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_elu_feature_map_far_below_zero(dtype):
    """Far below zero φ = e^x underflows towards 0 as exp does: never NaN or negative, within about
    the smallest normal number of e^x, and so is its gradient."""
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([-1e30, -2000.0, -750.0, -100.0, -87.0, -50.0, 0.0, 3.0], dtype=dtype)
    phi = elu_feature_map(x)
    exact = torch.where(x > 0, x + 1, x.clamp(max=0).exp()).double()  # (elu(x) + 1 rounds to 0 here)
    assert ((phi.double() - exact).abs() <= 2 * tiny + 1e-6 * exact).all()
    assert (phi >= 0).all()
    grad = torch.autograd.grad(elu_feature_map(x.requires_grad_()).sum(), x)[0]
    assert ((grad.double() - exact.clamp(max=1)).abs() <= 2 * tiny + 1e-6 * exact).all()


def test_custom_feature_map():
    check_against_reference("linear", causal=True, masked=True,
                            options={"feature_map": lambda x: torch.relu(x) + 0.1})
    with pytest.raises(ValueError, match="feature_map"):
        LinearOptions(feature_map="relu")


def test_pointwise_feature_map_goes_back_by_its_derivative():
    """A PointwiseMap as the feature map, against gradcheck and the reference, with padded keys.
    A backend may go back by its derivative, dx = dφ ⊙ derivative(φ): padded keys' features
    are filled with 0, where this map's derivative is not 0 (elu + 1's is), so their gradient
    must be masked too."""
    tanh2 = PointwiseMap(lambda x: torch.tanh(x) + 2, lambda phi: 1 - (phi - 2) ** 2)
    assert tanh2.derivative(torch.zeros(1)).item() == -3
    for causal in (False, True):
        options = {"feature_map": tanh2, "chunk": 3}
        check_against_reference("linear", causal=causal, masked=True, options=options)
        check_gradcheck("linear", causal=causal, masked=True, Lq=6, Lk=7, options=options)


def test_step_by_step_equals_the_causal_call():
    q, k, v, _ = random_inputs(B=2, H=3, Lq=17, Lk=17, D=5, Dv=4)
    full = attnzoo.attention(q, k, v, mechanism="linear", causal=True)
    state, outs = None, []
    for t in range(17):
        out, state = linear_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-12, rtol=1e-10)
    # and in blocks of several tokens
    out_a, state = linear_step(q[:, :, :6], k[:, :, :6], v[:, :, :6])
    out_b, _ = linear_step(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], state)
    torch.testing.assert_close(torch.cat([out_a, out_b], 2), full, atol=1e-12, rtol=1e-10)


def test_linear_gradcheck():
    check_gradcheck("linear", causal=True, masked=True, Lq=7, Lk=9, options={"chunk": 3})
    check_gradcheck("linear", Lq=6, Lk=4)


def test_no_scale():
    q, k, v, _ = random_inputs()
    with pytest.raises(ValueError, match="no score scale"):
        attnzoo.attention(q, k, v, mechanism="linear", scale=0.5)
