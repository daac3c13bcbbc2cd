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


# inside `metaloom.models`, bottom to top, by module (a name stands for itself and what is below
# it): what every part reads (paths, protocols, the config and other plain data), the kernels,
# the model built from them, and loading on top. A module may import its own line or earlier.
MODELS_LAYERS = (
    ("paths", "protocols", "flops", "engine.config", "engine.sharing", "engine.rope", "engine.kv_policy",
     "engine.kv_int8", "engine.gguf_file", "engine.tokenizer"),
    ("kernels",),
    ("engine", "forward", "scorers"),
    ("find", "load", "__init__"),  # find: a model spec -> its transformers folder (a GGUF converted once)
)


def models_rank(module: str) -> int:
    """The line of `MODELS_LAYERS` a module of metaloom.models ("engine.llama") is on: its most
    specific entry."""
    best, rank = -1, None
    for r, names in enumerate(MODELS_LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), r
    assert rank is not None, f"metaloom.models.{module} has no line in MODELS_LAYERS"
    return rank


def models_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module under metaloom.models) of every import of one, lazy ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("metaloom.models"):
            base = node.module.removeprefix("metaloom.models").lstrip(".")
            if base in ("", "kernels", "engine"):  # from metaloom.models.kernels import quant
                out += [(node.lineno, f"{base}.{a.name}".lstrip(".")) for a in node.names]
            else:
                out.append((node.lineno, base))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.removeprefix("metaloom.models.")) for a in node.names
                    if a.name.startswith("metaloom.models.")]
    return out


def test_inside_models_imports_only_go_down():
    up = []
    for path in sorted((ROOT / "models").rglob("*.py")):
        here = ".".join(path.relative_to(ROOT / "models").with_suffix("").parts).removesuffix(".__init__")
        for line, there in models_imports(ast.parse(path.read_text(), str(path))):
            if there and models_rank(there) > models_rank(here):
                up.append(f"models/{path.relative_to(ROOT / 'models')}:{line}: {here} imports {there}")
    assert not up, "imports inside metaloom.models that go up:\n" + "\n".join(up)


def test_the_models_check_ranks_by_the_most_specific_name():
    assert models_rank("engine.config") == 0 and models_rank("engine.llama") == 2
    assert models_rank("kernels.fused") == 1 and models_rank("load") == 3
    tree = ast.parse("from metaloom.models.kernels import quant\ndef f():\n    from metaloom.models.load import load\n")
    assert models_imports(tree) == [(1, "kernels.quant"), (3, "load")]
