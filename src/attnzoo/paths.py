"""Where attnzoo keeps what it makes on a machine: ``$ATTNZOO_CACHE``, default ``~/.cache/attnzoo``
(the C kernels' builds, :func:`attnzoo.recommend`'s measured times)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnzoo"
    return Path(os.environ.get("ATTNZOO_CACHE", default))
