"""The package's import graph: every module on its floor, and any import circle.

Reads the sources of ``src/recurrent_cache`` (``.py``, and ``.pyx`` / ``.pxd`` of a compiled
module, which count as one module) and collects the imports of the package's own modules:
``import``, ``from ... import`` and ``cimport``, relative or absolute, at module level or inside
a function (a late import is still a dependency, and one made late to dodge a circle is the
circle).  ``from . import name`` is an import of submodule ``name`` when there is one, else of
the package itself.

A module's floor is 1 + the highest floor among the modules it imports (0: it imports none of
the package).  Modules that import each other, directly or round a longer loop, have no floor:
they are a circle, and the tool names each one and exits 1.

    python tools/import_graph.py            # the map by floor, then any circle
    python tools/import_graph.py --check    # only the circles (exit 1 if there is one)
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "recurrent_cache"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE
SUFFIXES = (".py", ".pyx", ".pxd")

# one (c)import statement of Cython source; a parenthesised name list may span lines
_CYTHON_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(?P<base>[\w.]+)[ \t]+c?import[ \t]+(?P<names>\([^)]*\)|[^\n#]*)"
                            r"|c?import[ \t]+(?P<modules>[^\n#]*))", re.MULTILINE)


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module a source file under ``root`` (the package's folder) is."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _statements(path: Path) -> Iterable[tuple[int, str | None, list[str]]]:
    """Each import of a source file as (level, base module, names); ``import a.b`` is
    (0, None, ["a.b"])."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Import):
                yield 0, None, [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                yield node.level, node.module, [alias.name for alias in node.names]
        return
    for match in _CYTHON_IMPORT.finditer(text):
        if match["modules"] is not None:
            yield 0, None, [name.split()[0] for name in match["modules"].split(",") if name.strip()]
            continue
        base = match["base"]
        level = len(base) - len(base.lstrip("."))
        names = [name.split()[0] for name in match["names"].strip("() \t\n").replace("\n", " ").split(",")
                 if name.strip()]
        yield level, base[level:] or None, names


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that the source file of module ``name`` imports."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for level, base, names in _statements(path):
        if level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - (level - 1)]
            target = ".".join(anchor + ([base] if base else []))
        elif base is not None:
            target = base
        else:   # import a.b.c: the deepest of them that is a module of the package
            found.update(_deepest(full, modules) for full in names)
            continue
        for imported in names:
            submodule = f"{target}.{imported}"
            found.add(submodule if submodule in modules else _deepest(target, modules))
    return {module for module in found if module is not None and module != name}


def _deepest(dotted: str, modules: set[str]) -> str | None:
    """The longest prefix of ``dotted`` that is one of ``modules`` (None: not the package's)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path = SOURCE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every module under ``root``."""
    files: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*")):
        if path.suffix in SUFFIXES and path.is_file():
            files.setdefault(module_name(path, root), []).append(path)
    modules = set(files)
    return {name: set().union(*(_imports(path, name, modules) for path in paths)) for name, paths in files.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import circles: each set of modules that reach one another (sorted), Tarjan's way."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def floors(graph: Mapping[str, set[str]]) -> dict[str, int]:
    """Each module's floor; the modules of a circle (and those above one) have none."""
    in_circle = {module for circle in circles(graph) for module in circle}
    floor: dict[str, int] = {}
    pending = {module for module in graph if module not in in_circle}
    while True:
        ready = [module for module in pending if all(imported in floor for imported in graph[module])]
        if not ready:
            return floor
        for module in ready:
            floor[module] = 1 + max((floor[imported] for imported in graph[module]), default=-1)
        pending.difference_update(ready)


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".") if module != PACKAGE else PACKAGE


def module_map(graph: Mapping[str, set[str]]) -> str:
    """The modules floor by floor, each with what it imports; then the modules with no floor."""
    floor = floors(graph)
    lines = []
    for level in range(max(floor.values(), default=-1) + 1):
        lines.append(f"floor {level}:")
        for module in sorted(module for module, at in floor.items() if at == level):
            imported = ", ".join(sorted(map(_short, graph[module])))
            lines.append(f"  {_short(module)}" + (f"  <- {imported}" if imported else ""))
    unplaced = sorted(set(graph) - set(floor))
    if unplaced:
        lines.append("no floor (in or above a circle): " + ", ".join(map(_short, unplaced)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print only the circles")
    parser.add_argument("--root", type=Path, default=SOURCE, help="the package's folder (default: %(default)s)")
    args = parser.parse_args(argv)
    graph = import_graph(args.root)
    if not args.check:
        print(module_map(graph))
    found = circles(graph)
    for circle in found:
        print("circle: " + " <-> ".join(map(_short, circle)), file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
