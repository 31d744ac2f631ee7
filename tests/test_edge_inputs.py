"""Degenerate shapes and arguments: empty results where torch gives them, clear errors elsewhere."""

import pytest
import torch

import attnzoo

MECHANISMS = attnzoo.mechanisms()


def _causal(name):
    return attnzoo.get(name).capabilities.causal


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("B, H", [(0, 2), (2, 0)])
def test_no_batch_entries_or_no_heads_give_an_empty_result(name, B, H):
    q = torch.randn(B, H, 40, 8, requires_grad=True)
    k, v = torch.randn(B, H, 40, 8), torch.randn(B, H, 40, 6, requires_grad=True)
    for causal in [False] + [True] * _causal(name):
        out = attnzoo.attention(q, k, v, mechanism=name, causal=causal)
        assert out.shape == (B, H, 40, 6) and out.dtype == q.dtype
        out.sum().backward()
        assert q.grad.shape == q.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_layer_takes_an_empty_batch(name):
    options = {"max_len": 24} if name == "linformer" else {}
    layer = attnzoo.MultiheadAttention(16, 2, mechanism=name, **options)
    x = torch.randn(0, 24, 16)
    assert layer(x).shape == (0, 24, 16)


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_head_dim_of_zero_is_refused(name):
    q = torch.randn(1, 2, 16, 0)
    with pytest.raises(ValueError, match="head dims must be >= 1"):
        attnzoo.attention(q, q, q, mechanism=name)
    with pytest.raises(ValueError, match="Dv=0"):
        attnzoo.attention(torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4), q, mechanism=name)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0, True, "0.1"])
def test_a_scale_that_is_not_finite_and_positive_is_refused(scale):
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        attnzoo.attention(q, q, q, mechanism="full", scale=scale)


def test_connectivity_defaults_to_attentions_causal_false():
    assert attnzoo.connectivity("full", length=4).all()
    assert attnzoo.connectivity("local", length=9, window=2)[0, 1]  # two-sided: query 0 sees key 1
