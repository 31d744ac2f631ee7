"""The CPU backend's efficient attention (attnzoo.backends.cpu.efficient): its override of
``efficient_attention`` is taken on float32 and float64 CPU tensors (by the C kernels, or by the
streamed eager blocks where they are off) and declines elsewhere, and gives the portable body's
function, outputs and gradients."""

import contextlib

import pytest
import torch

import attnzoo
from attnzoo import ops
from attnzoo.backends.cpu import efficient, kernel
from attnzoo.backends.cpu import native as _native
from backends.cpu.spies import override_answers

from mechanism_checks import check_against_reference, check_gradcheck, random_inputs


def _native_calls(monkeypatch):
    """A list of whether each call of the C kernel ran (True) or left it to the eager blocks."""
    calls, run = [], _native.efficient

    def spy(*args):
        out = run(*args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(_native, "efficient", spy)
    return calls


def _fast_and_portable(q, k, v, key_mask, grad_mode):
    """[(output, *gradients of q, k, v)] with the backend, then under ops.portable() (gradients
    only for grad_mode "qkv"; "no_grad" runs without grad mode)."""
    results = []
    for mode in (contextlib.nullcontext(), ops.portable()):
        ins = [t.detach().requires_grad_(grad_mode == "qkv") for t in (q, k, v)]
        with mode, torch.set_grad_enabled(grad_mode != "no_grad"):
            out = attnzoo.attention(*ins, mechanism="efficient", key_mask=key_mask)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
            grads = torch.autograd.grad(out, ins, g) if grad_mode == "qkv" else ()
        results.append((out.detach(), *grads))
    return results


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_override_is_taken_natively_or_by_the_eager_blocks(monkeypatch, native):
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    calls, ran = override_answers(monkeypatch, "efficient_attention"), _native_calls(monkeypatch)
    q, k, v, km = random_inputs(B=2, H=2, Lq=9, Lk=11, D=4, masked=True, requires_grad=True)
    attnzoo.attention(q, k, v, mechanism="efficient", key_mask=km).sum().backward()
    with torch.no_grad():
        attnzoo.attention(q.float(), k.float(), v.float(), mechanism="efficient")
    assert calls == [True, True]
    assert ran == [native == "1"] * 2


def test_the_override_declines_off_the_cpu_and_in_half_precision():
    q, k, v, _ = random_inputs(B=1, H=2, Lq=5, Lk=6, D=4)
    assert efficient.efficient_attention(q.half(), k.half(), v.half(), None) is NotImplemented
    assert efficient.efficient_attention(*(t.to("meta") for t in (q, k, v)), None) is NotImplemented


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_override_gives_the_portable_function_float64(monkeypatch, native, masked):
    """Unequal odd lengths, padding (a batch entry with one real key), D != Dv: outputs and the
    gradients of q, k and v, to float64 rounding."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    for seed, (Lq, Lk, D, Dv) in enumerate([(9, 14, 8, 5), (6, 3, 17, 8), (1, 5, 3, 1)]):
        q, k, v, km = random_inputs(B=2, H=3, Lq=Lq, Lk=Lk, D=D, Dv=Dv, masked=masked, seed=seed)
        fast, plain = _fast_and_portable(q, k, v, km, "qkv")
        for a, b in zip(fast, plain, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("grad_mode", ["qkv", "grad_enabled", "no_grad"])
@pytest.mark.parametrize("native", ["1", "0"])
def test_the_override_gives_the_portable_function_float32_past_its_blocks(monkeypatch, native, grad_mode):
    """float32 at B·H = 2 and 2300 positions, past the eager stream's blocks (2048 positions),
    padded keys, each grad mode."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    q, k, v, km = random_inputs(B=1, H=2, Lq=2300, Lk=2100, D=16, masked=True, seed=5, dtype=torch.float32)
    fast, plain = _fast_and_portable(q, k, v, km, grad_mode)
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-3)


@pytest.mark.parametrize("masked", [False, True])
def test_the_eager_engine_where_the_c_kernels_are_off(monkeypatch, masked):
    """The eager blocks, which run where the C kernels cannot, against the reference: unequal odd
    lengths, padding, D != Dv, gradients and gradcheck, and scores far beyond exp's range (the
    saved row shifts and the keys' column max keep every exponential finite)."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    for seed, (Lq, Lk, D, Dv) in enumerate([(9, 14, 8, 5), (6, 3, 17, 8), (1, 5, 3, 1)]):
        check_against_reference("efficient", B=2, H=3, Lq=Lq, Lk=Lk, D=D, Dv=Dv, masked=masked, seed=seed)
    check_gradcheck("efficient", masked=masked, Lq=5, Lk=7)
    q, k, v, km = random_inputs(B=2, H=3, Lq=9, Lk=11, D=8, masked=masked)
    q, k = (1000 * t for t in (q, k))
    fast, plain = _fast_and_portable(q, k, v, km if masked else None, "qkv")
    for a, b in zip(fast, plain, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


def test_many_small_blocks(monkeypatch):
    """The eager stream in blocks of two positions (B·H = 6), some all padding: forward (its
    temporaries in one Scratch), backward and gradcheck against the reference."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    monkeypatch.setattr(kernel, "STREAM_POSITIONS", 12)
    calls = override_answers(monkeypatch, "efficient_attention")
    check_gradcheck("efficient", Lq=5, Lk=7, masked=True)
    for seed in range(3):
        check_against_reference("efficient", Lq=9, Lk=11, masked=True, seed=seed)
    with torch.no_grad():
        for masked in (False, True):
            check_against_reference("efficient", Lq=9, Lk=11, masked=masked, backward=False)
    assert calls and all(calls)
