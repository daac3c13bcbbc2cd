"""Benchmarks: side by side in one run, medians over repeats after a warm-up, ratios.
Registered by name for `metaloom bench NAME`."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _decode(args: argparse.Namespace) -> int:
    from metaloom.bench.decode import main

    return main(args)


def _constrained(args: argparse.Namespace) -> int:
    from metaloom.bench.constrained import main

    return main(args)


def _speculative(args: argparse.Namespace) -> int:
    from metaloom.bench.speculative import main

    return main(args)


def _fork(args: argparse.Namespace) -> int:
    from metaloom.bench.fork import main

    return main(args)


def _admit(args: argparse.Namespace) -> int:
    from metaloom.bench.admit import main

    return main(args)


def _remote(args: argparse.Namespace) -> int:
    from metaloom.bench.remote import main

    return main(args)


def _search(args: argparse.Namespace) -> int:
    from metaloom.bench.search import main

    return main(args)


def _serve(args: argparse.Namespace) -> int:
    from metaloom.bench.serve import main

    return main(args)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], int]] = {"decode": _decode, "constrained": _constrained,
                                                              "speculative": _speculative, "fork": _fork,
                                                              "serve": _serve, "admit": _admit,
                                                              "remote": _remote, "search": _search}


class _Given(argparse.Action):
    """Store the value and set ``<dest>_given``: a flag shared by benchmarks whose defaults differ
    (--peers) tells each one whether the user chose it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128, help="batch-1 greedy length")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=64, help="tokens per sample in the n-samples case")
    p.add_argument("--json", action="store_true")
    # decode: metaloom's weight modes and the llama.cpp peer's venv (vLLM's: --vllm)
    p.add_argument("--weights", default="dense",
                   help="decode: metaloom weight modes, comma-separated: native (the GGUF's quantised blocks, in the "
                        "first of --dtypes), dense (dequantised, once per --dtypes entry)")
    p.add_argument("--llama-cpp", default=None, metavar="VENV",
                   help="decode: llama-cpp-python's venv for --peers llama.cpp (default: this interpreter's)")
    p.add_argument("--llama-cpp-avx2", default=None, metavar="VENV",
                   help="decode: a second llama-cpp-python venv built for AVX2 alone (GGML_NATIVE=OFF, GGML_AVX512=OFF), "
                        "run beside the first with --peers llama.cpp: what an AVX2 user gets, on an AVX-512 machine")
    p.add_argument("--isa", default="", metavar="PATHS",
                   help="decode: run metaloom once per kernel path, comma-separated (avx512, avx2, neon, generic: "
                        "METALOOM_ISA, with PyTorch's, oneDNN's and MKL's own capped alike); default: the best this CPU has")
    # speculative: drafters to compare (DEFAULT_DRAFTERS), the draft model, K, the prefix-cache case
    p.add_argument("--drafters", default="ngram,quantized,quantized-int4,jacobi,jacobi-lookup,heads,draft")
    p.add_argument("--draft-model", default=None, help="draft model (same tokenizer) for the draft-model drafter")
    p.add_argument("--num-draft", type=int, default=None, help="draft tokens per step (default: each drafter's own)")
    p.add_argument("--peers", default="transformers,llama.cpp", action=_Given,
                   help="peers to run beside metaloom, comma-separated ('' for none); speculative: transformers, "
                        "llama.cpp (default both); decode: transformers, llama.cpp, vllm (default transformers)")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix for the prefix-cache case (0: skip)")
    # serve: an OpenAI-compatible server measured from the client side, metaloom's beside vLLM's
    p.add_argument("--clients", default="1,8,32", help="serve: concurrency levels, comma-separated")
    p.add_argument("--serve-tokens", type=int, default=64, help="serve: max_tokens of each request")
    p.add_argument("--serve-requests", type=int, default=64,
                   help="serve: requests per level (each of N clients sends max(2, this // N))")
    p.add_argument("--serve-same-prompts", action="store_true",
                   help="serve: send the bare prompts again and again (they then hit prefix caches); "
                        "by default each request is tagged so that none repeats")
    p.add_argument("--serve-dtype", default="bfloat16", help="serve: --dtype of both servers")
    p.add_argument("--vllm", default=None, metavar="VENV",
                   help="serve, decode: a vLLM venv to run beside metaloom (default: none)")
    p.add_argument("--port-base", type=int, default=18230, help="serve: metaloom's port; vLLM's is the next one")
    p.add_argument("--serve-startup-timeout", type=float, default=300.0, help="serve: seconds to wait for /health")
    from metaloom.bench.remote import add_remote_args  # remote: strategies locally, on vLLM, in optillm

    add_remote_args(p)
    from metaloom.bench.search import add_search_args  # search: tree search vs sampling at equal FLOPs

    add_search_args(p)


def single_weights(args: argparse.Namespace) -> str:
    """``--weights`` for the benchmarks that load one model (all but decode, which compares the
    modes it is given): exactly one of auto, native, dense."""
    from metaloom.errors import InvalidParameter

    value = str(getattr(args, "weights", "dense") or "dense")
    if value not in ("auto", "native", "dense"):
        raise InvalidParameter("weights", value, "one of auto, native, dense for this benchmark (decode takes a list)")
    return value
