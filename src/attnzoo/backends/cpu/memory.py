"""Memory keeping for large CPU results, and block temporaries in reused buffers: opt-in.

A fresh tensor of tens of MiB is mapped from the OS and faulted in 4 KiB at a time when it
is first written, and glibc's heap may hand a freed block back to the OS between two calls,
so that the next call faults it in again. Two opt-in remedies live here, both off by default
because they change the whole process's memory:

- *Kept blocks* (``ATTNZOO_KEEP_MIB=N`` in the environment, or :func:`keep`): results of
  POOL_BYTES or more come from blocks that attnzoo maps itself and keeps when the tensors on
  them die, up to N MiB, so the next result of the same size takes one already faulted in;
  :func:`empty_cache` hands them back. Keeping registers a fork hook (a child starts
  without its parent's blocks).
- *Huge pages* (``ATTNZOO_HUGE_PAGES=1``): results of MIN_BYTES or more are advised as
  transparent huge pages (Linux's MADV_HUGEPAGE) and faulted in at once from the calling
  thread (MADV_POPULATE_WRITE, Linux 5.14+), 2 MiB at a time instead of 4 KiB. torch's own
  ``THP_MEM_ALLOC_ENABLE=1`` does this for every allocation of a process.

Without either, :func:`fresh_empty` is ``new_empty``. docs/internals.md gives the
measurements behind both. Blocks of a loop write their temporaries into one
:class:`Scratch` instead of fresh tensors (only where each block's result is copied out
before the next block runs: a result left in a scratch buffer is overwritten by the next).
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
# more than it saved. Kept blocks (below) follow the same line when they are first mapped.
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


_MADVISE = _madvise() if os.environ.get("ATTNZOO_HUGE_PAGES", "0") == "1" else None


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
KEEP_BYTES = int(os.environ.get("ATTNZOO_KEEP_MIB", "0")) << 20  # freed blocks kept, at most (0: none)
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
    that are gone (kept only where asked: :func:`keep`)."""
    with _KEPT_LOCK:
        _KEPT.clear()


def _after_fork() -> None:
    """A forked child starts without the parent's blocks, and with the lock free (a thread of
    the parent may have held it: that thread is not in the child)."""
    _KEPT.clear()
    if _KEPT_LOCK.locked():
        _KEPT_LOCK.release()


def keep(mib: int) -> None:
    """Keep the blocks of dead results, up to ``mib`` MiB, for the next results of their size
    (0: keep none, the default; ``ATTNZOO_KEEP_MIB`` sets it at import). Process-wide: every
    attnzoo call's large CPU results then come from kept blocks."""
    global KEEP_BYTES
    if mib < 0:
        raise ValueError(f"keep: mib must be >= 0, got {mib}")
    KEEP_BYTES = int(mib) << 20
    if KEEP_BYTES:
        _register_fork_hook()
    else:
        empty_cache()


@lru_cache(maxsize=1)
def _register_fork_hook() -> None:
    """Once, when keeping starts: a forked child drops the parent's blocks."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)


if KEEP_BYTES:
    _register_fork_hook()



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
    are written into them (``out=``) rather than into fresh tensors, which glibc's heap may
    hand back to the OS and fault in again block after block. A buffer is reused by the next
    request of its name and shape: only a result copied out before then may be written here."""

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
        for ``name`` and that shape."""
        key = (name, tuple(shape))
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = self.like.new_empty(shape)
        return buf


def scratch_buffer(scratch: Scratch | None, name: str, shape) -> torch.Tensor | None:
    """``scratch(name, shape)``, or None (a fresh result) without a scratch: for ``out=``."""
    return None if scratch is None else scratch(name, shape)
