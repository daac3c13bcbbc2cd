"""Compile a C kernel file on first use, cache the library, load it (shared by `fused` and
`quant`).

Why here and not a build step: the kernels are compiled with ``-march=native`` for the machine
they run on (AVX-512 where it exists), which a wheel cannot ship. The machine's C compiler
(``$CC``, else ``cc``, ``gcc`` or ``clang``) builds the library into
``<cache>/kernels/<hash>/<name>.so`` (about a second), keyed by the source, the compiler, the
flags and the CPU, so later processes just load it. Nothing here raises on a failed build: the
caller gets the compiler's complaint as a reason and runs its PyTorch fallback.

OpenMP: ``-fopenmp`` links ``libgomp.so.1``. PyTorch's CPU wheel ships and has already loaded a
library of that soname, so the kernels' parallel regions run on the same OpenMP runtime (and
thread pool) as PyTorch's own ops rather than a second one competing for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from metaloom.models.load import user_cache_dir

FLAGS = ("-O3", "-fno-math-errno", "-shared", "-fPIC")
# Tried in order: -march=native (AVX-512 here) with OpenMP; a compiler that does not know one of
# them gets the next; the last is the plain baseline.
ARCH_FLAGS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())

T = TypeVar("T")


@dataclass(frozen=True)
class Built(Generic[T]):
    """A loaded library bound by the caller (``value``), or None and why (``reason``); on
    success ``reason`` is the library's path."""

    value: T | None
    reason: str


def compiler() -> str | None:
    """``$CC`` (resolved on PATH), else the first of cc, gcc, clang found."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(lines)))


def compile_library(cc: str, source: Path, out: Path, flags: tuple[str, ...] = FLAGS) -> str | None:
    """Compile ``source`` into ``out`` (atomically: a temporary file renamed into place, so a
    concurrent or interrupted build never leaves a half-written library to load); returns the
    compiler's complaint, or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    error = ""
    try:
        for arch in ARCH_FLAGS:
            run = subprocess.run([cc, *arch, *flags, str(source), "-o", tmp, "-lm"],
                                 capture_output=True, text=True, timeout=300)
            if run.returncode == 0:
                os.replace(tmp, out)
                return None
            error = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
        return error or f"{cc} exited with {run.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(source: Path, bind: Callable[[ctypes.CDLL, Path], T], *, cache_dir: Path | None = None,
                  cc: str | None = None, flags: tuple[str, ...] = FLAGS) -> Built[T]:
    """Compile (or reuse) ``source`` and hand the loaded library to ``bind`` (which checks its
    ABI version and declares argument types; an OSError or AttributeError from it is a reason).
    Never raises."""
    cc = cc or compiler()
    if cc is None:
        return Built(None, "no C compiler found (set CC, or install gcc or clang)")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), cc.encode(), " ".join(flags).encode(),
                                     platform.machine().encode(), cpu_signature().encode()])).hexdigest()[:16]
    path = (cache_dir or Path(user_cache_dir("kernels"))) / key / (source.stem + ".so")
    if not path.exists():
        error = compile_library(cc, source, path, flags)
        if error is not None:
            return Built(None, f"compiling {source.name} with {cc} failed: {error}")
    try:
        return Built(bind(ctypes.CDLL(str(path)), path), str(path))
    except (OSError, AttributeError) as exc:
        return Built(None, f"loading {path} failed: {exc}")
