"""The package's layering rules, checked on the source (AST), so `make test` fails when one is broken.

Layers, bottom to top; a module imports only from its own layer or below, and the packages that share a layer
(weights, data, parallel) do not import each other:

    base       errors paths io output logs runtime sources
    layout     layout
    config     config
    model      model/
    domain     weights/  data/  parallel/
    training   training/
    byhand     byhand/   (parallelism by hand on CPU workers: model.scratch's hooks, data, the lr schedule)
    launch     launch/
    doctor     doctor/
    course     course/
    entry      cli  __main__  launch/__main__   (dispatch only)

Also: only entry points import the CLI; no private name (`_x`) is taken from another module; no import cycle; the
trainer does not use the planner, nor the hand-written layouts (byhand) the parallel package; the data layer neither
builds nor trains a model; a module imports the package's own modules at its top, where a reader sees its
dependencies (inside a function only with a comment on the line saying why; MindSpore, mindformers and torch stay
lazy for start-up time).

The imports are read by `labkit.sources.package_imports`, the reader the caches' source keys use too."""
from __future__ import annotations

import ast
from pathlib import Path

from labkit.sources import modules, package_imports

LAYERS = [
    ("base", ["errors", "paths", "io", "output", "logs", "runtime", "sources"]),
    ("layout", ["layout"]),
    ("config", ["config"]),
    ("model", ["model"]),
    ("domain", ["weights", "data", "parallel"]),
    ("training", ["training"]),
    ("byhand", ["byhand"]),
    ("launch", ["launch"]),
    ("doctor", ["doctor"]),
    ("course", ["course"]),
    ("entry", ["cli", "__main__", "launch.__main__"]),
]
FORBIDDEN = [  # (importer prefix, imported prefix, why)
    ("training", "parallel.planner", "the trainer does not depend on the planner"),
    ("byhand", "parallel", "the hand-written layouts do not use the planner nor the framework's parallel config"),
    ("data", "model", "the data layer does not build a model"),
    ("data", "training", "the data layer does not train a model"),
]


def place(mod: str) -> tuple[int, str]:
    """(layer index, package within the layer) of a module name relative to the package."""
    best = None
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if mod == m or mod.startswith(m + "."):
                if best is None or len(m) > len(best[1]):
                    best = (i, m)
    if best is None:
        raise ValueError(f"module '{mod}' is in no layer: add it to LAYERS in tests/layering.py")
    return best


def violations(pkg: Path) -> list[str]:
    """Every broken rule in the package at `pkg`, one line each (empty when the layering holds)."""
    mods = modules(pkg)
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    bad = []
    for mod, f in mods.items():
        if not mod:
            continue
        li, lp = place(mod)
        text = f.read_text(encoding="utf-8")
        for target, name, line in package_imports(text, mod, f.name == "__init__.py", known, pkg.name):
            where = f"{f.relative_to(pkg.parent)}:{line}"
            if target and target != mod:
                graph[mod].add(target)
            if not target or target == mod or target not in known:
                continue
            ti, tp = place(target)
            if target == "cli" and LAYERS[li][0] != "entry":
                bad.append(f"{where}: {mod} imports the CLI (only entry points may)")
            if ti > li:
                bad.append(f"{where}: {mod} ({LAYERS[li][0]}) imports {target} ({LAYERS[ti][0]}), a higher layer")
            elif ti == li and tp != lp and LAYERS[li][0] not in ("base", "entry"):
                bad.append(f"{where}: {mod} imports {target}: {lp} and {tp} share a layer and stay independent")
            if name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{where}: {mod} imports the private name {target}.{name}")
            for a, b, why in FORBIDDEN:
                if (mod == a or mod.startswith(a + ".")) and (target == b or target.startswith(b + ".")):
                    bad.append(f"{where}: {mod} imports {target}: {why}")
        bad += private_attributes(f, mod, known, pkg.name) + hidden_imports(f, mod, pkg.name)
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return bad


def hidden_imports(f: Path, mod: str, pkg_name: str) -> list[str]:
    """The package's own modules imported inside a function without a comment on the line saying why."""
    text = f.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.level:
                names = [pkg_name]
            if any(n == pkg_name or n.startswith(pkg_name + ".") for n in names) and "#" not in lines[node.lineno - 1]:
                found.append(f"{f.name}:{node.lineno}: {mod} imports its own package inside {fn.name}(); "
                             "move it to the top (or say why on the line)")
    return found


def private_attributes(f: Path, mod: str, known: set[str], pkg_name: str) -> list[str]:
    """`other._x` where `other` is a module of the package bound by an import."""
    tree = ast.parse(f.read_text(encoding="utf-8"))
    alias = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(pkg_name)):
            for a in node.names:
                base = (node.module or "").removeprefix(pkg_name).strip(".")
                full = f"{base}.{a.name}".strip(".")
                if full in known and full != mod:
                    alias[a.asname or a.name] = full
    return [f"{f.relative_to(f.parents[len(mod.split('.'))])}:{n.lineno}: {mod} uses the private name "
            f"{alias[n.value.id]}.{n.attr}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in alias
            and n.attr.startswith("_") and not n.attr.startswith("__")]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles (one per strongly connected component of more than one module), by Tarjan's algorithm."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
