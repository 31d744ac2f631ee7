import pytest
import torch

import attnzoo


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
