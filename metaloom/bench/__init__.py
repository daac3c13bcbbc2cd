"""Benchmarks: side by side in one run, medians over repeats after a warm-up, ratios.
`metaloom bench NAME`: each benchmark module has its own parser (``HELP``, ``add_args``) and
``main``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# name -> the module holding its HELP, add_args(parser) and main(args): one parser per benchmark
BENCHMARKS: dict[str, str] = {name: f"metaloom.bench.{name}" for name in
                              ("decode", "constrained", "speculative", "fork", "admit", "serve", "soak", "remote", "activations",
                               "search", "gpu", "kv")}


def model_args(p: argparse.ArgumentParser, *, repeats: int | None = 3, device: bool = False,
               dtypes: str | None = None, weights: bool = True) -> None:
    """The flags most benchmarks share: the model, --json, and where asked --repeats, --device,
    --dtypes (a list where the benchmark compares dtypes, else one dtype, also spelled --dtype)
    and one --weights mode."""
    p.add_argument("--model", default="default", help="a model name, folder or GGUF file (default: the built-in one)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help="timed repeats after a warm-up (medians)")
    if device:
        p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    if dtypes is not None and "," in dtypes:
        p.add_argument("--dtypes", default=dtypes, help="comma-separated")
    elif dtypes is not None:
        p.add_argument("--dtype", "--dtypes", dest="dtype", default=dtypes, help="float32 | bfloat16 | float16")
    if weights:
        p.add_argument("--weights", default="dense", choices=("auto", "native", "dense"),
                       help="native: the GGUF's quantised blocks; dense: dequantised (default)")


def names(param: str, value: str, allowed: Sequence[str]) -> list[str]:
    """A comma-separated list of names, each one of ``allowed``, in order, repeats dropped; an
    unknown name is an `InvalidParameter` naming ``param``."""
    from metaloom.errors import InvalidParameter

    chosen = [n.strip() for n in value.split(",") if n.strip()]
    if unknown := [n for n in chosen if n not in allowed]:
        raise InvalidParameter(param, unknown, f"a comma-separated subset of {list(allowed)}")
    return list(dict.fromkeys(chosen))


def single_weights(args: argparse.Namespace) -> str:
    """``--weights`` for the benchmarks that load one model (all but decode, which compares the
    modes it is given): exactly one of auto, native, dense."""
    from metaloom.errors import InvalidParameter

    value = str(args.weights)
    if value not in ("auto", "native", "dense"):
        raise InvalidParameter("weights", value, "one of auto, native, dense for this benchmark (decode takes a list)")
    return value
