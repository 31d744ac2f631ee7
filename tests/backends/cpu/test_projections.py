"""The CPU backend's projections (attnzoo.backends.cpu.projections) against the modules, and
every mechanism's layer on kept memory blocks (attnzoo.backends.cpu.memory) against torch's."""

import pytest
import torch

import attnzoo
from attnzoo.backends.cpu import memory as _pages
from attnzoo.backends.cpu import projections
from backends.cpu.spies import override_answers


def _grads(layer, x):
    layer.zero_grad(set_to_none=True)
    layer._generator = None  # lsh: the same draw each call (reseeded from layer.seed)
    x = x.detach().requires_grad_(x.requires_grad)
    y = layer(x)
    y.backward(torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3)))
    return y, [None if t.grad is None else t.grad.clone() for t in (x, *layer.parameters())]

@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_every_mechanism_gives_the_same_on_kept_blocks(monkeypatch, name):
    """Every result of POOL_BYTES or more lies on a block kept from a dead one (_pages): with every
    fresh result on one (POOL_BYTES = 1), twice, so the second call takes the first's blocks, the
    layer's output and gradients equal those in torch's own memory."""
    torch.manual_seed(0)
    spec = attnzoo.get(name)
    extra = {"max_len": 32} if name == "linformer" else {}
    layer = attnzoo.MultiheadAttention(12, 3, mechanism=name, causal=spec.capabilities.causal,
                                       **extra).double()
    x = torch.randn(2, 19, 12, dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(_pages, "KEEP_BYTES", 0)
    expected = _grads(layer, x)
    monkeypatch.setattr(_pages, "KEEP_BYTES", 1 << 30)
    monkeypatch.setattr(_pages, "POOL_BYTES", 1)
    _pages.empty_cache()
    for _ in range(2):
        got = _grads(layer, x)
        assert _pages._KEPT  # the call's dead results came back
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    _pages.empty_cache()

@pytest.mark.parametrize("name", ["full", "lsh"])  # lsh: shared QK, two projections
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen", ["none", "x", "q_proj"])
def test_fused_projections_equal_separate_ones(monkeypatch, name, bias, frozen):
    """Self-attention in training projects x by one function (dx summed in place); a hook on a
    projection makes the layer call the modules one by one. Outputs and every gradient agree."""
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(12, 3, mechanism=name, bias=bias, causal=True).double()
    x = torch.randn(2, 8, 12, dtype=torch.float64).requires_grad_(frozen != "x")
    if frozen == "q_proj":
        layer.q_proj.requires_grad_(False)
    nn_mod = projections
    calls = []
    apply = nn_mod._SharedInputLinear.apply
    monkeypatch.setattr(nn_mod._SharedInputLinear, "apply",
                        lambda x, n_rows, *ps: calls.append(len(ps) // 2) or apply(x, n_rows, *ps))
    fused_out, fused = _grads(layer, x)
    n_in = 2 if name == "lsh" else 3
    assert calls == [n_in, 1]  # the input projections in one call, then the output projection
    layer.q_proj.register_forward_hook(lambda module, args, out: None)
    separate_out, separate = _grads(layer, x)
    assert calls == [n_in, 1, 1]  # the hook kept the input projections apart
    torch.testing.assert_close(fused_out, separate_out, atol=0, rtol=0)
    for a, b in zip(fused, separate, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-12)

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_projections_without_grad_equal_the_modules(monkeypatch, bias, cross):
    """Without grad the layer writes each projection into fresh memory itself (``times_t_into``);
    a global module hook makes it call the modules. The outputs agree."""
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(12, 3, bias=bias).double()
    x, memory = torch.randn(2, 7, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    nn_mod = projections
    calls, linear = [], nn_mod.times_t_into
    monkeypatch.setattr(nn_mod, "times_t_into", lambda *a: calls.append(1) or linear(*a))
    with torch.no_grad():
        ours = layer(x, memory if cross else None)
        assert len(calls) == 4  # q, k, v, out
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        try:
            modules = layer(x, memory if cross else None)
        finally:
            handle.remove()
    assert len(calls) == 4
    torch.testing.assert_close(ours, modules, atol=1e-13, rtol=1e-12)

def test_projections_of_one_width_share_one_buffer():
    """q, k and v (one input, one width) are written into one fresh buffer, one allocation not
    three (see ``_linears``); a width apart gets its own."""
    nn_mod = projections
    x = torch.randn(2, 5, 6)
    same = [torch.nn.Linear(6, 4) for _ in range(3)]
    with torch.no_grad():
        outs = nn_mod.project(x, same)
        mixed = nn_mod.project(x, [torch.nn.Linear(6, 4), torch.nn.Linear(6, 3)])
    assert len({t.untyped_storage().data_ptr() for t in outs}) == 1
    assert len({t.untyped_storage().data_ptr() for t in mixed}) == 2
    for t, lin in zip(outs, same, strict=True):
        torch.testing.assert_close(t, lin(x))

def test_fused_projections_gradcheck():
    """Feature maps (x Wᵀ + b) and row maps (P x, P shared by the batch or one per entry)."""
    fn = projections._SharedInputLinear.apply
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w1, w2 = (torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    b1 = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    P = torch.randn(2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    P_each = torch.randn(2, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: fn(t[0], 0, *t[1:]), (x, w1, b1, w2, None))
    assert torch.autograd.gradcheck(lambda *t: fn(t[0], 2, *t[1:]), (x, w1, None, P, P_each))
    assert torch.autograd.gradcheck(lambda *t: fn(t[0], 1, *t[1:]), (x, P))
    P2 = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)  # shared, other rows:
    # its gradient and P's from one product, rows of one buffer; one that needs none left out
    assert torch.autograd.gradcheck(lambda *t: fn(t[0], 3, *t[1:]), (x, P, P_each, P2))
    assert torch.autograd.gradcheck(lambda *t: fn(t[0], 3, *t[1:]), (x, P.detach(), P2, P_each))




@pytest.mark.parametrize("name", ["full", "lsh", "linformer"])
@pytest.mark.parametrize("grad", [False, True])
def test_the_backend_s_projections_equal_the_portable_layer(monkeypatch, name, grad):
    """The layer with the CPU backend's projections (one function for the maps of x; without
    grad, writes into fresh memory and linformer's query blocks) against the same layer with
    every operation portable (the modules called): outputs and gradients."""
    from attnzoo import ops

    torch.manual_seed(0)
    extra = {"max_len": 40} if name == "linformer" else {}
    layer = attnzoo.MultiheadAttention(12, 3, mechanism=name, **extra).double()
    x = torch.randn(2, 33, 12, dtype=torch.float64)
    project_calls = override_answers(monkeypatch, "project")
    blocks_calls = override_answers(monkeypatch, "attend_in_query_blocks")

    def run():
        layer._generator = None  # lsh: the same draw each call
        return _grads(layer, x.requires_grad_()) if grad else (layer(x), [])

    with torch.set_grad_enabled(grad):
        fast, fast_grads = run()
        assert any(project_calls) and (grad or name != "linformer" or any(blocks_calls))
        with ops.portable():
            n = len(project_calls)
            slow, slow_grads = run()
            assert len(project_calls) == n  # not even asked
    torch.testing.assert_close(fast, slow, atol=1e-12, rtol=1e-10)
    for a, b in zip(fast_grads, slow_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
