"""The native kernels (attnzoo.backends.cpu.native), of linear attention (causal and not), efficient
attention and LSH (its rounds, hash and sort): against the eager engines and the dense
reference, their use by the mechanisms, and the fall-back where they cannot be built."""

import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.backends.cpu import native as _native
from attnzoo.mechanisms.linear import LinearOptions, linear_flops, linear_step
from backends.cpu.spies import kernel_spy

from mechanism_checks import NATIVE_WIDTHS, check_against_reference, check_gradcheck, random_inputs


def _outputs(q, k, v, km, monkeypatch, causal=True):
    """(native, eager, reference) linear attention, without autograd."""
    kw = dict(mechanism="linear", causal=causal, key_mask=km)
    with torch.no_grad():
        native = attnzoo.attention(q, k, v, **kw)
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
        eager = attnzoo.attention(q, k, v, **kw)
        monkeypatch.delenv("ATTNZOO_NATIVE")
        ref = attnzoo.attention(q, k, v, reference=True, **kw)
    return native, eager, ref


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Lq=st.integers(1, 23), Lk=st.integers(1, 23),
       widths=NATIVE_WIDTHS, masked=st.booleans(),
       causal=st.booleans(), seed=st.integers(0, 99))
def test_native_matches_eager_and_reference_float64(B, H, Lq, Lk, widths, masked, causal, seed):
    """Odd and unequal lengths (causal: keys before the first query, queries before the first
    key), padded keys, widths that are no multiple of a vector (the lanes' zero padding), B and
    H > 1 (heads split among threads), in float64 (C's exp): to the reference's rounding."""
    D, Dv = widths
    q, k, v, km = random_inputs(B, H, Lq, Lk, D, Dv, seed=seed, masked=masked)
    with pytest.MonkeyPatch.context() as mp:
        native, eager, ref = _outputs(q, k, v, km, mp, causal)
    torch.testing.assert_close(native, ref, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(native, eager, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("causal", [True, False])
def test_native_float32_and_its_exp(monkeypatch, causal):
    """float32 runs the polynomial exp: within float32 rounding of the float64 reference, for
    features from e^-100 (clamped at the smallest normal number, as the eager map) to 1 + 30."""
    q, k, v, km = random_inputs(B=2, H=4, Lq=301, Lk=301, D=64, Dv=64, masked=True, seed=3)
    q, k = q * 4, k * 4
    q[0, 0, :10], k[0, 0, :10] = -100.0, -100.0  # features at the clamp
    q[1, 1, 5:9], k[1, 1, 20:30] = 30.0, 30.0
    native, eager, ref = _outputs(q.float(), k.float(), v.float(), km, monkeypatch, causal)
    torch.testing.assert_close(native.double(), ref.double(), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(native, eager, atol=2e-5, rtol=2e-4)


def test_native_kernel_runs_and_carries_the_state(monkeypatch):
    """attention(causal linear) calls the kernel (which builds here: this machine has a C
    compiler), and linear_step through it continues from a state token by token exactly as
    one call over the whole sequence."""
    calls = []
    for name in ("causal_linear", "linear"):
        monkeypatch.setattr(_native, name, kernel_spy(getattr(_native, name), name, calls))
    q, k, v, _ = random_inputs(B=2, H=2, Lq=12, Lk=12, D=6, Dv=4, seed=5)
    with torch.no_grad():
        attnzoo.attention(q, k, v, mechanism="linear")
        assert calls == [("linear", True)]
        whole = attnzoo.attention(q, k, v, mechanism="linear", causal=True)
        state, steps = None, []
        for t in range(12):
            out, state = linear_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
            steps.append(out)
    assert len(calls) == 14 and all(ran for _, ran in calls), calls
    torch.testing.assert_close(torch.cat(steps, 2), whole, atol=1e-12, rtol=1e-10)
    ref = attnzoo.attention(q, k, v, mechanism="linear", causal=True, reference=True)
    torch.testing.assert_close(whole, ref, atol=1e-10, rtol=1e-8)




@pytest.mark.parametrize("how", ["off", "no compiler", "build fails"])
def test_without_the_kernel_the_eager_engine_answers(monkeypatch, tmp_path, how):
    monkeypatch.setenv("ATTNZOO_CACHE", str(tmp_path))
    _native._library.cache_clear()  # (a failed build is remembered: this test's warnings come once)
    if how == "off":
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    else:
        monkeypatch.setenv("CC", "/nonexistent/cc" if how == "no compiler" else "false")
    q, k, v, km = random_inputs(B=1, H=2, Lq=9, Lk=11, D=7, Dv=3, masked=True, seed=1)
    S, z = torch.zeros(1, 2, 7, 3, dtype=q.dtype), torch.zeros(1, 2, 7, dtype=q.dtype)
    with warnings.catch_warnings(record=True) as said:  # a failed build says so, once a family and shape
        warnings.simplefilter("always")
        for _ in range(2):
            assert _native.causal_linear(q, k[:, :, :9], v[:, :, :9], S, z, None, 1e-6) is None
            assert _native.linear(q, k, v, km, 1e-6) is None
    assert [str(w.message).split(")")[0] for w in said] == (
        [f"attnzoo: the native kernels ({family}, double, D=7, Dv=3"
         for family in ("causal_linear", "linear")] if how == "build fails" else [])
    assert _native.available() == (how == "build fails")
    for causal in (True, False):
        with torch.no_grad():
            out = attnzoo.attention(q, k, v, mechanism="linear", causal=causal, key_mask=km)
        ref = attnzoo.attention(q, k, v, mechanism="linear", causal=causal, key_mask=km, reference=True)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)


def test_a_cache_it_cannot_write_builds_in_the_temporary_folder(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder would be: no folder can be made there
    monkeypatch.setenv("ATTNZOO_CACHE", str(blocked / "attnzoo"))
    _native._library.cache_clear()  # (a build loaded before would not be looked for)
    q, k, v, _ = random_inputs(B=1, H=2, Lq=9, Lk=9, D=7, Dv=2, seed=4)
    S, z = torch.zeros(1, 2, 7, 2, dtype=q.dtype), torch.zeros(1, 2, 7, dtype=q.dtype)
    assert _native.causal_linear(q, k, v, S, z, None, 1e-6) is not None


def test_a_first_call_builds_its_own_family_of_kernels_only(monkeypatch, tmp_path):
    """Each family of kernels is a build of its own: a first call of linear attention compiles
    linear's entry points, none of the other families' (the first call's wait)."""
    monkeypatch.setenv("ATTNZOO_CACHE", str(tmp_path))
    _native._library.cache_clear()
    q, k, v, _ = random_inputs(B=1, H=2, Lq=9, Lk=9, D=7, Dv=2, seed=4)
    assert _native.linear(q, k, v, None, 1e-6) is not None
    assert [p.name.rsplit("_", 1)[0] for p in tmp_path.iterdir()] == ["kernels_linear_double_7x2"]
    lib, families = _native._kernels("linear", q, k, v), _native._signatures("double")
    assert all(hasattr(lib, name) for name in families.pop("linear"))
    assert not any(hasattr(lib, name) for others in families.values() for name in others)


def test_each_entry_point_returns_what_its_c_declares():
    """ctypes is told each entry point's return type, and each family's entry points are all
    the source exports: an int status (−1: no memory) read as nothing would go unchecked."""
    exported = re.findall(r"^(void|int) (\w+)\(", _native.SOURCE.read_text(), re.M)  # (kind, name)
    declared = {name: kind for kind, name in exported}
    listed = [name for family in _native._signatures("float").values() for name in family]
    assert sorted([*listed, "parallel_build", "serial_heads"]) == sorted(declared)
    assert {name for name, kind in declared.items() if kind == "void"} == _native._RETURN_NOTHING


def test_flops_count_the_recurrence_where_it_runs(monkeypatch):
    """The native kernel's work is the recurrence's 4·D·Dv + 2·D a position; the eager
    engine's chunks add 2·chunk·(D + Dv)."""
    B, H, L, D, Dv = 1, 8, 4096, 64, 64
    assert linear_flops(B, H, L, L, D, Dv, True, LinearOptions()) == B * H * L * (4 * D * Dv + 2 * D)
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    assert linear_flops(B, H, L, L, D, Dv, True, LinearOptions()) == B * H * L * (
        2 * 64 * (D + Dv) + 4 * D * Dv + 2 * D)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _trained(mechanism, q, k, v, km, g):
    """(out, dq, dk, dv) of ``mechanism`` on leaves made from q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attnzoo.attention(q, k, v, mechanism=mechanism, key_mask=km)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.skipif(not torch._C.has_openmp, reason="torch without OpenMP: no OpenMP build")
@pytest.mark.parametrize("mechanism", ["linear", "efficient"])
def test_heads_split_by_openmp_or_by_python_give_the_same(monkeypatch, two_threads, mechanism):
    """Built with OpenMP (where torch runs on it), the kernels split the heads among its threads
    themselves; built without, Python's pool does. Outputs and gradients agree (B·H = 6 heads
    over 2 threads), and a causal_linear call too. (Each build's name hashes its flags: those
    with and without OpenMP live in the one cache, each built once.)"""
    q, k, v, km = random_inputs(B=2, H=3, Lq=13, Lk=11, D=8, Dv=5, masked=True, seed=5)
    g = torch.randn(2, 3, 13, 5, dtype=q.dtype)
    S, z = torch.zeros(2, 3, 8, 5, dtype=q.dtype), torch.zeros(2, 3, 8, dtype=q.dtype)
    got = {}
    for openmp in (True, False):
        flags = [*_native._flags(), "-fopenmp"] if openmp else _native._flags()
        monkeypatch.setattr(_native, "_flag_sets", lambda flags=flags: [flags])
        _native._library.cache_clear()
        assert _native._kernels(mechanism, q, k, v).splits_heads == openmp
        got[openmp] = (*_trained(mechanism, q, k, v, km, g),
                       _native.causal_linear(q[:, :, :11], k, v, S, z, None, 1e-6)[0])
    _native._library.cache_clear()
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_a_forked_child_runs_the_kernel_in_a_pool_of_its_own():
    """Neither the pool's threads nor OpenMP's survive a fork: the child makes a pool of its own
    and runs each kernel call's OpenMP region on its calling thread (else it would hang)."""
    import multiprocessing as mp

    q, k, v, _ = random_inputs(B=2, H=2, Lq=10, Lk=10, D=4, seed=2)
    with torch.no_grad():
        parent = attnzoo.attention(q, k, v, mechanism="linear", causal=True)  # the pool is made
    with mp.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(_causal_linear, (q, k, v)).get(timeout=60)
    torch.testing.assert_close(child, parent)


def _causal_linear(q, k, v):
    torch.set_num_threads(2)
    with torch.no_grad():
        return attnzoo.attention(q, k, v, mechanism="linear", causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_native_backward(monkeypatch, masked, causal):
    """Training through the native kernels: gradients against the reference's on unequal odd
    lengths (rows past a group of four; causal: keys before the first query, whose gradients
    come through the state before, and queries before the first key), padded keys, D != Dv;
    gradcheck; and the same gradients from the eager engine."""
    calls, name = [], "causal_linear" if causal else "linear"
    monkeypatch.setattr(_native, name, kernel_spy(getattr(_native, name), name, calls))
    for seed, (Lq, Lk, D, Dv) in enumerate([(9, 14, 8, 5), (6, 3, 17, 8), (1, 5, 3, 1), (13, 13, 16, 16)]):
        check_against_reference("linear", B=2, H=3, Lq=Lq, Lk=Lk, D=D, Dv=Dv, causal=causal, masked=masked,
                                seed=seed)
    check_gradcheck("linear", Lq=7, Lk=6, causal=causal, masked=masked)
    assert calls and all(ran for _, ran in calls), calls
    q, k, v, km = random_inputs(B=2, H=2, Lq=11, Lk=13, D=6, Dv=4, masked=masked, requires_grad=True)
    g = torch.randn(2, 2, 11, 4, dtype=q.dtype)
    grads = []
    for native in ("1", "0"):
        monkeypatch.setenv("ATTNZOO_NATIVE", native)
        out = attnzoo.attention(q, k, v, mechanism="linear", causal=causal, key_mask=km)
        grads.append(torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_native_causal_backward_carries_the_states_gradient():
    """linear_step from a state that needs gradients: the kernel's backward gives the state
    before its gradient, so two steps of 7 and 6 positions differentiate as one call over 13
    (float32 too: the polynomial exp and its slope)."""
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        q, k, v, _ = random_inputs(B=2, H=2, Lq=13, Lk=13, D=8, Dv=5, seed=4, requires_grad=True)
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        g = torch.randn(2, 2, 13, 5, dtype=dtype)
        whole = attnzoo.attention(q, k, v, mechanism="linear", causal=True)
        first, state = linear_step(q[:, :, :7], k[:, :, :7], v[:, :, :7])
        second, _ = linear_step(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], state)
        a = torch.autograd.grad(whole, (q, k, v), g)
        b = torch.autograd.grad(torch.cat([first, second], 2), (q, k, v), g)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=tol, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Lq=st.integers(1, 23), Lk=st.integers(1, 23),
       widths=NATIVE_WIDTHS, masked=st.booleans(),
       seed=st.integers(0, 99))
def test_native_efficient_matches_eager_and_reference(B, H, Lq, Lk, widths, masked, seed):
    """Efficient attention in C, forward and gradients, against the reference and the eager engine."""
    D, Dv = widths
    q, k, v, km = random_inputs(B, H, Lq, Lk, D, Dv, seed=seed, masked=masked, requires_grad=True)
    g = torch.randn(B, H, Lq, Dv, dtype=q.dtype)
    results = []
    with pytest.MonkeyPatch.context() as mp:
        for how in ("native", "eager", "reference"):
            mp.setenv("ATTNZOO_NATIVE", "0" if how == "eager" else "1")
            out = attnzoo.attention(q, k, v, mechanism="efficient", key_mask=km, reference=how == "reference")
            results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for native, other in ((results[0], results[1]), (results[0], results[2])):
        for a, b in zip(native, other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-4), (torch.float64, 1e-10)])
@pytest.mark.parametrize("D", [64, 17])
def test_native_efficient_shifts_by_the_true_maxima(monkeypatch, dtype, atol, D):
    """Scores of several hundred: exp overflows unless each query row is shifted by its own
    maximum and each key feature by its maximum over the keys (a shift any smaller, such as a
    lane's or a half's maximum, gives inf or nan). D = 64 fills whole vectors of lanes, 17 not."""
    calls = []
    monkeypatch.setattr(_native, "efficient", kernel_spy(_native.efficient, "efficient", calls))
    q, k, v, km = random_inputs(B=2, H=3, Lq=33, Lk=29, D=D, Dv=8, masked=True, seed=5)
    q, k = q * 300, k * 300
    with torch.no_grad():
        native = attnzoo.attention(q.to(dtype), k.to(dtype), v.to(dtype), mechanism="efficient", key_mask=km)
    ref = attnzoo.attention(q, k, v, mechanism="efficient", key_mask=km, reference=True)
    torch.testing.assert_close(native.double(), ref, atol=atol, rtol=0)
    assert calls and all(ran for _, ran in calls), calls


def test_native_efficient_runs_float32_and_gradcheck(monkeypatch):
    calls = []
    monkeypatch.setattr(_native, "efficient", kernel_spy(_native.efficient, "efficient", calls))
    check_gradcheck("efficient", masked=True, Lq=5, Lk=7)
    q, k, v, km = random_inputs(B=2, H=4, Lq=301, Lk=257, D=64, Dv=64, masked=True, seed=3)
    with torch.no_grad():
        native = attnzoo.attention(q.float(), k.float(), v.float(), mechanism="efficient", key_mask=km)
    ref = attnzoo.attention(q, k, v, mechanism="efficient", key_mask=km, reference=True)
    torch.testing.assert_close(native.double(), ref, atol=2e-6, rtol=2e-5)
    assert len(calls) >= 2 and all(ran for _, ran in calls), calls


@pytest.mark.parametrize("mechanism, causal, name", [
    ("efficient", False, "efficient"), ("linear", False, "linear"), ("linear", True, "causal_linear")])
@pytest.mark.parametrize("D, Dv", [(64, 64), (48, 80)])
def test_native_float32_gradients_at_vector_widths(monkeypatch, mechanism, causal, name, D, Dv):
    """float32 forward and gradients within float32 rounding of the float64 reference, at rows of
    whole 64-byte vectors (64 and 48 values: on AVX-512 the four-row products hold them in
    registers, kernels.c IN_REGISTERS) and past four of them (80: the loops GCC vectorises)."""
    calls = []
    monkeypatch.setattr(_native, name, kernel_spy(getattr(_native, name), name, calls))
    q, k, v, km = random_inputs(B=2, H=3, Lq=157, Lk=157, D=D, Dv=Dv, masked=True, seed=7, requires_grad=True)
    g = torch.randn(2, 3, 157, Dv, dtype=q.dtype, generator=torch.Generator().manual_seed(7))
    kw = dict(mechanism=mechanism, causal=causal, key_mask=km)
    ref = attnzoo.attention(q, k, v, reference=True, **kw)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), g))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = attnzoo.attention(q32, k32, v32, **kw)
    got = (out, *torch.autograd.grad(out, (q32, k32, v32), g.float()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-4 * b.abs().max().item(), rtol=2e-4)
    assert calls and all(ran for _, ran in calls), calls
