"""Measuring one mechanism in this process: inputs, time, peak memory, error against full.

Run by the sweep in fresh child processes per mechanism (``python -m attnzoo.bench.child``),
so one mechanism's allocations never count against another's: one for the timed calls
(:func:`measure_cell`), with glibc's defaults as a user's process has them, and one for the
memory calls (:func:`measure_memory`), started with :func:`memory_env`.

Peak memory of one call: the kernel's resident high-water mark (VmHWM) is reset
to the current resident set by writing 5 to /proc/self/clear_refs, right after
``gc.collect()`` and glibc ``malloc_trim(0)`` have handed freed memory back and
after the inputs exist; the call's peak is VmHWM afterwards minus VmRSS before.
It counts every page the call touched (intermediates, output, and with backward
the saved activations and gradients), exact to the page, not sampled. In a process
started with :func:`memory_env` that is the call's peak of live memory. Where
/proc is missing (not Linux) memory is reported as unknown.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

import attnzoo

FAMILIES = ("gaussian", "peaked", "trained")
TRAINED = Path(__file__).parents[1] / "data" / "trained_attention.pt"  # benchmarks/train_attention_inputs.py
MMAP_THRESHOLD = 128 * 1024  # bytes: glibc maps larger blocks for their life (memory processes)


@dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    backward: bool = False


def make_inputs(shape: Shape, L: int, family: str, seed: int = 0):
    """q, k, v of (B, H, L, D) for an input family.

    - ``gaussian``: i.i.d. N(0, 1): scores q·k/√D have unit variance, so attention is
      spread nearly uniformly over the keys (the hard case for sparse patterns).
    - ``peaked``: every feature an AR(1) process along the sequence (coefficient
      0.9, unit variance), q = k + 0.1 noise, scaled by 1.5: scores fall as
      ~18·0.9^|i-j|, so attention concentrates on the nearest ~20 positions, as in
      smooth time series.
    - ``trained``: real attention inputs, those of the first encoder layer of a forecaster
      trained on ETTh1 (:func:`trained_inputs`); (1, its heads, L, its head dim) whatever
      the shape asks, the same for every seed.
    """
    if family == "trained":
        return tuple(t.to(getattr(torch, shape.dtype)) for t in trained_inputs(L))
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    size = (shape.batch, shape.heads, L, shape.head_dim)
    if family == "gaussian":
        q, k, v = (torch.randn(size, generator=g) for _ in range(3))
    elif family == "peaked":
        noise = torch.randn(size, generator=g)
        k = torch.empty(size)
        k[:, :, 0] = noise[:, :, 0]
        rho = 0.9
        for i in range(1, L):  # AR(1): k_i = rho k_{i-1} + sqrt(1 - rho²) e_i
            k[:, :, i] = rho * k[:, :, i - 1] + math.sqrt(1 - rho * rho) * noise[:, :, i]
        q = 1.5 * (k + 0.1 * torch.randn(size, generator=g))
        k = 1.5 * k
        v = torch.randn(size, generator=g)
    else:
        raise ValueError(f"unknown input family {family!r}; known: {FAMILIES}")
    return q.to(dtype), k.to(dtype), v.to(dtype)


@cache
def _trained() -> tuple[dict, object]:
    """The shipped weights (benchmarks/train_attention_inputs.py) and the series they apply to."""
    from attnzoo.data import ETTH1
    from attnzoo.data.timeseries import read_csv

    return torch.load(TRAINED, weights_only=True), read_csv(ETTH1)


@torch.no_grad()
def trained_inputs(L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, H, L, Dh) float32: the first L hours of ETTh1's OT (scaled as in training)
    through the trained forecaster's input embedding, with its positions at length L, and its
    first encoder layer's query, key and value projections (that layer sees the embedding)."""
    from attnzoo.data.timeseries import time_features
    from attnzoo.models.informer import DataEmbedding

    saved, series = _trained()
    w, d_model = saved["weights"], saved["d_model"]
    if L > len(series.times):
        raise ValueError(f"trained inputs: ETTh1 has {len(series.times)} hours, fewer than L = {L}")
    embed = DataEmbedding(1, d_model, dropout=0.0, max_len=L)
    embed.value.weight.copy_(w["value"])
    embed.time.weight.copy_(w["time"])
    ot = series.columns.index("OT")
    x = ((series.values[:L, ot:ot + 1] - saved["mean"]) / saved["std"]).float()  # (L, 1)
    h = embed(x[None], time_features(series.times[:L])[None].float())  # (1, L, d_model)
    heads = [torch.nn.functional.linear(h, w[f"{p}.weight"], w[f"{p}.bias"]) for p in "qkv"]
    return tuple(t.unflatten(-1, (saved["n_heads"], -1)).transpose(1, 2).contiguous() for t in heads)


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _release_memory() -> None:
    """Free what the process holds but no longer uses: garbage, glibc's free heap, attnzoo's
    kept blocks (a result counts as memory its call adds, as it would without them)."""
    gc.collect()
    attnzoo.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def memory_env() -> dict[str, str]:
    """The environment of a memory process: glibc's mmap threshold fixed at MMAP_THRESHOLD.
    Every block of that size or more is then mapped for its life and unmapped when freed, so a
    call's peak resident memory is its peak of live memory, not what glibc's heap failed to
    reuse. With glibc's default (a threshold that rises as blocks are freed) the identical SDPA
    training step at L = 4096 read 29-60 MiB from call to call; with it, 18.0-18.1 MiB in every
    call. It must hold from the process's start: mallopt() after the first calls changed
    nothing (the heap's free chunks still serve large requests). It also slows large
    allocations, so timed calls run in a process without it."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))


def require_memory_env() -> None:
    """Raise RuntimeError unless this process was started with :func:`memory_env`'s setting: a
    memory process without it would read what glibc's heap kept as the call's memory."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):
        raise RuntimeError(f"a memory process needs MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} set from its "
                           "start (attnzoo.bench.measure.memory_env)")


def peak_memory(fn) -> int | None:
    """Bytes of resident memory ``fn()`` adds at its peak (see the module doc), or None."""
    _release_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        fn()
        return None
    before = _proc_status("VmRSS")
    fn()
    after = _proc_status("VmHWM")
    if before is None or after is None:
        return None
    return max(0, after - before)


def call(name: str, q, k, v, shape: Shape, options: dict):
    """One timed unit: a forward (no grad), or forward + backward with a fixed upstream grad."""
    gen = torch.Generator().manual_seed(0)
    if not shape.backward:
        with torch.no_grad():
            return attnzoo.attention(q, k, v, mechanism=name, causal=shape.causal, generator=gen,
                                     **options)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = attnzoo.attention(q, k, v, mechanism=name, causal=shape.causal, generator=gen, **options)
    out.backward(torch.ones_like(out))
    return out.detach()


def timings(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def visible_average(v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Each query's plain average of the values it may see, (B, H, L, Dv) from v (B, H, L, Dv):
    the mean of all of them, or causal the running mean of v_0..v_i. O(L·Dv)."""
    if not causal:
        return v.mean(2, keepdim=True).expand_as(v)
    seen = torch.arange(1, v.shape[2] + 1, dtype=v.dtype, device=v.device)
    return v.cumsum(2) / seen[:, None]


def errors(name: str, shape: Shape, L: int, family: str, options: dict) -> tuple[float, float | None]:
    """On one input family, forward, norms in float64: the relative error ‖out − full‖ / ‖full‖
    and the normalised one, ‖out − full‖ / ‖avg − full‖, avg each query's plain average of the
    values it may see (:func:`visible_average`): 0 is exact, 1 no closer to full attention than
    averaging, above 1 farther. None where full attention is that average."""
    q, k, v = make_inputs(shape, L, family)
    fwd = Shape(**{**shape.__dict__, "backward": False})
    out = call(name, q, k, v, fwd, options).double()
    ref = call("full", q, k, v, fwd, {}).double()
    miss, spread = (out - ref).norm(), (visible_average(v.double(), shape.causal) - ref).norm()
    return float(miss / ref.norm()), float(miss / spread) if spread > 0 else None


def measure_cell(name: str, L: int, shape: Shape, options: dict, *, repeats: int,
                 error_max_len: int, timeout_s: float = math.inf) -> dict:
    """What the sweep records for one (mechanism, L) but its memory (:func:`measure_memory`):
    times, FLOPs, errors against full; skipped if one call exceeds timeout_s."""
    q, k, v = make_inputs(shape, L, "gaussian")
    warm, skipped = _warm_up(name, L, q, k, v, shape, options, timeout_s)
    if skipped:
        return skipped
    times = timings(lambda: call(name, q, k, v, shape, options), repeats)
    spec = attnzoo.get(name)
    flops = None
    if spec.flops is not None:
        opts = attnzoo.registry.make_options(spec, options)
        flops = spec.flops(shape.batch, shape.heads, L, L, shape.head_dim, shape.head_dim,
                           shape.causal, opts)
        if shape.backward:
            flops *= 3  # backward ≈ twice the forward's products, the usual estimate
    median = statistics.median(times)
    cell = {
        "mechanism": name, "L": L, "status": "ok", "warmup_s": warm,
        "time_s": median, "time_min_s": min(times), "time_max_s": max(times),
        "times_s": times, "flops": flops,
        "gflops_per_s": None if flops is None else flops / median / 1e9,
    }
    for family in FAMILIES:
        measured = errors(name, shape, L, family, options) if L <= error_max_len else (None, None)
        cell[f"error_{family}"], cell[f"nerror_{family}"] = measured
    cell["err_trained"] = cell["nerror_trained"]  # the column to choose by: real inputs, normalised
    return cell


def measure_memory(name: str, L: int, shape: Shape, options: dict, *,
                   timeout_s: float = math.inf) -> dict:
    """The peak extra resident bytes of one call after a warm-up (``peak_bytes``, None where
    /proc cannot tell), for a process started with :func:`memory_env`; skipped if the warm-up
    exceeds timeout_s."""
    q, k, v = make_inputs(shape, L, "gaussian")
    warm, skipped = _warm_up(name, L, q, k, v, shape, options, timeout_s)
    if skipped:
        return skipped
    return {"mechanism": name, "L": L, "status": "ok", "warmup_s": warm,
            "peak_bytes": peak_memory(lambda: call(name, q, k, v, shape, options))}


def _warm_up(name, L, q, k, v, shape, options, timeout_s) -> tuple[float, dict | None]:
    """One call's seconds, and the skipped cell where it exceeded timeout_s (else None)."""
    warm = timings(lambda: call(name, q, k, v, shape, options), 1)[0]
    if warm <= timeout_s:
        return warm, None
    return warm, {"mechanism": name, "L": L, "status": "skipped", "warmup_s": warm,
                  "reason": f"one call took {warm:.0f} s > timeout {timeout_s:g} s"}


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """The machine's float32 matmul rate (GFLOP/s, median), the ceiling for every mechanism."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / statistics.median(timings(lambda: a @ b, repeats)) / 1e9
