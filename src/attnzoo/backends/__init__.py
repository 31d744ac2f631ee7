"""Backends: overrides of :mod:`attnzoo.ops`'s operations that are faster on some inputs.

Each backend registers its overrides when imported; ``attnzoo`` imports them after the
mechanisms (``ATTNZOO_FAST=0`` keeps every override from running). Nothing else in the
package imports a backend: the mechanisms' portable bodies are complete without one.
"""
