"""`metaloom generate`: one prompt, streamed (n = 1) or as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from metaloom.commands.common import (
    add_model_args,
    add_sampling_args,
    engine_options,
    kernel_usage,
    remote_generator,
    sampling_params,
)
from metaloom.commands.constraint import add_constraint_args, constraint_spec
from metaloom.commands.decoding import add_decoder_args, amateur_model, decoder_spec
from metaloom.commands.speculative import add_speculative_args, check_speculative_args, speculative_option, speculative_report


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt")
    add_model_args(g, remote=True)
    add_sampling_args(g)
    add_decoder_args(g)
    add_constraint_args(g)
    add_speculative_args(g)
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    g.add_argument("--json", action="store_true", help="print one JSON object with completions and usage")
    g.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from metaloom.generator import LocalGenerator, Request
    from metaloom.ledger import Ledger
    from metaloom.models import load

    params = sampling_params(args)  # validate before the (slower) model load
    params, decoder = decoder_spec(args, params)
    constraint = constraint_spec(args)
    check_speculative_args(args)
    remote = remote_generator(args, {"speculative": args.speculative, "amateur-model": args.amateur_model})
    speculative = None
    loaded = None
    if remote is not None:
        generator, name = remote, args.model
    else:
        loaded = load(args.model, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                      **engine_options(args))
        speculative = speculative_option(args, loaded)
        generator, name = LocalGenerator(loaded, amateur=amateur_model(args, loaded), speculative=speculative), loaded.name
    request = Request(args.prompt, params) if args.raw else Request.chat(args.prompt, params, system=args.system)
    request = dataclasses.replace(request, decoder=decoder)
    request = dataclasses.replace(request, constraint=constraint, token_healing=args.token_healing)
    ledger = Ledger()
    if params.n == 1 and not args.json:
        last = None
        for chunk in generator.stream(request, ledger=ledger):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
        sys.stdout.write("\n")
        if last is not None and last.finish_reason == "error":
            print(f"error: generation stopped: {last.error}", file=sys.stderr)
            return 1
        return 0
    completions = generator.generate([request], ledger=ledger)[0]
    if args.json:
        print(json.dumps({
            "model": name,
            "completions": [{"text": c.text, "tokens": list(c.token_ids), "logprob": c.logprob,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                            | ({} if c.score is None else {"score": c.score})
                            | ({} if c.error is None else {"error": c.error}) for c in completions],
            "usage": ledger.usage.to_dict() | kernel_usage(loaded),
        } | speculative_report(speculative, ledger.usage)))
    else:
        for i, c in enumerate(completions):
            print(f"--- sample {i + 1} ({c.finish_reason}) ---\n{c.text}")
    return 0


