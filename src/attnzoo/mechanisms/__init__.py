"""Built-in mechanisms: one module each; importing a module registers it."""

from attnzoo.mechanisms import full  # noqa: F401
