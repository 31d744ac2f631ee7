"""torch.compile: every mechanism traces and gives the eager answer (compiled code takes the portable
bodies, plain torch, never a backend's C kernel or private op)."""

import pytest
import torch

import attnzoo

CAUSAL = [(n, c) for n in attnzoo.mechanisms() for c in (False, True)
          if not c or attnzoo.get(n).capabilities.causal]


def _inputs(L=80, D=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, D, generator=g) for _ in range(3))
    key_mask = torch.ones(2, L, dtype=torch.bool)
    key_mask[1, L - 13:] = False
    return q, k, v, key_mask


def _attend(name, causal):
    def attend(q, k, v, key_mask):
        return attnzoo.attention(q, k, v, mechanism=name, causal=causal, key_mask=key_mask,
                                 generator=torch.Generator().manual_seed(1))
    return attend


@pytest.mark.parametrize("name, causal", CAUSAL)
def test_every_mechanism_compiles_to_the_eager_answer(name, causal):
    """AOT autograd's tracing (fake tensors, the backward graph) without code generation: fast."""
    torch.compiler.reset()
    q, k, v, key_mask = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(_attend(name, causal), backend="aot_eager")
    out = compiled(*leaves, key_mask)
    out.square().sum().backward()
    want_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with attnzoo.ops.portable():
        want = _attend(name, causal)(*want_leaves, key_mask)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    for got_leaf, want_leaf in zip(leaves, want_leaves, strict=True):
        torch.testing.assert_close(got_leaf.grad, want_leaf.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name, causal", [("local", True), ("linear", True), ("prob_sparse", True)])
def test_inductor_compiles_a_few(name, causal):
    torch.compiler.reset()
    q, k, v, key_mask = _inputs()
    out = torch.compile(_attend(name, causal))(q, k, v, key_mask)
    torch.testing.assert_close(out, _attend(name, causal)(q, k, v, key_mask), atol=1e-5, rtol=1e-4)
