"""Instruction-set paths of the C kernels (`fused.c`, `quant.c`): which ones this CPU runs, which
one runs, and the compiler flags that build each.

Why paths and not ``-march=native``: a library built for the build machine's best instruction
set either crashes on a smaller CPU or, built for the smallest, leaves most of a bigger one
unused; and a path no machine of ours takes is a path no test runs. So each kernel file is
compiled once per path, for exactly that instruction set, and:

- ``avx512``: x86-64 with AVX-512 F/BW/VL/DQ (Skylake-X and later Xeons, Zen 4, Zen 5), with
  VNNI's int8 dot products (``vpdpbusd``) where the CPU has them (Cascade Lake and later, Zen 4);
- ``avx2``: x86-64 with AVX2, FMA and F16C (Haswell and later, every Zen);
- ``neon``: aarch64 (Apple M-series, Graviton, Ampere, Snapdragon), with the dot-product
  extension where the CPU has it;
- ``generic``: the compiler's baseline for the architecture (SSE2 on x86-64), the portable
  fallback every CPU runs.

The best path this CPU has runs by default. ``METALOOM_ISA=avx2`` (or ``avx512``, ``neon``,
``generic``) forces a lower one, so that every x86 path is exercised on an AVX-512 machine: the
tests run each kernel suite once per path the machine can execute. A path the CPU lacks, or a
name that is no path, is an `UnsupportedISA` naming what the CPU has; it is never quietly
replaced by another. What the CPU has is read from the kernel's view of it (``/proc/cpuinfo``
flags, which Linux clears when the OS does not save a register file), not assumed from the
build machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from metaloom.errors import UnsupportedISA

ENV = "METALOOM_ISA"
NAMES = ("avx512", "avx2", "neon", "generic")


@dataclass(frozen=True)
class IsaPath:
    """One instruction-set path: the CPU ``arch`` it is for, the CPU features it needs (names as
    ``/proc/cpuinfo`` spells them) and the compiler flags that build it."""

    name: str
    arch: str  # "x86_64", "aarch64", or "any"
    needs: frozenset[str]
    flags: tuple[str, ...]


_X86_V3 = ("-mavx", "-mavx2", "-mfma", "-mf16c")
PATHS: dict[str, IsaPath] = {
    "avx512": IsaPath("avx512", "x86_64",
                      frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
                      (*_X86_V3, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
    "avx2": IsaPath("avx2", "x86_64", frozenset({"avx", "avx2", "fma", "f16c"}), _X86_V3),
    "neon": IsaPath("neon", "aarch64", frozenset({"asimd"}), ("-march=armv8-a",)),
    "generic": IsaPath("generic", "any", frozenset(), ()),
}
# aarch64 CPUs with the dot-product extension (ARMv8.2+, "asimddp") get it on the neon path, and
# AVX-512 CPUs with VNNI (int8 dot products for `--activations q8`) on the avx512 path
_NEON_DOTPROD = ("-march=armv8.2-a+dotprod",)
_AVX512_VNNI = ("-mavx512vnni",)


def machine() -> str:
    """The CPU architecture in the kernels' terms: x86_64, aarch64, or what platform says."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.cache
def cpuinfo() -> str:
    """/proc/cpuinfo as the OS reports it ("" where there is none: macOS, Windows)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(keys: tuple[str, ...]) -> str | None:
    """The first /proc/cpuinfo value under one of ``keys``."""
    for line in cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as the OS reports them (x86 ``flags``, aarch64 ``Features`` of
    /proc/cpuinfo); on an aarch64 without /proc (macOS) NEON, which every aarch64 CPU has."""
    found = _field(("flags", "Features"))
    if found is not None:
        return frozenset(found.split())
    return frozenset({"asimd"}) if machine() == "aarch64" else frozenset()


def cpu_name() -> str:
    """The CPU's model name, for messages and reports."""
    return _field(("model name", "Model", "cpu model")) or platform.processor() or machine()


def missing(path: IsaPath, arch: str | None = None, features: frozenset[str] | None = None) -> list[str]:
    """What this CPU (or the given ``arch`` and ``features``) lacks to run ``path``; [] when it runs it."""
    arch = machine() if arch is None else arch
    features = cpu_features() if features is None else features
    if path.arch not in ("any", arch):
        return [f"an {path.arch} CPU (this one is {arch})"]
    return sorted(path.needs - features)


def runnable(arch: str | None = None, features: frozenset[str] | None = None) -> list[str]:
    """The paths this CPU runs, best first (generic always last)."""
    return [name for name in NAMES if not missing(PATHS[name], arch, features)]


def flags(name: str, features: frozenset[str] | None = None) -> tuple[str, ...]:
    """Compiler flags that build path ``name`` (neon: with dotprod, avx512: with VNNI, where the
    CPU has it)."""
    features = cpu_features() if features is None else features
    if name == "neon" and "asimddp" in features:
        return _NEON_DOTPROD
    if name == "avx512" and "avx512_vnni" in features:
        return (*PATHS[name].flags, *_AVX512_VNNI)
    return PATHS[name].flags


def resolve(value: str | None) -> IsaPath:
    """The path for a ``METALOOM_ISA`` value (None, "" or "auto": the best this CPU runs). A
    name that is no path, or a path this CPU lacks, is an `UnsupportedISA` naming what the CPU
    has and which paths it runs."""
    name = (value or "").strip().lower()
    paths = runnable()
    if name in ("", "auto"):
        return PATHS[paths[0]]
    if name not in PATHS:
        raise UnsupportedISA(f"{ENV}={value!r} is not a kernel path: allowed {', '.join(NAMES)} or auto "
                             f"(this CPU runs {', '.join(paths)})")
    lacks = missing(PATHS[name])
    if lacks:
        raise UnsupportedISA(f"{ENV}={name}: this CPU ({cpu_name()}, {machine()}) lacks {', '.join(lacks)}; "
                             f"it has {describe(cpu_features())} and runs {', '.join(paths)}")
    return PATHS[name]


def describe(features: frozenset[str]) -> str:
    """The vector features of a CPU that matter to the paths, in a short list."""
    known = ("sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "avx_ne_convert", "amx_bf16", "asimd", "asimddp", "bf16")
    have = [f for f in known if f in features]
    return ", ".join(have) if have else "none of the vector extensions the kernels use"


# PyTorch's dispatch (ATen), oneDNN and MKL pick their own instruction set; a benchmark of a path
# forced lower caps theirs alike (set before the process imports torch), else "what an AVX2 user
# gets" would still run PyTorch's AVX-512 GEMMs
_LIBRARY_CAPS = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def library_env(name: str) -> dict[str, str]:
    """Environment variables that cap PyTorch's, oneDNN's and MKL's own instruction set at path
    ``name`` (x86; {} for neon, whose libraries have no such switch)."""
    if machine() != "x86_64":
        return {}
    return dict(_LIBRARY_CAPS.get(name, {}))


_current: list[IsaPath] = []  # the path this process runs, resolved on first use


def chosen() -> IsaPath:
    """The path the kernels run: ``METALOOM_ISA`` if set, else the best this CPU has; read once per
    process (the matmuls ask for it on every call, a few hundred times a token); `using` changes it
    for a block."""
    if not _current:
        _current.append(resolve(os.environ.get(ENV)))
    return _current[0]


@contextlib.contextmanager
def using(name: str) -> Iterator[IsaPath]:
    """Run path ``name`` inside the block, the previous path after it, as tests and benchmarks
    do to compare paths in one process; an `UnsupportedISA` as `resolve`."""
    previous = chosen()
    _current[:] = [resolve(name)]
    try:
        yield _current[0]
    finally:
        _current[:] = [previous]


def has_fma(name: str) -> bool:
    """Whether path ``name`` multiplies and adds with one rounding (its compiler contracts ``a * b
    + c``): every path but x86's generic (SSE2 has no fma)."""
    return name != "generic" or machine() == "aarch64"
