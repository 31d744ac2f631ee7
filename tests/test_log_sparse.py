import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo

from mechanism_checks import cases, check_against_reference, check_gradcheck

log_cases = cases(local=st.integers(1, 5), restart=st.none() | st.integers(1, 12))


@settings(max_examples=60, deadline=None)
@given(log_cases)
def test_log_sparse_matches_reference(case):
    check_against_reference("log_sparse", **case)


def test_log_sparse_pattern_is_the_papers():
    m = attnzoo.connectivity("log_sparse", length=20, causal=True)
    assert torch.nonzero(m[13]).flatten().tolist() == [5, 9, 11, 12, 13]  # 13-8, -4, -2, -1, 0
    assert torch.nonzero(m[0]).flatten().tolist() == [0]
    local = attnzoo.connectivity("log_sparse", length=20, causal=True, local=3)
    # window 0..2, then 2 + 1, 2, 4, 8, 16
    assert torch.nonzero(local[19]).flatten().tolist() == [1, 9, 13, 15, 16, 17, 18, 19]
    restart = attnzoo.connectivity("log_sparse", length=20, causal=True, restart=8)
    assert torch.nonzero(restart[13]).flatten().tolist() == [9, 11, 12, 13]  # 13-8 = 5 is outside
    two_sided = attnzoo.connectivity("log_sparse", length=20, causal=False)
    assert torch.nonzero(two_sided[4]).flatten().tolist() == [0, 2, 3, 4, 5, 6, 8, 12]


def test_each_query_sees_log_many_keys():
    m = attnzoo.connectivity("log_sparse", length=1024, causal=True)
    assert m.sum(1).max() == 11  # itself and 1, 2, 4, ..., 512


def test_log_sparse_gradcheck():
    check_gradcheck("log_sparse", causal=True, masked=True, Lq=7, Lk=7, options={"local": 2})
    check_gradcheck("log_sparse", Lq=5, Lk=8, options={"restart": 4})


@pytest.mark.parametrize("kernel_size", [1, 3])
def test_layer_never_sees_the_future(kernel_size):
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(16, 2, mechanism="log_sparse", causal=True,
                                       kernel_size=kernel_size).double()
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    y = layer(x)
    x2 = x.clone()
    x2[:, 17:] += torch.randn_like(x2[:, 17:])
    y2 = layer(x2)
    torch.testing.assert_close(y[:, :17], y2[:, :17], atol=1e-12, rtol=0)
    assert not torch.allclose(y[:, 17:], y2[:, 17:])


def test_convolutional_queries_and_keys():
    layer = attnzoo.MultiheadAttention(8, 2, mechanism="log_sparse", kernel_size=4)
    assert isinstance(layer.q_proj, attnzoo.nn.CausalConv1d)
    assert isinstance(layer.k_proj, attnzoo.nn.CausalConv1d)
    assert isinstance(layer.v_proj, torch.nn.Linear)
    assert layer(torch.randn(2, 9, 8)).shape == (2, 9, 8)
    with pytest.raises(ValueError, match="kernel_size"):
        attnzoo.MultiheadAttention(8, 2, mechanism="log_sparse", kernel_size=0)
    with pytest.raises(ValueError, match="unknown option"):
        attnzoo.MultiheadAttention(8, 2, mechanism="full", kernel_size=3)
