import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo

from mechanism_checks import cases, check_against_reference, check_gradcheck, random_inputs

# D >= 2: at D = 1, x/‖x‖ = sign(x), whose zero derivative comes out as rounding noise
# amplified by 1/|x|, so the two grads differ by noise, not by a bug.
taylor_cases = cases(D=(2, 6), Dv=True, chunk=st.integers(1, 9))


@settings(max_examples=60, deadline=None)
@given(taylor_cases)
def test_taylor_matches_reference(case):
    # atol: a weight 1 + q'·k' near 0 (q' ≈ −k') loses digits to cancellation in both paths,
    # each in its own order: ~1e-16 absolute, which the normaliser's eps = 1e-6 amplifies to
    # at most ~1e-16·|v|/(4·eps) ≈ 1e-10·|v| in the output (hypothesis found 2.8e-10 at D = 2)
    check_against_reference("taylor", **case, atol=1e-9)


def test_taylor_is_the_seed_formula():
    q, k, v, _ = random_inputs(B=1, H=1, Lq=30, Lk=30, D=8)
    Q, K, V = q[0, 0], k[0, 0], v[0, 0]
    Qp, Kp = Q / Q.norm(dim=1, keepdim=True), K / K.norm(dim=1, keepdim=True)
    N = Q.shape[0]
    expected = (V.sum(0) + Qp @ (Kp.t() @ V)) / (N + Qp @ Kp.sum(0)).unsqueeze(-1)
    out = attnzoo.attention(q, k, v, mechanism="taylor", eps=0.0)
    torch.testing.assert_close(out[0, 0], expected)


def test_taylor_gradcheck():
    check_gradcheck("taylor", causal=True, masked=True, Lq=7, Lk=7, options={"chunk": 2})
