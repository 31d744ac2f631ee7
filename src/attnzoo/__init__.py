"""attnzoo: attention mechanisms for long sequences behind one API.

>>> import attnzoo
>>> "full" in attnzoo.mechanisms()
True
"""

# Importing the subpackage registers the built-in mechanisms; it comes first so that the
# function `mechanisms` below, not the subpackage, is what `attnzoo.mechanisms` names.
import attnzoo.mechanisms as _builtin  # noqa: F401  isort: skip
import attnzoo.backends.cpu as _cpu_backend  # noqa: F401  isort: skip  (registers its overrides)
from attnzoo.backends.cpu.memory import empty_cache
from attnzoo.nn import MultiheadAttention
from attnzoo.recommend import recommend
from attnzoo.registry import attention, connectivity, get, mechanisms
from attnzoo.swap import swap_attention

__all__ = ["MultiheadAttention", "attention", "connectivity", "empty_cache", "get", "mechanisms",
           "recommend", "swap_attention"]
__version__ = "0.1.0"
