"""Progress for the command line and the benchmark scripts: rich's bars on a terminal, plain lines
in a log file (where rich's live bars draw nothing until the end).

    with progress(console, *columns) as bar:
        task = bar.add_task("epochs", total=6, note="")
        bar.update(task, advance=1, note="loss 0.1")
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress

__all__ = ["LineProgress", "progress"]


def progress(console: Console, *columns: Any, every_s: float = 30.0, disable: bool = False):
    """rich's ``Progress(*columns)`` where ``console`` is a terminal; else a :class:`LineProgress`
    writing a line at most every ``every_s`` seconds a task (and whenever a task's description
    changes or it completes)."""
    if console.is_terminal or disable:
        return Progress(*columns, console=console, disable=disable)
    return LineProgress(console, every_s)


class LineProgress:
    """The part of rich's Progress API the CLI uses (add_task, update, reset), as printed lines:
    ``description completed/total note (elapsed)``."""

    def __init__(self, console: Console, every_s: float):
        self.console, self.every_s = console, every_s
        self.tasks: dict[int, dict] = {}
        self.started = time.monotonic()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        task = len(self.tasks)
        self.tasks[task] = {"description": description, "total": total, "completed": 0, "fields": fields,
                            "printed": -math.inf}  # a task's first update prints, however soon after boot
        return task

    def reset(self, task: int, *, total: float | None = None, description: str | None = None,
              **fields: Any) -> None:
        self.tasks[task]["completed"] = 0
        self.update(task, total=total, description=description, **fields)

    def update(self, task: int, *, advance: float = 0, completed: float | None = None,
               total: float | None = None, description: str | None = None, **fields: Any) -> None:
        t = self.tasks[task]
        renamed = description is not None and description != t["description"]
        t["completed"] = completed if completed is not None else t["completed"] + advance
        t["total"] = total if total is not None else t["total"]
        t["description"] = description if description is not None else t["description"]
        t["fields"].update(fields)
        now = time.monotonic()
        done = t["total"] is not None and t["completed"] >= t["total"]
        if renamed or done or now - t["printed"] >= self.every_s:
            t["printed"] = now
            self._line(t, now)

    def _line(self, t: dict, now: float) -> None:
        total = "" if t["total"] is None else f"/{t['total']:g}"
        note = " ".join(str(v) for v in t["fields"].values() if v)
        elapsed = int(now - self.started)
        line = f"{t['description']} {t['completed']:g}{total} {note} ({elapsed // 60}:{elapsed % 60:02d})"
        self.console.print(line, highlight=False)
