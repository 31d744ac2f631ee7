"""The boundary between the mathematics and the speed layer: named operations.

An *operation* is a function of tensors with a portable body, written in plain public torch
beside the mathematics it serves (``@operation("attend_few_keys")`` on that body). The
portable body is what runs on a GPU, what ``ATTNZOO_FAST=0`` runs everywhere, and what the
differential tests hold every fast path to.

A backend (``attnzoo.backends``) may register an override of an operation by name
(``@override("attend_few_keys")``): a function of the same signature that computes the same
thing faster on some inputs, and returns ``NotImplemented`` on the others (another device or
dtype, a layout its kernel cannot read, an option it does not know), which the portable body
then takes. Overrides are the only place private torch APIs, C kernels or process-wide
state may appear.

``ATTNZOO_FAST=0`` in the environment turns every override off, read at each call;
:func:`portable` does so for a block of code, in this thread. Code that ``torch.compile`` (or
``torch.export``) traces takes only the overrides registered as *traceable*
(``@override(name, traceable=True)``): plain torch around custom operators
(``torch.library``), which the graph holds as single nodes; every other operation takes its
portable body there.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Operation", "compiling", "fast_enabled", "needs_grad", "operation", "operations", "override",
           "portable"]

_OPERATIONS: dict[str, Operation] = {}
_OVERRIDES: dict[str, Callable[..., Any]] = {}
_TRACEABLE: dict[str, Callable[..., Any]] = {}  # the overrides code being traced may take
_LOCAL = threading.local()
compiling = getattr(torch.compiler, "is_compiling", lambda: False)  # (torch >= 2.3; before: never)


def fast_enabled() -> bool:
    """Whether overrides may run here: not with ``ATTNZOO_FAST=0`` and not inside :func:`portable`."""
    return os.environ.get("ATTNZOO_FAST", "1") != "0" and not getattr(_LOCAL, "portable", False)


def _override_of(name: str) -> Callable[..., Any] | None:
    """The override an operation takes here: while ``torch.compile`` traces, only a traceable one
    (an override's C kernel called through ctypes, or a private op, would break its graph)."""
    if not fast_enabled():
        return None
    return _TRACEABLE.get(name) if compiling() else _OVERRIDES.get(name)


@contextmanager
def portable() -> Iterator[None]:
    """Run every operation by its portable body inside this block (this thread only)."""
    before = getattr(_LOCAL, "portable", False)
    _LOCAL.portable = True
    try:
        yield
    finally:
        _LOCAL.portable = before


class Operation:
    """A named operation: its portable body, and the override a backend registered, if any."""

    def __init__(self, name: str, body: Callable[..., Any]):
        self.name, self.portable = name, body
        functools.update_wrapper(self, body)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fast = _override_of(self.name)
        if fast is not None:
            out = fast(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return self.portable(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<operation {self.name}{' (overridden)' if self.name in _OVERRIDES else ''}>"


def operation(name: str) -> Callable[[Callable[..., Any]], Operation]:
    """Declare the portable body of operation ``name``."""

    def declare(body: Callable[..., Any]) -> Operation:
        if name in _OPERATIONS:
            raise ValueError(f"operation {name!r} is already declared")
        _OPERATIONS[name] = op = Operation(name, body)
        return op

    return declare


def override(name: str, *, traceable: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a backend's override of operation ``name`` (it returns NotImplemented where it
    does not apply); ``traceable=True``: the one code being traced by ``torch.compile`` takes.
    The operation need not be declared yet: backends load after the mechanisms, and
    :func:`operations` tells a misspelt name (a test checks every override names one)."""
    table = _TRACEABLE if traceable else _OVERRIDES

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in table:
            raise ValueError(f"operation {name!r} already has an override")
        table[name] = fn
        return fn

    return register


def operations() -> dict[str, bool]:
    """Every declared operation and whether a backend overrides it, and any override whose
    name no operation declares (mapped to None: a defect)."""
    found: dict[str, Any] = {name: name in _OVERRIDES for name in _OPERATIONS}
    found.update({name: None for name in [*_OVERRIDES, *_TRACEABLE] if name not in _OPERATIONS})
    return found


def needs_grad(*ts: torch.Tensor | None) -> bool:
    """Whether autograd will differentiate through any of ``ts`` here."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)
