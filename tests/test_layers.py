"""The package layer graph: a package imports only packages below it (lazy imports and
TYPE_CHECKING imports included), so a newcomer can read the code bottom-up and no two rooms
depend on each other. A new edge that goes up fails here, naming the file and the import."""

import ast
import pathlib

import metaloom

ROOT = pathlib.Path(metaloom.__file__).parent

# bottom to top; a package may import any package on an earlier line, none on its own line or later
LAYERS = (
    ("errors",),
    ("ledger",),
    ("models", "sampling", "constrain", "sandbox"),
    ("prefix", "tools"),  # tools: what tool_chain calls (calculator, sandboxed python, BM25 search)
    ("speculative",),
    ("decode",),
    ("generator",),
    ("score",),
    ("meta",),
    ("search",),
    ("wiring", "present"),  # names -> objects (registry, configure, specs, engines); how traces and figures read
    ("eval", "server"),
    ("testing",),  # toy models, scripted generators, a server on a free port (as `metaloom serve` runs it)
    ("bench",),
    ("commands",),
    ("cli", "__main__"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def room(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "metaloom" else [f"metaloom.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, name.split(".")[1]) for line, name in out if name.startswith("metaloom.")]


def edges() -> list[tuple[str, str, str]]:
    """(importing file:line, from room, to room) for every import between rooms."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        here = room(path)
        for line, there in imported(ast.parse(path.read_text(), str(path))):
            if there != here:
                found.append((f"{path.relative_to(ROOT.parent)}:{line}", here, there))
    return found


def test_every_room_has_a_layer():
    rooms = {room(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert rooms <= set(RANK), f"rooms without a layer: {sorted(rooms - set(RANK))}"


def test_imports_only_go_down():
    up = [f"{where}: {a} imports {b}" for where, a, b in edges() if RANK[b] >= RANK[a]]
    assert not up, "imports that go up or sideways:\n" + "\n".join(up)


def test_the_check_sees_lazy_and_type_checking_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import metaloom.generator.types\n"
                     "def f():\n    from metaloom.search.core import Tree\n    from metaloom import eval\n")
    assert imported(tree) == [(3, "generator"), (5, "search"), (6, "eval")]
