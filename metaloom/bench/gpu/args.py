"""The command line of `metaloom bench gpu`: its flags (`add_args`), and every argument checked
before anything is built (`options`: an `Options`, or an `InvalidParameter` naming the flag)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.bench import gpu_worker as gw
from metaloom.bench import names
from metaloom.bench.gpu.cases import CASES, DEFAULT_CASES, DEFAULT_SYSTEMS, SYSTEMS
from metaloom.errors import InvalidParameter


@dataclass(frozen=True)
class ShapeRun:
    """A shape and the cases to run on it, in order."""

    shape: str
    cases: tuple[str, ...]


def parse_shapes(value: str, default_cases: Sequence[str]) -> list[ShapeRun]:
    """``1b,7b:greedy+s16,135m`` -> shape runs in that order (a shape without cases gets
    ``default_cases``); an unknown shape or case is an `InvalidParameter`."""
    runs = []
    for item in (s.strip() for s in value.split(",")):
        if not item:
            continue
        shape, _, cases = item.partition(":")
        if shape not in gw.SHAPES:
            raise InvalidParameter("shapes", shape, f"a comma-separated list of {list(gw.SHAPES)}, each optionally "
                                                    f"SHAPE:CASE+CASE with cases of {list(CASES)}")
        chosen = names("shapes", cases.replace("+", ","), list(CASES)) if cases else list(default_cases)
        runs.append(ShapeRun(shape, tuple(chosen)))
    if not runs:
        raise InvalidParameter("shapes", value, f"at least one of {list(gw.SHAPES)}")
    return runs


def _positive(name: str, value: float, integer: bool = False) -> None:
    if (integer and (not isinstance(value, int) or isinstance(value, bool))) or not value > 0:
        raise InvalidParameter(name, value, "an integer >= 1" if integer else "a number > 0")


@dataclass(frozen=True)
class Options:
    shapes: tuple[ShapeRun, ...]
    systems: tuple[str, ...]
    baseline_cases: tuple[str, ...]
    static_cases: tuple[str, ...]
    repeats: int
    budget_s: float
    compile_s: float
    compile_share: float
    max_tokens: int | None
    seed: int
    dtype: str
    baseline_path: str | None
    spec_draft: int = 4


def options(args: argparse.Namespace) -> Options:
    """Every argument checked before anything is built."""
    from metaloom.models.engine.static_step import MAX_WIDTH
    from metaloom.models.load import DTYPES

    cases = names("cases", args.cases, list(CASES))
    shapes = parse_shapes(args.shapes, cases)
    systems = names("systems", args.systems, list(SYSTEMS))
    if not systems:
        raise InvalidParameter("systems", args.systems, f"a comma-separated subset of {list(SYSTEMS)}, not empty")
    _positive("repeats", args.repeats, integer=True)
    _positive("budget_s", args.budget_s)
    _positive("compile_s", args.compile_s)
    if not 0 <= args.compile_share <= 1:
        raise InvalidParameter("compile_share", args.compile_share, "a fraction in [0, 1]")
    if args.max_tokens is not None:
        _positive("max_tokens", args.max_tokens, integer=True)
    if args.dtype not in DTYPES:
        raise InvalidParameter("dtype", args.dtype, f"one of {sorted(DTYPES)}")
    k = args.spec_draft
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_WIDTH - 1:
        raise InvalidParameter("spec_draft", k, f"an integer in [1, {MAX_WIDTH - 1}] (a verify forward of the pending "
                                                f"token and K drafts, at most {MAX_WIDTH} tokens, takes the static step)")
    path = args.baseline_path
    if path is not None and not os.path.isfile(os.path.join(path, "metaloom", "__init__.py")):
        raise InvalidParameter("baseline_path", path, "a folder holding a metaloom package (DIR/metaloom/__init__.py)")
    if path is None:
        systems = [s for s in systems if s != "baseline"]
    return Options(shapes=tuple(shapes), systems=tuple(systems),
                   baseline_cases=tuple(names("baseline_cases", args.baseline_cases, list(CASES))),
                   static_cases=tuple(names("static_cases", args.static_cases, list(CASES))),
                   repeats=args.repeats, budget_s=float(args.budget_s), compile_s=float(args.compile_s),
                   compile_share=float(args.compile_share), max_tokens=args.max_tokens, seed=args.seed,
                   dtype=args.dtype, baseline_path=os.path.abspath(path) if path else None, spec_draft=k)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="1b,7b,135m",
                   help=f"shapes in the order to run, comma-separated, of {', '.join(gw.SHAPES)}; SHAPE:CASE+CASE "
                        "names that shape's cases")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"cases of shapes that name none, of {', '.join(CASES)} (spec only when named)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"rows, comma-separated, of {', '.join(SYSTEMS)} "
                                                              "(baseline only with --baseline-path)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="a tokenizer folder (tokenizer.json ...); default: the default model's")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up (medians)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON report here (rewritten after every cell)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run; cells that would not fit are "
                                                                 "skipped with reason 'time budget'")
    p.add_argument("--baseline-path", default=None, metavar="DIR",
                   help="a folder holding an older metaloom package, measured in a worker process")
    p.add_argument("--baseline-cases", default="greedy,s64", help="cases the baseline runs")
    p.add_argument("--static-cases", default="greedy,s64", help="cases transformers static (compiled on CUDA) runs")
    p.add_argument("--compile-s", type=float, default=90.0, help="estimated seconds of a first compiled call")
    p.add_argument("--compile-share", type=float, default=0.4, help="at most this fraction of the budget compiling")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every case's tokens per sequence (tests)")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    p.add_argument("--spec-draft", type=int, default=4, metavar="K",
                   help="the spec case's drafts a step (n-gram drafter; a verify forward is K+1 tokens a row)")
    p.add_argument("--smoke", action="store_true",
                   help="compare token ids with METALOOM_CUDA_GRAPHS on and off instead (exit status 1 if they differ "
                        "in float32)")
    p.add_argument("--smoke-dtypes", default="float32,bfloat16", help="the dtypes --smoke compares in")
