"""One mechanism's part of a sweep, in its own process: ``python -m attnzoo.bench.child JSON``.

The job's ``part`` is ``time`` (:func:`~attnzoo.bench.measure.measure_cell`) or ``memory``
(:func:`~attnzoo.bench.measure.measure_memory`, in a process started with ``memory_env()``).
Prints one JSON line per length, ascending. After a length fails (out of memory, or one
call ran past the timeout) the longer ones are reported skipped without running.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

from attnzoo.bench.measure import Shape, measure_cell, measure_memory, require_memory_env


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    memory = job["part"] == "memory"
    if memory:
        require_memory_env()
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
            if memory:
                cell = measure_memory(name, L, shape, job["options"], timeout_s=job["timeout_s"])
            else:
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
