"""The layering rules, checked on the source: private torch APIs and process-wide state only
inside ``attnzoo.backends``; nothing outside it imports a backend (but the package's
``__init__``, which loads it); no import cycles among attnzoo's modules; every override names
an operation that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attnzoo
from attnzoo import ops

SRC = Path(attnzoo.__file__).parent
PRIVATE = re.compile(r"torch\.ops\.aten\._|torch\._C\b|torch\.ops\.mkldnn|_global_forward|torch\._[a-z]"
                     r"|register_at_fork|madvise")


def _modules() -> dict[str, Path]:
    """attnzoo's modules by dotted name."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _outside_backends():
    return {name: path for name, path in _modules().items() if not name.startswith("attnzoo.backends")}


def _imports(path: Path) -> set[str]:
    """The attnzoo modules a file imports (absolute imports; attnzoo uses no relative ones
    outside the backends)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attnzoo"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1]) + (f".{base}" if base else "")
            if base.startswith("attnzoo"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
    return found & set(_modules())


def test_no_private_torch_api_outside_the_backends():
    found = [f"{name}:{n + 1}: {line.strip()}" for name, path in _outside_backends().items()
             for n, line in enumerate(path.read_text().splitlines()) if PRIVATE.search(line)]
    assert not found, "private torch API or process-wide state outside attnzoo.backends:\n" + "\n".join(found)


def test_nothing_outside_the_package_root_imports_a_backend():
    found = [name for name, path in _outside_backends().items()
             if name != "attnzoo" and any(m.startswith("attnzoo.backends") for m in _imports(path))]
    assert not found, f"these import attnzoo.backends: {found}"


def test_no_import_cycles():
    graph = {name: _imports(path) - {name} for name, path in _modules().items()}
    # a package's own __init__ importing its submodules is no cycle: drop edges into a parent package
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(name, path):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join([*path, name, dep]))
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_every_override_names_an_operation():
    found = ops.operations()
    assert None not in found.values(), [name for name, v in found.items() if v is None]
    assert any(found.values()), "no operation is overridden: the CPU backend did not load"


def test_portable_turns_every_override_off(monkeypatch):
    """Inside ``ops.portable()``, and with ATTNZOO_FAST=0, no override runs."""
    seen = []
    op = ops.Operation("test_only_op", lambda x: ("portable", x))
    monkeypatch.setitem(ops._OVERRIDES, "test_only_op", lambda x: seen.append(x) or ("fast", x))
    assert op(1) == ("fast", 1)
    with ops.portable():
        assert op(2) == ("portable", 2)
    monkeypatch.setenv("ATTNZOO_FAST", "0")
    assert op(3) == ("portable", 3)
    monkeypatch.delenv("ATTNZOO_FAST")
    monkeypatch.setitem(ops._OVERRIDES, "test_only_op", lambda x: NotImplemented)
    assert op(4) == ("portable", 4)  # an override that does not apply
    assert seen == [1]
