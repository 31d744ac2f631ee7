"""Built-in mechanisms: one module each; importing a module registers it.

The import order is the order of ``attnzoo.mechanisms()``.
"""

from attnzoo.mechanisms import full  # noqa: F401  isort: skip
from attnzoo.mechanisms import prob_sparse  # noqa: F401  isort: skip
from attnzoo.mechanisms import log_sparse  # noqa: F401  isort: skip
from attnzoo.mechanisms import lsh  # noqa: F401  isort: skip
from attnzoo.mechanisms import sparse_transformer  # noqa: F401  isort: skip
from attnzoo.mechanisms import local  # noqa: F401  isort: skip
from attnzoo.mechanisms import block_local  # noqa: F401  isort: skip
from attnzoo.mechanisms import efficient  # noqa: F401  isort: skip
from attnzoo.mechanisms import linear  # noqa: F401  isort: skip
from attnzoo.mechanisms import taylor  # noqa: F401  isort: skip
from attnzoo.mechanisms import linformer  # noqa: F401  isort: skip
from attnzoo.mechanisms import performer  # noqa: F401  isort: skip
from attnzoo.mechanisms import nystrom  # noqa: F401  isort: skip
