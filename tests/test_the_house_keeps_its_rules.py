# SPDX-License-Identifier: Apache-2.0
"""The house keeps its rules: every product module small, documented, on the layer map, importing down.

Bug: issue 42. Between two redesigns the size discipline went unchecked (13 modules grew past 400
lines, five classes past 300, six functions past 80, modules landed that docs/design.md's layer table
does not name) and nobody saw it until a count by hand.
Invariant (docs/design.md, "Rules that hold"): every product module (aiokv/**.py, native/*.c|h)
  - is at most 400 lines (C: 600); a class at most 300 lines, a function at most 80 (Python: from
    its first decorator or `def`/`class` to its last line; C: from the signature to the `}` in column 0);
  - opens with a docstring (C: a comment after the SPDX line) saying its job and its threading
    contract (the word "thread"; a package's face, __init__.py or __main__.py, and aiokv.h are exempt);
  - is named in docs/design.md's "Layers" section, on its folder's row (or, beside the layers, after
    its folder's name), by file name (a subpackage's module by its path in the folder: `format/keys.py`);
  - imports (deferred imports too) only its own folder and what LAYERS allows, which points down the
    table; nothing but aiokv/connector and aiokv/demo/run_once.py imports vllm; config.py, jobs.py and
    util/ import nothing of aiokv;
  - imports no `contextvars`: what a call needs (a save's tenant, a job's abandon callback, the drives
    it waited on) is an argument of the call, never state its task's context carries.
KNOWN holds today's violations, each with what removes it: its case is xfail(strict=True), so a fix
that leaves its entry fails, a violation not in it fails, and a known size that grows past its
"N lines today" fails. KNOWN only shrinks: never add to it.
Fix: the redesign of issue 42; this test keeps it. Plain AST and text: no aiokv or vllm import.
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULE, MAX_C, MAX_CLASS, MAX_FUNC = 400, 600, 300, 80
FACES = ("__init__.py", "__main__.py")
BOTTOM = {"native", "jobs", "config", "util", "__version__"}  # every layer may import these
BASE = {"config", "jobs", "util"}  # ...which import nothing of aiokv themselves
LAYERS = {  # folder (or top-level module) -> the folders it may import besides its own and BOTTOM
    "connector": {"scheduler", "worker", "store", "bucket", "data"},
    "scheduler": {"store"},
    "worker": {"bucket", "data"},  # the worker never opens the index ("Processes and threads")
    "store": {"data"},
    "bucket": {"data"},
    "data": set(),
    "ops": {"store", "bucket", "data"},
    "cli": {"ops", "store", "bucket", "data"},
    "demo": set(),
    "__main__": {"cli"},
    "__init__": set(),
}
VLLM_OK = ("aiokv/connector/", "aiokv/demo/run_once.py")
SPLIT = "split it, a module per job"
KNOWN: dict[str, dict[str, str]] = {  # rule -> {path or path::name: what removes it}; it only shrinks
    "small": {},  # sizes: "N lines today", and a known one may not grow past its N either
    "parts_small": {},
    "c_functions_small": {},
    "says_its_job": {},
    "on_the_map": {},
    "imports_down": {},
    "no_context_vars": {},
}


def _py_modules(root: str = ROOT) -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(root, "aiokv")):
        out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(".py")]
    return sorted(out)


def _c_units(root: str = ROOT) -> list[str]:
    nat = os.path.join(root, "native")
    return sorted("native/" + f for f in os.listdir(nat) if f.endswith((".c", ".h")))


def _read(root: str, path: str) -> str:
    with open(os.path.join(root, path)) as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _tree(root: str, path: str) -> ast.Module:
    return ast.parse(_read(root, path))


# -- the checkers: each answers {path or path::name: what is wrong and its fix} for one file --------


def small(root: str, path: str) -> dict[str, str]:
    n, limit = _read(root, path).count("\n"), MAX_C if path.startswith("native/") else MAX_MODULE
    return {path: f"{n} lines, at most {limit}: split it, add a module with one job"} if n > limit else {}


def parts_small(root: str, path: str) -> dict[str, str]:
    out = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                n, limit = child.end_lineno - first + 1, MAX_CLASS if isinstance(child, ast.ClassDef) else MAX_FUNC
                if n > limit:
                    out[f"{path}::{prefix}{child.name}"] = f"{n} lines, at most {limit}: split it, one job each"
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(_tree(root, path), "")
    return out


def c_functions_small(root: str, path: str) -> dict[str, str]:
    """Each function defined at file scope: from the first line of its signature to the `}` in column 0."""
    strip = r"""/\*.*?\*/|//.*|"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])'"""  # comments, strings, chars
    lines = [re.sub(strip, "", line).rstrip() for line in _read(root, path).split("\n")]
    out, start, body, depth = {}, None, None, 0
    for i, line in enumerate(lines):
        if depth:  # inside a file-scope block: a function's, a struct's or an initializer's
            depth += line.count("{") - line.count("}")
            name, first = body
            if depth <= 0 and name and i - first + 1 > MAX_FUNC:
                out[f"{path}::{name}"] = f"{i - first + 1} lines, at most {MAX_FUNC}: split it, one job each"
            depth = max(depth, 0)
            continue
        if start is None and not re.match(r"[A-Za-z_]", line):
            continue  # blank, preprocessor, comment or a continuation
        start = i if start is None else start
        head = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", " ".join(lines[start : i + 1]))
        if head.endswith("{"):
            m = re.match(r"[^=(]*?\b(\w+)\s*\(", head)  # no `(` before `=`: not an initializer
            body, start, depth = (m.group(1) if m else None, start), None, head.count("{") - head.count("}")
        elif head.endswith((";", "}")):
            start = None
    return out


def says_its_job(root: str, path: str) -> dict[str, str]:
    text = _read(root, path)
    if path.startswith("native/"):
        body = re.sub(r"^/\*\s*SPDX[^*]*\*/\s*", "", text)
        doc = body[: body.find("*/")] if body.startswith("/*") else ""
        exempt = path.endswith(".h")
    else:
        doc, exempt = ast.get_docstring(_tree(root, path)) or "", path.endswith(FACES)
    if not doc:
        return {path: "it opens with no docstring (C: comment): say its one job and its threading contract"}
    if not exempt and not re.search("thread", doc, re.I):
        return {
            path: "its docstring (C: comment) says no threading contract: say which threads call it, what they share"
        }
    return {}


@functools.lru_cache(maxsize=None)
def _layer_parts(root: str) -> dict[str, list[str]]:
    """folder -> the backticked names on its row of the layer table, or after it beside the layers."""
    text = _read(root, "docs/design.md")
    start = text.index("## Layers")
    section = text[start : text.index("\n## ", start + 1)]
    parts: dict[str, list[str]] = {}
    for row in re.findall(r"^\|(.*)\|$", section, re.M):
        cells = row.split("|") + [""]
        m = re.search(r"aiokv/(\w+)/", cells[0])
        folder = m.group(1) if m else cells[0].strip()
        if m or folder == "native":  # not the header or its rule
            parts.setdefault(folder, []).extend(re.findall(r"`([^`]+)`", cells[1]))
    beside = re.split(r"`aiokv/(\w+)/`", section[section.index("Beside the layers") :])
    parts.setdefault("", []).extend(re.findall(r"`([^`]+)`", beside[0]))  # the top-level modules
    for folder, prose in zip(beside[1::2], beside[2::2]):
        parts.setdefault(folder, []).extend(re.findall(r"`([^`]+)`", prose))
    return parts


def on_the_map(root: str, path: str) -> dict[str, str]:
    if path.endswith(FACES):
        return {}  # a package's face: its folder is on the map
    bits = path.split("/")
    if bits[0] == "native":
        folder, key = "native", "/".join(bits[1:])
    else:
        folder, key = ("", bits[1]) if len(bits) == 2 else (bits[1], "/".join(bits[2:]))
    names = _layer_parts(root).get(folder, [])
    if any(t == key or (t.endswith("/" + key) and path.endswith(t)) for t in names):
        return {}
    return {path: f"not named in docs/design.md's Layers section as `{key}`: add it to its layer's list, with its job"}


def _folder(path: str) -> str:
    bits = path.split("/")
    return bits[1][:-3] if len(bits) == 2 else bits[1]


def imports_down(root: str, path: str) -> dict[str, str]:
    me, out = _folder(path), {}
    allowed = {me} | (set() if me in BASE else BOTTOM | LAYERS.get(me, set()))
    package = path[:-3].split("/")[:-1] if not path.endswith("__init__.py") else path.split("/")[:-1]
    for node in ast.walk(_tree(root, path)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == "vllm" and not path.startswith(VLLM_OK):
                out[f"{path}::vllm"] = f"line {node.lineno} imports vllm: only aiokv/connector/ talks to vLLM"
            if bits[0] != "aiokv" or len(bits) < 2:
                continue
            to = "native" if bits[1] in ("_native", "_index") else bits[1]
            if to not in allowed:
                out[f"{path}::{to}"] = (
                    f"line {node.lineno} imports aiokv.{bits[1]}, up or across docs/design.md's layer table: "
                    f"move the code down a layer, or (if it points down) add it to LAYERS and 'Rules that hold'"
                )
    return out


def no_context_vars(root: str, path: str) -> dict[str, str]:
    for node in ast.walk(_tree(root, path)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n.split(".")[0] == "contextvars" for n in names):
            return {
                path: f"line {node.lineno} imports contextvars: pass what the call needs as an argument of the call"
            }
    return {}


# -- the rules on today's tree ----------------------------------------------------------------------


PY, C = _py_modules(), _c_units()
PATHS = {"small": PY + C, "parts_small": PY, "c_functions_small": [p for p in C if p.endswith(".c")]}
PATHS.update(says_its_job=PY + C, on_the_map=PY + C, imports_down=PY, no_context_vars=PY)


def _cases(rule: str) -> list:
    """The tree (a violation not in KNOWN fails), then each KNOWN entry, which must still be a violation."""
    cases = [pytest.param(None, id="the-tree")]
    for key, why in sorted(KNOWN[rule].items()):
        cases.append(pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=why), id=f"KNOWN-{key}"))
    return cases


def _grew(known: str, found: str) -> bool:
    """A known size violation that grew past its "N lines today": worse, so it fails too."""
    today = re.search(r"(\d+) lines today", known)
    return bool(today) and int(found.split()[0]) > int(today.group(1))


def _check(rule: str, key: str | None) -> None:
    checker = globals()[rule]
    if key is not None:
        found = checker(ROOT, key.split("::")[0])
        assert key not in found, f"{key}: {found.get(key)}"
        return
    found = {k: v for p in PATHS[rule] for k, v in checker(ROOT, p).items()}
    new = {k: v for k, v in found.items() if k not in KNOWN[rule]}
    new.update(
        {k: f"{v}; grew past KNOWN's '{KNOWN[rule][k]}'" for k, v in found.items() if _grew(KNOWN[rule].get(k, ""), v)}
    )
    assert not new, "\n".join(f"{k}: {v}" for k, v in new.items())


@pytest.mark.parametrize("key", _cases("small"))
def test_a_module_is_small(key):
    _check("small", key)


@pytest.mark.parametrize("key", _cases("parts_small"))
def test_classes_and_functions_are_small(key):
    _check("parts_small", key)


@pytest.mark.parametrize("key", _cases("c_functions_small"))
def test_c_functions_are_small(key):
    _check("c_functions_small", key)


@pytest.mark.parametrize("key", _cases("says_its_job"))
def test_a_module_says_its_job_and_threading(key):
    _check("says_its_job", key)


@pytest.mark.parametrize("key", _cases("on_the_map"))
def test_a_module_is_on_the_layer_map(key):
    _check("on_the_map", key)


@pytest.mark.parametrize("key", _cases("imports_down"))
def test_imports_go_down(key):
    _check("imports_down", key)


@pytest.mark.parametrize("key", _cases("no_context_vars"))
def test_no_module_imports_contextvars(key):
    _check("no_context_vars", key)


def test_config_imports_nothing_of_aiokv():
    tree = ast.parse(_read(ROOT, "aiokv/config.py"))
    mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    mods += [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in mods if m.split(".")[0] in ("aiokv", ".")], "config.py is the base: it imports no layer"


def test_layers_point_down_the_table():
    """LAYERS, read against the table's order of rows: a layer may import only the rows below its own."""
    rows = list(_layer_parts(ROOT))
    order = rows[: rows.index("")]  # the table's rows, top to bottom; then what is beside the layers
    assert set(order) - {"native"} <= set(LAYERS), f"a layer without a LAYERS entry: {set(order) - set(LAYERS)}"
    for folder, allowed in LAYERS.items():
        below = set(order[order.index(folder) + 1 :]) if folder in order else set(order) | set(LAYERS) - {folder}
        assert allowed <= below, f"LAYERS lets {folder} import {allowed - below}: up the table; move the code down"


def test_known_names_only_what_exists():
    assert set(KNOWN) == set(PATHS), "KNOWN has a list per rule, and no other"
    for rule, entries in KNOWN.items():
        for key in entries:
            path, _, name = key.partition("::")
            assert os.path.isfile(os.path.join(ROOT, path)), f"KNOWN[{rule}] names {path}: gone, take it out"
            if name and rule in ("parts_small", "c_functions_small"):
                assert re.search(rf"\b{re.escape(name.split('.')[-1])}\b", _read(ROOT, path)), f"{key}: gone"


def test_the_checkers_catch_a_synthetic_house(tmp_path):
    """A tiny tree with one of each violation: each checker reports it, and only it."""
    (tmp_path / "aiokv" / "store").mkdir(parents=True)
    (tmp_path / "aiokv" / "data").mkdir()
    (tmp_path / "native").mkdir()
    (tmp_path / "docs").mkdir()
    doc = '"""One job. Threading: the scheduler thread."""\n'
    (tmp_path / "aiokv" / "data" / "big.py").write_text(doc + "x = 1\n" * 400)
    f80 = "@staticmethod\ndef f():\n" + "    x = 1\n" * 78  # 80 lines, its decorator counted
    g81 = "@staticmethod\ndef g():\n" + "    x = 1\n" * 79
    (tmp_path / "aiokv" / "data" / "funcs.py").write_text(doc + f80 + g81)
    (tmp_path / "aiokv" / "data" / "up.py").write_text(
        doc + "def f():\n    from aiokv.store import x\n    import vllm\n"
    )
    (tmp_path / "aiokv" / "store" / "ok.py").write_text(doc + "from ..data import up\n")
    (tmp_path / "aiokv" / "data" / "ctx.py").write_text(doc + "def f():\n    from contextvars import ContextVar\n")
    (tmp_path / "aiokv" / "store" / "nodoc.py").write_text("x = 1\n")
    c_func = "static int\nf(int a,\n  int b) {\n" + "    a++;\n" * 76 + "}\n"  # 80 lines
    (tmp_path / "native" / "x.c").write_text(
        "/* SPDX */\n/* x: one job */\n" + c_func + c_func.replace("f(", "g(").replace("a++;\n", "a++;\n    b++;\n", 1)
    )
    (tmp_path / "docs" / "design.md").write_text(
        "## Layers\n\n| layer | modules |\n|---|---|\n| data (`aiokv/data/`) | `big.py`, `funcs.py` |\n"
        "| store (`aiokv/store/`) | `ok.py`, `nodoc.py` |\n| native | `native/x.c` |\n\nBeside the layers: none.\n\n## Next\n"
    )
    root = str(tmp_path)
    assert list(small(root, "aiokv/data/big.py")) == ["aiokv/data/big.py"]
    assert small(root, "aiokv/data/funcs.py") == {}
    assert list(parts_small(root, "aiokv/data/funcs.py")) == ["aiokv/data/funcs.py::g"]
    assert list(c_functions_small(root, "native/x.c")) == ["native/x.c::g"]
    assert list(imports_down(root, "aiokv/data/up.py")) == ["aiokv/data/up.py::store", "aiokv/data/up.py::vllm"]
    assert imports_down(root, "aiokv/store/ok.py") == {}  # a relative import, resolved: store -> data
    assert list(no_context_vars(root, "aiokv/data/ctx.py")) == ["aiokv/data/ctx.py"]  # a deferred import too
    assert no_context_vars(root, "aiokv/data/up.py") == {} and no_context_vars(root, "aiokv/store/ok.py") == {}
    assert list(says_its_job(root, "aiokv/store/nodoc.py")) == ["aiokv/store/nodoc.py"]
    assert list(says_its_job(root, "native/x.c")) == ["native/x.c"]  # no threading contract
    assert says_its_job(root, "aiokv/data/big.py") == {}
    assert on_the_map(root, "aiokv/data/up.py") and not on_the_map(root, "aiokv/data/big.py")
    assert on_the_map(root, "aiokv/data/ok.py") and not on_the_map(root, "native/x.c")  # its own row only
    assert _grew("split it; 80 lines today", "81 lines, at most 80") and not _grew("80 lines today", "80 lines")


OPERATOR_CLI = ("aiokv/cli/operate.py", "aiokv/cli/warm.py")  # aiokv clear, pin, unpin; aiokv warm


def _aiokv_imports(path: str) -> list[str]:
    """Every aiokv module a file imports, deferred imports too."""
    out = []
    for node in ast.walk(_tree(ROOT, path)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.split(".")[0] == "aiokv"]


def test_the_operator_commands_reach_the_store_only_through_ops():
    """Following `aiokv clear` (or warm) from the command line to the engines stays in aiokv/ops/ and
    the store: the CLI's modules of the operators' commands import nothing of the store, and call ops."""
    for path in OPERATOR_CLI:
        mods = _aiokv_imports(path)
        assert not [m for m in mods if m.startswith("aiokv.store")], f"{path} imports the store: go through aiokv/ops/"
        assert any(m.startswith("aiokv.ops") for m in mods), f"{path} does not call aiokv/ops/"
