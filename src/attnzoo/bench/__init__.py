"""The benchmark: time, peak memory, FLOPs and error against full attention, per mechanism and length.

>>> from attnzoo.bench import BenchConfig, run_sweep, write   # doctest: +SKIP
>>> result = run_sweep(BenchConfig(mechanisms=["full", "local"], lengths=[256, 512]))
>>> write(result, Path("bench-results"))
"""

from attnzoo.bench.measure import Shape
from attnzoo.bench.report import markdown, write
from attnzoo.bench.sweep import BenchConfig, run_sweep

__all__ = ["BenchConfig", "Shape", "markdown", "run_sweep", "write"]
