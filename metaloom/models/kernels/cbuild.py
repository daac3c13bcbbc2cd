"""Compile a C kernel file on first use, cache the library, load it (shared by `fused` and
`quant`).

Why here and not a build step: the kernels are compiled for the instruction set of the machine
they run on, which a wheel cannot ship. Each file is built once per instruction-set path
(`metaloom.models.kernels.isa`: avx512, avx2, neon, generic) with exactly that path's flags, never with
``-march=native``, so a path forced lower (``METALOOM_ISA``) runs the code a smaller CPU runs.
The machine's C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) builds the library into
``<cache>/kernels/<hash>/<name>.so`` (seconds to a minute), keyed by the source and the local
headers it includes, the compiler, the flags and the CPU, so later processes just load it.
Nothing here raises on a failed build: a path the compiler cannot build (an old compiler without
``-mavx512bw``, say) falls to the next path this CPU runs, and the reason says so; with no path
built the caller gets the compiler's complaint as a reason and runs its PyTorch fallback.

OpenMP: ``-fopenmp`` links ``libgomp.so.1``. PyTorch's CPU wheel ships and has already loaded a
library of that soname, so the kernels' parallel regions run on the same OpenMP runtime (and
thread pool) as PyTorch's own ops rather than a second one competing for the cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from metaloom.errors import KernelPathWarning
from metaloom.models.kernels import isa
from metaloom.models.paths import user_cache_dir

FLAGS = ("-O3", "-fno-math-errno", "-shared", "-fPIC")

T = TypeVar("T")


@dataclass(frozen=True)
class Availability(Generic[T]):
    """A kernel library of one instruction-set path (``kernels``), or None and ``reason`` why
    not (else where the library is)."""

    kernels: T | None
    reason: str


class KernelLibrary(Generic[T]):
    """One C file's kernels: compiled per instruction-set path on first use (cached on disk),
    loaded once per process and path; ``current()`` is the path that runs now
    (`metaloom.models.kernels.isa.chosen`: ``METALOOM_ISA``, else the best this CPU has)."""

    def __init__(self, source: Path, bind: Callable[[ctypes.CDLL, Path, str], T], parts: int = 1) -> None:
        self.source, self.bind, self.parts = source, bind, parts
        self._loaded: dict[str, Availability[T]] = {}

    def build(self, cache_dir: Path | None = None, compiler: str | None = None,
              path: str | None = None) -> Availability[T]:
        """Compile (or reuse) and load the kernels for ``path`` (None: the one that runs now).
        Never raises, but for an `UnsupportedISA` when ``METALOOM_ISA`` names a path this CPU
        lacks: a failure is a reason."""
        built = build_library(self.source, self.bind, cache_dir=cache_dir, cc=compiler, path=path, parts=self.parts)
        return Availability(built.value, built.reason)

    def for_path(self, path: str) -> Availability[T]:
        """The kernels of one path, built once per process (compiled once per machine)."""
        if path not in self._loaded:
            self._loaded[path] = self.build(path=path)
        return self._loaded[path]

    def current(self) -> Availability[T]:
        return self.for_path(isa.chosen().name)


@dataclass(frozen=True)
class Built(Generic[T]):
    """A loaded library bound by the caller (``value``), or None and why (``reason``); on
    success ``reason`` is the library's path."""

    value: T | None
    reason: str
    isa: str = ""  # the instruction-set path built ("" when none was)


def compiler() -> str | None:
    """``$CC`` (resolved on PATH), else the first of cc, gcc, clang found."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def cpu_signature() -> str:
    """What a build depends on besides its path's flags (``-mtune=native``; and the recorded
    `--weights auto` choices): the CPU model and its feature flags."""
    text = isa.cpuinfo()
    if not text:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(lines)))


def attempts(isa_flags: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Flag sets tried in order for one path: tuned for this CPU (scheduling only: the
    instruction set is the path's) with OpenMP; a compiler that does not know an extra gets the
    next; the path's own flags are never dropped."""
    return ((*isa_flags, "-mtune=native", "-fopenmp"), (*isa_flags, "-fopenmp"), isa_flags)


TIMEOUT = 1800  # seconds a build may take: a busy machine compiles the largest path for minutes


def compile_library(cc: str, source: Path, out: Path, flags: tuple[str, ...] = FLAGS,
                    isa_flags: tuple[str, ...] = (), parts: int = 1) -> str | None:
    """Compile ``source`` into ``out`` with the path's ``isa_flags`` (atomically: a temporary
    file renamed into place, so a concurrent or interrupted build never leaves a half-written
    library to load); returns the compiler's complaint, or None. ``parts`` > 1: the source is
    compiled that many times at once, with ``-DMETALOOM_PART=k``, and the objects linked (the
    source splits its exported functions between the parts; quant.c says why)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    error = ""
    try:
        for arch in attempts(isa_flags):
            run = _compile(cc, source, tmp, [*arch, *flags], parts)
            if run.returncode == 0:
                os.replace(tmp, out)
                return None
            error = _complaint(run.stderr or run.stdout)
        return error or f"{cc} exited with {run.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _complaint(output: str) -> str:
    """The compiler's own error lines (gcc ends with the source line and a caret, which name
    nothing), else its last three lines."""
    lines = output.strip().splitlines()
    errors = [line.strip() for line in lines if "error" in line.lower()]
    return " | ".join(errors[:3] or lines[-3:])


def _compile(cc: str, source: Path, out: str, flags: list[str], parts: int) -> subprocess.CompletedProcess[str]:
    """One attempt: the whole source into ``out``, or its parts in parallel and then linked (the
    first failing part's result when one fails)."""
    if parts == 1:
        return subprocess.run([cc, *flags, str(source), "-o", out, "-lm"], capture_output=True, text=True,
                              timeout=TIMEOUT)
    objects = [f"{out}.{k}.o" for k in range(parts)]
    compile_flags = [f for f in flags if f != "-shared"]
    # each part in a process group of its own: killing only the compiler driver left its assembler
    # running, which wrote its object after the cleanup below had removed it (a stray .o)
    procs = [subprocess.Popen([cc, *compile_flags, f"-DMETALOOM_PART={k}", "-c", str(source), "-o", obj],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for k, obj in enumerate(objects)]
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            if proc.returncode != 0:
                return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        return subprocess.run([cc, *flags, *objects, "-o", out, "-lm"], capture_output=True, text=True, timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # the group already gone
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for obj in objects:
            if os.path.exists(obj):
                os.unlink(obj)


def build_library(source: Path, bind: Callable[[ctypes.CDLL, Path, str], T], *, cache_dir: Path | None = None,
                  cc: str | None = None, flags: tuple[str, ...] = FLAGS, path: str | None = None,
                  parts: int = 1) -> Built[T]:
    """Compile (or reuse) ``source`` for instruction-set ``path`` (None: `metaloom.models.kernels.isa.chosen`)
    and hand the loaded library, its file and the path it was built for to ``bind`` (which checks
    its ABI version and declares argument types; an OSError or AttributeError from it is a reason).
    A path the compiler cannot build falls to the next one this CPU runs (``Built.isa`` says which
    was built, ``reason`` why the others were not, and a `KernelPathWarning` says so on stderr).
    Never raises, but for an `UnsupportedISA` when ``path`` is None and ``METALOOM_ISA`` names a
    path this CPU lacks."""
    cc = cc or compiler()
    if cc is None:
        return Built(None, "no C compiler found (set CC, or install gcc or clang)")
    wanted = path or isa.chosen().name
    if wanted not in isa.PATHS or isa.missing(isa.PATHS[wanted]):  # never load code that would not run here
        lacks = ", ".join(isa.missing(isa.PATHS[wanted])) if wanted in isa.PATHS else "a path of that name"
        return Built(None, f"this CPU cannot run the {wanted} path: it lacks {lacks}")
    order = [wanted, *[p for p in isa.runnable() if isa.NAMES.index(p) > isa.NAMES.index(wanted)]]
    failures: list[str] = []
    for name in order:
        built = _build_one(source, bind, cache_dir, cc, flags, name, parts)
        if built.value is not None:
            note = f" ({'; '.join(failures)})" if failures else ""
            if failures:  # said on stderr too: a run on a slower path otherwise shows no sign of it
                warnings.warn(f"{source.name}: the {wanted} kernels did not build, so the slower {name} path runs: "
                              f"{'; '.join(failures)}", KernelPathWarning, stacklevel=2)
            return Built(built.value, built.reason + note, name)
        failures.append(f"{name}: {built.reason}")
    return Built(None, "; ".join(failures))


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_text(source: Path, seen: frozenset[Path] = frozenset()) -> bytes:
    """``source`` and, in order, every local header it includes (``#include "x.h"``, found next to
    it, recursively): what a build depends on, so that editing a header rebuilds."""
    text = source.read_bytes()
    parts = [text]
    for name in _INCLUDE.findall(text):
        header = source.parent / name.decode()
        if header.exists() and header not in seen:
            parts.append(source_text(header, seen | {source}))
    return b"\0".join(parts)


def _build_one(source: Path, bind: Callable[[ctypes.CDLL, Path, str], T], cache_dir: Path | None, cc: str,
               flags: tuple[str, ...], name: str, parts: int = 1) -> Built[T]:
    isa_flags = isa.flags(name)
    key = hashlib.sha256(b"\0".join([source_text(source), cc.encode(), " ".join(flags).encode(), name.encode(),
                                     str(parts).encode(),
                                     " ".join(isa_flags).encode(), platform.machine().encode(),
                                     cpu_signature().encode()])).hexdigest()[:16]
    path = (cache_dir or Path(user_cache_dir("kernels"))) / key / (source.stem + ".so")
    if not path.exists():
        error = compile_library(cc, source, path, flags, isa_flags, parts)
        if error is not None:
            return Built(None, f"compiling {source.name} for {name} with {cc} failed: {error}")
    try:
        return Built(bind(ctypes.CDLL(str(path)), path, name), str(path), name)
    except (OSError, AttributeError) as exc:
        return Built(None, f"loading {path} failed: {exc}")
