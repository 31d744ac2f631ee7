"""torch.compile and torch.export: every mechanism traces and gives the eager answer. Traced code
takes the portable bodies (plain torch), but for linear and efficient attention's C kernels, which
it takes as custom operators (attnzoo.backends.cpu.library): one node each, fake and backward
registered."""

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


@pytest.mark.parametrize("name, causal", [("linear", True)])
def test_inductor_compiles_around_the_custom_ops(name, causal):
    """Inductor's code generation, once (its first compile costs about 25 s on 2 cores): around the C
    kernels' custom operators. The tracing of every mechanism is the aot_eager test's."""
    torch.compiler.reset()
    q, k, v, key_mask = _inputs()
    out = torch.compile(_attend(name, causal))(q, k, v, key_mask)
    torch.testing.assert_close(out, _attend(name, causal)(q, k, v, key_mask), atol=1e-5, rtol=1e-4)


LIBRARY = [("linear", False), ("linear", True), ("efficient", False)]
custom_ops = pytest.mark.skipif(not hasattr(torch.library, "custom_op"),
                                reason="torch.library.custom_op: torch >= 2.4")


def _graph_ops(fn, *args) -> set[str]:
    """The functions called in the graph(s) torch.compile traces of fn(*args)."""
    torch.compiler.reset()
    found = set()

    def backend(gm, example_inputs):
        found.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    return found


@custom_ops
@pytest.mark.parametrize("name, causal", LIBRARY)
def test_traced_linear_and_efficient_take_the_c_kernels_as_custom_ops(name, causal):
    q, k, v, key_mask = _inputs()
    found = _graph_ops(_attend(name, causal), q, k, v, key_mask)
    assert any(op.startswith("attnzoo.") for op in found), found
    with attnzoo.ops.portable():  # ATTNZOO_FAST=0 keeps them out of traced code too
        found = _graph_ops(_attend(name, causal), q, k, v, key_mask)
    assert not any(op.startswith("attnzoo.") for op in found)


@custom_ops
@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("name, causal", LIBRARY)
def test_custom_ops_give_the_portable_answer_and_gradients(name, causal, native, monkeypatch):
    """float64, with padding; ATTNZOO_NATIVE=0: the operators' own portable fallback (an exported
    program where the kernels cannot build)."""
    from attnzoo.backends.cpu import library

    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    q, k, v, key_mask = (t.double() if t.is_floating_point() else t for t in _inputs(L=70))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if name == "efficient":
        out = library.efficient(*leaves, key_mask)[0]
    elif causal:
        S0, z0 = torch.rand(2, 2, 16, 16, dtype=torch.float64), torch.rand(2, 2, 16, dtype=torch.float64)
        leaves += [S0.clone().requires_grad_(), z0.clone().requires_grad_()]
        out, S, z = library.causal_linear_elu(*leaves, key_mask, 1e-6)
        out = out.sum() + S.square().sum() + z.sum()
    else:
        out = library.linear_elu(*leaves, key_mask, 1e-6)[0]
    out.square().sum().backward()
    want_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    with attnzoo.ops.portable():
        if name == "efficient":
            want = library._portable_efficient(*want_leaves, key_mask)
        elif causal:
            state = tuple(want_leaves[3:])
            want, (S, z) = library._portable_linear(*want_leaves[:3], key_mask, 1e-6, state=state)
            want = want.sum() + S.square().sum() + z.sum()
        else:
            want = library._portable_linear(*want_leaves, key_mask, 1e-6)[0]
    want.square().sum().backward()
    torch.testing.assert_close(out, want)
    for got_leaf, want_leaf in zip(leaves, want_leaves, strict=True):
        torch.testing.assert_close(got_leaf.grad, want_leaf.grad)


@custom_ops
def test_custom_ops_pass_torch_library_opcheck():
    """Schema, fake implementation, autograd registration, as torch.library checks them."""
    from attnzoo.backends.cpu import library

    q, k, v, key_mask = _inputs(L=24)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    S, z = torch.rand(2, 2, 16, 16), torch.rand(2, 2, 16)
    torch.library.opcheck(library.linear_elu, (*leaves, key_mask, 1e-6))
    torch.library.opcheck(library.linear_elu, (*leaves, None, 1e-6))
    torch.library.opcheck(library.causal_linear_elu, (*leaves, S, z, key_mask, 1e-6))
    torch.library.opcheck(library.efficient, (*leaves, key_mask))


def test_every_mechanism_exports_to_the_eager_answer():
    """torch.export of a MultiheadAttention layer: the program runs and gives the layer's output."""
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))
    for name in attnzoo.mechanisms():
        options = {"max_len": 64} if name == "linformer" else {}
        layer = attnzoo.MultiheadAttention(32, 4, name, seed=0, **options).eval()
        program = torch.export.export(layer, (x,))
        torch.testing.assert_close(program.module()(x), layer(x), atol=1e-5, rtol=1e-4, msg=name)
