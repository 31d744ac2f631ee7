"""Rows times a matrix's transpose, ``a wᵀ + b``, by oneDNN's inner product where it runs.

The layer's projections, their input gradient ``g W`` and linformer's ``E X`` and ``dE = g Xᵀ``
are such products of many rows. On the benchmark's AMD EPYC (Zen 4, 2 threads) MKL's sgemm
takes its generic path (``MKL_VERBOSE=1``: "Intel(R) Architecture processors") and oneDNN
its AVX-512 one (``ONEDNN_VERBOSE=1``: "brg_matmul:avx512_core"), in float32:

    (4096 × 512) (512 × 512)ᵀ          MKL 11.1 ms, oneDNN 9.9, in blocks with their copies 10.3
    dE = g Xᵀ (512 × 512) (4096 × 512)ᵀ   11.7 ms, 10.0, in blocks 10.6
    E X  (256 × 4096) (512 × 4096)ᵀ         6.2 ms, 5.2

Not faster there, and left to MKL: gᵀ X (a weight's gradient: oneDNN copies a transposed
first factor first), the (256 × 256) products of nystrom's heads, and products added into a
tensor. oneDNN writes a fresh tensor from torch's allocator (no ``out=``), which glibc faulted
in afresh on most calls (linformer's training step at L = 4096: ~3k page faults, none by MKL
into :func:`~attnzoo._pages.fresh_empty`'s kept blocks): it writes blocks of BLOCK_BYTES,
which the heap hands out again warm, each copied into the result at once.

By default only on AMD's CPUs, where MKL was seen to take its generic path; on Intel's MKL runs
its own AVX-512 kernels (not measured against oneDNN here), and elsewhere torch's BLAS stays.
``ATTNZOO_ONEDNN=1`` or ``0`` decides instead.
"""

from __future__ import annotations

import os

import torch

BLOCK_BYTES = 2 << 20  # oneDNN's result a call (see the module doc)


def _default_use(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """``ATTNZOO_ONEDNN`` where it is 1 or 0, else whether Linux names the CPU's vendor AMD."""
    chosen = os.environ.get("ATTNZOO_ONEDNN")
    if chosen in ("0", "1"):
        return chosen == "1"
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return False


USE_ONEDNN = _default_use()  # (tests set it to compare the two)


def _onednn_op():
    """torch's oneDNN inner product (mkldnn::_linear_pointwise), or None in a build without it."""
    try:
        return torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


_LINEAR = _onednn_op()


def by_onednn(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``a wᵀ + bias`` goes to oneDNN: float32 on a CPU, ``a`` 2-D and contiguous, no
    autograd (the op has no derivative), oneDNN built in and not turned off
    (``torch.backends.mkldnn.enabled``)."""
    return (USE_ONEDNN and _LINEAR is not None and torch.backends.mkldnn.enabled
            and not torch.is_grad_enabled() and a.device.type == "cpu" and a.dim() == 2 == w.dim()
            and a.dtype == w.dtype == torch.float32 and (bias is None or bias.dtype == a.dtype)
            and a.is_contiguous() and a.shape[1] > 0)


def times_t_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a wᵀ + bias`` written into ``out`` (n, m): a (n, k), w (m, k) in any strides, bias
    (m,) or None. By oneDNN where :func:`by_onednn`, a block of rows of the result (of columns,
    where it is wider than tall) a call; else by torch.mm (``out`` contiguous). Returns ``out``."""
    if not by_onednn(a, w, bias):
        return torch.mm(a, w.t(), out=out) if bias is None else torch.addmm(bias, a, w.t(), out=out)
    n, m = out.shape
    if n >= m:
        step = max(1, BLOCK_BYTES // (out.element_size() * m))
        for s in range(0, n, step):
            out[s:s + step].copy_(_LINEAR(a[s:s + step], w, bias, "none", [], ""))
    else:
        step = max(1, BLOCK_BYTES // (out.element_size() * n))
        for s in range(0, m, step):
            part = None if bias is None else bias[s:s + step]
            out[:, s:s + step].copy_(_LINEAR(a, w[s:s + step], part, "none", [], ""))
    return out
