"""Measure the table ``attnzoo.recommend`` reads: every mechanism at its defaults, causal and not,
at L = 1024, 4096 and 16384 (time, peak memory, normalised error on the trained inputs).

    .venv/bin/python benchmarks/recommend_table.py        # ~15 minutes on 2 cores, a quiet machine

Each mode is one `attnzoo.bench` sweep (B = 1, H = 8, D = 64, float32, forward, median of 3 calls;
errors on the trained forecaster's attention inputs); the rows go to
``src/attnzoo/data/recommend.json``, the full sweeps beside it under ``runs/recommend/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from attnzoo.bench import BenchConfig, Shape, run_sweep, write

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "src" / "attnzoo" / "data" / "recommend.json"
LENGTHS = [1024, 4096, 16384]


def main() -> int:
    rows, machine = [], None
    for causal in (False, True):
        config = BenchConfig(lengths=LENGTHS, error_max_len=max(LENGTHS), shape=Shape(causal=causal))
        result = run_sweep(config, on_cell=lambda c: print(c["mechanism"], c["L"], c["status"], flush=True))
        write(result, ROOT / "runs" / "recommend" / ("causal" if causal else "non-causal"),
              command=f"benchmarks/recommend_table.py ({'causal' if causal else 'non-causal'})")
        machine = result["machine"]
        rows += [{"mechanism": c["mechanism"], "L": c["L"], "causal": causal, "time_s": c["time_s"],
                  "peak_bytes": c.get("peak_bytes"), "err_trained": c.get("err_trained")}
                 for c in result["cells"] if c["status"] == "ok"]
    TABLE.write_text(json.dumps({"machine": machine, "lengths": LENGTHS, "rows": rows}, indent=1) + "\n")
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
