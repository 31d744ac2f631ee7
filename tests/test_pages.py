import sys

import pytest
import torch

from attnzoo import _pages
from attnzoo._pages import HUGE_PAGE, MIN_BYTES, fresh_empty, fresh_like, whole_huge_pages


@pytest.mark.parametrize("ptr, nbytes, expected", [
    (0, 3 * HUGE_PAGE, (0, 3 * HUGE_PAGE)),  # aligned at both ends
    (16, 3 * HUGE_PAGE, (HUGE_PAGE, 2 * HUGE_PAGE)),  # the partial pages at either end are left out
    (HUGE_PAGE - 1, HUGE_PAGE + 2, (HUGE_PAGE, HUGE_PAGE)),
    (16, HUGE_PAGE, (HUGE_PAGE, 0)),  # no whole huge page inside
])
def test_whole_huge_pages_lie_inside_the_tensor(ptr, nbytes, expected):
    start, length = whole_huge_pages(ptr, nbytes)
    assert (start, length) == expected
    assert start % HUGE_PAGE == 0 and length % HUGE_PAGE == 0
    assert length == 0 or (start >= ptr and start + length <= ptr + nbytes)


def test_fresh_empty_advises_a_large_result_and_is_a_plain_tensor(monkeypatch):
    calls = []
    monkeypatch.setattr(_pages, "_MADVISE", lambda *args: calls.append(args) or 0)
    like = torch.zeros(2, dtype=torch.float64)
    t = fresh_empty(MIN_BYTES // 8 + 3, like=like)
    assert t.shape == (MIN_BYTES // 8 + 3,) and t.dtype == torch.float64
    (start, length, advice), (start2, length2, populate) = calls
    assert (advice, populate) == (14, 23) and (start, length) == (start2, length2)  # advise, populate
    assert length >= 2 * HUGE_PAGE
    assert t.data_ptr() <= start and start + length <= t.data_ptr() + t.numel() * 8
    t.fill_(1.0)  # written whole, as its callers do
    assert t.sum().item() == t.numel()
    fresh_empty(5, like=like)  # small: left to the heap
    assert len(calls) == 2


def test_fresh_empty_with_strides_is_laid_out_as_asked_and_advised(monkeypatch):
    """Laid out as a transposed (B, H, L, D) view of (B, L, H, D), and advised as a contiguous
    result of its size is."""
    calls = []
    monkeypatch.setattr(_pages, "_MADVISE", lambda *args: calls.append(args) or 0)
    B, H, L, D = 1, 4, MIN_BYTES // (4 * 4 * 16), 16
    t = fresh_empty(B, H, L, D, like=torch.zeros(1), stride=(L * H * D, D, H * D, 1))
    assert t.shape == (B, H, L, D) and t.stride() == (L * H * D, D, H * D, 1)
    (start, length, _), _ = calls
    assert length >= t.nbytes - 2 * HUGE_PAGE
    assert t.data_ptr() <= start and start + length <= t.data_ptr() + t.nbytes


def test_fresh_empty_populates_only_advised_huge_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(_pages, "_MADVISE", lambda *args: calls.append(args) or -1)  # refused
    fresh_empty(MIN_BYTES // 4, like=torch.zeros(1)).zero_()
    assert [advice for *_, advice in calls] == [14]


def test_fresh_like_takes_each_shape_and_dtype_and_zeroes_on_request():
    a, b = torch.ones(2, 3, dtype=torch.float64).t(), torch.ones(4, dtype=torch.int32)  # (a: a view)
    x, y = fresh_like(a, b, zero=True)
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((3, 2), torch.float64, (4,), torch.int32)
    assert x.is_contiguous() and not x.any() and not y.any()
    assert [t.shape for t in fresh_like(a, b)] == [(3, 2), (4,)]


def test_thp_never_reads_the_kernel_setting(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert _pages.thp_never(str(setting))
    setting.write_text("always [madvise] never\n")
    assert not _pages.thp_never(str(setting))
    assert not _pages.thp_never(str(tmp_path / "missing"))  # no such file: not known to be off


def test_fresh_empty_without_madvise(monkeypatch):
    monkeypatch.setattr(_pages, "_MADVISE", None)
    assert fresh_empty(3, 4, like=torch.zeros(1, dtype=torch.float16)).shape == (3, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_libc_madvise_is_found_on_linux():
    assert (_pages._MADVISE is None) == _pages.thp_never()  # found, unless THP is off
    t = fresh_empty(MIN_BYTES // 4, like=torch.zeros(1))  # the real calls, on a real tensor
    assert t.fill_(2.0).sum().item() == 2 * t.numel()
