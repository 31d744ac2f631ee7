"""Rows times a matrix's transpose, ``a wᵀ + b``, by oneDNN's inner product where it runs.

The layer's projections, their input gradient ``g W`` and linformer's ``E X`` and ``dE = g Xᵀ``
are such products of many rows. On some AMD CPUs MKL's sgemm takes its generic path while
oneDNN (torch's private ``mkldnn::_linear_pointwise``, guarded: absent in a build without
oneDNN) runs AVX-512 kernels. oneDNN writes a fresh tensor (no ``out=``), so it writes blocks
of BLOCK_BYTES, which the heap hands out again warm, each copied into the result at once.
Weights' gradients, float64 and products added into a tensor stay with torch's BLAS.

By default only on AMD's CPUs, where MKL was seen to take its generic path; elsewhere torch's
BLAS stays. ``ATTNZOO_ONEDNN=1`` or ``0`` decides instead. docs/internals.md gives the
measurements.
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
    autograd (the op has no derivative), no empty dimension (an empty product stays with torch),
    oneDNN built in and not turned off (``torch.backends.mkldnn.enabled``)."""
    return (USE_ONEDNN and _LINEAR is not None and torch.backends.mkldnn.enabled
            and not torch.is_grad_enabled() and a.device.type == "cpu" and a.dim() == 2 == w.dim()
            and a.dtype == w.dtype == torch.float32 and (bias is None or bias.dtype == a.dtype)
            and a.is_contiguous() and a.numel() > 0 and w.shape[0] > 0)


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
