"""The CPU backend: everything whose only reason is CPU speed.

C kernels compiled on first use (:mod:`.native`, ``kernels.c``), torch's fused CPU attention
kernel called directly (a private op, guarded), oneDNN's inner product for projections
(:mod:`.products`), hand-written backward passes that recompute instead of keeping, and the
opt-in memory keeping of :mod:`.memory`; the C kernels of linear and efficient attention
as torch custom operators for traced code (:mod:`.library`). Importing this package registers its overrides of
:mod:`attnzoo.ops`' operations; each returns NotImplemented where its preconditions do not
hold, and the portable body runs. docs/internals.md tells what each buys and why.
"""
from attnzoo.backends.cpu import (  # noqa: F401  (each registers its overrides)
    efficient,
    few,
    kernel,
    library,
    log_sparse,
    lsh,
    projections,
    sparse_transformer,
    windows,
)
