import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo

from mechanism_checks import (
    DEVICE,
    cases,
    check_against_reference,
    check_equals_full,
    check_gradcheck,
    random_inputs,
    seeded,
    tied_hash_inputs,
)

lsh_cases = cases(cross=False, D=(2, 6), bucket_size=st.integers(1, 9), n_hashes=st.integers(1, 4),
                  n_buckets=st.none() | st.sampled_from([1, 2, 4, 6, (2, 4), (4, 1, 2)]),
                  attend_across_buckets=st.booleans(), count_duplicates=st.booleans())


@settings(max_examples=60, deadline=None)
@given(lsh_cases)
def test_lsh_matches_reference(case):
    check_against_reference("lsh", **case)


@settings(max_examples=30, deadline=None)
@given(lsh_cases)
def test_lsh_inference_matches_reference(case):
    """Inputs that take no gradient: the forward alone, nothing saved for a backward."""
    check_against_reference("lsh", **case, backward=False)


def _shared(case_seed, causal, masked, **options):
    q, _, v, km = random_inputs(B=2, H=2, Lq=23, Lk=23, D=5, seed=case_seed, masked=masked)
    run = lambda ref: attnzoo.attention(q, q, v, mechanism="lsh", causal=causal, key_mask=km,  # noqa: E731
                                        shared_qk=True, reference=ref,
                                        generator=seeded(case_seed), **options)
    return run(False), run(True), q, v, km


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_shared_qk_matches_reference(causal, masked):
    fast, ref, *_ = _shared(3, causal, masked, bucket_size=4, n_hashes=3)
    torch.testing.assert_close(fast, ref, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_one_chunk_equals_full(causal):
    check_equals_full("lsh", L=13, causal=causal, options={"n_buckets": 1, "bucket_size": 13, "n_hashes": 2})


def test_shared_qk_one_chunk_is_full_attention_without_self():
    fast, _, q, v, _ = _shared(0, True, False, n_buckets=1, bucket_size=23, n_hashes=1)
    k = torch.nn.functional.normalize(q, dim=-1)
    L = q.shape[2]
    mask = torch.ones(L, L, dtype=torch.bool, device=DEVICE).tril(-1)
    mask[0, 0] = True  # position 0 has no other key, so it attends to itself
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(fast, expected, atol=1e-10, rtol=1e-8)


def test_more_rounds_meet_more_keys():
    q, k, _, _ = random_inputs(B=1, H=1, Lq=256, Lk=256, D=16)
    seen = [attnzoo.connectivity("lsh", q=q, k=k, causal=False, n_hashes=n, bucket_size=16,
                                 generator=seeded(0)).sum().item()
            for n in (1, 2, 4)]
    assert seen[0] < seen[1] < seen[2] < 256 * 256 / 2


def test_lsh_gradcheck():
    check_gradcheck("lsh", Lq=9, Lk=9, causal=True, masked=True,
                    options={"bucket_size": 3, "n_hashes": 2, "n_buckets": 2})


def test_lsh_refuses_what_it_cannot_do():
    q, k, v, _ = random_inputs(Lq=8, Lk=8)
    with pytest.raises(ValueError, match="pass k=q"):
        attnzoo.attention(q, k, v, mechanism="lsh", shared_qk=True)
    for bad in (3, (4, 3), (), [4, 4]):
        with pytest.raises(ValueError, match="even"):
            attnzoo.attention(q, k, v, mechanism="lsh", n_buckets=bad)
    with pytest.raises(ValueError, match="self-attention only"):
        attnzoo.attention(q, k[:, :, :5], v[:, :, :5], mechanism="lsh")


def test_module_shares_qk_by_default_and_is_reproducible():
    layer = attnzoo.MultiheadAttention(16, 2, mechanism="lsh", bucket_size=4, seed=1).to(DEVICE)
    assert layer.k_proj is None
    x = torch.randn(2, 20, 16).to(DEVICE)
    y1 = layer(x)
    saved = io.BytesIO()
    torch.save(layer.state_dict(), saved)  # as a checkpoint: map_location moves the generator's
    saved.seek(0)                          # state to the device too
    state = torch.load(saved, map_location=DEVICE, weights_only=True)
    y2 = layer(x)  # the generator moved on: new rotations
    assert not torch.allclose(y1, y2)
    other = attnzoo.MultiheadAttention(16, 2, mechanism="lsh", bucket_size=4, seed=1).to(DEVICE)
    other.load_state_dict(state)
    torch.testing.assert_close(other(x), y2)
    separate = attnzoo.MultiheadAttention(16, 2, mechanism="lsh", shared_qk=False).to(DEVICE)
    assert separate.k_proj is not None and separate(x).shape == x.shape


def test_lsh_duplicate_counting_changes_the_weights():
    """count_duplicates=False (reformer-pytorch's default) weights a key by the rounds it was met in."""
    q, _, v = random_inputs(1, 2, 32, 32, 8, 8, seed=3)[:3]
    run = lambda dup: attnzoo.attention(q, q, v, mechanism="lsh", shared_qk=True, bucket_size=4,  # noqa: E731
                                        n_hashes=4, count_duplicates=dup,
                                        generator=seeded(0))
    assert not torch.allclose(run(True), run(False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hash_buckets_is_the_argmax_of_the_concatenation(monkeypatch, dtype):
    """h(x) = argmax([xR; -xR]) with argmax's first-maximum rule, ties included, over several
    blocks of positions (the portable body; the CPU's is checked in tests/backends/cpu)."""
    from attnzoo.mechanisms import lsh

    monkeypatch.setattr(lsh, "HASH_BLOCK", 2 * 3 * 3 * 8 * 5)  # 5 positions a block: several blocks
    x, rotations, expected = tied_hash_inputs(dtype)
    with attnzoo.ops.portable():
        assert torch.equal(lsh.hash_buckets(x.to(DEVICE), rotations.to(DEVICE)).cpu(), expected)


def test_one_bucket_hashes_to_zero():
    from attnzoo.mechanisms import lsh

    with attnzoo.ops.portable():
        buckets = lsh.hash_buckets(torch.randn(2, 3, 5, 4, device=DEVICE),
                                   torch.zeros(2, 4, 0, device=DEVICE))
    assert buckets.shape == (2, 3, 2, 5) and not buckets.any()


def test_float32_keeps_a_query_that_sees_only_itself_exact():
    """Causal shared QK: position 0 sees only its own key (score − 1e5), met in every round.
    Counted once, it is v_0 in float32 too (weights near 1e5 would lose ~1 % to rounding)."""
    q, _, v = random_inputs(1, 2, 40, 40, 8, 8, seed=5, dtype=torch.float64)[:3]
    run = lambda dt: attnzoo.attention(q.to(dt), q.to(dt), v.to(dt), mechanism="lsh",  # noqa: E731
                                       causal=True, shared_qk=True, bucket_size=4, n_hashes=4,
                                       generator=seeded(0))
    torch.testing.assert_close(run(torch.float32).double(), run(torch.float64), atol=1e-5, rtol=1e-5)


def test_factorized_hash_is_its_definition():
    """n_buckets (b1, b2): bucket h1 + b1·h2, each the argmax of [xR; -xR] over its own columns of
    the round's rotation, as trax's factorized hashing; (b, 1) is the plain hash of b buckets."""
    from attnzoo.mechanisms.lsh import LSHOptions, _buckets_and_order

    q, k, _, _ = random_inputs(B=2, H=3, Lq=50, Lk=50, D=8)
    opts = LSHOptions(n_buckets=(6, 4), n_hashes=2)
    q_buckets, k_buckets, q_order, _ = _buckets_and_order(q, k, opts, seeded(5))
    R = torch.randn(2, 8, 5, generator=seeded(5), device=DEVICE).double()  # the same draw: 3 + 2 columns
    h = [torch.cat([x := torch.einsum("bhld,rdc->bhrlc", q, part), -x], -1).argmax(-1)
         for part in (R[..., :3], R[..., 3:])]
    torch.testing.assert_close(q_buckets, h[0] + 6 * h[1], rtol=0, atol=0)
    assert q_buckets.max() < 24 and (q_buckets // 6).max() > 0
    assert torch.equal(q_order, q_buckets.sort(dim=-1, stable=True)[1])

    plain = _buckets_and_order(q, k, LSHOptions(n_buckets=8), seeded(1))
    factor_one = _buckets_and_order(q, k, LSHOptions(n_buckets=(8, 1)), seeded(1))
    assert all(torch.equal(a, b) for a, b in zip(plain, factor_one, strict=True))


def test_default_buckets_factorize_past_the_threshold():
    from attnzoo.mechanisms.lsh import FACTORIZE_ABOVE, LSHOptions, bucket_factors, n_buckets_for

    opts = LSHOptions()
    small = FACTORIZE_ABOVE * opts.bucket_size
    assert bucket_factors(small, opts) == (FACTORIZE_ABOVE,)
    for L in (2 * small, 2**20):
        b1, b2 = bucket_factors(L, opts)
        assert b1 % 2 == 0 and b2 % 2 == 0 and abs(b1 - b2) <= 2
        assert abs(n_buckets_for(L, opts) - L / opts.bucket_size) <= 0.1 * L / opts.bucket_size
