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

Results of POOL_BYTES or more come from blocks that attnzoo maps itself and keeps when the
tensors on them die (up to ATTNZOO_KEEP_MIB MiB, default 256; 0 turns the keeping off;
:func:`empty_cache` hands them back): the next result of the same size takes one already
faulted in. Left to glibc, whose heap hands its top back to the OS whenever more than ~2×
the largest block freed so far lies free there, the same training step (efficient, L = 4096,
four 8 MiB results) read 7.6 ms in some processes and 35 ms in others, 4k page faults a step.
Blocks of a loop write their temporaries into one :class:`Scratch` instead of fresh tensors.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from functools import lru_cache

import torch

HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and arm64 (4 KiB base pages)
# glibc's largest dynamic mmap threshold on 64-bit: torch's larger allocations are always
# mapped afresh. Smaller ones mostly came from the heap, already faulted in, where advice cost
# more than it saved: at 8 MiB (L = 4096) linear's and efficient's training steps took 40-83 ms
# with 16-56 ms of kernel time in 1-2 of every 4 calls, against 22-34 ms with none advised.
# Kept blocks (below) follow the same line when they are first mapped.
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


def _advise_huge(ptr: int, nbytes: int) -> None:
    """Advise the whole huge pages of [ptr, ptr + nbytes) as such and fault them in (populate,
    by this thread alone), from MIN_BYTES on a Linux CPU. Best effort: nothing where madvise is
    missing or refuses (the kernel's THP set to never, or older than 5.14 for populating)."""
    if _MADVISE is not None and nbytes >= MIN_BYTES:
        start, length = whole_huge_pages(ptr, nbytes)
        if length and _MADVISE(start, length, _MADV_HUGEPAGE) == 0:
            _MADVISE(start, length, _MADV_POPULATE_WRITE)


POOL_BYTES = 1 << 20  # results from this size on come from kept blocks
KEEP_BYTES = int(os.environ.get("ATTNZOO_KEEP_MIB", "256")) << 20  # freed blocks kept, at most
_PAGE = mmap.PAGESIZE
_KEPT: list[mmap.mmap] = []  # blocks whose tensors died, the oldest first
_KEPT_LOCK = threading.Lock()  # tried, never waited on, in _block and _hand_back: no deadlock in GC


def _hand_back(lease, kept=_KEPT, lock=_KEPT_LOCK) -> None:
    """A lease's ``__del__``: its block is kept (the oldest dropped past KEEP_BYTES), or dropped
    where the lock is busy. (Defaults, not globals: it may run while the interpreter exits.)"""
    if lock.acquire(blocking=False):
        try:
            kept.append(lease.block)
            total, limit = sum(len(b) for b in kept), KEEP_BYTES or 0
            while total > limit:
                total -= len(kept.pop(0))
        finally:
            lock.release()


@lru_cache(maxsize=64)
def _lease_type(nbytes: int) -> type:
    """A ctypes array of ``nbytes`` on a block, whose death hands the block back: the tensor on
    it holds it (``torch.frombuffer``), views included, so it dies with the last of them."""
    return type("_Lease", (ctypes.c_byte * nbytes,), {"__del__": _hand_back})


def _block(nbytes: int) -> mmap.mmap:
    """A kept block of ``nbytes`` (page-rounded) or, where none is, a fresh anonymous mapping,
    its huge pages advised and populated (:func:`_advise_huge`)."""
    if _KEPT_LOCK.acquire(blocking=False):
        try:
            for i in range(len(_KEPT) - 1, -1, -1):  # the most recently freed first
                if len(_KEPT[i]) == nbytes:
                    return _KEPT.pop(i)
        finally:
            _KEPT_LOCK.release()
    block = mmap.mmap(-1, nbytes)
    _advise_huge(ctypes.addressof(ctypes.c_byte.from_buffer(block)), nbytes)
    return block


def empty_cache() -> None:
    """Hand the blocks attnzoo keeps for its next results back to the OS: the memory of results
    that are gone (up to ATTNZOO_KEEP_MIB MiB, default 256; see :mod:`attnzoo._pages`)."""
    with _KEPT_LOCK:
        _KEPT.clear()


def _after_fork() -> None:
    """A forked child starts without the parent's blocks, and with the lock free (a thread of
    the parent may have held it: that thread is not in the child)."""
    _KEPT.clear()
    if _KEPT_LOCK.locked():
        _KEPT_LOCK.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def fresh_empty(*shape: int, like: torch.Tensor, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """``like.new_empty(shape)`` (``new_empty_strided`` with ``stride``, a permutation of a
    contiguous layout: no gaps), for a result about to be written whole. On a CPU, from
    POOL_BYTES on, it lies on a kept block (see the module doc), else in fresh memory; on
    Linux its whole huge pages are advised and populated where it is MIN_BYTES or more
    (:func:`_advise_huge`). Its storage cannot be resized."""
    numel, device = math.prod(shape), like.device
    nbytes = numel * like.element_size()
    if device.type != "cpu" or nbytes < POOL_BYTES or not KEEP_BYTES:
        t = like.new_empty(shape) if stride is None else like.new_empty_strided(shape, stride)
        if device.type == "cpu":
            _advise_huge(t.data_ptr(), t.nbytes)
        return t
    block = _block(-(-nbytes // _PAGE) * _PAGE)
    lease = _lease_type(len(block)).from_buffer(block)
    lease.block = block
    flat = torch.frombuffer(lease, dtype=like.dtype, count=numel)
    return flat.view(shape) if stride is None else flat.as_strided(shape, stride)


def fresh_as(t: torch.Tensor) -> torch.Tensor:
    """A :func:`fresh_empty` tensor of t's shape, dtype and device, dense, its dimensions in
    memory in t's order (``torch.empty_like``'s strides): a gradient laid out as its input."""
    return fresh_empty(*t.shape, like=t, stride=torch.empty_like(t, device="meta").stride())


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
