"""Built-in mechanisms: one module each; importing a module registers it."""

from attnzoo.mechanisms import full, local, sparse_transformer  # noqa: F401
