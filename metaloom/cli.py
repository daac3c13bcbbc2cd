"""`metaloom` command line. Subcommands are registered by name at this edge; each builds its
arguments and runs. Every `MetaloomError` becomes one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from metaloom.errors import MetaloomError

EXIT_USAGE = 2


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a .gguf file, or a transformers folder")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--backend", default="auto", help="auto | native | transformers")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--n", type=int, default=1, help="number of samples (prompt prefilled once)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):  # -> SamplingParams
    from metaloom.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, n=args.n,
        seed=args.seed, stop=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from metaloom.generator import LocalGenerator, Request
    from metaloom.ledger import Ledger
    from metaloom.models import load

    params = _sampling_params(args)  # validate before the (slower) model load
    loaded = load(args.model, dtype=args.dtype, device=args.device, backend=args.backend)
    generator = LocalGenerator(loaded)
    request = Request(args.prompt, params) if args.raw else Request.chat(args.prompt, params, system=args.system)
    ledger = Ledger()
    if params.n == 1 and not args.json:
        for chunk in generator.stream(request, ledger=ledger):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    completions = generator.generate([request], ledger=ledger)[0]
    if args.json:
        print(json.dumps({
            "model": loaded.name,
            "completions": [{"text": c.text, "tokens": list(c.token_ids), "logprob": c.logprob,
                             "finish_reason": c.finish_reason} for c in completions],
            "usage": ledger.usage.to_dict(),
        }))
    else:
        for i, c in enumerate(completions):
            print(f"--- sample {i + 1} ({c.finish_reason}) ---\n{c.text}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from metaloom.bench import BENCHMARKS

    return BENCHMARKS[args.which](args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metaloom", description="Make a language model better and faster at inference time.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    g.add_argument("--json", action="store_true", help="print one JSON object with completions and usage")
    g.set_defaults(run=cmd_generate)

    from metaloom.bench import BENCHMARKS, add_bench_args

    b = sub.add_parser("bench", help="benchmarks (side by side in one run)")
    b.add_argument("which", choices=sorted(BENCHMARKS))
    add_bench_args(b)
    b.set_defaults(run=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except MetaloomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
