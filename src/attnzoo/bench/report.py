"""Writing a sweep's results: results.json, results.csv, report.md and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from attnzoo.bench.measure import FAMILIES  # noqa: E402

CSV_FIELDS = ["mechanism", "L", "status", "reason", "time_s", "time_min_s", "time_max_s",
              "peak_bytes", "flops", "gflops_per_s", "err_trained", "nerror_gaussian", "nerror_peaked",
              "nerror_trained", "error_gaussian", "error_peaked", "error_trained"]

METHOD = """\
## Method

- Each mechanism runs in two fresh child processes (`python -m attnzoo.bench.child`), one
  for memory, then one for time, lengths ascending, with `torch.set_num_threads(threads)`
  and an address-space cap (`RLIMIT_AS`), so an oversized allocation fails cleanly and is
  reported as skipped.
- Inputs: q, k, v of shape (B, H, L, D), seeded. Per cell: one warm-up call, then
  `repeats` timed calls; time is their median (min–max shown as spread).
  Forward calls run under `torch.no_grad()`; with `--backward` each call is a forward
  plus `out.backward(ones)`.
- Peak memory: the kernel's resident high-water mark (VmHWM) is reset to the current
  resident set (`/proc/self/clear_refs` = 5) after `gc.collect()` and `malloc_trim(0)`,
  with the inputs already allocated; the call's peak is VmHWM after it minus VmRSS before.
  It counts every page the call touched (intermediates, output, saved activations),
  exact to the page. One call after a warm-up, in the memory process, started with
  `MALLOC_MMAP_THRESHOLD_=131072`: glibc maps every block of 128 KiB or more for its life,
  so the reading is the call's peak of live memory, not what the heap failed to reuse
  (which moved `full`'s training step at L = 4096 between 59 and 75 MiB from run to run).
  The timed process keeps glibc's defaults, as yours has them.
- FLOPs: each mechanism's analytic count of the products its fast function executes
  (2 per multiply-add, block padding included; `full` causal counts the visible pairs);
  checked against `torch.utils.flop_counter` in the tests. With `--backward`, 3× the
  forward. GFLOP/s = FLOPs / median time; the ceiling is this machine's float32 matmul
  rate, measured at the start.
- Error: ‖out − full‖ / ‖full‖ of the forward, against `full` on the same inputs, for two
  input families: *gaussian* — i.i.d. N(0, 1) q, k, v (scores of unit variance: attention
  spread nearly uniformly); *peaked* — each feature of k an AR(1) process along the
  sequence (coefficient 0.9), q = k + 0.1·noise, both ×1.5 (scores ≈ 18·0.9^|i−j|:
  attention concentrated on the nearest ~20 positions, like smooth time series).
  Randomized mechanisms use a fixed generator. Skipped above `error_max_len`.
- *trained* inputs: real ones, the q, k, v of the first encoder layer of a forecaster trained
  with full attention on ETTh1 (univariate OT, 336-step input; d_model 256, 4 heads of 64:
  `benchmarks/train_attention_inputs.py`, shipped as `attnzoo/data/trained_attention.pt`), at
  each length the first L hours of the series through its embedding (positions at that
  length) and projections: (1, 4, L, 64) whatever the shape asks. `err_trained` is the
  normalised error on them, the column to choose a mechanism by.
- Normalised error: ‖out − full‖ / ‖avg − full‖, where avg gives each query the plain average
  of the values it may see (causal: of v_0..v_i). 0 is exact, 1 is no closer to full attention
  than averaging, above 1 is farther. The relative error alone misleads: on i.i.d. Gaussian
  inputs full attention is itself nearly that average, a vector of small norm, so any
  mechanism's relative error reads large; the normalised error says how much of full
  attention's departure from averaging a mechanism keeps.
- Mechanisms with learned parts run untrained: linformer's E and F are random draws
  (N(0, 1/proj_len)), so its error here says little about a trained model.
- Derived: the scaling exponent is the least-squares slope of log(time) (or log(memory))
  against log(L), over every length run, then over the last step alone (the two longest
  lengths), where a growth that sets in late shows; the crossover is the first length at
  which the mechanism's median time beats `full`'s in the same run.
"""


def _mib(b):
    return None if b is None else b / 2**20


def _fmt(x, spec=".3g", none="—"):
    return none if x is None else format(x, spec)


def exponents(derived: dict, what: str) -> str:
    """``what``'s exponent fitted over every length, then over the last step: "1.02 / 1.48"."""
    return f"{_fmt(derived[f'{what}_exponent'], '.2f')} / {_fmt(derived[f'{what}_exponent_last'], '.2f')}"


def _grid(result, value, fmt):
    """A markdown table: mechanisms × lengths, cells formatted by ``fmt(value(cell))``."""
    lengths = result["config"]["lengths"]
    cells = {(c["mechanism"], c["L"]): c for c in result["cells"]}
    lines = ["| mechanism | " + " | ".join(f"L={L}" for L in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name in result["config"]["mechanisms"]:
        row = []
        for L in lengths:
            c = cells.get((name, L))
            row.append("skipped" if c is None or c["status"] != "ok" else fmt(value(c)))
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


GROUPS = {  # mechanism families, for the report's reading of the errors
    "Kernel and low-rank": ["linear", "efficient", "taylor", "performer", "linformer", "nystrom"],
    "Fixed sparse patterns": ["local", "block_local", "strided", "fixed", "log_sparse"],
    "Data-dependent sparsity": ["prob_sparse", "lsh"],
}


def errors_said(result: dict) -> list[str]:
    """One sentence a mechanism family: its normalised errors on the trained inputs at the longest
    length measured, beside those on Gaussian inputs."""
    cells = [c for c in result["cells"] if c["status"] == "ok" and c.get("err_trained") is not None]
    if not cells:
        return []
    L = max(c["L"] for c in cells)
    at_L = {c["mechanism"]: c for c in cells if c["L"] == L}
    lines = []
    for group, names in GROUPS.items():
        mine = sorted((at_L[n]["err_trained"], n) for n in names if n in at_L)
        if not mine:
            continue
        closer = sum(e < 1 for e, _ in mine)
        gauss = [at_L[n]["nerror_gaussian"] for _, n in mine if at_L[n].get("nerror_gaussian") is not None]
        lines.append(f"- {group} ({', '.join(n for _, n in mine)}): on the trained inputs at L = {L}, "
                     f"from {mine[0][0]:.3g} ({mine[0][1]}) to {mine[-1][0]:.3g} ({mine[-1][1]}); "
                     f"{closer} of {len(mine)} closer to full attention than averaging is"
                     + (f"; on Gaussian inputs {min(gauss):.3g} to {max(gauss):.3g}." if gauss else "."))
    return ["\n## What the errors say\n", *lines]


def markdown(result: dict, command: str = "attnzoo bench") -> str:
    m, cfg = result["machine"], result["config"]
    shape = cfg["shape"]
    ceiling = m["matmul_gflops"]
    parts = [
        "# attnzoo benchmark\n",
        f"Command: `{command}`\n",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, "
        f"Python {m['python']}; float32 matmul {ceiling:.0f} GFLOP/s. Date {m['date']}.\n",
        f"Shape: B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}, {shape['dtype']}, "
        f"{'causal' if shape['causal'] else 'non-causal'}, "
        f"{'forward+backward' if shape['backward'] else 'forward'}; {cfg['repeats']} timed repeats.\n",
        "## Time (ms, median [min–max])\n",
        _grid(result, lambda c: c, lambda c: f"{c['time_s'] * 1e3:.1f} [{c['time_min_s'] * 1e3:.0f}–"
              f"{c['time_max_s'] * 1e3:.0f}]"),
        "\n## Peak extra memory of one call (MiB)\n",
        _grid(result, lambda c: _mib(c["peak_bytes"]), lambda x: _fmt(x, ".1f")),
        f"\n## Achieved GFLOP/s (ceiling: matmul {ceiling:.0f})\n",
        _grid(result, lambda c: c["gflops_per_s"], lambda x: _fmt(x, ".1f")),
    ]
    for family in FAMILIES:
        parts += [f"\n## Normalised error against full, {family} inputs (0 exact, 1 no better than "
                  "averaging)\n",
                  _grid(result, lambda c, f=family: c.get(f"nerror_{f}"), lambda x: _fmt(x, ".3g"))]
    for family in FAMILIES:
        parts += [f"\n## Relative error against full, {family} inputs\n",
                  _grid(result, lambda c, f=family: c.get(f"error_{f}"), lambda x: _fmt(x, ".2e"))]
    parts += errors_said(result)
    parts += ["\n## Scaling and crossover\n",
              "| mechanism | time exponent: fit / last step | memory exponent: fit / last step "
              "| beats full from L = |",
              "|---|---|---|---|"]
    for name, d in result["derived"].items():
        parts.append(f"| {name} | {exponents(d, 'time')} | {exponents(d, 'memory')} "
                     f"| {d['crossover_L'] or '—'} |")
    skipped = [c for c in result["cells"] if c["status"] != "ok"]
    if skipped:
        parts += ["\n## Skipped\n", "| mechanism | L | reason |", "|---|---|---|"]
        parts += [f"| {c['mechanism']} | {c['L']} | {c['reason']} |" for c in skipped]
    parts.append("\n" + METHOD)
    return "\n".join(parts) + "\n"


def _line_plot(result, key, scale, ylabel, title, path):
    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = "os^vD<>phX*P8"
    colors = plt.get_cmap("tab20").colors
    for n, name in enumerate(result["config"]["mechanisms"]):
        pts = sorted((c["L"], c[key] * scale) for c in result["cells"]
                     if c["mechanism"] == name and c["status"] == "ok" and c.get(key))
        if pts:
            style = (dict(color="black", linewidth=2.5) if name == "full"
                     else dict(color=colors[(2 * n) % 20 + (n // 10) % 2]))
            ax.plot(*zip(*pts, strict=True), marker=markers[n % len(markers)], label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _error_plot(result, path):
    cells = [c for c in result["cells"] if c["status"] == "ok" and c.get("nerror_gaussian") is not None]
    if not cells:
        return False
    L = max(c["L"] for c in cells)
    at_L = {c["mechanism"]: c for c in cells if c["L"] == L}
    names = [n for n in result["config"]["mechanisms"] if n in at_L and n != "full"]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(FAMILIES)
    for i, family in enumerate(FAMILIES):
        values = [max(at_L[n].get(f"nerror_{family}") or 0.0, 1e-12) for n in names]
        ax.bar([x + (i - (len(FAMILIES) - 1) / 2) * width for x in range(len(names))], values, width,
               label=family)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="no better than averaging")
    ax.set_ylabel("‖out − full‖ / ‖avg − full‖")
    ax.set_title(f"Normalised error against full attention at L = {L} (0 exact; lower is better)")
    ax.legend(title="inputs")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(result: dict, out: Path, command: str = "attnzoo bench") -> list[Path]:
    """Write every output file into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv", out / "report.md"]
    paths[0].write_text(json.dumps(result, indent=2))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["cells"])
    paths[2].write_text(markdown(result, command))
    _line_plot(result, "time_s", 1e3, "median time (ms)", "Time against length", out / "time_vs_length.png")
    _line_plot(result, "peak_bytes", 1 / 2**20, "peak extra memory (MiB)", "Memory against length",
               out / "memory_vs_length.png")
    paths += [out / "time_vs_length.png", out / "memory_vs_length.png"]
    if _error_plot(result, out / "error.png"):
        paths.append(out / "error.png")
    return paths

