"""Two versions of a kernel source side by side, for the A/B scripts (q8_kernel_ab.py,
attend_kernel_ab.py): a git revision's files and the working tree's, each compiled into a library
of its own with the flags of the path this CPU runs, so only the source differs."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from metaloom.models.kernels import cbuild, isa

KERNELS = Path("metaloom/models/kernels")


def at_revision(files: tuple[str, ...], rev: str) -> dict[str, str]:
    """The kernel files ``files`` as git revision ``rev`` has them."""
    return {f: subprocess.run(["git", "show", f"{rev}:{KERNELS / f}"], capture_output=True, text=True,
                              check=True).stdout for f in files}


def in_tree(files: tuple[str, ...]) -> dict[str, str]:
    return {f: (KERNELS / f).read_text() for f in files}


def compile_and_load(sources: dict[str, str], main: str, where: Path, parts: int = 1) -> tuple[ctypes.CDLL, Path]:
    """Write ``sources`` into the new folder ``where``, compile ``main`` (one of them) for this CPU's
    path, load it; exits with the compiler's complaint when it does not build."""
    where.mkdir(parents=True)
    for name, text in sources.items():
        (where / name).write_text(text)
    out = where / (Path(main).stem + ".so")
    cc = cbuild.compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    complaint = cbuild.compile_library(cc, where / main, out, isa_flags=isa.flags(isa.chosen().name), parts=parts)
    if complaint:
        raise SystemExit(f"build failed in {where}: {complaint}")
    return ctypes.CDLL(str(out)), out
