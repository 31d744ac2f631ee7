"""Large results in huge pages, and block temporaries in reused buffers.

A fresh tensor of tens of MiB is mapped from the OS and faulted in 4 KiB at a time when it
is first written: at L = 16384 a (1, 8, L, 64) float32 output is 8192 faults, ~12 ms on the
benchmark's CPU for a copy of ~2 ms, and every output and gradient of that size pays it.
Advised as transparent huge pages (Linux's MADV_HUGEPAGE) before it is written, the same
tensor is faulted in 2 MiB at a time: ~4 ms. torch does this for every allocation when the
process starts with THP_MEM_ALLOC_ENABLE=1; attnzoo does it for its own large results only,
and then faults the pages in at once from the calling thread (MADV_POPULATE_WRITE, Linux
5.14+): written by torch's threads together, fresh huge pages took ~50 ms per 32 MiB in a
process's first allocations on the benchmark's VM (one thread: ~8 ms; populated: 3-8 ms).
Blocks of a loop write their temporaries into one :class:`Scratch` instead of fresh tensors.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and arm64 (4 KiB base pages)
# glibc's largest dynamic mmap threshold on 64-bit: larger results are always mapped afresh.
# Smaller ones mostly come from the heap, already faulted in, where advice cost more than it
# saved: at 8 MiB (L = 4096) linear's and efficient's training steps took 40-83 ms with
# 16-56 ms of kernel time in 1-2 of every 4 calls, against 22-34 ms with none advised.
MIN_BYTES = 16 * HUGE_PAGE
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL) and the pages fault as written


def thp_never(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> bool:
    """Whether the kernel's transparent huge pages are off ("[never]"): advice would not help,
    and populating small pages in one call ran slower than faulting them as written."""
    try:
        with open(path) as f:
            return "[never]" in f.read()
    except OSError:
        return False


def _madvise():
    """libc's madvise, or None off Linux, where it cannot be found or where THP is off."""
    if not sys.platform.startswith("linux") or thp_never():
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def whole_huge_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(start, length): the whole huge pages inside the bytes [ptr, ptr + nbytes); length 0
    if there is none."""
    start = -(-ptr // HUGE_PAGE) * HUGE_PAGE
    return start, max(0, (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE - start)


def fresh_empty(*shape: int, like: torch.Tensor, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """``like.new_empty(shape)`` (``new_empty_strided`` with ``stride``, a permutation of a
    contiguous layout: no gaps), for a result about to be written whole: on a Linux CPU, when
    it is at least MIN_BYTES, its whole huge pages are advised as such and faulted in first
    (populated, by this thread alone). Best effort: the tensor is the same where madvise is
    missing or refuses (the kernel's THP set to never, or older than 5.14 for populating)."""
    t = like.new_empty(shape) if stride is None else like.new_empty_strided(shape, stride)
    if _MADVISE is not None and t.device.type == "cpu" and t.nbytes >= MIN_BYTES:
        start, length = whole_huge_pages(t.data_ptr(), t.nbytes)
        if length and _MADVISE(start, length, _MADV_HUGEPAGE) == 0:
            _MADVISE(start, length, _MADV_POPULATE_WRITE)
    return t


def fresh_like(*tensors: torch.Tensor, zero: bool = False) -> tuple[torch.Tensor, ...]:
    """A :func:`fresh_empty` tensor of each of ``tensors``' shape, dtype and device (contiguous),
    zero-filled with ``zero``: gradients about to be written whole, or added into."""
    out = tuple(fresh_empty(*t.shape, like=t) for t in tensors)
    return tuple(t.zero_() for t in out) if zero else out


class Scratch:
    """Buffers that every block of one call reuses, by name and shape: a block's temporaries
    are written into them (``out=``) rather than into fresh tensors. A fresh tensor of a
    block's size (~1 MiB) is faulted in from the OS again whenever glibc's heap has just
    handed its memory back, which in some processes happens block after block: there linear's
    forward at L = 16384 took 26k–29k page faults a call (~1k in others) and twice the time."""

    def __init__(self, like: torch.Tensor):
        self.like, self.buffers, self.parts = like, {}, {}

    def part(self, name: str) -> Scratch:
        """A scratch of its own for part ``name`` of a block (made on first request): two parts
        alive at once, such as the query's and the key's feature maps, must not share buffers."""
        if name not in self.parts:
            self.parts[name] = Scratch(self.like)
        return self.parts[name]

    def __call__(self, name: str, shape) -> torch.Tensor:
        """The ``shape`` buffer ``name`` (made on first request); it holds until the next request
        for ``name`` and that shape. (A dict lookup: a view into one buffer a name took ~7 µs.)"""
        key = (name, tuple(shape))
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = self.like.new_empty(shape)
        return buf


def scratch_buffer(scratch: Scratch | None, name: str, shape) -> torch.Tensor | None:
    """``scratch(name, shape)``, or None (a fresh result) without a scratch: for ``out=``."""
    return None if scratch is None else scratch(name, shape)
