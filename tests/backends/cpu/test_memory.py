import sys

import pytest
import torch

from attnzoo.backends.cpu import memory as _pages
from attnzoo.backends.cpu.memory import (
    HUGE_PAGE,
    MIN_BYTES,
    empty_cache,
    fresh_empty,
    fresh_like,
    whole_huge_pages,
)


@pytest.fixture(autouse=True)
def no_kept_blocks(monkeypatch):
    """Each test starts with no kept block (a block kept by another would be taken, not mapped),
    and with keeping on, as a user who asked for it has it (it is off by default)."""
    monkeypatch.setattr(_pages, "KEEP_BYTES", 256 << 20)
    empty_cache()
    yield
    empty_cache()


def test_nothing_is_kept_or_advised_unless_asked():
    """By default fresh_empty is torch's new_empty: no kept block, no huge-page advice, no fork
    hook; ``keep`` turns keeping on and off."""
    import subprocess

    code = ("import os, torch; from attnzoo.backends.cpu import memory as m; "
            "t = m.fresh_empty(1 << 22, like=torch.zeros(1)); del t; "
            "print(m.KEEP_BYTES, len(m._KEPT), m._MADVISE is None, "
            "m._register_fork_hook.cache_info().currsize)")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("ATTNZOO_KEEP_MIB", "ATTNZOO_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0", "True", "0"]


def test_keep_turns_keeping_on_and_off():
    _pages.keep(0)
    fresh_empty(_pages.POOL_BYTES, like=torch.zeros(1))  # dies at once: nothing kept
    assert not _pages._KEPT
    _pages.keep(64)
    fresh_empty(_pages.POOL_BYTES, like=torch.zeros(1))
    assert _pages._KEPT and _pages.KEEP_BYTES == 64 << 20
    _pages.keep(0)
    assert not _pages._KEPT
    with pytest.raises(ValueError, match="mib must be >= 0"):
        _pages.keep(-1)


@pytest.fixture
def unkept(monkeypatch):
    """fresh_empty without kept blocks: torch's own allocation, advised."""
    monkeypatch.setattr(_pages, "KEEP_BYTES", 0)


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


def test_fresh_empty_advises_a_large_result_and_is_a_plain_tensor(monkeypatch, unkept):
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


def test_fresh_empty_with_strides_is_laid_out_as_asked_and_advised(monkeypatch, unkept):
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


@pytest.mark.parametrize("keep", [True, False])
def test_fresh_empty_populates_only_advised_huge_pages(monkeypatch, keep):
    calls = []
    monkeypatch.setattr(_pages, "_MADVISE", lambda *args: calls.append(args) or -1)  # refused
    monkeypatch.setattr(_pages, "KEEP_BYTES", _pages.KEEP_BYTES if keep else 0)
    fresh_empty(MIN_BYTES // 4, like=torch.zeros(1)).zero_()
    assert [advice for *_, advice in calls] == [14]


def test_a_dead_result_s_block_is_taken_by_the_next_of_its_size():
    like = torch.zeros(1, dtype=torch.float64)
    n = _pages.POOL_BYTES // 8 + 3  # not a whole number of pages; 5 × 26215
    t = fresh_empty(n, like=like).fill_(1.0)
    ptr = t.data_ptr()
    del t
    assert [len(b) for b in _pages._KEPT] == [-(-n * 8 // _pages._PAGE) * _pages._PAGE]
    u = fresh_empty(5, n // 5, like=like, stride=(1, 5))  # the same bytes, another layout
    assert u.data_ptr() == ptr and u.shape == (5, n // 5) and u.stride() == (1, 5) and not _pages._KEPT
    assert fresh_empty(n + 4096, like=like).data_ptr() != ptr  # another size: a block of its own
    small = fresh_empty(5, like=like)  # below POOL_BYTES: torch's allocation, resizable
    assert small.untyped_storage().resizable()


def test_a_block_stays_with_its_views_until_the_last_dies():
    t = fresh_empty(_pages.POOL_BYTES // 4, like=torch.zeros(1)).fill_(7.0)
    view = t[10:20]
    del t
    assert not _pages._KEPT  # the view holds the block
    other = fresh_empty(_pages.POOL_BYTES // 4, like=torch.zeros(1)).fill_(-1.0)  # a fresh block
    assert (view == 7.0).all() and (other == -1.0).all()
    del view
    assert len(_pages._KEPT) == 1


def test_kept_blocks_are_bounded_oldest_dropped_first(monkeypatch):
    size = _pages.POOL_BYTES
    monkeypatch.setattr(_pages, "KEEP_BYTES", 2 * size)
    ts = [fresh_empty(size // 4, like=torch.zeros(1)) for _ in range(3)]
    blocks = [t.data_ptr() for t in ts]
    while ts:  # freed in order: the first is dropped when the third comes back
        ts.pop(0)
    again = [fresh_empty(size // 4, like=torch.zeros(1)) for _ in range(3)]
    assert [t.data_ptr() for t in again[:2]] == [blocks[2], blocks[1]]  # the newest first
    assert again[2].data_ptr() not in blocks[1:]
    empty_cache()
    assert not _pages._KEPT


def test_after_a_fork_no_block_is_kept_and_the_lock_is_free():
    fresh_like(torch.zeros(_pages.POOL_BYTES // 4))  # dies at once: its block is kept
    assert _pages._KEPT and _pages._KEPT_LOCK.acquire()  # held, as by a thread that forked away
    _pages._after_fork()
    assert not _pages._KEPT and not _pages._KEPT_LOCK.locked()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc's resident set is Linux's")
def test_benchmark_memory_counts_a_result_on_a_kept_block():
    from attnzoo.bench.measure import peak_memory
    n = _pages.POOL_BYTES  # floats: 4 × POOL_BYTES bytes
    fresh_empty(n, like=torch.zeros(1))  # dies at once: a block of this size is kept
    assert _pages._KEPT
    peak = peak_memory(lambda: fresh_empty(n, like=torch.zeros(1)).fill_(1.0))
    assert peak is None or peak >= 4 * _pages.POOL_BYTES - HUGE_PAGE


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
def test_libc_madvise_is_found_on_linux(monkeypatch):
    monkeypatch.setattr(_pages, "_MADVISE", _pages._madvise())  # as ATTNZOO_HUGE_PAGES=1 has it
    assert (_pages._MADVISE is None) == _pages.thp_never()  # found, unless THP is off
    t = fresh_empty(MIN_BYTES // 4, like=torch.zeros(1))  # the real calls, on a real tensor
    assert t.fill_(2.0).sum().item() == 2 * t.numel()
