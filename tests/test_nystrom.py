import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.mechanisms.nystrom import iterative_pinv, pinv_times, segment_means

from mechanism_checks import cases, check_against_reference, check_gradcheck, random_inputs

nystrom_cases = cases(causal=False, Dv=True, num_landmarks=st.integers(1, 12))


@settings(max_examples=50, deadline=None)
@given(nystrom_cases)
def test_nystrom_matches_reference(case):
    check_against_reference("nystrom", **case, atol=1e-9, rtol=1e-7)


def test_landmarks_equal_to_length_give_full_attention():
    q, k, v, _ = random_inputs(B=2, H=2, Lq=24, Lk=24, D=8)
    out = attnzoo.attention(q, k, v, mechanism="nystrom", num_landmarks=24, pinv_iterations=30)
    torch.testing.assert_close(out, attnzoo.attention(q, k, v), atol=1e-6, rtol=1e-6)


def test_segment_means_and_pinv():
    x = torch.arange(10, dtype=torch.float64).view(1, 1, 10, 1)
    assert segment_means(x, 5).flatten().tolist() == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert segment_means(x, 3).flatten().tolist() == [1.5, 5.0, 8.0]  # segments 4, 3, 3 long
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1, 1, 1], [1] * 10], dtype=torch.bool)
    means = segment_means(x.expand(2, 2, 10, 1), 3, mask)  # per batch entry, real rows only
    torch.testing.assert_close(means[:, 0, :, 0], torch.tensor([[5 / 3, 0.0, 8.0], [1.5, 5.0, 8.0]],
                                                              dtype=torch.float64))
    a = torch.softmax(torch.randn(3, 6, 6, dtype=torch.float64), -1)
    torch.testing.assert_close(iterative_pinv(a, 40), torch.linalg.pinv(a), atol=1e-8, rtol=1e-6)


def test_pinv_steps_are_the_papers():
    """Before convergence too: each step is Z ← ¼Z(13I − AZ(15I − AZ(7I − AZ))), written out."""
    a = torch.softmax(3 * torch.randn(2, 3, 7, 7, dtype=torch.float64), -1)
    eye = torch.eye(7, dtype=torch.float64)
    z = a.transpose(-1, -2) / (a.abs().sum(-1).amax(-1) * a.abs().sum(-2).amax(-1))[..., None, None]
    for steps in range(1, 4):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
        torch.testing.assert_close(iterative_pinv(a, steps), z, atol=1e-13, rtol=1e-12)


def test_pinv_times_is_the_pinv_applied():
    """The fast path applies the last two steps' brackets to b (one step: its one): the same numbers,
    grouped differently."""
    a = torch.softmax(3 * torch.randn(2, 3, 7, 7, dtype=torch.float64), -1)
    b = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    for steps in (1, 2, 6):
        torch.testing.assert_close(pinv_times(a, b, steps), iterative_pinv(a, steps) @ b,
                                   atol=1e-12, rtol=1e-10)


def test_pinv_times_keeps_the_iterations_float32_accuracy():
    """Grouped differently, the same rounding in float32: within 2x the error of the iteration
    with Z formed (a product of all six steps' brackets, not corrected by A afresh, is 30-80x)."""
    torch.manual_seed(0)
    worst = {"formed": 0.0, "applied": 0.0}
    for scale in (0.125, 0.5, 2.0, 8.0):
        q_l, k_l = torch.randn(2, 2, 8, 64, 64, dtype=torch.float64)
        a = torch.softmax(q_l @ k_l.transpose(-1, -2) * scale, -1)  # (8, 64, 64)
        b = torch.randn(8, 64, 16, dtype=torch.float64)
        exact = iterative_pinv(a, 6) @ b
        for name, got in (("formed", iterative_pinv(a.float(), 6) @ b.float()),
                          ("applied", pinv_times(a.float(), b.float(), 6))):
            worst[name] = max(worst[name], ((got.double() - exact).abs().max() / exact.abs().max()).item())
    assert 0 < worst["applied"] <= 2 * worst["formed"]


def test_equal_segments_match_the_general_path():
    x = torch.randn(2, 3, 12, 5, dtype=torch.float64)
    everyone = torch.ones(2, 12, dtype=torch.bool)  # a mask takes the index_add_ path
    for m in (1, 3, 4, 12):
        torch.testing.assert_close(segment_means(x, m), segment_means(x, m, everyone))


def test_nystrom_gradcheck():
    check_gradcheck("nystrom", masked=True, Lq=6, Lk=7, options={"num_landmarks": 3})


def test_nystrom_unmasked_gradcheck():
    check_gradcheck("nystrom", Lq=6, Lk=7, options={"num_landmarks": 3})


def test_segment_means_gradient():
    """Equal segments' gradient against autograd's mean written out, on x laid out contiguous,
    as a layer's q (a transposed view) and expanded; gradcheck."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 12, 3, 4, dtype=torch.float64, generator=g)
    for x in (base.transpose(1, 2).contiguous(), base.transpose(1, 2), base[:1, :1].expand(2, 12, 3, 4)
              .transpose(1, 2)):
        x = x.detach().requires_grad_()
        y = segment_means(x, 4)
        grad = torch.randn(y.shape, dtype=y.dtype, generator=g)
        (dx,) = torch.autograd.grad(y, x, grad)
        plain = x.detach().requires_grad_()
        (expected,) = torch.autograd.grad(plain.reshape(2, 3, 4, 3, 4).mean(3), plain, grad)
        torch.testing.assert_close(dx, expected, atol=1e-15, rtol=1e-14)
    x = base.transpose(1, 2).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: segment_means(t, 6), (x,))
