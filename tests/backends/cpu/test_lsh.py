"""The CPU backend's LSH attention (attnzoo.backends.cpu.lsh): its overrides of lsh_buckets
(the hash in C or by reductions), lsh_order (a counting sort in C) and lsh_attend (the rounds
in C without gradients, by groups of sorted chunks with a recomputing backward otherwise):
that each is taken where it should be, and gives what the portable body gives."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.backends.cpu import lsh as cpu_lsh
from attnzoo.backends.cpu import native as _native
from attnzoo.mechanisms import lsh
from attnzoo.mechanisms.lsh import LSHOptions, _buckets_and_order, _meets
from backends.cpu.spies import kernel_spy

from mechanism_checks import NATIVE_WIDTHS, check_against_reference, random_inputs, tied_hash_inputs


def _lsh(q, k, v, km, generator_seed, reference=False, **options):
    with torch.no_grad():
        return attnzoo.attention(q, k, v, mechanism="lsh", key_mask=km, reference=reference,
                                 generator=torch.Generator().manual_seed(generator_seed), **options)




# The rounds in C (from tests/backends/cpu/test_native.py)

@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 120), widths=NATIVE_WIDTHS,
       bucket_size=st.sampled_from([1, 2, 5, 8, 37]),
       n_hashes=st.integers(1, 4),
       across=st.booleans(), count_duplicates=st.booleans(), shared=st.booleans(), causal=st.booleans(),
       masked=st.booleans(), seed=st.integers(0, 99))
def test_native_lsh_matches_eager_and_reference_float64(B, H, L, widths, bucket_size, n_hashes, across,
                                                        count_duplicates, shared, causal, masked, seed):
    """LSH's forward without gradients in C: every round's chunks and windows (the last chunk
    short, chunk 0 without one before), buckets, causality, keys met in earlier rounds (counted
    once or not), the self penalty, padded keys and queries with no key at all, widths off the
    vector lanes, chunks of more than one tile of queries (37), against the eager rounds and
    the dense reference, in float64."""
    D, Dv = widths
    q, k, v, km = random_inputs(B, H, L, L, D, Dv, seed=seed, masked=masked)
    k = q if shared else k
    options = dict(causal=causal, bucket_size=bucket_size, n_hashes=n_hashes, attend_across_buckets=across,
                   count_duplicates=count_duplicates, shared_qk=shared)
    native = _lsh(q, k, v, km, seed, **options)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNZOO_NATIVE", "0")
        eager = _lsh(q, k, v, km, seed, **options)
    ref = _lsh(q, k, v, km, seed, reference=True, **options)
    torch.testing.assert_close(native, eager, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(native, ref, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("n_buckets", [None, 64])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_native_lsh_at_the_default_bucket_size(causal, across, n_buckets):
    """Chunks of 64 (two tiles of queries) over 301 positions, with a few buckets a window or
    many (runs starting anywhere in a tile), in float64."""
    q, _, v, km = random_inputs(B=2, H=2, Lq=301, Lk=301, D=16, Dv=8, masked=True, seed=11)
    options = dict(causal=causal, n_hashes=3, attend_across_buckets=across, shared_qk=True,
                   n_buckets=n_buckets)
    native = _lsh(q, q, v, km, 3, **options)
    torch.testing.assert_close(native, _lsh(q, q, v, km, 3, reference=True, **options), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("causal", [True, False])
def test_native_lsh_float32_runs_only_without_gradients(monkeypatch, causal):
    """float32 (the polynomial exp) at the benchmark's widths within float32 rounding of the
    float64 reference; under autograd the eager rounds run (their backward needs them)."""
    calls = []
    monkeypatch.setattr(_native, "lsh", kernel_spy(_native.lsh, "lsh", calls))
    q, _, v, km = random_inputs(B=2, H=4, Lq=301, Lk=301, D=64, Dv=64, masked=True, seed=3)
    options = dict(causal=causal, bucket_size=16, n_hashes=3, shared_qk=True)
    native = _lsh(q.float(), q.float(), v.float(), km, 7, **options)
    ref = _lsh(q, q, v, km, 7, reference=True, **options)
    torch.testing.assert_close(native.double(), ref, atol=2e-5, rtol=2e-4)
    assert calls == [("lsh", True)]
    q.requires_grad_(True)
    attnzoo.attention(q, q, v, mechanism="lsh", generator=torch.Generator().manual_seed(7), **options)
    assert calls[1:] == [("lsh", False)]


def test_lsh_order_is_torchs_stable_sort():
    """The counting sort of LSH's buckets: torch's stable sort, for one bucket, many, rows of
    one position; a bucket out of range (a NaN's hash) leaves it to torch (None)."""
    g = torch.Generator().manual_seed(0)
    for shape, n_buckets in (((2, 3, 4, 37), 6), ((1, 1, 1, 1), 1), ((3, 2, 500), 1), ((5, 64), 200)):
        buckets = torch.randint(0, n_buckets, shape, generator=g)
        order = _native.lsh_order(buckets, n_buckets)
        assert torch.equal(order, torch.sort(buckets, dim=-1, stable=True)[1])
    buckets[2, 7] = 200
    assert _native.lsh_order(buckets, 200) is None


# The rounds by groups of sorted chunks (from tests/test_lsh.py)

@pytest.mark.parametrize("causal, masked", [(False, False), (True, True)])
@pytest.mark.parametrize("across, dup", [(False, True), (True, False), (True, True)])
def test_groups_of_chunks_match_reference(monkeypatch, causal, masked, across, dup):
    """Groups of 3 chunks (2m·m scores each): groups that start and end inside a head and span
    two (a head's first chunk sees the last chunk of the head before, none of whose keys it may
    attend), windows across group edges and gradients added there."""
    monkeypatch.setattr(cpu_lsh, "GROUP_SCORES", 3 * 2 * 4 * 4)
    check_against_reference("lsh", B=2, H=2, Lq=37, Lk=37, D=5, causal=causal, masked=masked,
                            options={"bucket_size": 4, "n_hashes": 3, "attend_across_buckets": across,
                                     "count_duplicates": dup}, device="cpu")


@pytest.mark.parametrize("causal", [False, True])
def test_shared_qk_groups_and_gradients_match_reference(monkeypatch, causal):
    """Shared QK (one sort order, keys q/‖q‖, the self penalty) over groups of 3 chunks: the
    outputs and the gradients of q (through the keys too) and v."""
    monkeypatch.setattr(cpu_lsh, "GROUP_SCORES", 3 * 2 * 4 * 4)
    q, _, v, km = random_inputs(B=2, H=2, Lq=37, Lk=37, D=5, seed=4, masked=True, requires_grad=True,
                                device="cpu")
    g = torch.randn(2, 2, 37, 5, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    results = []
    for reference in (False, True):
        out = attnzoo.attention(q, q, v, mechanism="lsh", causal=causal, key_mask=km, shared_qk=True,
                                bucket_size=4, n_hashes=3, reference=reference,
                                generator=torch.Generator().manual_seed(6))
        results.append((out, *torch.autograd.grad(out, (q, v), g)))
    for fast, ref in zip(*results, strict=True):
        torch.testing.assert_close(fast, ref, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("shared_qk, across", [(True, False), (False, False), (True, True), (False, True)])
def test_meeting_codes_say_who_meets(shared_qk, across):
    """0 <= q_code − k_code <= 1 exactly when query and key share a bucket (unless across) and the
    key's sorted chunk is the query's or the one before: the codes that count each key once."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        q, k = torch.randn(2, 2, 61, 4, generator=g), torch.randn(2, 2, 61, 4, generator=g)
        k[..., 0] += 2.0  # keys crowd into a few buckets: their sorted chunks drift from the queries'
        opts = LSHOptions(bucket_size=2, n_hashes=3, n_buckets=16, shared_qk=shared_qk,
                          attend_across_buckets=across)
        qb, kb, qo, ko = _buckets_and_order(q, q if shared_qk else k, opts, g)
        q_code, k_code = cpu_lsh._meeting_codes(qb, kb, qo, ko, 2, opts)
        assert q_code.dtype == torch.int16
        for r in range(3):
            qc = (qo[:, :, r].argsort(-1) // 2)[..., :, None]  # chunk of each query, as lsh_meetings
            kc = (ko[:, :, r].argsort(-1) // 2)[..., None, :]
            expected = _meets(qc, kc, qb[:, :, r, :, None], kb[:, :, r, None, :], across)
            d = q_code[:, :, r, :, None].long() - k_code[:, :, r, None, :].long()
            assert torch.equal((d >= 0) & (d <= 1), expected)
            assert expected.sum() > 0 and (~expected).sum() > 0


# The hash

@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hash_buckets_is_the_argmax_of_the_concatenation(monkeypatch, dtype, native):
    """h(x) = argmax([xR; -xR]) with argmax's first-maximum rule, ties included, over blocks,
    in C (from (xR)ᵀ) and by reductions (the override without the kernels)."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    monkeypatch.setattr(cpu_lsh, "HASH_BLOCK", 2 * 3 * 3 * 4 * 5)  # 5 positions a block: several blocks
    x, rotations, expected = tied_hash_inputs(dtype)
    assert torch.equal(cpu_lsh.hash_buckets(x, rotations), expected)


# Each override: taken where it should be, and the portable body's function

def test_overrides_are_registered_and_declared():
    declared = attnzoo.ops.operations()
    assert all(declared[name] is True for name in ("lsh_buckets", "lsh_order", "lsh_attend"))


@pytest.mark.parametrize("native", ["1", "0"])
def test_hash_and_sort_overrides_are_taken_on_the_cpu(monkeypatch, native):
    """With the kernels, lsh_buckets and lsh_order run in C; without them the hash takes the
    reductions and the sort torch's (the override declines); never under ``portable()``."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    calls = []
    in_c = []
    monkeypatch.setattr(_native, "lsh_buckets", _recording(_native.lsh_buckets, in_c))
    monkeypatch.setattr(_native, "lsh_order", kernel_spy(_native.lsh_order, "lsh_order", calls))
    reductions = []
    monkeypatch.setattr(cpu_lsh, "_hash_by_reductions", _recording(cpu_lsh._hash_by_reductions, reductions))
    portable_sorts = []
    monkeypatch.setattr(lsh.bucket_order, "portable", _recording(lsh.bucket_order.portable, portable_sorts))
    q, k, v, _ = random_inputs(B=1, H=2, Lq=40, Lk=40, D=8)
    _lsh(q, k, v, None, 0, bucket_size=4, n_hashes=2)
    if native == "1":
        assert calls == [("lsh_order", True)] * 2 and len(in_c) == 2  # (one block of q's, one of k's)
        assert not portable_sorts and not reductions
    else:
        assert calls == [("lsh_order", False)] * 2 and not in_c
        assert len(portable_sorts) == 2 and len(reductions) == 2
    calls.clear(), in_c.clear(), portable_sorts.clear(), reductions.clear()
    with attnzoo.ops.portable():
        _lsh(q, k, v, None, 0, bucket_size=4, n_hashes=2)
    assert not calls and not in_c and not reductions and len(portable_sorts) == 2


def _recording(fn, calls):
    def recording(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return recording


@pytest.mark.parametrize("grad, native", [(False, "1"), (False, "0"), (True, "1")])
def test_attend_override_is_taken_on_the_cpu(monkeypatch, grad, native):
    """lsh_attend: without gradients the rounds in C; under autograd (or without the kernels)
    the groups of chunks (_Rounds); never the portable body, except under ``portable()``."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    calls = []
    monkeypatch.setattr(_native, "lsh", kernel_spy(_native.lsh, "lsh", calls))
    monkeypatch.setattr(cpu_lsh._Rounds, "apply", _recording(cpu_lsh._Rounds.apply, rounds := []))
    monkeypatch.setattr(lsh.attend_rounds, "portable", _recording(lsh.attend_rounds.portable, bodies := []))
    q, _, v, _ = random_inputs(B=2, H=2, Lq=30, Lk=30, D=8, requires_grad=grad)
    run = lambda: attnzoo.attention(q, q, v, mechanism="lsh", shared_qk=True, bucket_size=4,  # noqa: E731
                                    generator=torch.Generator().manual_seed(0))
    with torch.set_grad_enabled(grad):
        run()
    assert calls == [("lsh", not grad and native == "1")]
    assert len(rounds) == (grad or native == "0") and not bodies
    calls.clear(), rounds.clear()
    with attnzoo.ops.portable():
        run()
    assert not calls and not rounds and len(bodies) == 1


def test_overrides_decline_off_the_cpu():
    """Another device (here the meta device): every override returns NotImplemented."""
    x = torch.empty(1, 2, 8, 4, device="meta")
    hashed = [torch.empty(1, 2, 2, 8, dtype=torch.long, device="meta")] * 4
    assert cpu_lsh.hash_buckets(x, torch.empty(2, 4, 2, device="meta")) is NotImplemented
    assert cpu_lsh.bucket_order(hashed[0], 4) is NotImplemented
    assert cpu_lsh.attend_rounds(x, x, x, hashed, None, False, LSHOptions(), 0.5) is NotImplemented


def _attend_both(q, k, v, km, causal, opts, seed, grad_of):
    """lsh_attend by its override and by its portable body on the same draw: (outputs and
    gradients) each."""
    hashed = _buckets_and_order(q, k, opts, torch.Generator().manual_seed(seed))
    g = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=q.dtype)
    results = []
    for portable in (False, True):
        with attnzoo.ops.portable() if portable else contextlib.nullcontext():
            out = lsh.attend_rounds(q, k, v, hashed, km, causal, opts, 0.3)
            results.append((out, *torch.autograd.grad(out, grad_of, g)) if grad_of else (out,))
    return results


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 60), widths=NATIVE_WIDTHS,
       bucket_size=st.sampled_from([1, 3, 8]), n_hashes=st.integers(1, 3),
       across=st.booleans(), dup=st.booleans(), shared=st.booleans(), causal=st.booleans(),
       masked=st.booleans(), grad=st.booleans(), native=st.sampled_from(["1", "0"]), seed=st.integers(0, 99))
def test_attend_override_matches_portable_float64(B, H, L, widths, bucket_size, n_hashes, across, dup,
                                                  shared, causal, masked, grad, native, seed):
    """The override (in C without gradients, else the groups) against the portable body on the
    same buckets and orders, in float64: outputs, and under autograd the gradients of q, k, v."""
    D, Dv = widths
    q, k, v, km = random_inputs(B, H, L, L, D, Dv, seed=seed, masked=masked, requires_grad=grad,
                                device="cpu")
    k = q if shared else k
    opts = LSHOptions(bucket_size=bucket_size, n_hashes=n_hashes, attend_across_buckets=across,
                      count_duplicates=dup, shared_qk=shared)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNZOO_NATIVE", native)
        grad_of = () if not grad else (q, v) if shared else (q, k, v)
        fast, portable = _attend_both(q, k, v, km, causal, opts, seed, grad_of)
    for f, p in zip(fast, portable, strict=True):
        torch.testing.assert_close(f, p, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("grad", [False, True])
def test_attend_override_matches_portable_float32_past_the_groups(grad):
    """float32 at the default bucket size over 2500 positions and 4 heads (160 chunks a round,
    three groups of GROUP_SCORES), causal, padded keys: the override within float32 rounding of
    the portable body, outputs and gradients."""
    q, k, v, km = random_inputs(B=2, H=2, Lq=2500, Lk=2500, D=16, dtype=torch.float32, masked=True,
                                requires_grad=grad, seed=2, device="cpu")
    opts = LSHOptions(n_hashes=3)
    assert 2 * 2 * 40 > 2 * cpu_lsh.GROUP_SCORES // (2 * 64 * 64)  # more than two groups a round
    fast, portable = _attend_both(q, k, v, km, True, opts, 1, (q, k, v) if grad else ())
    for f, p in zip(fast, portable, strict=True):
        torch.testing.assert_close(f, p, atol=2e-5, rtol=2e-4)


def test_hash_override_matches_portable_past_its_blocks():
    """float32 over 4096 positions and 8 heads (HASH_BLOCK rotated values make 4 blocks): the
    override's buckets are the portable argmax's, but where the two largest of [xR; −xR] lie
    within float32 rounding of each other (the two sum their products in another order)."""
    g = torch.Generator().manual_seed(0)
    x, rotations = torch.randn(1, 8, 4096, 64, generator=g), torch.randn(4, 64, 32, generator=g)
    assert 8 * 4 * 32 * 4096 >= 4 * cpu_lsh.HASH_BLOCK
    fast = cpu_lsh.hash_buckets(x, rotations)
    with attnzoo.ops.portable():
        portable = lsh.hash_buckets(x, rotations)
    rotated = torch.einsum("bhld,rdc->bhrlc", x.double(), rotations.double())
    both = torch.cat([rotated, -rotated], -1)  # (B, H, R, L, b)
    differ = fast != portable
    gap = (both.gather(-1, fast.unsqueeze(-1)) - both.gather(-1, portable.unsqueeze(-1))).abs().squeeze(-1)
    assert differ.sum() <= 8 and bool((gap[differ] < 1e-4).all())
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ATTNZOO_NATIVE", native)
            assert torch.equal(cpu_lsh.hash_buckets(x.double(), rotations), lsh.hash_buckets.portable(
                x.double(), rotations))


def test_sort_override_matches_portable_past_its_split():
    """The counting sort over many rows (split among threads) and many buckets: the stable sort."""
    buckets = torch.randint(0, 64, (4, 8, 4, 4096), generator=torch.Generator().manual_seed(0))
    with attnzoo.ops.portable():
        expected = lsh.bucket_order(buckets, 64)
    assert torch.equal(lsh.bucket_order(buckets, 64), expected)
    assert torch.equal(cpu_lsh.bucket_order(buckets, 64), expected)
