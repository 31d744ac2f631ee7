"""The CPU backend's kernel attention (attnzoo.backends.cpu.kernel): its override of
``kernel_attention`` is taken for every map it knows and declines elsewhere, gives the portable
body's function (outputs, gradients, the state after), and its eager engine's blocks, their
merge and their recomputing backwards hold at block sizes small enough to make many."""

import contextlib

import pytest
import torch

import attnzoo
from attnzoo import ops
from attnzoo.backends.cpu import kernel
from attnzoo.mechanisms._kernel import FeatureMap, kernel_attention
from attnzoo.mechanisms.linear import LinearOptions, PointwiseMap, elu_feature_map, linear_flops, linear_step
from backends.cpu.spies import override_answers

from mechanism_checks import check_against_reference, check_gradcheck, random_inputs


def _tanh2():
    return PointwiseMap(lambda x: torch.tanh(x) + 2, lambda phi: 1 - (phi - 2) ** 2)


# one call of each map the override knows: (mechanism, options)
MAPS = {
    "elu": ("linear", {}),
    "custom": ("linear", {"feature_map": lambda x: torch.relu(x) + 0.1}),
    "pointwise": ("linear", {"feature_map": _tanh2()}),
    "taylor": ("taylor", {}),
    "favor": ("performer", {"nb_features": 12}),
}




def _fast_and_portable(call, inputs, grad_mode="qkv"):
    """[(output, *gradients)] of ``call(q, k, v)`` with the backend, then under ops.portable(): the
    gradients of the inputs the grad mode makes require them ("no_grad": none, in no_grad;
    "grad_enabled": none, grad mode on)."""
    results = []
    for mode in (contextlib.nullcontext(), ops.portable()):
        ins = [t.detach().requires_grad_(grad_mode == "qkv") for t in inputs]
        with mode, torch.set_grad_enabled(grad_mode != "no_grad"):
            out = call(*ins)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
            grads = torch.autograd.grad(out, ins, g) if grad_mode == "qkv" else ()
        results.append((out.detach(), *grads))
    return results


def _attention(mechanism, options, causal, key_mask):
    def call(q, k, v):
        return attnzoo.attention(q, k, v, mechanism=mechanism, causal=causal, key_mask=key_mask,
                                 generator=torch.Generator().manual_seed(3), **options)
    return call


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("map_name", sorted(MAPS))
def test_the_override_answers_for_every_map_it_knows(monkeypatch, map_name, causal):
    mechanism, options = MAPS[map_name]
    calls = override_answers(monkeypatch, "kernel_attention")
    q, k, v, km = random_inputs(B=2, H=2, Lq=9, Lk=11, D=4, masked=True, requires_grad=True)
    attnzoo.attention(q, k, v, mechanism=mechanism, causal=causal, key_mask=km, **options).sum().backward()
    with torch.no_grad():
        attnzoo.attention(q.float(), k.float(), v.float(), mechanism=mechanism, causal=causal, **options)
    plain_users = map_name == "custom"  # a user's map without a derivative: without grad mode only
    assert calls == [not plain_users, True]


def test_the_override_declines_what_it_cannot_run(monkeypatch):
    """Trainable random features (the portable body gives them their gradient), a key map it does not
    know, and tensors off the CPU; half precision reaches it widened to float32, and is taken."""
    calls = override_answers(monkeypatch, "kernel_attention")
    q, k, v, _ = random_inputs(B=1, H=2, Lq=5, Lk=6, D=4)
    W = torch.randn(8, 4, dtype=q.dtype, requires_grad=True)
    attnzoo.attention(q, k, v, mechanism="performer", features=W)
    attnzoo.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mechanism="performer", features=W.detach())
    assert calls == [False, True]
    unknown = FeatureMap("mine", torch.exp, 4, key=lambda x, mask: torch.exp(x))
    meta = FeatureMap("elu", torch.exp, 4)
    kw = dict(causal=False, key_mask=None, eps=1e-6, chunk=4)
    assert kernel.kernel_attention(q, k, v, unknown, **kw) is NotImplemented
    assert kernel.kernel_attention(*(t.to("meta") for t in (q, k, v)), meta, **kw) is NotImplemented


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("map_name", sorted(MAPS))
def test_the_override_gives_the_portable_function_float64(map_name, causal):
    """Small shapes, Lq < Lk and Lq > Lk (causal: keys before the first query, queries before the
    first key), padded keys (a batch entry with one real key), chunks of 4: outputs and the
    gradients of q, k and v, to float64 rounding."""
    mechanism, options = MAPS[map_name]
    for seed, (Lq, Lk) in enumerate([(13, 17), (17, 13)]):
        q, k, v, km = random_inputs(B=2, H=3, Lq=Lq, Lk=Lk, D=6, Dv=5, masked=True, seed=seed)
        call = _attention(mechanism, {**options, "chunk": 4}, causal, km)
        fast, plain = _fast_and_portable(call, (q, k, v))
        for a, b in zip(fast, plain, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_override_carries_the_state_as_the_portable_body(monkeypatch, native):
    """From a state that needs gradients (the C recurrence, and the eager blocks): linear_step in
    two calls, and the operation itself with keys before the first query (added to the state)
    and queries before the first key: the output, the state after and every gradient, the
    state's included, as the portable body's."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    phi = FeatureMap("elu", elu_feature_map, 8, derivative=elu_feature_map.derivative)
    q, k, v, _ = random_inputs(B=2, H=2, Lq=13, Lk=13, D=8, Dv=5, seed=4)
    S0, z0 = torch.rand(2, 2, 8, 5, dtype=q.dtype), torch.rand(2, 2, 8, dtype=q.dtype)

    def calls(q, k, v, S0, z0):
        _, state = linear_step(q[:, :, :6], k[:, :, :6], v[:, :, :6], opts=LinearOptions(chunk=4))
        out, after = linear_step(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], state, LinearOptions(chunk=4))
        results = [out, after.kv]
        for Lq, Lk in [(5, 9), (9, 5)]:
            out, (S, z) = kernel_attention(q[:, :, :Lq], k[:, :, :Lk], v[:, :, :Lk], phi, causal=True,
                                           key_mask=None, eps=1e-6, chunk=4, state=(S0, z0))
            results += [out, S, z]
        return results

    got = []
    for mode in (contextlib.nullcontext(), ops.portable()):
        ins = [t.detach().requires_grad_() for t in (q, k, v, S0, z0)]
        with mode:
            results = calls(*ins)
        got.append((*results, *torch.autograd.grad(sum(t.sum() for t in results), ins)))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("grad_mode", ["qkv", "grad_enabled", "no_grad"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("map_name", ["elu", "elu eager", "taylor", "favor", "pointwise"])
def test_the_override_gives_the_portable_function_float32_past_its_blocks(monkeypatch, map_name, causal,
                                                                          grad_mode):
    """float32 at B·H = 2 and 2300 positions: past the non-causal stream's blocks (2048 positions)
    and two causal blocks (1024), padded keys, each grad mode (grad mode on with nothing requiring
    grad: the scratch must not be read after a later block overwrote it). "elu eager": the eager
    engine where the C kernels are off."""
    if map_name == "elu eager":
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    mechanism, options = MAPS[map_name.split()[0]]
    q, k, v, km = random_inputs(B=1, H=2, Lq=2300, Lk=2300, D=16, masked=True, seed=5, dtype=torch.float32)
    calls = override_answers(monkeypatch, "kernel_attention")
    fast, plain = _fast_and_portable(_attention(mechanism, options, causal, km), (q, k, v), grad_mode)
    assert calls == [True]
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5 * b.abs().max().item(), rtol=1e-3)


def test_an_elementwise_map_goes_back_by_its_derivative(monkeypatch):
    """The engine's backwards recompute a PointwiseMap's features and take dx = dφ ⊙ derivative(φ),
    with no graph through the map (non-causal and causal, Lq = Lk: no keys before the first
    query, which go through the map under autograd)."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    seen, graphs, pointwise = [], [], kernel._Pointwise.apply
    monkeypatch.setattr(kernel._Pointwise, "apply", lambda *a: graphs.append(1) or pointwise(*a))
    tanh2 = _tanh2()
    counted = PointwiseMap(tanh2.fn, lambda phi: seen.append(phi.shape) or tanh2.derivative(phi))
    for causal in (False, True):
        check_against_reference("linear", Lq=9, Lk=9, causal=causal, masked=True,
                                options={"feature_map": counted})
    assert len(seen) >= 4 and not graphs  # (queries and keys, each way)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_elu_map_is_floored_at_the_smallest_normal_exponent(dtype):
    """The backend's elu + 1 raises exponents below log(tiny) to it: φ off by about tiny at most,
    never 0 or NaN, and its derivative likewise."""
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([-1e30, -2000.0, -750.0, -100.0, -87.0, -50.0, 0.0, 3.0], dtype=dtype)
    phi = kernel.ELU(x)
    exact = torch.where(x > 0, x + 1, x.clamp(max=0).exp()).double()
    assert ((phi.double() - exact).abs() <= 2 * tiny + 1e-6 * exact).all()
    assert (phi > 0).all()
    grad = torch.autograd.grad(kernel.ELU(x.requires_grad_()).sum(), x)[0]
    assert ((grad.double() - exact.clamp(max=1)).abs() <= 2 * tiny + 1e-6 * exact).all()


def test_flops_follow_the_path_that_runs(monkeypatch):
    """Where the C recurrence runs causal elu + 1, its FLOPs (4·D·Dv + 2·D a position); under
    ops.portable(), or for the other maps, the chunked prefix sums' (2·chunk·(D + Dv) more)."""
    B, H, L, D, Dv = 1, 8, 4096, 64, 64
    recurrence = B * H * L * (4 * D * Dv + 2 * D)
    chunked = B * H * L * (2 * 64 * (D + Dv) + 4 * D * Dv + 2 * D)
    calls = override_answers(monkeypatch, "kernel_attention_flops")
    assert linear_flops(B, H, L, L, D, Dv, True, LinearOptions()) == recurrence
    with ops.portable():
        assert linear_flops(B, H, L, L, D, Dv, True, LinearOptions()) == chunked
    taylor = attnzoo.get("taylor")
    assert taylor.flops(B, H, L, L, D - 1, Dv, True, taylor.options()) == chunked
    assert calls == [True, False]


@pytest.mark.parametrize("name", ["linear", "performer", "taylor"])
def test_streamed_blocks_and_their_recomputing_backward(monkeypatch, name):
    """Many small blocks (some all padding): the block merge by constants and the backwards
    that recompute each block (non-causal: its features; causal: the block from its saved
    state, last block first), against the dense reference and gradcheck."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # linear's blocks, not its C kernels (test_native.py)
    monkeypatch.setattr(kernel, "STREAM_POSITIONS", 12)  # B·H = 6: two positions a block
    monkeypatch.setattr(kernel, "CAUSAL_POSITIONS", 6)  # causal: one chunk a block
    calls = override_answers(monkeypatch, "kernel_attention")
    check_gradcheck(name, Lq=5, Lk=7, masked=True)
    for seed in range(3):
        check_against_reference(name, Lq=9, Lk=11, masked=True, seed=seed)
    with torch.no_grad():  # the forward alone: every block's temporaries in one Scratch
        for masked in (False, True):  # (unmasked, a block's features stay in the scratch)
            check_against_reference(name, Lq=9, Lk=11, masked=masked, backward=False)
    for Lq, Lk in [(9, 11), (11, 9), (10, 10)]:  # causal: blocks of one chunk of 2
        check_against_reference(name, Lq=Lq, Lk=Lk, causal=True, masked=True, options={"chunk": 2})
    check_gradcheck(name, Lq=6, Lk=7, causal=True, masked=True, options={"chunk": 2})
    # blocks of three chunks: each chunk reads the state before its block plus the chunks before it
    monkeypatch.setattr(kernel, "causal_rows", lambda B, H, chunk: 3 * chunk)
    for Lq, Lk in [(13, 15), (15, 13)]:
        check_against_reference(name, Lq=Lq, Lk=Lk, causal=True, masked=True, options={"chunk": 2})
        with torch.no_grad():  # inference: each block's chunk terms in one Scratch, the last
            for masked in (False, True):  # block shorter (its own buffers, padded)
                check_against_reference(name, Lq=Lq, Lk=Lk, causal=True, masked=masked,
                                        backward=False, options={"chunk": 2})
    check_gradcheck(name, Lq=8, Lk=9, causal=True, masked=True, options={"chunk": 2})
    assert calls and all(calls)


def test_streamed_backward_recomputes_the_forwards_key_blocks(monkeypatch):
    """The backward finds the key block that holds performer's c_max by comparing recomputed
    logits with the forward's, bit for bit: a matmul of another shape may round them
    otherwise. So its key blocks must be the forward's (300 rows here, where the query
    blocks of the backward have 150), and the gradients must match the reference's."""
    monkeypatch.setattr(kernel, "STREAM_POSITIONS", 900)  # B·H = 3: 300 positions a block
    seen, key_blocks = [], kernel.key_blocks

    def recording(k, v, key_mask, rows):
        seen.append(rows)
        return key_blocks(k, v, key_mask, rows)

    monkeypatch.setattr(kernel, "key_blocks", recording)
    check_against_reference("performer", B=1, H=3, Lq=650, Lk=700, D=8)
    assert seen == [300, 300]  # forward, backward


@pytest.mark.parametrize("causal", [False, True])
def test_a_users_map_that_closes_over_a_parameter_gets_its_gradient(causal):
    """A user's feature map may close over tensors that need gradients: the engine's backward
    differentiates maps in x alone, so with grad mode on the override leaves such maps to the
    portable body, and w's gradient is autograd's (it was lost: None from autograd.grad)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)

    def phi(x):
        return torch.nn.functional.elu(x * w) + 1

    q, k, v = (torch.randn(1, 2, 300, 8, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))
    grads = []
    for ctx in (torch.enable_grad(), ops.portable()):
        with ctx:
            out = attnzoo.attention(q, k, v, mechanism="linear", causal=causal, feature_map=phi)
            grads.append(torch.autograd.grad(out.sum(), (w, q, k, v), allow_unused=True))
    assert grads[0][0] is not None
    for fast, portable in zip(*grads, strict=True):
        torch.testing.assert_close(fast, portable)
