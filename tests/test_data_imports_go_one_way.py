# SPDX-License-Identifier: Apache-2.0
"""The modules of aiokv/data import one another one way: no import circle.

Bug: backend.py's open_backend imported the backends (uring.py, threads.py),
which import backend.py for the interface: a circle, held together only by
imports deferred into the function body; whichever module a reader met first,
the other half of the I/O layer came with it, and moving an import to the top
of either file would break `import aiokv`.
Invariant: the graph of imports between the modules of aiokv/data (every
`import` and `from ... import` anywhere in a module, deferred ones included;
the package's __init__ aside; a subpackage such as format/ one node) has no cycle, and backend.py, the interface,
imports none of them.
Fix: open_backend and the choice it makes moved to choice.py, which imports
the backends; the backends import backend.py; backend.py imports neither.
"""

from __future__ import annotations

import ast
import os

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "aiokv", "data")


def _sources(m: str) -> list[str]:
    """A module's file, or every file of a subpackage (format/: one node of the graph)."""
    path = os.path.join(DATA, m)
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]
    return [path + ".py"]


def _graph() -> dict[str, set[str]]:
    mods = {f[:-3] for f in os.listdir(DATA) if f.endswith(".py") and f != "__init__.py"}
    mods |= {d for d in os.listdir(DATA) if os.path.isfile(os.path.join(DATA, d, "__init__.py"))}
    graph: dict[str, set[str]] = {}
    for m in mods:
        trees = []
        for src in _sources(m):
            with open(src) as f:
                trees.append(ast.parse(f.read()))
        deps = set()
        for node in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["aiokv", "data"] and len(parts) > 2 and parts[2] in mods:
                    deps.add(parts[2])
        graph[m] = deps - {m}
    return graph


def test_backend_interface_imports_no_other_data_module():
    assert _graph()["backend"] == set()


def test_no_import_cycle_among_data_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path[path.index(d) :] + [d])
            if d not in state:
                walk(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
