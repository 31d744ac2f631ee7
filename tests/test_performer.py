import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.mechanisms.performer import draw_features

from mechanism_checks import DEVICE, cases, check_against_reference, check_gradcheck, random_inputs, seeded

performer_cases = cases(Dv=True, nb_features=st.integers(1, 20), orthogonal=st.booleans(),
                        chunk=st.integers(1, 9))


@settings(max_examples=50, deadline=None)
@given(performer_cases)
def test_performer_matches_reference(case):
    check_against_reference("performer", **case)


def test_orthogonal_features_are_orthogonal_within_blocks():
    W = draw_features(10, 4, orthogonal=True, generator=torch.Generator().manual_seed(0))
    block = W[:4] / W[:4].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(4), atol=1e-5, rtol=0)


def test_orthogonal_features_are_standard_normal_at_every_place_in_a_block():
    """Each row ~ N(0, I) marginally, which the estimate's unbiasedness rests on: over 4000
    blocks, the mean of every entry (place in the block, coordinate) is 0 within 5 standard
    errors (1/√4000 each) and the mean square 1. Q of a QR taken as it comes fails: its i-th
    row's i-th entry was always negative (mean -0.8)."""
    W = draw_features(16 * 4000, 16, orthogonal=True, generator=seeded(0), device=DEVICE).view(4000, 16, 16)
    assert W.mean(0).abs().max() < 5 / 4000**0.5
    torch.testing.assert_close(W.square().mean(0), torch.ones(16, 16, device=W.device), atol=0.15, rtol=0)


def _error(m, causal, seeds=range(6)):
    errs = []
    for seed in seeds:
        q, k, v, _ = random_inputs(B=1, H=2, Lq=64, Lk=64, D=16, seed=seed)
        q, k = q * 0.6, k * 0.6  # moderately peaked attention
        full = attnzoo.attention(q, k, v, causal=causal)
        approx = attnzoo.attention(q, k, v, mechanism="performer", causal=causal, nb_features=m,
                                   generator=seeded(100 + seed))
        errs.append(((approx - full).norm() / full.norm()).item())
    return sum(errs) / len(errs)


def test_error_against_full_attention_falls_as_features_grow():
    # Unbiased features: the error keeps falling as m grows, towards 1/√m (√8 ≈ 2.8 an 8× step);
    # a bias stalls it (biased orthogonal blocks: 0.066 -> 0.052 from m = 4096 to 32768, causal).
    for causal in (False, True):
        errors = [_error(m, causal) for m in (8, 64, 512, 4096, 32768)]
        assert all(a > 1.5 * b for a, b in itertools.pairwise(errors)), errors
        assert errors[-1] < 0.045, errors


def test_module_redraws_on_request():
    layer = attnzoo.MultiheadAttention(16, 2, mechanism="performer", nb_features=8)
    before = layer.features.clone()
    x = torch.randn(1, 5, 16)
    torch.testing.assert_close(layer(x), layer(x))  # fixed features between redraws
    layer.redraw()
    assert not torch.equal(before, layer.features)
    assert "features" in layer.state_dict()


def test_given_features_must_be_on_the_inputs_device():
    q = torch.randn(1, 2, 5, 4, device="meta")  # stands in for a GPU: the features are not moved
    with pytest.raises(ValueError, match="features is on cpu but the inputs are on meta"):
        attnzoo.attention(q, q, q, mechanism="performer", features=torch.randn(8, 4))


def test_performer_gradcheck():
    check_gradcheck("performer", causal=True, masked=True, Lq=6, Lk=6, options={"nb_features": 5})


@pytest.mark.parametrize("causal", [False, True])
def test_features_that_require_grad_get_it(causal):
    """Random features passed as a trainable tensor get their gradient, the reference's (causal:
    over several chunks)."""
    q, k, v, km = random_inputs(B=2, H=2, Lq=5, Lk=6, D=4, masked=True, requires_grad=True)
    W = torch.randn(8, 4, dtype=torch.float64, device=q.device, requires_grad=True)
    grads = [torch.autograd.grad(attnzoo.attention(q, k, v, mechanism="performer", features=W, chunk=2,
                                                   causal=causal, key_mask=km, reference=ref).sum(), W)[0]
             for ref in (False, True)]
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-8)
