"""The scale run: every sub-quadratic mechanism at L = 2^16, 2^18 and 2^20, forward and forward +
backward, with full attention until it passes the timeout. Writes docs/scale.md, docs/scale.json
and docs/img/scale.png.

    .venv/bin/python benchmarks/scale.py              # run what is missing, then write the docs
    .venv/bin/python benchmarks/scale.py --report     # only write the docs from the runs kept
    .venv/bin/python benchmarks/scale.py --only lsh,linear --modes forward

Each (mode, mechanism) is one `attnzoo.bench` sweep (a memory process, then a timed one, per
mechanism: see docs/benchmarking.md) at B = 1, H = 8, D = 64, float32, one timed call after a
warm-up (a call at 2^20 takes seconds to minutes: the spread between calls is small beside
the factor of 4 between lengths), kept in ``RUNS/<mode>-<mechanism>.json`` as soon as it ends:
the run can be stopped and started again. It wants a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import attnzoo
from attnzoo.bench import BenchConfig, Shape, run_sweep
from attnzoo.bench.sweep import loglog_slope, machine_info

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [2**16, 2**18, 2**20]
FULL_LENGTHS = [2**14, 2**15, 2**16, 2**17]  # full attention: until one call passes the timeout
TIMEOUT_S = 600.0  # one call longer than this: that length and longer are skipped
FULL_TIMEOUT_S = 120.0
MODES = {"forward": False, "training": True}  # -> Shape.backward
# The targets for the time exponent from 2^16 to 2^20, by the cost each paper states.
CLASSES = {
    "O(L)": (["linear", "efficient", "taylor", "performer", "local", "block_local", "linformer", "nystrom"],
             1.15),
    "O(L log L)": (["prob_sparse", "log_sparse", "lsh"], 1.3),
    "O(L √L)": (["strided", "fixed"], 1.6),
}
MEMORY_TARGET = 1.1
# Why a mechanism misses its target, from what the run and its profile showed (shown only where
# it misses): written after reading the run, never instead of it.
WHY: dict[tuple[str, str], str] = {
    ("training", "strided"): "its backward keeps each block's attention probabilities, about 2√L per "
    "query and head (autograd through the blockwise softmax): 1.3 GiB beside the O(L) tensors at 2^16, "
    "growing as L √L, past the memory cap at 2^18. A backward that recomputes the probabilities block "
    "by block (as flash attention's does) would make the memory O(L); not built yet.",
    ("training", "fixed"): "the same as strided: the saved probabilities (own block and c·L/l summary "
    "keys per query) take 4.4 GiB beside the O(L) tensors at 2^16, past the cap at 2^18.",
}


def classes() -> dict[str, tuple[str, float]]:
    return {name: (cls, target) for cls, (names, target) in CLASSES.items() for name in names}


def run(runs: Path, mode: str, name: str) -> Path:
    """One (mode, mechanism) sweep, kept as JSON; nothing if it is kept already."""
    path = runs / f"{mode}-{name}.json"
    if path.exists():
        return path
    full = name == "full"
    lengths = FULL_LENGTHS if full else LENGTHS
    foreseen = _foreseen_skips(runs, mode, name, lengths)
    lengths = [L for L in lengths if L not in {c["L"] for c in foreseen}]

    def said(cell: dict) -> None:
        what = (f"{cell['time_s']:.2f} s" if cell["status"] == "ok" else f"skipped: {cell['reason']}")
        print(f"{time.strftime('%H:%M:%S')}  {mode:8s} {name:12s} L=2^{cell['L'].bit_length() - 1}  {what}",
              flush=True)

    if lengths:
        config = BenchConfig(mechanisms=[name], lengths=lengths, repeats=1,
                             timeout_s=FULL_TIMEOUT_S if full else TIMEOUT_S, error_max_len=0,
                             shape=Shape(backward=MODES[mode]))
        result = run_sweep(config, on_cell=said)
    else:
        result = {"machine": machine_info(BenchConfig().threads), "cells": []}
    result["cells"] = sorted(result["cells"] + foreseen, key=lambda c: c["L"])
    runs.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return path


def _foreseen_skips(runs: Path, mode: str, name: str, lengths: list[int]) -> list[dict]:
    """Skipped cells for forward + backward from the first length whose forward call alone took
    more than a third of the timeout (or did not run): forward + backward costs about three
    forwards, so trying it would cost more than the timeout twice (the memory process, then the
    warm-up) before it was skipped anyway."""
    forward = runs / f"forward-{name}.json"
    if not MODES[mode] or not forward.exists():
        return []
    limit = FULL_TIMEOUT_S if name == "full" else TIMEOUT_S
    cells = {c["L"]: c for c in json.loads(forward.read_text())["cells"]}
    for i, L in enumerate(lengths):
        c = cells.get(L)
        if c is None or c["status"] != "ok" or c["time_s"] > limit / 3:
            why = ("its forward did not run" if c is None or c["status"] != "ok"
                   else f"its forward alone took {c['time_s']:.0f} s")
            return [{"mechanism": name, "L": n, "status": "skipped",
                     "reason": f"not tried: {why} at L = 2^{L.bit_length() - 1}, so forward + backward "
                               f"would likely pass the {limit:g} s timeout"} for n in lengths[i:]]
    return []


def load(runs: Path) -> dict[str, dict[str, list[dict]]]:
    """{mode: {mechanism: cells}} of every kept sweep."""
    found: dict[str, dict[str, list[dict]]] = {mode: {} for mode in MODES}
    for path in sorted(runs.glob("*.json")):
        mode, name = path.stem.split("-", 1)
        if mode in found:
            found[mode][name] = json.loads(path.read_text())["cells"]
    return found


def _ok(cells: list[dict], L: int) -> dict | None:
    return next((c for c in cells if c["L"] == L and c["status"] == "ok"), None)


def exponents(cells: list[dict]) -> tuple[float | None, float | None, int | None]:
    """Time and memory exponents fitted over the lengths of 2^16..2^20 that ran from 2^16 on (at
    least two), and the longest of them; None where fewer than two ran."""
    ok = []
    for L in LENGTHS:
        if (c := _ok(cells, L)) is None:
            break
        ok.append(c)
    if len(ok) < 2:
        return None, None, None
    Ls = [c["L"] for c in ok]
    peaks = [c.get("peak_bytes") for c in ok]
    memory = loglog_slope(Ls, peaks) if all(peaks) else None
    return loglog_slope(Ls, [c["time_s"] for c in ok]), memory, Ls[-1]


def summary(found: dict) -> list[dict]:
    rows = []
    for mode, by_name in found.items():
        for name, cells in by_name.items():
            cls, target = classes().get(name, ("O(L²)", None))
            t_exp, m_exp, upto = exponents(cells)
            rows.append({"mode": mode, "mechanism": name, "class": cls, "time_target": target,
                         "time_exponent": t_exp, "memory_exponent": m_exp, "fitted_to": upto,
                         "cells": [{k: c.get(k) for k in ("L", "status", "reason", "time_s", "peak_bytes")}
                                   for c in cells]})
    return rows


def _cell_text(c: dict | None, key: str) -> str:
    if c is None:
        return "—"
    if c["status"] != "ok":  # a length past one that ran out of memory was not tried: "not run"
        return "out of memory" if f"out of memory at L={c['L']} " in c.get("reason", "") else "not run"
    value = c.get(key)
    if value is None:
        return "—"
    return f"{value:.3g}" if key == "time_s" else f"{value / 2**20:,.0f}"


def _verdict(row: dict) -> str:
    t, m = row["time_exponent"], row["memory_exponent"]
    if row["time_target"] is None:
        return ""
    if t is None:
        ran = sum(c["status"] == "ok" for c in row["cells"])
        return "✗ one length only" if ran else "✗ did not run"
    if m is None:
        return "✗ no memory reading"
    ok_t, ok_m = t <= row["time_target"], m <= MEMORY_TARGET
    return "✓" if ok_t and ok_m else "✗ " + ", ".join(
        what for what, ok in (("time", ok_t), ("memory", ok_m)) if not ok)


def _memory_cap_gib(rows: list[dict], mode: str) -> float | None:
    """The memory cap the cells of ``mode`` that ran out of memory were under (None: none did)."""
    caps = [float(m.group(1)) for r in rows if r["mode"] == mode for c in r["cells"]
            if (m := re.search(r"out of memory at L=\d+ \(limit ([\d.]+) GiB\)", c.get("reason") or ""))]
    return max(caps, default=None)


def table(rows: list[dict], mode: str) -> list[str]:
    Ls = LENGTHS
    head = ["mechanism", "cost", *[f"time (s) 2^{L.bit_length() - 1}" for L in Ls],
            *[f"memory (MiB) 2^{L.bit_length() - 1}" for L in Ls], "time exp.", "target", "memory exp.", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {name: i for i, name in enumerate(attnzoo.mechanisms())}
    for row in sorted((r for r in rows if r["mode"] == mode), key=lambda r: order.get(r["mechanism"], 99)):
        by_L = {c["L"]: c for c in row["cells"]}
        short = row["fitted_to"] is not None and row["fitted_to"] < LENGTHS[-1]
        span = f" (to 2^{row['fitted_to'].bit_length() - 1})" if short else ""
        exp = [("—" if x is None else f"{x:.2f}{span}")
               for x in (row["time_exponent"], row["memory_exponent"])]
        target = "—" if row["time_target"] is None else f"≤ {row['time_target']:g}"
        lines.append("| " + " | ".join([row["mechanism"], row["class"],
                                          *[_cell_text(by_L.get(L), "time_s") for L in Ls],
                                          *[_cell_text(by_L.get(L), "peak_bytes") for L in Ls],
                                          exp[0], target, exp[1], _verdict(row)]) + " |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = plt.get_cmap("tab20").colors
    names = attnzoo.mechanisms()
    for i, mode in enumerate(MODES):
        for row in (r for r in rows if r["mode"] == mode):
            n = names.index(row["mechanism"]) if row["mechanism"] in names else 0
            ok = [c for c in row["cells"] if c["status"] == "ok"]
            full = row["mechanism"] == "full"
            style = dict(color="black", linewidth=2.5) if full else dict(color=colors[n])
            for ax, key, scale in ((axes[i][0], "time_s", 1.0), (axes[i][1], "peak_bytes", 2**-20)):
                pts = [(c["L"], c[key] * scale) for c in ok if c.get(key)]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=row["mechanism"], **style)
        for ax, what in ((axes[i][0], "time (s)"), (axes[i][1], "peak extra memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            ax.set_title(f"{mode}: {what}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Scale: B = 1, H = 8, D = 64, float32, 2 threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: Path, docs: Path) -> None:
    found = load(runs)
    rows = summary(found)
    machine = next((json.loads(p.read_text())["machine"] for p in sorted(runs.glob("*.json"))), None)
    (docs / "scale.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    plot(rows, docs / "img" / "scale.png")
    m = machine or machine_info(2)
    lines = [
        "# Scale: every sub-quadratic mechanism to a million positions", "",
        f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, {m['date'][:10]}. "
        "B = 1, H = 8, D = 64, float32, self-attention, each mechanism at its defaults; one timed call "
        "after a warm-up (`repeats=1`), peak extra resident memory of one call in a process of its own "
        "(the method of docs/benchmarking.md). Exponents are the least-squares slope of log time "
        "(log memory) against log L over 2^16, 2^18 and 2^20 (over 2^16 and 2^18 where 2^20 did not "
        "run: marked \"to 2^18\"); the targets are the costs the papers "
        f"state: at most 1.15 for O(L), 1.3 for O(L log L), 1.6 for O(L √L), memory at most {MEMORY_TARGET}. "
        f"Full attention runs from 2^14 until one call passes {FULL_TIMEOUT_S:g} s.", "",
        "Command: `.venv/bin/python benchmarks/scale.py` (resumable; `--report` rewrites this page "
        "from the kept runs).", "",
        "![time and memory against length](img/scale.png)", ""]
    for mode in (mode for mode in MODES if found[mode]):
        lines += [f"## {'Forward (no grad)' if mode == 'forward' else 'Forward + backward'}", "",
                  *table(rows, mode), ""]
        cap = _memory_cap_gib(rows, mode)
        if MODES[mode] and cap is not None:
            lines += [
                "Memory sets the limit here, not time. At L = 2^20 a forward + backward keeps q, k, v, "
                "their gradients, the output and its gradient: eight (1, 8, 2^20, 64) float32 tensors "
                "of 2 GiB, 16 GiB (the inputs are not counted in the table's peak, the other 10 GiB "
                f"are) of the {cap:g} GiB the run allows itself on this machine. A mechanism that "
                f"saves more than about {cap - 16:.1f} GiB for its backward runs out of memory there, "
                "and its exponents are fitted to 2^18.", ""]
        full = next((r for r in rows if r["mode"] == mode and r["mechanism"] == "full"), None)
        if full is not None:
            lines += ["Full attention (SDPA): " + ", ".join(
                f"2^{c['L'].bit_length() - 1} {c['time_s']:.3g} s" if c["status"] == "ok"
                else f"2^{c['L'].bit_length() - 1} not run ({c['reason']})" for c in full["cells"]) + ".", ""]
        skipped = [(r["mechanism"], c) for r in rows if r["mode"] == mode for c in r["cells"]
                   if c["status"] != "ok" and r["mechanism"] != "full"]
        if skipped:
            lines += ["Not run: " + "; ".join(f"{name} at L = 2^{c['L'].bit_length() - 1} ({c['reason']})"
                                             for name, c in skipped) + ".", ""]
        misses = [r for r in rows if r["mode"] == mode and _verdict(r).startswith("✗")]
        notes = [f"- {r['mechanism']}: {WHY[(mode, r['mechanism'])]}" for r in misses
                 if (mode, r["mechanism"]) in WHY]
        if notes:
            lines += ["Where a target is missed, and why:", "", *notes, ""]
    missing = [mode for mode in MODES if not found[mode]]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)} (`benchmarks/scale.py --modes {','.join(missing)}` "
                  "continues the run).", ""]
    (docs / "scale.md").write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="only write the docs from the kept runs")
    parser.add_argument("--only", default="", help="comma-separated mechanisms (default: all)")
    parser.add_argument("--modes", default="forward,training", help="forward, training or both")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "scale"), help="where each sweep is kept")
    parser.add_argument("--docs", default=str(ROOT / "docs"))
    args = parser.parse_args()
    runs = Path(args.runs)
    if not args.report:
        names = args.only.split(",") if args.only else [*classes(), "full"]
        for mode in args.modes.split(","):
            for name in names:
                run(runs, mode, name)
    report(runs, Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
