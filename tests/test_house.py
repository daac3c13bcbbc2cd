"""The house rules DESIGN.md sets for the package, held by the suite rather than by review: no
module over 400 lines and no function over 80 (split along what each part is about), so a
newcomer reads a file whole and a function on one screen."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "metaloom"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def long_modules(root: Path) -> dict[str, int]:
    """Modules under root over MAX_FILE_LINES: their path and line count."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}
    return {p: n for p, n in counts.items() if n > MAX_FILE_LINES}


def long_functions(root: Path) -> dict[str, int]:
    """Functions and methods under root over MAX_FUNCTION_LINES (def line to last line)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES):
                out[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = n
    return out


def test_no_module_is_over_400_lines():
    assert not long_modules(ROOT), f"modules over {MAX_FILE_LINES} lines: {long_modules(ROOT)}"


def test_no_function_is_over_80_lines():
    assert not long_functions(ROOT), f"functions over {MAX_FUNCTION_LINES} lines: {long_functions(ROOT)}"


def test_the_checks_see_a_long_module_and_a_long_method(tmp_path):
    """Both checks would pass on a tree they failed to read: show them one they must flag."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text(f"class A:\n    def ok(self):\n{body}\n")
    (tmp_path / "pkg" / "long.py").write_text(f"class A:\n    def m(self):\n{body}\n        y = 1\n"
                                              + "\n" * (MAX_FILE_LINES - MAX_FUNCTION_LINES))
    assert long_functions(tmp_path) == {"pkg/long.py:2 m": MAX_FUNCTION_LINES + 1}
    assert list(long_modules(tmp_path)) == ["pkg/long.py"]
