import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo

from mechanism_checks import cases, check_against_reference, check_gradcheck, random_inputs

linformer_cases = cases(causal=False, Dv=True, proj_len=st.integers(1, 12), share_kv=st.booleans())


@settings(max_examples=50, deadline=None)
@given(linformer_cases)
def test_linformer_matches_reference(case):
    check_against_reference("linformer", **case)


def test_identity_projection_equals_full():
    q, k, v, km = random_inputs(Lq=9, Lk=11, masked=True, empty_row=False)
    eye = torch.eye(11, dtype=q.dtype, device=q.device)
    out = attnzoo.attention(q, k, v, mechanism="linformer", key_mask=km, proj_k=eye, proj_v=eye)
    # zeroed padded keys still take part (score 0): compare with full attention on the same
    keep = km[:, None, :, None].to(q.dtype)
    torch.testing.assert_close(out, attnzoo.attention(q, k * keep, v * keep))
    torch.testing.assert_close(attnzoo.attention(q, k, v, mechanism="linformer", proj_k=eye, proj_v=eye),
                               attnzoo.attention(q, k, v))


def test_given_projections_are_sliced_to_the_length():
    q, k, v, _ = random_inputs(Lq=7, Lk=7)
    E = torch.randn(4, 20, dtype=q.dtype, device=q.device)
    a = attnzoo.attention(q, k, v, mechanism="linformer", proj_k=E, share_kv=True)
    b = attnzoo.attention(q, k, v, mechanism="linformer", proj_k=E[:, :7], proj_v=E[:, :7])
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="needs >= Lk"):
        attnzoo.attention(q, k, v, mechanism="linformer", proj_k=E[:, :5], share_kv=True)
    on_meta = torch.randn(1, 2, 7, 4, device="meta")  # stands in for a GPU: never moved, refused
    with pytest.raises(ValueError, match="proj_k is on cpu but the inputs are on meta"):
        attnzoo.attention(on_meta, on_meta, on_meta, mechanism="linformer", proj_k=E.cpu(), share_kv=True)


def test_layer_owns_e_and_f_for_max_len():
    layer = attnzoo.MultiheadAttention(16, 2, mechanism="linformer", proj_len=8, max_len=32)
    assert layer.proj_k.shape == (8, 32) and layer.proj_v.shape == (8, 32)
    x = torch.randn(2, 20, 16)
    y = layer(x)
    y.sum().backward()
    assert layer.proj_k.grad[:, 20:].abs().sum() == 0 and layer.proj_k.grad[:, :20].abs().sum() > 0
    with pytest.raises(ValueError, match="max_len"):
        attnzoo.MultiheadAttention(16, 2, mechanism="linformer")
    with pytest.raises(ValueError, match="needs >= Lk"):
        layer(torch.randn(1, 33, 16))
    shared = attnzoo.MultiheadAttention(16, 2, mechanism="linformer", max_len=32, share_kv=True)
    assert shared.proj_v is None and shared(x).shape == x.shape


def test_linformer_gradcheck():
    check_gradcheck("linformer", masked=True, Lq=5, Lk=7, options={"proj_len": 3})


def _layer_grads(layer, x, memory, key_mask):
    """The layer's output and the gradients of x, memory (None: self-attention) and its parameters."""
    layer.zero_grad(set_to_none=True)
    inputs = [t.detach().requires_grad_() for t in (x, memory) if t is not None]
    y = layer(*inputs, key_mask=key_mask)
    y.backward(torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3)))
    return y, [t.grad for t in (*inputs, *layer.parameters())]


def _layer_and_inputs(bias, share_kv, masked, cross):
    """A float64 linformer layer (d_model 12, 3 heads, proj_len 5, max_len 16), x (2, 9, 12), memory
    (2, 11, 12) or None, and a key mask with padding in the second batch entry or None."""
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(12, 3, mechanism="linformer", proj_len=5, max_len=16, bias=bias,
                                       share_kv=share_kv).double()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    memory = torch.randn(2, 11, 12, dtype=torch.float64) if cross else None
    key_mask = None
    if masked:
        key_mask = torch.ones(2, 11 if cross else 9, dtype=torch.bool)
        key_mask[1, 6:] = False
    return layer, x, memory, key_mask


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("share_kv", [True, False])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("cross", [True, False])
def test_layer_projects_e_x_first_as_every_key_projected(monkeypatch, bias, share_kv, masked, cross):
    """The layer computes (E X) W_Kᵀ + (E 1) b_Kᵀ; a hook on k_proj makes it project every key
    and call the mechanism. Outputs and every gradient agree (E, F: their first Lk columns)."""
    layer, x, memory, key_mask = _layer_and_inputs(bias, share_kv, masked, cross)
    calls = []
    forward = type(layer.extra).forward
    monkeypatch.setattr(type(layer.extra), "forward", lambda *a: calls.append(1) or forward(*a))
    fast_out, fast = _layer_grads(layer, x, memory, key_mask)
    assert calls == [1]
    layer.k_proj.register_forward_hook(lambda module, args, out: None)
    plain_out, plain = _layer_grads(layer, x, memory, key_mask)
    assert calls == [1]  # the hook: every key projected, then the mechanism
    torch.testing.assert_close(fast_out, plain_out, atol=1e-12, rtol=1e-10)
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("fast", [True, False])
def test_layer_without_grad_in_query_blocks_equals_training_forward(bias, masked, cross, fast):
    """Without grad the layer projects E X and F X alone and attends ``layer.in_query_blocks``;
    training self-attention projects q, E X and F X in one call and attends every query at once.
    The outputs agree, with the CPU backend (which may run the query rows in blocks) and
    without."""
    layer, x, memory, key_mask = _layer_and_inputs(bias, False, masked, cross)
    with contextlib.nullcontext() if fast else attnzoo.ops.portable():
        with torch.no_grad():
            inference = layer(x, memory, key_mask=key_mask)
        training = layer(x.requires_grad_(), memory, key_mask=key_mask)
    torch.testing.assert_close(inference, training.detach(), atol=1e-13, rtol=1e-12)
