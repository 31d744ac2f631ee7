"""Which mechanism, at which length: a choice made from measurements.

:func:`recommend` returns the fastest mechanism whose normalised error on real attention inputs
(``err_trained``: ‖out − full‖ / ‖avg − full‖ on the inputs of a trained forecaster, see
``attnzoo.bench.measure``) is within ``max_error`` at the asked length, with its expected time
and memory against full attention and the reason; full attention where nothing sub-quadratic
beats it. It reads a table measured on this project's machine and shipped with the package
(``attnzoo/data/recommend.json``, written by ``benchmarks/recommend_table.py``), or with
``measure=True`` times the candidates on this machine at that length (seconds to a minute)
and caches those times under ``~/.cache/attnzoo``; the errors always come from the table (they
depend on the inputs, not on the machine). Each mechanism runs at its defaults.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnzoo.paths import cache_dir
from attnzoo.registry import Capabilities, Mechanism, attention, get, mechanisms, register_auto

TABLE = Path(__file__).with_name("data") / "recommend.json"

__all__ = ["AUTO", "AutoOptions", "Recommendation", "recommend"]


@dataclass(frozen=True)
class Recommendation:
    """The choice for one length: ``attnzoo.attention(..., mechanism=rec.mechanism, **rec.options)``."""

    mechanism: str
    options: dict
    length: int
    causal: bool
    time_ratio: float  # expected time over full attention's at this length (1.0 for full)
    memory_ratio: float | None  # expected peak memory over full attention's
    error: float  # normalised error on the trained inputs (0 for full)
    reason: str
    runners_up: list[dict] = field(default_factory=list)  # the other candidates, fastest first, and why not


def _load_table() -> dict:
    if not TABLE.exists():
        raise FileNotFoundError(f"attnzoo.recommend: no table at {TABLE} (benchmarks/recommend_table.py "
                                "writes it)")
    return json.loads(TABLE.read_text())


def _log_interp(points: list[tuple[int, float]], L: int) -> float | None:
    """y at L from (length, y) points, linear in log-log between the two around L, extended by the
    two nearest beyond the ends; None without points."""
    pts = sorted((x, y) for x, y in points if y and y > 0)
    if not pts:
        return None
    if len(pts) == 1:
        return pts[0][1]
    i = max(1, min(len(pts) - 1, next((j for j, (x, _) in enumerate(pts) if x >= L), len(pts) - 1)))
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * (L / x0) ** slope


def _error_at(rows: list[dict], L: int) -> tuple[float | None, int | None]:
    """(err_trained, the length it was measured at): at the longest measured length <= L, else
    the shortest one (the error of a fixed pattern grows with L: a shorter length would flatter)."""
    measured = sorted((r["L"], r["err_trained"]) for r in rows if r.get("err_trained") is not None)
    if not measured:
        return None, None
    at = [m for m in measured if m[0] <= L]
    length, error = at[-1] if at else measured[0]
    return error, length


def _estimate(rows: list[dict], L: int) -> dict:
    error, error_L = _error_at(rows, L)
    return {"time_s": _log_interp([(r["L"], r["time_s"]) for r in rows], L),
            "peak_bytes": _log_interp([(r["L"], r.get("peak_bytes")) for r in rows], L),
            "error": error, "error_L": error_L}


def _capable(name: str, causal: bool, key_mask: bool, cross: bool) -> str | None:
    """Why ``name`` cannot serve the call, or None."""
    caps = get(name).capabilities
    for wanted, has, what in ((causal, caps.causal, "causal"), (key_mask, caps.key_mask, "a key mask"),
                              (cross, caps.cross, "cross-attention")):
        if wanted and not has:
            return f"no {what}"
    return None


def _time_here(name: str, L: int, causal: bool, device: torch.device, timeout_s: float) -> float | None:
    """Median of 2 forward calls after a warm-up at B=1, H=8, D=64 float32; None past timeout_s."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64, generator=g, device=device) for _ in range(3))
    gen = torch.Generator(device=device).manual_seed(1)

    def once() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            attention(q, k, v, mechanism=name, causal=causal, generator=gen)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    if once() > timeout_s:
        return None
    return statistics.median([once(), once()])


def _cache_path(device: torch.device) -> Path:
    return cache_dir() / f"recommend-{device.type}-torch{torch.__version__}.json"


def _measured_times(L: int, causal: bool, names: list[str], device: torch.device) -> dict[str, float]:
    """Times of ``names`` at L on this machine, from the cache or measured now (then cached)."""
    path = _cache_path(device)
    cache = json.loads(path.read_text()) if path.exists() else {}
    key = f"{L}-{'causal' if causal else 'full'}"
    times = cache.get(key, {})
    for name in names:
        if name not in times:
            times[name] = _time_here(name, L, causal, device, timeout_s=10.0)
    cache[key] = times
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)
    return {name: t for name, t in times.items() if t is not None}


def recommend(length: int, *, causal: bool = False, key_mask: bool = False, cross: bool = False,
              max_error: float = 0.1, device: str | torch.device | None = None,
              measure: bool = False) -> Recommendation:
    """The fastest mechanism (at its defaults) within ``max_error`` normalised error at ``length``.

    Args:
        length: the sequence length L (keys; queries too for self-attention).
        causal, key_mask, cross: what the call needs; mechanisms without it are left out.
        max_error: the largest normalised error on the trained inputs to accept (0: exact;
            1: no closer to full attention than averaging).
        device: where the call will run; None: the CPU. The shipped table is of a CPU; another
            device needs ``measure=True``.
        measure: time the candidates here at ``length`` (cached) instead of reading the table's times.

    Returns:
        A :class:`Recommendation`; ``full`` when no sub-quadratic mechanism within the error is
        faster than full attention.
    """
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if not (isinstance(max_error, (int, float)) and max_error >= 0):
        raise ValueError(f"max_error must be >= 0, got {max_error!r}")
    device = torch.device(device or "cpu")
    table = _load_table()
    if device.type != "cpu" and not measure:
        raise ValueError(f"the shipped table is of a CPU; for {device.type}, pass measure=True")
    rows = [r for r in table["rows"] if r["causal"] == causal]
    estimates = {name: _estimate([r for r in rows if r["mechanism"] == name], length)
                 for name in mechanisms()}
    refusals = {name: _capable(name, causal, key_mask, cross) for name in mechanisms()}
    if measure:
        here = _measured_times(length, causal, [n for n in mechanisms() if refusals[n] is None], device)
        for name, est in estimates.items():
            est["time_s"] = here.get(name)
    full = estimates["full"]
    if full["time_s"] is None:
        raise RuntimeError(f"no time for full attention at L = {length}")
    candidates, others = [], []
    for name, est in estimates.items():
        if name == "full":
            continue
        why = refusals[name] or _why_not(est, max_error)
        entry = {"mechanism": name, "time_ratio": _ratio(est["time_s"], full["time_s"]),
                 "memory_ratio": _ratio(est["peak_bytes"], full["peak_bytes"]), "error": est["error"],
                 "error_measured_at": est["error_L"], "why_not": why}
        (others if why else candidates).append(entry)
    candidates.sort(key=lambda e: e["time_ratio"])
    best = candidates[0] if candidates and candidates[0]["time_ratio"] < 1 else None
    for entry in candidates[1:] if best else candidates:
        entry["why_not"] = (f"slower ({entry['time_ratio']:.2f}x full's time)" if best is None
                            else f"slower than {best['mechanism']}")
    runners_up = [e for e in candidates if e is not best] + sorted(
        others, key=lambda e: (e["time_ratio"] is None, e["time_ratio"] or 0))
    where = "measured here" if measure else f"the table measured on {table['machine']['cpu']}"
    if best is None:
        return Recommendation("full", {}, length, causal, 1.0, 1.0, 0.0,
                              f"nothing sub-quadratic within normalised error {max_error:g} beats full "
                              f"attention's time at L = {length} ({where})", runners_up)
    beyond = "" if best["error_measured_at"] >= length else (
        f" (error measured at L = {best['error_measured_at']}, the longest in the table)")
    memory = "" if best["memory_ratio"] is None else f", {best['memory_ratio']:.2f}x its memory"
    reason = (f"the fastest within normalised error {max_error:g}: {best['time_ratio']:.2f}x full "
              f"attention's time{memory}, error {best['error']:.3g} on the trained inputs{beyond}; "
              f"times from {where}")
    return Recommendation(best["mechanism"], {}, length, causal, best["time_ratio"], best["memory_ratio"],
                          best["error"], reason, runners_up)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _why_not(est: dict, max_error: float) -> str | None:
    if est["time_s"] is None:
        return "not measured at this length"
    if est["error"] is None:
        return "no error measured"
    if est["error"] > max_error:
        return f"error {est['error']:.3g} > {max_error:g}"
    return None


# --- mechanism="auto" ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AutoOptions:
    max_error: float = 0.1  # the largest normalised error on the trained inputs a choice may have


@functools.lru_cache(maxsize=256)
def _choice(L: int, causal: bool, key_mask: bool, cross: bool, max_error: float,
            device: str) -> Recommendation:
    return recommend(L, causal=causal, key_mask=key_mask, cross=cross, max_error=max_error, device=device,
                     measure=device != "cpu")


def auto_attention(q, k, v, opts=AutoOptions(), *, causal=False, key_mask=None, scale=None, generator=None,
                   reference=False):
    """The mechanism :func:`recommend` chooses for this call's length (Lk), causality, padding and
    cross-attention (Lq != Lk), at its defaults; chosen once per such call and cached. On a device
    other than the CPU the first call of a length times the candidates there (``measure=True``)."""
    choice = _choice(k.shape[2], causal, key_mask is not None, q.shape[2] != k.shape[2], opts.max_error,
                     q.device.type)
    if not get(choice.mechanism).randomized:
        generator = None
    return attention(q, k, v, mechanism=choice.mechanism, causal=causal, key_mask=key_mask, scale=scale,
                     generator=generator, reference=reference, **choice.options)


AUTO = Mechanism(
    name="auto",
    summary="the fastest mechanism within max_error at the call's length (attnzoo.recommend)",
    options=AutoOptions,
    fn=auto_attention,
    reference=functools.partial(auto_attention, reference=True),
    capabilities=Capabilities(causal=True, cross=True, key_mask=True),
    time="the chosen mechanism's",
    memory="the chosen mechanism's",
    citation="attnzoo.recommend, from measurements",
    randomized=True,
)

register_auto(AUTO)
