"""What a measurement was taken on, where the result depends on it (times above all)."""

from __future__ import annotations

import platform


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as Linux gives it, else what ``platform`` tells (often only the
    architecture)."""
    try:
        with open(cpuinfo) as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
