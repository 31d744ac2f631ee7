import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.mechanisms.nystrom import iterative_pinv, pinv_times, segment_means

from mechanism_checks import (
    DEVICE,
    cases,
    check_against_reference,
    check_equals_full,
    check_gradcheck,
    random_inputs,
)

nystrom_cases = cases(causal=False, Dv=True, num_landmarks=st.integers(1, 12))


@settings(max_examples=50, deadline=None)
@given(nystrom_cases)
def test_nystrom_matches_reference(case):
    check_against_reference("nystrom", **case, atol=1e-9, rtol=1e-7)


def test_landmarks_equal_to_length_give_full_attention():
    q, k, v, _ = random_inputs(B=2, H=2, Lq=24, Lk=24, D=8)
    out = attnzoo.attention(q, k, v, mechanism="nystrom", num_landmarks=24, pinv_iterations=30)
    torch.testing.assert_close(out, attnzoo.attention(q, k, v), atol=1e-6, rtol=1e-6)


def test_landmarks_at_least_the_keys_are_exact_softmax_attention():
    """m >= Lk is softmax attention itself, at the default six pseudo-inverse steps, as in the
    official code: self- and cross-attention, with and without a key_mask (before: 1-15% off)."""
    check_equals_full("nystrom", L=16, causal=False, options={"num_landmarks": 16}, atol=1e-12, rtol=1e-10)
    for Lq, Lk, m in ((16, 16, 16), (16, 16, 64), (8, 16, 16), (24, 12, 12), (3, 12, 20)):
        q, k, v, mask = random_inputs(B=2, H=2, Lq=Lq, Lk=Lk, D=8, seed=Lq + Lk, masked=True)
        for key_mask in (None, mask):
            out = attnzoo.attention(q, k, v, mechanism="nystrom", num_landmarks=m, key_mask=key_mask)
            full = attnzoo.attention(q, k, v, mechanism="full", key_mask=key_mask)
            torch.testing.assert_close(out, full, atol=1e-12, rtol=1e-10)


def _alone(q, k, v, key_mask, **options):
    """Each batch entry on its real keys alone (an entry with none: zeros)."""
    rows = [attnzoo.attention(q[b:b + 1], k[b:b + 1, :, real], v[b:b + 1, :, real], mechanism="nystrom",
                              **options) if real.any() else q.new_zeros(1, *q.shape[1:3], v.shape[-1])
            for b, real in enumerate(key_mask)]
    return torch.cat(rows)


def test_padded_keys_take_no_part():
    """8 of 16 keys real: the same as the 8 real keys alone (the same queries), at every m: m >= 8
    exact softmax attention over them (the default six steps), m < 8 their Nyström approximation;
    also with the real keys scattered, and batch entries of other counts (none, all) beside.
    (Before: 4.5e-2 relative at m = 16 with 40 steps.)"""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 16, 8, dtype=torch.float64, generator=g).to(DEVICE) for _ in range(3))
    first = torch.zeros(4, 16, dtype=torch.bool)
    first[:, :8] = True
    scattered = torch.rand(4, 16, generator=g) < 0.5
    scattered[1], scattered[2] = True, False  # beside them: all real, none real
    for key_mask in (first.to(DEVICE), scattered.to(DEVICE)):
        for m, iterations in ((16, 40), (16, 6), (12, 6), (8, 6), (5, 6), (3, 2), (1, 6)):
            options = {"num_landmarks": m, "pinv_iterations": iterations}
            out = attnzoo.attention(q, k, v, mechanism="nystrom", key_mask=key_mask, **options)
            torch.testing.assert_close(out, _alone(q, k, v, key_mask, **options), atol=1e-13, rtol=1e-12)
            real = key_mask[0]
            if m >= int(real.sum()):
                full = attnzoo.attention(q[:1, :, :], k[:1, :, real], v[:1, :, real], mechanism="full")
                torch.testing.assert_close(out[:1], full, atol=1e-12, rtol=1e-10)


def test_a_segment_of_padding_makes_no_difference():
    """8 real keys in m = 4 segments of 2; a segment's worth of padding keys appended (and their
    contents large), or put between them: the output is unchanged (before, the padding took
    part in the landmarks)."""
    q, k, v, _ = random_inputs(B=2, H=2, Lq=12, Lk=8, D=4)
    options = {"num_landmarks": 4}
    plain = attnzoo.attention(q, k, v, mechanism="nystrom", **options)
    junk = 100 * torch.ones(2, 2, 2, 4, dtype=q.dtype, device=q.device)
    for at in (8, 4, 0):
        k_p, v_p = (torch.cat([t[:, :, :at], junk, t[:, :, at:]], 2) for t in (k, v))
        key_mask = torch.ones(2, 10, dtype=torch.bool, device=q.device)
        key_mask[:, at:at + 2] = False
        out = attnzoo.attention(q, k_p, v_p, mechanism="nystrom", key_mask=key_mask, **options)
        torch.testing.assert_close(out, plain, atol=1e-13, rtol=1e-12)


def test_nystrom_exact_and_mixed_gradcheck():
    """Gradients where entries mix: one exact (n <= m), one Nyström (n > m), one without keys,
    with Lq below and above m; and the exact path m >= Lk."""
    key_mask = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0, 1], [0] * 7], dtype=torch.bool)
    for Lq, m in ((6, 4), (2, 4), (6, 7)):
        q, k, v, _ = random_inputs(B=3, H=2, Lq=Lq, Lk=7, D=3, seed=Lq + m, requires_grad=True)
        for mask in (None, key_mask.to(q.device)):
            def fn(q, k, v, mask=mask, m=m):
                return attnzoo.attention(q, k, v, mechanism="nystrom", key_mask=mask, num_landmarks=m)
            assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_segment_means_and_pinv():
    x = torch.arange(10, dtype=torch.float64).view(1, 1, 10, 1)
    assert segment_means(x, 5).flatten().tolist() == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert segment_means(x, 3).flatten().tolist() == [1.5, 5.0, 8.0]  # segments 4, 3, 3 long
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1, 1, 1], [1] * 10, [0, 1, 0, 0, 0, 0, 0, 0, 1, 0]],
                        dtype=torch.bool)
    means = segment_means(x.expand(3, 2, 10, 1), 3, mask)  # segments of each entry's real rows alone
    torch.testing.assert_close(means[:, 0, :, 0], torch.tensor([[1.0, 5.0, 8.5], [1.5, 5.0, 8.0],
                                                               [1.0, 8.0, 0.0]], dtype=torch.float64))
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
