"""Native kernels: C compiled on first use by the system's compiler, loaded with ctypes.

Causal linear attention's least work is a recurrence, S += φ(k)vᵀ then φ(q)ᵀS, one position
after another; eager torch can only run it as chunked matmuls and many passes over every
block. The recurrence in C keeps S in the L1 cache and reads each input once (kernels.c beside
this module); so do the non-causal form (φ = elu + 1) and efficient attention (two softmaxes
and two small products); LSH attention's rounds without gradients (each chunk's window of
keys in cache, its masks made as it goes); and attention of many queries over few keys and of
few queries over many keys, forward and backward.

Each family of kernels (causal linear, linear, efficient, few keys, few queries, LSH) gets a
build of its own for each (dtype, D, Dv): the sizes compiled in, so the compiler vectorises the
loops over them, and one family, so a first call compiles only the kernels it runs. Builds are
cached in ``$ATTNZOO_CACHE`` (default ``~/.cache/attnzoo``) under a name that hashes the source,
the flags and the CPU, so a changed source or another machine builds afresh. Where there is no
compiler, the build fails, or ``ATTNZOO_NATIVE=0``, the entry points (:func:`causal_linear`,
:func:`linear`, :func:`efficient`, :func:`few_keys`, :func:`few_queries`, :func:`lsh`,
:func:`lsh_order`, and :func:`lsh_kernels` for the hash) return None and the callers return
NotImplemented: the portable code runs, with the same results to rounding. The batch entries and
heads are split among torch's intra-op threads: where torch runs on OpenMP, the kernels are
built with it and split them in C, on the threads torch's own ops use; otherwise, and for LSH's,
a Python pool splits them (:func:`_over_heads`), ctypes letting go of the GIL while C runs.
docs/internals.md gives the measurements.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from attnzoo.backends.cpu.memory import fresh_as, fresh_empty, fresh_like
from attnzoo.ops import needs_grad
from attnzoo.paths import cache_dir

SOURCE = Path(__file__).with_name("kernels.c")
_REALS = {torch.float32: "float", torch.float64: "double"}  # the C type of each dtype built for
_SCALARS = {"float": ctypes.c_float, "double": ctypes.c_double}


def enabled() -> bool:
    """Whether native kernels may be used (``ATTNZOO_NATIVE=0`` turns them off)."""
    return os.environ.get("ATTNZOO_NATIVE", "1") != "0"


def available() -> bool:
    """Whether native kernels are on and a C compiler is found (a build may still fail)."""
    return enabled() and _compiler() is not None


def _flags() -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # AVX-512 where there is one (1.3x over 256 here)
    return flags


def _cpu() -> str:
    """What the build's -march=native depends on: the CPU's model and flags where Linux tells."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor() or platform.machine()


def _flag_sets() -> list[list[str]]:
    """The flags to build with, the first that builds: with OpenMP where torch's own parallel ops
    run on it (its libgomp.so.1 then serves the kernels too: one pool of threads), else without."""
    return [[*_flags(), "-fopenmp"], _flags()] if torch._C.has_openmp else [_flags()]


def _signatures(real: str) -> dict[str, dict[str, list]]:
    """Each family's entry points (kernels.c builds one family at a time) and their argument
    types; every build also has ``parallel_build`` and ``serial_heads``. Those not in
    :data:`_RETURN_NOTHING` return an int: a status (−1: no memory for their buffers) or, for
    ``parallel_build``, a flag."""
    ptr, i64, scalar = ctypes.c_void_p, ctypes.c_int64, _SCALARS[real]
    return {
        "causal_linear": {
            "causal_linear": [ptr] * 4 + [i64] * 3 + [ptr] * 3 + [i64] * 2 + [scalar] * 2,
            "causal_linear_grad": [ptr] * 6 + [i64] * 4 + [ptr] * 7 + [i64] * 2 + [scalar] * 2},
        "linear": {
            "linear_keys": [ptr] * 3 + [i64] * 2 + [ptr] * 2 + [i64] * 2 + [scalar],
            "linear_queries": [ptr, i64] + [ptr] * 3 + [i64] * 2 + [scalar] * 2,
            "linear_queries_grad": [ptr] * 2 + [i64] * 2 + [ptr] * 5 + [i64] * 2 + [scalar] * 2,
            "linear_keys_grad": [ptr] * 3 + [i64] * 2 + [ptr] * 4 + [i64] * 2 + [scalar]},
        "efficient": {
            "efficient_forward": [ptr] * 4 + [i64] * 3 + [ptr] * 5 + [i64] * 3 + [scalar] * 2,
            "efficient_backward": [ptr] * 5 + [i64] * 4 + [ptr] * 8 + [i64] * 3 + [scalar] * 2},
        "few_keys": {
            "few_keys_forward": [ptr] * 7 + [i64] * 5 + [scalar] * 2,
            "few_keys_backward": [ptr] * 13 + [i64] * 5 + [scalar] * 2},
        "few_queries": {
            "few_queries_forward": [ptr] * 9 + [i64] * 5 + [scalar] * 2,
            "few_queries_backward": [ptr] * 17 + [i64] * 5 + [scalar] * 2},
        "lsh": {
            "lsh_forward": [ptr] * 3 + [i64] * 3 + [ptr] * 9 + [i64] * 4 + [ctypes.c_int] + [scalar] * 3},
        "lsh_hash": {  # (no D or Dv: built once, at (1, 1))
            "lsh_buckets": [ptr] + [i64] * 4 + [ptr] + [i64] * 2,
            "lsh_order": [ptr] + [i64] * 3 + [ptr]},
    }


_RETURN_NOTHING = {"causal_linear", "linear_keys", "linear_queries", "efficient_forward", "serial_heads"}


@cache
def _library(cc: str, family: str, real: str, dk: int, dv: int) -> ctypes.CDLL | None:
    """``family``'s kernels built for (real, dk, dv), from the cache or compiled now; None where
    it fails."""
    signatures = {**_signatures(real)[family], "parallel_build": [], "serial_heads": []}
    defines = [f"-DFAMILY_{family.upper()}", f"-DREAL={real}", f"-DDK={dk}", f"-DDV={dv}"]
    for flags in _flag_sets():
        target, failure = _built(cc, flags, defines, f"kernels_{family}_{real}_{dk}x{dv}")
        if failure is None:
            break
    else:  # a compiler that fails is worth a word: the same results come, several times slower
        warnings.warn(f"attnzoo: the native kernels ({family}, {real}, D={dk}, Dv={dv}) did not build "
                      f"with {cc} ({failure}); the eager engines run instead, slower. ATTNZOO_NATIVE=0 "
                      f"turns the kernels off.", RuntimeWarning, stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, (None if name in _RETURN_NOTHING else ctypes.c_int)
    lib.splits_heads = bool(lib.parallel_build())
    _register_fork_hook()
    return lib


def _built(cc: str, flags: list[str], defines: list[str], stem: str) -> tuple[Path, str | None]:
    """The library of these flags, under a name that hashes them, the source and the CPU: from
    the cache, or built now into it or, where the cache cannot be written, into the temporary
    folder; with why it did not build (a line), else None."""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *flags, *defines, _cpu()]).encode())
    name = f"{stem}_{key.hexdigest()[:16]}.so"
    user = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"attnzoo{user}"):
        target = folder / name
        failure = None if target.exists() else _build(cc, flags, defines, target)
        if failure is None:
            break
    return target, failure


def _build(cc: str, flags: list[str], defines: list[str], target: Path) -> str | None:
    """Compile the source into ``target``: None where it worked, else why not (a line)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # then one atomic rename:
            built = Path(tmp) / target.name  # a concurrent build or reader never sees half a file
            subprocess.run([cc, *flags, *defines, str(SOURCE), "-o", str(built), "-lm"],
                           check=True, capture_output=True, timeout=120)
            os.replace(built, target)
        return None
    except subprocess.CalledProcessError as e:
        said = e.stderr.decode(errors="replace").strip().splitlines()
        return said[0] if said else f"exit status {e.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return str(e) or type(e).__name__


def _compiler() -> str | None:
    return _which(os.environ.get("CC", "cc"))


@cache
def _which(name: str) -> str | None:
    """``shutil.which``, once a name (a search of PATH on every kernel call cost more than some
    small calls)."""
    return shutil.which(name)


@cache
def _pool() -> ThreadPoolExecutor:
    _register_fork_hook()
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="attnzoo")


_forked = False  # whether this is a forked child (of a process that imported this module)


def _after_fork() -> None:
    """A forked child has none of its parent's threads: a new pool (:func:`_over_heads`), and no
    OpenMP region of more than one thread (:func:`_split_heads`)."""
    global _forked
    _forked = True
    _pool.cache_clear()


@cache
def _register_fork_hook() -> None:
    """Once, when the first kernel library loads or the pool starts: not at import, so that a
    process that never runs a kernel has no hook of attnzoo's."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, X) with rows of X contiguous values and its B·H heads ``stride(1)`` apart (as a
    slice of positions of a contiguous tensor is), else a copy with torch's standard strides.
    With one head the heads are the batch entries, so stride(1) is set to stride(0): torch keeps
    any stride for a dimension of size 1 (a (B, L, 1, X) tensor's transpose has X there, and
    ``contiguous()`` returns it as it is)."""
    B, H, L, X = t.shape
    if H == 1:
        t = t.as_strided(t.shape, (t.stride(0), t.stride(0), *t.stride()[2:]), t.storage_offset())
    rows_dense = (X < 2 or t.stride(3) == 1) and (L < 2 or t.stride(2) == X)
    if rows_dense and (B < 2 or t.stride(0) == H * t.stride(1)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _kernels(family: str, *ts: torch.Tensor, sizes: tuple[int, int] | None = None) -> ctypes.CDLL | None:
    """``family``'s kernels (a key of :func:`_signatures`) for ``ts`` = (q, k, v, ...) (B, H, ·, D)
    and (B, H, ·, Dv) (or the build for ``sizes`` (D, Dv)), or None where they cannot run: turned
    off, not on the CPU, not float32 or float64, or no compiler builds them."""
    dtype = ts[0].dtype
    if not available() or ts[0].device.type != "cpu" or dtype not in _REALS or any(
            t.dtype != dtype for t in ts):
        return None
    return _library(_compiler(), family, _REALS[dtype], *(sizes or (ts[0].shape[-1], ts[2].shape[-1])))


def _key_ok(key_mask, B, H, L):
    """key_mask (B, L) as (B·H, L) bytes for the kernels (None: every key)."""
    return None if key_mask is None else key_mask[:, None].expand(B, H, L).reshape(B * H, L).to(torch.uint8)


def _over_heads(n: int, run) -> None:
    """``run(a, b)`` for the heads a..b−1 of n, in parts over torch's intra-op threads: the first
    part on the calling thread (ctypes lets the GIL go), the others in the pool (each pool thread
    woken and waited for has a cost that short calls feel)."""
    threads = max(1, min(torch.get_num_threads(), n))
    bounds = [n * i // threads for i in range(threads + 1)]
    jobs = [_pool().submit(run, a, b) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
    try:
        run(bounds[0], bounds[1])
    finally:
        for job in jobs:
            job.result()


def _split_heads(lib: ctypes.CDLL, n: int, run) -> None:
    """``run(0, n)`` where the build splits the heads among OpenMP's threads itself (linear's and
    efficient's kernels, built with it: see kernels.c), else :func:`_over_heads`: also in a
    forked child, where the kernels are told to run each call on its calling thread alone."""
    if lib.splits_heads and not _forked:
        run(0, n)
        return
    if lib.splits_heads:
        lib.serial_heads()
    _over_heads(n, run)


def _floor(dtype: torch.dtype) -> float:
    """log of the smallest normal number: the kernels clamp their exponents there (subnormal or 0
    results are slow), as attnzoo's eager maps do."""
    return math.log(torch.finfo(dtype).tiny)


def _with_autograd(function, forward, lib, q, k, v, *args):
    """``function.apply(q, k, v, *args, lib)`` where autograd needs it, else ``forward``'s output."""
    if needs_grad(q, k, v):
        return function.apply(q, k, v, *args, lib)
    return forward(lib, q, k, v, *args)[0]


def _checked(*statuses: int) -> None:
    """Raise where a kernel could not have its buffers (status −1)."""
    if any(statuses):
        raise MemoryError("attnzoo native kernel: no memory for its buffers")


def _at(t: torch.Tensor | None, a: int, stride: int | None = None):
    """The address of head a of ``t`` (B·H heads ``stride`` values apart, default t.stride(1))."""
    if t is None:
        return None
    return t.data_ptr() + a * (t.stride(1) if stride is None else stride) * t.element_size()


def causal_linear(q, k, v, S, z, key_mask, eps):
    """Causal linear attention, φ = elu + 1, from the state before: q, k (B, H, L, D), v (B, H, L, Dv),
    S (B, H, D, Dv), z (B, H, D) -> (out (B, H, L, Dv), S after, z after), each key j <= i for
    query i; ``key_mask`` (B, L) bool or None (False: a padded key, no part in the state).
    Queries and keys aligned (the caller handles keys before the first query). O(L·D·Dv) time,
    O(D·Dv) memory beside the output; under autograd the backward is native too
    (:class:`_CausalLinear`). None where the kernels cannot run (:func:`_kernels`)."""
    lib = _kernels("causal_linear", q, k, v, S, z)
    if lib is None:
        return None
    if needs_grad(q, k, v, S, z):
        return _CausalLinear.apply(q, k, v, S, z, key_mask, eps, lib)
    return _causal_linear_forward(lib, q, k, v, S, z, key_mask, eps)


def _causal_linear_forward(lib, q, k, v, S, z, key_mask, eps):
    """(out, S after, z after) of :func:`causal_linear`."""
    (B, H, L, D), Dv = q.shape, v.shape[-1]
    q, k, v = _heads(q), _heads(k), _heads(v)
    S, z = S.contiguous().clone(), z.contiguous().clone()  # (overwritten with the state after)
    out, ok = fresh_empty(B, H, L, Dv, like=v), _key_ok(key_mask, B, H, L)
    floor = _floor(q.dtype)
    _split_heads(lib, B * H, lambda a, b: lib.causal_linear(
        _at(q, a), _at(k, a), _at(v, a), _at(ok, a, L), q.stride(1), k.stride(1), v.stride(1),
        _at(out, a, L * Dv), _at(S, a, D * Dv), _at(z, a, D), b - a, L, eps, floor))
    return out, S, z


class _CausalLinear(torch.autograd.Function):
    """:func:`causal_linear` under autograd: the forward keeps the state before and the output
    (no features, no state per position); the backward runs the recurrence again in C, forward
    for dq, then backward for dk, dv and the state before's gradients (kernels.c,
    causal_linear_grad): O(L·D·Dv) time, O(L) memory beside the gradients."""

    @staticmethod
    def forward(ctx, q, k, v, S, z, key_mask, eps, lib):
        out, S_after, z_after = _causal_linear_forward(lib, q, k, v, S, z, key_mask, eps)
        ctx.save_for_backward(q, k, v, S, z, key_mask, out)
        ctx.eps, ctx.lib = eps, lib
        return out, S_after, z_after

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        q, k, v, S, z, key_mask, out = ctx.saved_tensors
        grads = _causal_linear_backward(ctx.lib, q, k, v, S, z, key_mask, ctx.eps, out, g_out, g_S, g_z)
        return *grads, None, None, None


def _causal_linear_backward(lib, q, k, v, S, z, key_mask, eps, out, g_out, g_S, g_z):
    """(dq, dk, dv, dS, dz) of :func:`causal_linear` (``S``, ``z``: the state before)."""
    (B, H, L, D), Dv = q.shape, v.shape[-1]
    q, k, v, g = _heads(q), _heads(k), _heads(v), _heads(g_out)
    S, z = S.contiguous(), z.contiguous()
    dq, dk, dv = fresh_like(q, k, v)
    dS, dz = g_S.contiguous().clone(), g_z.contiguous().clone()  # in: the state after's; out: before's
    ok, floor = _key_ok(key_mask, B, H, L), _floor(q.dtype)
    _split_heads(lib, B * H, lambda a, b: _checked(lib.causal_linear_grad(
        _at(q, a), _at(k, a), _at(v, a), _at(ok, a, L), _at(g, a), _at(out, a, L * Dv), q.stride(1),
        k.stride(1), v.stride(1), g.stride(1), _at(S, a, D * Dv), _at(z, a, D), _at(dq, a, L * D),
        _at(dk, a, L * D), _at(dv, a, L * Dv), _at(dS, a, D * Dv), _at(dz, a, D), b - a, L, eps, floor)))
    return dq, dk, dv, dS, dz


def linear(q, k, v, key_mask, eps):
    """Non-causal linear attention, φ = elu + 1: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv)
    -> (B, H, Lq, Dv); ``key_mask`` (B, Lk) bool or None. O((Lq + Lk)·D·Dv) time, O(D·Dv)
    memory beside the output; under autograd the backward is native too (:class:`_Linear`).
    None where the kernels cannot run (:func:`_kernels`)."""
    lib = _kernels("linear", q, k, v)
    return None if lib is None else _with_autograd(_Linear, _linear_forward, lib, q, k, v, key_mask, eps)


def _linear_forward(lib, q, k, v, key_mask, eps):
    """(out, S (B·H, D, Dv), z (B·H, D)) of :func:`linear`."""
    (B, H, Lq, D), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    q, k, v = _heads(q), _heads(k), _heads(v)
    S, z = q.new_empty(B * H, D, Dv), q.new_empty(B * H, D)
    out, ok, floor = fresh_empty(B, H, Lq, Dv, like=v), _key_ok(key_mask, B, H, Lk), _floor(q.dtype)

    def run(a, b):  # heads a..b−1: their keys' state, then their queries
        lib.linear_keys(_at(k, a), _at(v, a), _at(ok, a, Lk), k.stride(1), v.stride(1),
                        _at(S, a, D * Dv), _at(z, a, D), b - a, Lk, floor)
        lib.linear_queries(_at(q, a), q.stride(1), _at(S, a, D * Dv), _at(z, a, D),
                           _at(out, a, Lq * Dv), b - a, Lq, eps, floor)

    _split_heads(lib, B * H, run)
    return out, S, z


class _Linear(torch.autograd.Function):
    """:func:`linear` under autograd: the forward keeps S and z (no features), the backward
    recomputes the features row by row in C. With f = φ(q), den = f·z + eps, gn = g/den,
    df = S gn and gden = −(f·df)/den: dq = (df + gden z) ⊙ φ'(q), dS = Σ f gnᵀ, dz = Σ f gden;
    then dv = dSᵀφ(k) and dk = (dS v + dz) ⊙ φ'(k) (0 for padded keys)."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, eps, lib):
        out, S, z = _linear_forward(lib, q, k, v, key_mask, eps)
        ctx.save_for_backward(q, k, v, key_mask, S, z)
        ctx.eps, ctx.lib = eps, lib
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, key_mask, S, z = ctx.saved_tensors
        return *_linear_backward(ctx.lib, q, k, v, key_mask, ctx.eps, S, z, grad), None, None, None


def _linear_backward(lib, q, k, v, key_mask, eps, S, z, grad):
    """(dq, dk, dv) of :func:`linear` from the forward's S and z."""
    (B, H, Lq, D), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    q, k, v, g = _heads(q), _heads(k), _heads(v), _heads(grad)
    dq, dk, dv = fresh_like(q, k, v)
    dS, dz, ok = torch.empty_like(S), torch.empty_like(z), _key_ok(key_mask, B, H, Lk)
    floor = _floor(q.dtype)

    def run(a, b):  # heads a..b−1: dq, dS, dz, then dk, dv
        _checked(lib.linear_queries_grad(
            _at(q, a), _at(g, a), q.stride(1), g.stride(1), _at(S, a, D * Dv), _at(z, a, D),
            _at(dq, a, Lq * D), _at(dS, a, D * Dv), _at(dz, a, D), b - a, Lq, eps, floor))
        _checked(lib.linear_keys_grad(
            _at(k, a), _at(v, a), _at(ok, a, Lk), k.stride(1), v.stride(1), _at(dS, a, D * Dv),
            _at(dz, a, D), _at(dk, a, Lk * D), _at(dv, a, Lk * Dv), b - a, Lk, floor))

    _split_heads(lib, B * H, run)
    return dq, dk, dv


def efficient(q, k, v, key_mask):
    """Efficient attention, σ_features(q) (Σ_j E_j v_jᵀ / Σ_j E_j) with E = exp(k − c) (c: each
    feature's max over the real keys): q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) ->
    (B, H, Lq, Dv); ``key_mask`` (B, Lk) bool or None. O((Lq + Lk)·D·Dv) time, O(D·Dv) memory
    beside the output; under autograd the backward is native too (:class:`_EfficientNative`).
    None where the kernels cannot run (:func:`_kernels`)."""
    lib = _kernels("efficient", q, k, v)
    if lib is None:
        return None
    return _with_autograd(_EfficientNative, _efficient_forward, lib, q, k, v, key_mask)


def _efficient_forward(lib, q, k, v, key_mask, keep_shift=False):
    """(out, G (B·H, D, Dv), z (B·H, D), c (B·H, D), shift) of :func:`efficient`; with
    ``keep_shift`` (for the backward; else None) the queries' row shifts max + log Σ exp(q − max)
    (B·H, Lq), by which σ(q) = exp(q − shift)."""
    (B, H, Lq, D), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    q, k, v = _heads(q), _heads(k), _heads(v)
    G, z, c = q.new_empty(B * H, D, Dv), q.new_empty(B * H, D), q.new_empty(B * H, D)
    shift = q.new_empty(B * H, Lq) if keep_shift else None
    out, ok = fresh_empty(B, H, Lq, Dv, like=v), _key_ok(key_mask, B, H, Lk)
    tiny, floor = torch.finfo(q.dtype).tiny, _floor(q.dtype)

    def run(a, b):  # heads a..b−1, each its keys' G, then its queries
        lib.efficient_forward(_at(q, a), _at(k, a), _at(v, a), _at(ok, a, Lk), q.stride(1), k.stride(1),
                              v.stride(1), _at(G, a, D * Dv), _at(z, a, D), _at(c, a, D),
                              _at(out, a, Lq * Dv), _at(shift, a, Lq), b - a, Lq, Lk, tiny, floor)

    _split_heads(lib, B * H, run)
    return out, G, z, c, shift


class _EfficientNative(torch.autograd.Function):
    """:func:`efficient` under autograd: the forward keeps G, z, c and the queries' row shifts, the
    backward recomputes each row's softmax (σ(q) = exp(q − shift)) or weights in C. With p = σ(q):
    dq = p ⊙ (G g − p·G g), dG = Σ p gᵀ; then dS = dG / z, dz = −(dG·G)/z (0 where no real key),
    and per key dk = E ⊙ (dS v + dz), dv = dSᵀE."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, lib):
        out, G, z, c, shift = _efficient_forward(lib, q, k, v, key_mask, keep_shift=True)
        ctx.save_for_backward(q, k, v, key_mask, G, z, c, shift)
        ctx.lib = lib
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, key_mask, G, z, c, shift = ctx.saved_tensors
        return *_efficient_backward(ctx.lib, q, k, v, key_mask, G, z, c, shift, grad), None, None


def _efficient_backward(lib, q, k, v, key_mask, G, z, c, shift, grad):
    """(dq, dk, dv) of :func:`efficient` from the forward's G, z, c and row shifts."""
    (B, H, Lq, D), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    q, k, v, g = _heads(q), _heads(k), _heads(v), _heads(grad)
    dq, dk, dv = fresh_like(q, k, v)
    dG, ok = torch.empty_like(G), _key_ok(key_mask, B, H, Lk)
    tiny, floor = torch.finfo(q.dtype).tiny, _floor(q.dtype)

    def run(a, b):  # heads a..b−1, each its dq and dG, then its dk and dv
        _checked(lib.efficient_backward(
            _at(q, a), _at(k, a), _at(v, a), _at(ok, a, Lk), _at(g, a), q.stride(1), k.stride(1),
            v.stride(1), g.stride(1), _at(G, a, D * Dv), _at(z, a, D), _at(c, a, D), _at(shift, a, Lq),
            _at(dG, a, D * Dv), _at(dq, a, Lq * D), _at(dk, a, Lk * D), _at(dv, a, Lk * Dv), b - a,
            Lq, Lk, tiny, floor))

    _split_heads(lib, B * H, run)
    return dq, dk, dv


def few_keys(q, k, v, scale):
    """softmax(q kᵀ·scale) v over every key, for many queries over few keys (linformer's projected
    ones, nystrom's landmarks): q (B, H, Lq, D), k (B, H, n, D), v (B, H, n, Dv) -> (B, H, Lq, Dv),
    laid out (B, Lq, H, Dv) as SDPA's CPU kernel lays out its own (a layer's merge of the heads
    stays a view). q in any layout whose rows are D contiguous values (a layer's split of the
    heads is read in place). O(Lq·n·(D + Dv)) time, O(n·(D + Dv)) memory a head beside the
    output (and each row's log-sum-exp, (B, H, Lq), kept for the backward under autograd, which
    is native too: :class:`_FewKeys`). None where the kernels cannot run (:func:`_kernels`) or
    there is no key."""
    lib = _kernels("few_keys", q, k, v)
    if lib is None or k.shape[2] == 0:
        return None
    q, k, v = _rows(q), k.contiguous(), v.contiguous()  # (once: the backward reads these too)
    if needs_grad(q, k, v):
        return _FewKeys.apply(q, k, v, scale, lib)
    return _few_keys_forward(lib, q, k, v, scale, keep_lse=False)[0]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t, or its contiguous copy where its rows' values are not contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _layout(t: torch.Tensor):
    """The strides of t (B, H, L, X)'s positions, batch entries and heads: a layout of kernels.c's
    few-keys kernels (an array: pass its address, and keep it while the call runs)."""
    return (ctypes.c_int64 * 3)(t.stride(2), t.stride(0), t.stride(1))


def _few_keys_forward(lib, q, k, v, scale, keep_lse):
    """(out, lse (B, H, Lq) or None) of :func:`few_keys`, q's rows and k and v contiguous."""
    (B, H, Lq, _), n, Dv = q.shape, k.shape[2], v.shape[-1]
    out = fresh_empty(B, Lq, H, Dv, like=v).transpose(1, 2)  # (B, H, Lq, Dv)
    lse = q.new_empty(B, H, Lq) if keep_lse else None
    ql, ol, floor = _layout(q), _layout(out), _floor(q.dtype)
    _split_heads(lib, B * H, lambda a, b: _checked(lib.few_keys_forward(
        q.data_ptr(), ctypes.addressof(ql), k.data_ptr(), v.data_ptr(), out.data_ptr(), ctypes.addressof(ol),
        None if lse is None else lse.data_ptr(), a, b - a, H, Lq, n, scale, floor)))
    return out, lse


class _FewKeys(torch.autograd.Function):
    """:func:`few_keys` under autograd: the forward keeps each row's log-sum-exp, the backward
    recomputes the softmax from it (nothing of (Lq, n) is kept) and takes dq, dk and dv in C."""

    @staticmethod
    def forward(ctx, q, k, v, scale, lib):
        out, lse = _few_keys_forward(lib, q, k, v, scale, keep_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.lib = scale, lib
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        lib, (B, H, Lq, D), n = ctx.lib, q.shape, k.shape[2]
        g = _rows(grad)
        dq = fresh_empty(B, Lq, H, D, like=q).transpose(1, 2)  # (B, H, Lq, D)
        dk, dv = fresh_like(k, v)
        ql, gl, ol, dql, floor = _layout(q), _layout(g), _layout(out), _layout(dq), _floor(q.dtype)
        _split_heads(lib, B * H, lambda a, b: _checked(lib.few_keys_backward(
            q.data_ptr(), ctypes.addressof(ql), k.data_ptr(), v.data_ptr(), g.data_ptr(),
            ctypes.addressof(gl), out.data_ptr(), ctypes.addressof(ol), lse.data_ptr(), dq.data_ptr(),
            ctypes.addressof(dql), dk.data_ptr(), dv.data_ptr(), a, b - a, H, Lq, n, ctx.scale, floor)))
        return dq, dk, dv, None, None


def few_queries(q, k, v, key_mask, scale, keep_lse):
    """softmax(q kᵀ·scale) v over the keys ``key_mask`` (B, Lk) keeps (None: every key), for few
    queries over many keys (nystrom's landmark queries): q (B, H, m, D), k (B, H, Lk, D), v
    (B, H, Lk, Dv) -> (out (B, H, m, Dv), lse (B, H, m) where ``keep_lse``, else None); a query
    with no key gets 0 (lse −inf). q, k and v in any layout whose rows are contiguous (a layer's
    split of the heads is read in place). O(m·Lk·(D + Dv)) time, O(m·(D + Dv)) memory a head
    beside the output. No autograd: the caller's function takes the gradients
    (:class:`~attnzoo.backends.cpu.few.FewQueries`). None where the kernels cannot run
    (:func:`_kernels`)."""
    lib = _kernels("few_queries", q, k, v)
    if lib is None:
        return None
    (B, H, m, _), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = q.new_empty(B, H, m, Dv)
    lse = q.new_empty(B, H, m) if keep_lse else None
    ok = _key_ok(key_mask, B, H, Lk)
    ql, kl, vl, floor = _layout(q), _layout(k), _layout(v), _floor(q.dtype)
    _split_heads(lib, B * H, lambda a, b: _checked(lib.few_queries_forward(
        q.data_ptr(), ctypes.addressof(ql), k.data_ptr(), ctypes.addressof(kl), v.data_ptr(),
        ctypes.addressof(vl), None if ok is None else ok.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), a, b - a, H, m, Lk, scale, floor)))
    return out, lse


def few_queries_grad(q, k, v, key_mask, scale, g, out, lse):
    """The gradients (dq, dk, dv) of :func:`few_queries`' output from its gradient g (B, H, m, Dv),
    its output and its log-sum-exp: dq laid out as q, dk and dv as k and v (dense, in the same
    order of dimensions; 0 for a padded key). O(m·Lk·(D + Dv)) time, O(m·(D + Dv)) memory a
    head beside them. None where the kernels cannot run (:func:`_kernels`)."""
    lib = _kernels("few_queries", q, k, v)
    if lib is None:
        return None
    (B, H, m, _), Lk = q.shape, k.shape[2]
    q, k, v, g, out, lse = _rows(q), _rows(k), _rows(v), _rows(g), out.contiguous(), lse.contiguous()
    dq, dk, dv = (fresh_as(t) for t in (q, k, v))
    ok, floor = _key_ok(key_mask, B, H, Lk), _floor(q.dtype)
    layouts = [_layout(t) for t in (q, k, v, g, dq, dk, dv)]
    ql, kl, vl, gl, dql, dkl, dvl = (ctypes.addressof(lay) for lay in layouts)
    _split_heads(lib, B * H, lambda a, b: _checked(lib.few_queries_backward(
        q.data_ptr(), ql, k.data_ptr(), kl, v.data_ptr(), vl, None if ok is None else ok.data_ptr(),
        g.data_ptr(), gl, out.data_ptr(), lse.data_ptr(), dq.data_ptr(), dql, dk.data_ptr(), dkl,
        dv.data_ptr(), dvl, a, b - a, H, m, Lk, scale, floor)))
    return dq, dk, dv


def lsh(q, k, v, hashed, codes, key_mask, causal, shared, across, m, scale2, self2):
    """LSH attention's forward without gradients, every round in C: q, k (B, H, L, D), v (B, H, L, Dv)
    -> (B, H, L, Dv). ``hashed`` = (q_buckets, k_buckets, q_order, k_order), each (B, H, n_hashes, L)
    int64 (:func:`attnzoo.mechanisms.lsh._buckets_and_order`); ``codes`` = (q_code, k_code) of the
    rounds each pair met in, or None (keys met in several rounds then count once a round); scores
    in base 2 (``scale2`` = scale·log2 e). ``shared``: the keys are k/‖k‖ (k is q; scaled as the
    kernel gathers them, not written as a copy), ``self2`` off a query's own key.
    O(n_hashes·L·2m·(D + Dv)) time, O(m·(D + Dv)) memory a thread beside the output. None under
    autograd, or where the kernels cannot run (:func:`_kernels`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return None
    lib = _kernels("lsh", q, k, v)
    if lib is None:
        return None
    (B, H, L, _), Dv, R = q.shape, v.shape[-1], hashed[2].shape[2]
    q, k, v = _heads(q), _heads(k), _heads(v)
    q_buckets, k_buckets, q_order, k_order = (t.reshape(B * H, R, L).contiguous() for t in hashed)
    q_code, k_code = (None, None) if codes is None else (
        c.to(torch.int32).reshape(B * H, R, L).contiguous() for c in codes)
    out, ok = fresh_empty(B, H, L, Dv, like=v), _key_ok(key_mask, B, H, L)
    k_scale = None  # (B·H, L): 1 / max(‖k‖, 1e-12), F.normalize's factors
    if shared:
        k_scale = torch.linalg.vector_norm(k, dim=-1).clamp_min_(1e-12).reciprocal_().reshape(B * H, L)
    flags, floor = int(causal) | 2 * int(shared) | 4 * int(across), _floor(q.dtype)
    _over_heads(B * H, lambda a, b: _checked(lib.lsh_forward(
        _at(q, a), _at(k, a), _at(v, a), q.stride(1), k.stride(1), v.stride(1),
        *(_at(t, a, R * L) for t in (q_order, k_order, q_buckets, k_buckets, q_code, k_code)),
        _at(ok, a, L), _at(k_scale, a, L), _at(out, a, L * Dv), b - a, L, R, m, flags, scale2, self2, floor)))
    return out


def lsh_kernels(x: torch.Tensor) -> ctypes.CDLL | None:
    """The build that hashes x (B, H, L, D) (:func:`lsh_buckets`; it uses no D or Dv: one build
    serves every shape), or None where the kernels cannot run."""
    return _kernels("lsh_hash", x, sizes=(1, 1))


def lsh_buckets(lib, rotated, buckets, start) -> None:
    """LSH's bucket of n positions in each round from ``rotated`` (B, H, R, b/2, n) = (x R)ᵀ into
    ``buckets`` (B, H, R, L) at positions start..start + n: the first index of the maximum of
    [xR; −xR] (:func:`attnzoo.mechanisms.lsh.hash_buckets`)."""
    B, H, R, half, n = rotated.shape
    L = buckets.shape[-1]
    _over_heads(B * H, lambda a, b: _checked(lib.lsh_buckets(
        _at(rotated, a, R * half * n), b - a, n, R, half, _at(buckets, a, R * L), L, start)))


def lsh_order(buckets: torch.Tensor, n_buckets: int) -> torch.Tensor | None:
    """``torch.sort(buckets, dim=-1, stable=True)[1]`` for int64 buckets (..., L) in [0, n_buckets),
    by a counting sort in C: O(L + n_buckets) a row. None where the kernels cannot run or a
    bucket is out of range."""
    lib = lsh_kernels(torch.empty(0))  # (float32's: the sort needs no REAL either)
    if lib is None or buckets.dtype != torch.int64 or buckets.device.type != "cpu":
        return None
    b = buckets.contiguous()
    L, rows = b.shape[-1], b.numel() // max(1, b.shape[-1])
    order, failed = torch.empty_like(b), []

    def run(a, z):
        if lib.lsh_order(_at(b, a, L), z - a, L, n_buckets, _at(order, a, L)):
            failed.append(a)

    _over_heads(rows, run)
    return None if failed else order
