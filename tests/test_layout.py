"""The package's layout: its rooms (a module of the root, or a folder under it) import one another without a circle,
so that they stand in floors, each importing only those below it (the pipeline: ops -> feature maps -> attention ->
the swap -> stages -> commands). Imports inside functions count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dofattn"


def room(path: Path) -> str:
    """The room of a source file: `features.py` for a module of the root, `attention/` for a file in a folder."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) == 1 else parts[0] + "/"


def room_of_module(name: str) -> str | None:
    """The room of the package's module `name` (dotted), None for the package itself (its version) or none."""
    parts = name.split(".")[1:]
    if not parts:
        return None
    if (PACKAGE / parts[0]).is_dir():
        return parts[0] + "/"
    return parts[0] + ".py" if (PACKAGE / f"{parts[0]}.py").is_file() else None


def arrows() -> dict[str, set[str]]:
    """Room -> the rooms its files import (anywhere in their source)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue
        here = room(path)
        graph.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "dofattn" and (there := room_of_module(name)) and there != here:
                    graph[here].add(there)
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports among the rooms (its rooms in order, the first again at the end), or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node, [node]))), None)


def test_the_rooms_import_one_another_without_a_circle():
    graph = arrows()
    assert len(graph) > 10 and sum(map(len, graph.values())) > 50          # it read the package
    assert circle(graph) is None, "the rooms import in a circle: " + " -> ".join(circle(graph))


def test_a_circle_is_seen():
    """The check can fail: one import of a room above its own (the ops reading the feature maps) makes a circle."""
    graph = arrows()
    assert "ops/" in graph["features.py"]
    graph["ops/"] = graph["ops/"] | {"features.py"}
    assert circle(graph) == ["features.py", "ops/", "features.py"]
