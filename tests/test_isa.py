"""Instruction-set paths of the C kernels (`metaloom.models.kernels.isa`, `metaloom.models.kernels.cbuild`):
which paths a CPU runs, ``METALOOM_ISA`` forcing one (a typed error naming what the CPU has when
it cannot), the flags that build each, a compiler that lacks a path's flags falling to the next
path with the reason, and the path reported where users see it."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from metaloom.errors import KernelPathWarning, UnsupportedISA
from metaloom.models.kernels import isa
from metaloom.models.kernels.cbuild import build_library, compiler
from metaloom.models.kernels.fused import SOURCE as FUSED_SOURCE
from metaloom.models.kernels.fused import _bind as fused_bind

AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def test_the_paths_a_cpu_runs_best_first():
    assert isa.runnable("x86_64", AVX512_CPU) == ["avx512", "avx2", "generic"]
    assert isa.runnable("x86_64", AVX2_CPU) == ["avx2", "generic"]
    assert isa.runnable("x86_64", frozenset({"sse2", "avx"})) == ["generic"]  # Sandy Bridge: AVX but no AVX2
    assert isa.runnable("x86_64", AVX512_CPU - {"avx512bw"}) == ["avx2", "generic"]  # Xeon Phi: F but not BW
    assert isa.runnable("aarch64", frozenset({"asimd"})) == ["neon", "generic"]
    assert isa.runnable("riscv64", frozenset()) == ["generic"]
    assert isa.missing(isa.PATHS["avx512"], "x86_64", AVX2_CPU) == ["avx512bw", "avx512dq", "avx512f", "avx512vl"]
    assert isa.missing(isa.PATHS["neon"], "x86_64", AVX512_CPU) == ["an aarch64 CPU (this one is x86_64)"]


def test_each_path_is_built_with_its_own_flags_never_the_build_machines():
    assert "-mavx512bw" in isa.flags("avx512") and "-mavx512f" not in isa.flags("avx2")
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(isa.flags("avx2"))
    assert isa.flags("generic") == ()
    assert isa.flags("neon", frozenset({"asimd"})) == ("-march=armv8-a",)
    assert isa.flags("neon", frozenset({"asimd", "asimddp"})) == ("-march=armv8.2-a+dotprod",)
    assert "-mavx512vnni" not in isa.flags("avx512", AVX512_CPU)
    assert isa.flags("avx512", AVX512_CPU | {"avx512_vnni"})[-1] == "-mavx512vnni"  # int8 dot products where the CPU has them
    assert not any("native" in f for name in isa.NAMES for f in isa.flags(name))
    assert isa.library_env("avx2").get("ATEN_CPU_CAPABILITY", "avx2") == "avx2"


def test_metaloom_isa_selects_a_path_and_refuses_what_the_cpu_lacks():
    best = isa.runnable()[0]
    assert isa.resolve(None).name == best and isa.resolve("").name == best and isa.resolve(" AUTO ").name == best
    assert isa.resolve("generic").name == "generic"
    with pytest.raises(UnsupportedISA, match=r"'sse9' is not a kernel path: allowed avx512, avx2, neon, generic"):
        isa.resolve("sse9")
    lacking = next(name for name in isa.NAMES if name not in isa.runnable())
    with pytest.raises(UnsupportedISA) as err:
        isa.resolve(lacking)
    message = str(err.value)
    assert f"METALOOM_ISA={lacking}" in message and "lacks" in message and f"runs {', '.join(isa.runnable())}" in message
    with isa.using("generic"):
        assert isa.chosen().name == "generic"
    assert isa.chosen().name == best or os.environ.get(isa.ENV)


def test_a_forced_path_the_cpu_lacks_is_one_line_from_the_cli_and_nothing_runs():
    lacking = next(name for name in isa.NAMES if name not in isa.runnable())
    env = dict(os.environ, METALOOM_ISA=lacking)
    out = subprocess.run([METALOOM, "generate", "Hi", "--max-tokens", "2"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"METALOOM_ISA={lacking}" in out.stderr and "lacks" in out.stderr


def test_generate_json_says_which_path_ran():
    path = isa.runnable()[-2] if len(isa.runnable()) > 1 else "generic"  # a path below the best where there is one
    env = dict(os.environ, METALOOM_ISA=path)
    out = subprocess.run([METALOOM, "generate", "Hi", "--max-tokens", "2", "--temperature", "0", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["isa"] == path


def _fake_cc(tmp_path, refuse: str) -> str:
    """A compiler that fails whenever it is given ``refuse`` (a flag it does not know)."""
    cc = tmp_path / "cc-without"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{refuse}" ] && echo "unknown option {refuse}" >&2 && exit 1; done\n'
                  f'exec {compiler()} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    return str(cc)


@pytest.mark.skipif(compiler() is None or "avx2" not in isa.runnable(), reason="needs a C compiler and an AVX2 CPU")
def test_a_compiler_without_a_paths_flags_falls_to_the_next_path_and_says_so(tmp_path):
    with pytest.warns(KernelPathWarning, match="the avx2 kernels did not build, so the slower generic path runs"):
        built = build_library(FUSED_SOURCE, fused_bind, cache_dir=tmp_path, cc=_fake_cc(tmp_path, "-mavx2"), path="avx2")
    assert built.value is not None and built.isa == "generic"
    assert "avx2:" in built.reason and "unknown option -mavx2" in built.reason


@pytest.mark.skipif(compiler() is None, reason="needs a C compiler")
def test_a_path_the_cpu_cannot_run_is_never_built_or_loaded(tmp_path):
    lacking = next(name for name in isa.NAMES if name not in isa.runnable())
    built = build_library(FUSED_SOURCE, fused_bind, cache_dir=tmp_path, path=lacking)
    assert built.value is None and "cannot run" in built.reason
    assert not list(tmp_path.rglob("*.so"))


LACKED = [n for n in isa.NAMES if isa.PATHS[n].arch in ("any", isa.machine()) and n not in isa.runnable()]


@pytest.mark.skipif(compiler() is None, reason="needs a C compiler")
@pytest.mark.skipif(not LACKED, reason=f"this CPU runs every path of its architecture ({', '.join(isa.runnable())})")
@pytest.mark.parametrize("path", LACKED or ["none"])
@pytest.mark.parametrize("source", ["quant.c", "fused.c"])
def test_a_path_this_cpu_lacks_still_compiles(path, source, tmp_path):
    """The code of a path this machine cannot run (avx512 on an AVX2 x86) is compiled with that
    path's flags (and, for avx512, with VNNI as on a CPU that has it): the compiler checks it here,
    the CPUs that have it run it (and tests/aarch64/test_avx512_emulated.py runs its logic)."""
    src = Path(isa.__file__).with_name(source)
    variants = [isa.flags(path, frozenset())]
    if path == "avx512":
        variants.append(isa.flags(path, frozenset({"avx512_vnni"})))
    for flags in variants:
        run = subprocess.run([compiler(), *flags, "-O1", "-fno-math-errno", "-fopenmp", "-c", str(src), "-o",
                              str(tmp_path / "out.o")], capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-2000:]


def test_a_build_is_keyed_by_the_headers_its_source_includes(tmp_path):
    from metaloom.models.kernels.cbuild import source_text

    (tmp_path / "k.c").write_text('#include <math.h>\n#include "a.h"\nint f(void) { return A; }\n')
    (tmp_path / "a.h").write_text('#include "b.h"\n#define A B\n')
    (tmp_path / "b.h").write_text("#define B 1\n")
    before = source_text(tmp_path / "k.c")
    assert b"#define B 1" in before  # followed through a.h
    (tmp_path / "b.h").write_text("#define B 2\n")
    assert source_text(tmp_path / "k.c") != before  # an edited header is a new build


@pytest.mark.skipif(compiler() is None, reason="needs a C compiler")
def test_a_source_in_parts_is_compiled_at_once_and_linked(tmp_path):
    """quant.c builds as several units in parallel (cbuild's ``parts``): each unit defines its
    share of the functions, the library has them all; a part that fails is the build's reason."""
    import ctypes

    from metaloom.models.kernels.cbuild import compile_library

    src = tmp_path / "k.c"
    src.write_text("#if METALOOM_PART == 0\nint f(void) { return 1; }\n#elif METALOOM_PART == 1\n"
                   "int g(void) { return 2; }\n#else\nint h(void) { return 3; }\n#endif\n")
    out = tmp_path / "k.so"
    assert compile_library(compiler(), src, out, parts=3) is None
    lib = ctypes.CDLL(str(out))
    assert (lib.f(), lib.g(), lib.h()) == (1, 2, 3)
    src.write_text(src.read_text().replace("return 2;", "return 2"))  # part 1 no longer compiles
    error = compile_library(compiler(), src, tmp_path / "broken.so", parts=3)
    assert error is not None and "error" in error and not (tmp_path / "broken.so").exists()
    assert not list(tmp_path.glob("*.o")) and not list(tmp_path.glob("tmp*"))  # nothing left behind


def test_the_package_ships_every_source_and_header_the_kernels_compile():
    """A wheel holds only the package data pyproject names: quant_q8.h was missing from it, so an
    installed (not editable) metaloom could not compile quant.c and ran without its kernels."""
    import fnmatch
    import re
    import tomllib
    from pathlib import Path

    import metaloom.models.kernels as kernels_pkg

    root = Path(__file__).resolve().parents[1]
    shipped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "metaloom.models.kernels"]
    folder = Path(kernels_pkg.__file__).parent
    needed = set()
    for source in folder.glob("*.c"):
        needed.add(source.name)
        needed |= set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), re.MULTILINE))
    assert "quant_q8.h" in needed and "vec_store.h" in needed
    missing = sorted(n for n in needed if not any(fnmatch.fnmatch(n, pattern) for pattern in shipped))
    assert not missing, f"compiled from the package but not shipped in it: {missing}"
