"""The sweep: mechanisms × lengths, one child process per mechanism, and what follows from it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import attnzoo
from attnzoo.bench.measure import Shape, matmul_gflops, memory_env
from attnzoo.machine import cpu_name


def _default_mem_cap_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            total_kib = int(f.readline().split()[1])
        return round(0.75 * total_kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return 16.0


@dataclass
class BenchConfig:
    mechanisms: list[str] = field(default_factory=list)  # empty = every registered mechanism
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    shape: Shape = field(default_factory=Shape)
    repeats: int = 3  # timed calls per cell, after one warm-up (memory: its own process)
    threads: int = field(default_factory=lambda: torch.get_num_threads())
    timeout_s: float = 60.0  # a cell whose first call takes longer is skipped, and longer L too
    error_max_len: int = 8192  # error against full only up to this length (full is O(L²))
    mem_cap_gib: float = field(default_factory=_default_mem_cap_gib)  # address-space cap per child
    options: dict[str, dict] = field(default_factory=dict)  # per-mechanism options

    def __post_init__(self):
        known = attnzoo.mechanisms()
        self.mechanisms = list(self.mechanisms) or known
        unknown = [m for m in self.mechanisms if m not in known]
        if unknown:
            raise ValueError(f"unknown mechanism(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if not self.lengths or any(L < 2 for L in self.lengths):
            raise ValueError(f"lengths must be >= 2, got {self.lengths}")
        self.lengths = sorted(set(self.lengths))
        if self.repeats < 1 or self.threads < 1 or self.timeout_s <= 0:
            raise ValueError("repeats and threads must be >= 1 and timeout > 0")
        if self.shape.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, float64, bfloat16 or float16, got {self.shape.dtype}")
        for name, opts in self.options.items():
            attnzoo.registry.make_options(attnzoo.get(name), opts)  # reject bad options up front


def machine_info(threads: int) -> dict:
    return {
        "cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "attnzoo": attnzoo.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "matmul_gflops": matmul_gflops(threads),
    }


def _skip(name: str, lengths: list[int], reason: str) -> list[dict]:
    return [{"mechanism": name, "L": L, "status": "skipped", "reason": reason} for L in lengths]


def _child_cmd(name: str, config: BenchConfig, part: str) -> list[str]:
    job = {
        "mechanism": name, "part": part, "lengths": config.lengths,
        "shape": dataclasses.asdict(config.shape), "repeats": config.repeats, "threads": config.threads,
        "timeout_s": config.timeout_s, "error_max_len": config.error_max_len,
        "mem_cap_gib": config.mem_cap_gib, "options": config.options.get(name, {}),
    }
    return [sys.executable, "-m", "attnzoo.bench.child", json.dumps(job)]


def _per_cell_limit(config: BenchConfig) -> float:
    return config.timeout_s * (config.repeats + 6) + 60  # a hung call: kill the child


def _child(name: str, config: BenchConfig, part: str, on_cell: Callable[[dict], None]) -> list[dict]:
    """One part of a mechanism's cells, ``memory`` or ``time`` (see attnzoo.bench.child), from
    a process of its own (the memory one started with memory_env, see attnzoo.bench.measure):
    each passed to on_cell as it comes. The lengths it did not finish are skipped with the
    reason: it failed, or went past the per-cell limit without a cell (then it is killed).
    Its stderr goes to a file, read if it fails: a pipe left unread could fill and stall it."""
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(_child_cmd(name, config, part), stdout=subprocess.PIPE, stderr=stderr,
                                text=True, env=memory_env() if part == "memory" else None)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        cells: list[dict] = []
        per_cell_limit, reason = _per_cell_limit(config), None
        while reason is None and len(cells) < len(config.lengths):
            try:
                line = lines.get(timeout=per_cell_limit)
            except queue.Empty:
                proc.kill()
                at = config.lengths[len(cells)]
                reason = f"killed after {per_cell_limit:.0f} s without finishing L={at}"
                continue
            if line is None:  # the child ended early: say why
                proc.wait()
                stderr.seek(0)
                err = stderr.read().strip().splitlines()
                reason = f"child failed: {err[-1] if err else f'exit code {proc.returncode}'}"
                continue
            cells.append(json.loads(line))
            on_cell(cells[-1])
        for cell in _skip(name, config.lengths[len(cells):], reason) if reason else []:
            cells.append(cell)
            on_cell(cell)
        proc.wait()
    return cells


def _run_child(name: str, config: BenchConfig, on_cell: Callable[[dict], None],
               on_memory: Callable[[dict], None]) -> list[dict]:
    """A mechanism's cells: its memory process, then its timed one, whose cells carry the peak
    bytes of their length (None where the memory process did not measure it)."""
    readings = _child(name, config, "memory", on_memory)
    memory = {c["L"]: c["peak_bytes"] for c in readings if c["status"] == "ok"}

    def timed(cell: dict) -> None:
        if cell["status"] == "ok":
            cell["peak_bytes"] = memory.get(cell["L"])  # (in place: _child returns the same dicts)
        on_cell(cell)
    return _child(name, config, "time", timed)


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (the scaling exponent), None under 2 points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def derived(cells: list[dict], mechanisms: list[str]) -> dict[str, dict]:
    """Per mechanism: time and memory exponents in L, and the crossover length against full.

    Each exponent twice: fitted over every length run (``time_exponent``), and over the last
    step alone, the two longest lengths (``time_exponent_last``): a memory flat over
    1024..8192 that quadruples at 16384 fits to 0.4 where the last step reads 2, and the last
    step is where a user's next length goes."""
    ok = [c for c in cells if c["status"] == "ok"]
    full_time = {c["L"]: c["time_s"] for c in ok if c["mechanism"] == "full"}
    out = {}
    for name in mechanisms:
        mine = sorted((c for c in ok if c["mechanism"] == name), key=lambda c: c["L"])
        Ls = [c["L"] for c in mine]
        crossover = next((c["L"] for c in mine if c["L"] in full_time and name != "full"
                          and c["time_s"] < full_time[c["L"]]), None)
        times, peaks = [c["time_s"] for c in mine], [c["peak_bytes"] for c in mine]
        out[name] = {
            "time_exponent": loglog_slope(Ls, times),
            "time_exponent_last": loglog_slope(Ls[-2:], times[-2:]),
            "memory_exponent": loglog_slope(Ls, peaks),
            "memory_exponent_last": loglog_slope(Ls[-2:], peaks[-2:]),
            "crossover_L": crossover,
        }
    return out


def run_sweep(config: BenchConfig, on_cell: Callable[[dict], None] = lambda cell: None,
              on_memory: Callable[[dict], None] = lambda cell: None) -> dict:
    """Run every cell; never raises for a cell (it is recorded as skipped with the reason).

    Progress: on_memory gets each length's memory reading as it comes, then on_cell each
    timed cell, mechanism by mechanism; a mechanism skipped whole (no causal form) gives each
    of its cells to both, so each is called once per mechanism and length."""
    cells: list[dict] = []
    for name in config.mechanisms:
        spec = attnzoo.get(name)
        if config.shape.causal and not spec.capabilities.causal:
            reason = f"no causal form: {spec.reason_not_causal}"
            skipped = _skip(name, config.lengths, reason)
            cells += skipped
            for report in (on_memory, on_cell):
                for cell in skipped:
                    report(cell)
            continue
        cells += _run_child(name, config, on_cell, on_memory)
    return {
        "machine": machine_info(config.threads),
        "config": {**dataclasses.asdict(config)},
        "cells": cells,
        "derived": derived(cells, config.mechanisms),
    }
