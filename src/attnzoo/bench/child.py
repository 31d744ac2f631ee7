"""One mechanism's part of a sweep, in its own process: ``python -m attnzoo.bench.child JSON``.

Prints one JSON line per length, ascending. After a length fails (out of memory, or one
call ran past the timeout) the longer ones are reported skipped without running.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

from attnzoo.bench.measure import Shape, measure_cell


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    torch.set_num_threads(job["threads"])
    cap = int(job["mem_cap_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    shape = Shape(**job["shape"])
    name, reason = job["mechanism"], None
    for L in job["lengths"]:
        if reason is not None:
            _emit({"mechanism": name, "L": L, "status": "skipped", "reason": reason})
            continue
        try:
            cell = measure_cell(name, L, shape, job["options"], repeats=job["repeats"],
                                error_max_len=job["error_max_len"], timeout_s=job["timeout_s"])
        except (MemoryError, RuntimeError) as err:
            if "alloc" not in str(err).lower() and not isinstance(err, MemoryError):
                raise
            reason = f"out of memory at L={L} (limit {job['mem_cap_gib']:g} GiB)"
            _emit({"mechanism": name, "L": L, "status": "skipped", "reason": reason})
            continue
        _emit(cell)
        if cell["status"] != "ok":
            reason = f"L={L} already exceeded the timeout"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
