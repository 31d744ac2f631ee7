"""Half precision and autocast: the accumulations that overflow or stall in float16 / bfloat16
run in float32, so a half-precision output is as close to a float64 golden as rounding the
golden itself to that dtype allows (PyTorch flex-attention's rule: the error within a small
multiple of the precision's own floor), at lengths up to 60000 for the kernel mechanisms."""

import pytest
import torch

import attnzoo
from attnzoo import ops

HALF = [torch.float16, torch.bfloat16]
KERNEL = ["linear", "taylor", "performer", "efficient"]
DISCRETE = {"prob_sparse", "lsh"}  # top-u queries and hash buckets may flip between precisions


def _rel(out: torch.Tensor, golden: torch.Tensor) -> float:
    return ((out.double() - golden).norm() / golden.norm()).item()


def _check_half(name, L, dtype, causal, D=16, slack=3.0):
    """Our half-precision output against the float64 golden of the same (half-rounded) inputs: within
    ``slack`` times the error of the golden rounded to ``dtype``, on the default and portable paths."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, D, generator=g).to(dtype) for _ in range(3))

    def run(*ts):
        generator = torch.Generator().manual_seed(1)
        return attnzoo.attention(*ts, mechanism=name, causal=causal, generator=generator)

    with torch.no_grad():
        golden = run(*(t.double() for t in (q, k, v)))
        floor = _rel(golden.to(dtype), golden)
        out = run(q, k, v)
        with ops.portable():
            portable = run(q, k, v)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, golden) <= slack * floor, (name, _rel(out, golden), floor)
    assert _rel(portable, golden) <= slack * floor, (name, _rel(portable, golden), floor)


@pytest.mark.parametrize("name, causal", [(n, c) for n in KERNEL for c in (False, True)
                                           if not c or attnzoo.get(n).capabilities.causal])
@pytest.mark.parametrize("dtype", HALF)
def test_kernel_mechanisms_hold_half_precision_at_60000(name, causal, dtype):
    _check_half(name, 60000, dtype, causal)


@pytest.mark.parametrize("name", [n for n in attnzoo.mechanisms() if n not in KERNEL + sorted(DISCRETE)])
@pytest.mark.parametrize("dtype", HALF)
def test_every_other_mechanism_holds_half_precision(name, dtype):
    for causal in [False] + [True] * attnzoo.get(name).capabilities.causal:
        _check_half(name, 3000, dtype, causal, D=32)


@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_a_layer_under_cpu_bfloat16_autocast(name):
    """Projections in bfloat16, the mechanism fed bfloat16: finite, and within 5e-2 of the float32
    layer (where no discrete choice can flip)."""
    options = {"max_len": 1024} if name == "linformer" else {}
    torch.manual_seed(0)
    layer = attnzoo.MultiheadAttention(64, 4, mechanism=name, **options).eval()
    x = torch.randn(2, 1024, 64)
    with torch.no_grad():
        want = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    if name not in DISCRETE:
        assert _rel(got, want.double()) < 5e-2
