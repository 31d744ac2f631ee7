"""Spies the backend tests share: which override answered, and what a C kernel returned."""

from attnzoo import ops


def override_answers(monkeypatch, name: str) -> list[bool]:
    """A list that records, call by call, whether operation ``name``'s override answered (True) or
    returned NotImplemented (False: the portable body then ran)."""
    calls, fast = [], ops._OVERRIDES[name]

    def spy(*args, **kwargs):
        out = fast(*args, **kwargs)
        calls.append(out is not NotImplemented)
        return out

    monkeypatch.setitem(ops._OVERRIDES, name, spy)
    return calls


def kernel_spy(kernel, name: str, calls: list):
    """``kernel`` wrapped to append (name, whether it ran: a result other than None) to ``calls``."""

    def spy(*args, **kwargs):
        result = kernel(*args, **kwargs)
        calls.append((name, result is not None))
        return result

    return spy
