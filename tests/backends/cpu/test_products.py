import pytest
import torch

import attnzoo
from attnzoo.backends.cpu import products as _products

needs_onednn = pytest.mark.skipif(_products._LINEAR is None, reason="torch built without oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    """The calls that reach oneDNN's op, recorded (each: the shapes of a and w), oneDNN chosen
    whatever the CPU."""
    monkeypatch.setattr(_products, "USE_ONEDNN", True)
    calls, op = [], _products._LINEAR
    monkeypatch.setattr(_products, "_LINEAR",
                        lambda a, w, *rest: calls.append((a.shape, w.shape)) or op(a, w, *rest))
    return calls


@needs_onednn
@pytest.mark.parametrize("n, m", [(37, 5), (5, 37), (16, 16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("w_transposed", [False, True])
def test_times_t_into_by_blocks_equals_the_product(monkeypatch, onednn_calls, n, m, bias, w_transposed):
    """Blocks of rows (of columns where the result is wider), the last one short, each by oneDNN
    and copied into place: the product a wᵀ + b, as float64 computes it."""
    monkeypatch.setattr(_products, "BLOCK_BYTES", 4 * 3 * min(n, m))  # 3 rows (columns) of float32 a block
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, 11, generator=g)
    w = torch.randn(11, m, generator=g).t() if w_transposed else torch.randn(m, 11, generator=g)
    b = torch.randn(m, generator=g) if bias else None
    out = torch.full((n, m), float("nan"))
    with torch.no_grad():
        assert _products.times_t_into(out, a, w, b) is out
    expected = a.double() @ w.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert len(onednn_calls) == -(-max(n, m) // 3)


@needs_onednn
def test_times_t_into_leaves_to_mkl_what_onednn_does_not_take(monkeypatch, onednn_calls):
    """float64, autograd, a transposed first factor, oneDNN turned off: torch.mm, the same values."""
    a, w = torch.randn(6, 4), torch.randn(3, 4)
    cases = [(a.double(), w.double(), False), (a, w, True), (a.t().contiguous().t(), w, False)]
    for x, y, grad in cases:
        with torch.set_grad_enabled(grad):
            out = _products.times_t_into(torch.empty(6, 3, dtype=x.dtype), x, y)
        torch.testing.assert_close(out, x @ y.t())
    for module, name in ((torch.backends.mkldnn, "enabled"), (_products, "USE_ONEDNN")):
        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(module, name, False)
            _products.times_t_into(torch.empty(6, 3), a, w)
    assert onednn_calls == []
    with torch.no_grad():
        _products.times_t_into(torch.empty(6, 3), a, w)
    assert len(onednn_calls) == 1


@needs_onednn
@pytest.mark.parametrize("n, m, k", [(0, 3, 4), (6, 0, 4), (6, 3, 0)])
def test_times_t_into_leaves_an_empty_product_to_torch(onednn_calls, n, m, k):
    """An empty batch (or width) is torch's empty or zero product, never a block size of zero rows."""
    a, w, b = torch.randn(n, k), torch.randn(m, k), torch.randn(m)
    with torch.no_grad():
        out = _products.times_t_into(torch.full((n, m), float("nan")), a, w, b)
    torch.testing.assert_close(out, a @ w.t() + b)
    assert onednn_calls == []


def _step(layer, x):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x)
    out.backward(torch.ones_like(out))
    return out.detach(), [x.grad, *(p.grad for p in layer.parameters())]


@needs_onednn
@pytest.mark.parametrize("mechanism", ["linformer", "nystrom"])
def test_layer_by_onednn_equals_layer_by_mkl(monkeypatch, onednn_calls, mechanism):
    """A float32 layer's forward (without grad) and training step with its products by oneDNN
    (the projections, their input gradient, linformer's E X, F X and dE, dF) and by MKL alone:
    the same to float32's rounding."""
    torch.manual_seed(0)
    options = {"proj_len": 8, "max_len": 50} if mechanism == "linformer" else {"num_landmarks": 5}
    layer = attnzoo.MultiheadAttention(16, 2, mechanism=mechanism, bias=False, out_bias=True, **options)
    x = torch.randn(2, 45, 16, requires_grad=True)
    with torch.no_grad():
        fwd = layer(x)
    step = _step(layer, x)
    assert len(onednn_calls) >= 6
    monkeypatch.setattr(_products, "USE_ONEDNN", False)
    with torch.no_grad():
        fwd_mkl = layer(x)
    step_mkl = _step(layer, x)
    torch.testing.assert_close(fwd, fwd_mkl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[0], step_mkl[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(step[1], step_mkl[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_onednn_by_default_on_amd_cpus_or_as_the_environment_says(tmp_path, monkeypatch):
    amd, intel = tmp_path / "amd", tmp_path / "intel"
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: AMD-like name\n")
    monkeypatch.delenv("ATTNZOO_ONEDNN", raising=False)
    assert _products._default_use(str(amd)) and not _products._default_use(str(intel))
    assert not _products._default_use(str(tmp_path / "missing"))
    monkeypatch.setenv("ATTNZOO_ONEDNN", "0")
    assert not _products._default_use(str(amd))
    monkeypatch.setenv("ATTNZOO_ONEDNN", "1")
    assert _products._default_use(str(intel))
