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
    eye = torch.eye(11, dtype=q.dtype)
    out = attnzoo.attention(q, k, v, mechanism="linformer", key_mask=km, proj_k=eye, proj_v=eye)
    # zeroed padded keys still take part (score 0): compare with full attention on the same
    keep = km[:, None, :, None].to(q.dtype)
    torch.testing.assert_close(out, attnzoo.attention(q, k * keep, v * keep))
    torch.testing.assert_close(attnzoo.attention(q, k, v, mechanism="linformer", proj_k=eye, proj_v=eye),
                               attnzoo.attention(q, k, v))


def test_given_projections_are_sliced_to_the_length():
    q, k, v, _ = random_inputs(Lq=7, Lk=7)
    E = torch.randn(4, 20, dtype=q.dtype)
    a = attnzoo.attention(q, k, v, mechanism="linformer", proj_k=E, share_kv=True)
    b = attnzoo.attention(q, k, v, mechanism="linformer", proj_k=E[:, :7], proj_v=E[:, :7])
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="needs >= Lk"):
        attnzoo.attention(q, k, v, mechanism="linformer", proj_k=E[:, :5], share_kv=True)


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
