import pytest
import torch

import attnzoo
from attnzoo import _pages


def _copy_from_torch(ours: attnzoo.MultiheadAttention, theirs: torch.nn.MultiheadAttention):
    wq, wk, wv = theirs.in_proj_weight.chunk(3)
    bq, bk, bv = theirs.in_proj_bias.chunk(3)
    with torch.no_grad():
        for lin, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_full_matches_torch_multihead_attention(causal, masked):
    torch.manual_seed(0)
    d, h, B, L = 24, 4, 3, 11
    theirs = torch.nn.MultiheadAttention(d, h, batch_first=True, dtype=torch.float64)
    ours = attnzoo.MultiheadAttention(d, h, causal=causal).double()
    _copy_from_torch(ours, theirs)
    x = torch.randn(B, L, d, dtype=torch.float64)
    key_mask = torch.rand(B, L) < 0.8 if masked else None
    if masked:
        key_mask[:, 0] = True  # torch gives NaN for rows with no key; keep every row seeing one
    attn_mask = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None  # torch: True = block
    expected, _ = theirs(x, x, x, attn_mask=attn_mask,
                         key_padding_mask=None if key_mask is None else ~key_mask,
                         need_weights=False)
    torch.testing.assert_close(ours(x, key_mask=key_mask), expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mechanism", ["full", "linformer", "nystrom"])
def test_out_bias_apart_from_bias(mechanism):
    """bias=False, out_bias=True (the layout of the linformer and nystrom-attention packages):
    no biases on q, k, v and one on the output, which moves the output by exactly that bias;
    out_bias=None follows bias."""
    opts = dict(proj_len=4, max_len=9) if mechanism == "linformer" else {}
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(12, 3, mechanism=mechanism, bias=False, out_bias=True, **opts).double()
    assert [p.bias is None for p in (layer.q_proj, layer.k_proj, layer.v_proj)] == [True] * 3
    assert layer.out_proj.bias is not None
    assert attnzoo.MultiheadAttention(12, 3, bias=False).out_proj.bias is None
    assert attnzoo.MultiheadAttention(12, 3, out_bias=False).q_proj.bias is not None
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    b = torch.randn(12, dtype=torch.float64)
    with torch.no_grad():
        layer.out_proj.bias.copy_(b)
        shifted = layer(x)
        layer.out_proj.bias.zero_()
        torch.testing.assert_close(shifted, layer(x) + b, atol=1e-12, rtol=1e-12)


def test_cross_attention_matches_torch():
    torch.manual_seed(1)
    d, h = 16, 2
    theirs = torch.nn.MultiheadAttention(d, h, batch_first=True, dtype=torch.float64)
    ours = attnzoo.MultiheadAttention(d, h).double()
    _copy_from_torch(ours, theirs)
    x, mem = torch.randn(2, 5, d, dtype=torch.float64), torch.randn(2, 9, d, dtype=torch.float64)
    expected, _ = theirs(x, mem, mem, need_weights=False)
    out = ours(x, mem)
    assert out.shape == (2, 5, d)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)


def test_layer_rejects_bad_configuration_and_input():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        attnzoo.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="unknown option"):
        attnzoo.MultiheadAttention(8, 2, factr=5)
    with pytest.raises(ValueError, match="unknown mechanism"):
        attnzoo.MultiheadAttention(8, 2, mechanism="nope")
    layer = attnzoo.MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match="d_model=8"):
        layer(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="batch sizes"):
        layer(torch.randn(2, 5, 8), torch.randn(3, 5, 8))


def test_gradients_reach_every_parameter():
    layer = attnzoo.MultiheadAttention(8, 2, causal=True)
    layer(torch.randn(2, 6, 8)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_recurrent_step_equals_causal_forward():
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(12, 3, mechanism="linear", causal=True).double()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    full = layer(x)
    state, outs = None, []
    for t in range(9):
        y, state = layer.step(x[:, t:t + 1], state)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="no recurrent step"):
        attnzoo.MultiheadAttention(12, 3, causal=True).step(x)


@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_every_mechanism_runs_in_the_layer(name):
    spec = attnzoo.get(name)
    extra = {"max_len": 64} if name == "linformer" else {}
    layer = attnzoo.MultiheadAttention(16, 2, mechanism=name, causal=spec.capabilities.causal, **extra)
    x = torch.randn(2, 21, 16)
    key_mask = torch.ones(2, 21, dtype=torch.bool)
    key_mask[1, 15:] = False
    y = layer(x, key_mask=key_mask)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()


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


def _grads(layer, x):
    layer.zero_grad(set_to_none=True)
    layer._generator = None  # lsh: the same draw each call (reseeded from layer.seed)
    x = x.detach().requires_grad_(x.requires_grad)
    y = layer(x)
    y.backward(torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3)))
    return y, [None if t.grad is None else t.grad.clone() for t in (x, *layer.parameters())]


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
    nn_mod = __import__("attnzoo.nn", fromlist=["_SharedInputLinear"])
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
    nn_mod = __import__("attnzoo.nn", fromlist=["times_t_into"])
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
    nn_mod = __import__("attnzoo.nn", fromlist=["_project"])
    x = torch.randn(2, 5, 6)
    same = [torch.nn.Linear(6, 4) for _ in range(3)]
    with torch.no_grad():
        outs = nn_mod._project(x, same)
        mixed = nn_mod._project(x, [torch.nn.Linear(6, 4), torch.nn.Linear(6, 3)])
    assert len({t.untyped_storage().data_ptr() for t in outs}) == 1
    assert len({t.untyped_storage().data_ptr() for t in mixed}) == 2
    for t, lin in zip(outs, same, strict=True):
        torch.testing.assert_close(t, lin(x))


def test_fused_projections_gradcheck():
    """Feature maps (x Wᵀ + b) and row maps (P x, P shared by the batch or one per entry)."""
    fn = __import__("attnzoo.nn", fromlist=["_SharedInputLinear"])._SharedInputLinear.apply
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


def test_a_global_module_hook_sees_every_projection():
    """A hook registered for every module (torch.nn.modules.module.register_module_forward_hook)
    keeps the projections separate, so it sees each of their calls."""
    layer = attnzoo.MultiheadAttention(8, 2)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(module) if isinstance(module, torch.nn.Linear) else None)
    try:
        layer(torch.randn(2, 5, 8, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    projections = (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj)
    assert [id(m) for m in seen] == [id(m) for m in projections]
