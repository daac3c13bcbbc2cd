"""`metaloom score PROMPT --continuation A --continuation B`: the log-probability the model gives
to each continuation of the prompt (one forward per batch; see `metaloom.decode.score`)."""

from __future__ import annotations

import argparse
import json

from metaloom.commands.common import add_model_args, engine_options


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("score", help="log-probability of given continuations of a prompt")
    s.add_argument("prompt")
    s.add_argument("--continuation", action="append", required=True, help="a continuation to score (repeatable)")
    add_model_args(s)
    s.add_argument("--raw", action="store_true", help="plain text: no chat template (else the continuation is the reply)")
    s.add_argument("--system", default=None, help="system message (chat mode)")
    s.add_argument("--batch-size", type=int, default=16, help="continuations per forward pass")
    s.add_argument("--json", action="store_true", help="print one JSON object with per-token logprobs and usage")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time

    from metaloom.decode.score import score_texts
    from metaloom.errors import InvalidParameter
    from metaloom.ledger import Ledger
    from metaloom.models import load

    if args.batch_size < 1:  # validate before the (slower) model load
        raise InvalidParameter("batch_size", args.batch_size, "an integer >= 1")
    if any(not c for c in args.continuation):
        raise InvalidParameter("continuation", "", "non-empty text")
    loaded = load(args.model, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                  **engine_options(args))
    tok = loaded.tokenizer
    if args.raw:
        context, special = args.prompt, True
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        context, special = tok.apply_chat_template(messages), False
    ledger = Ledger()
    started = time.perf_counter()
    scores = score_texts(loaded.model, tok, context, args.continuation, ledger, add_special_tokens=special,
                         batch_size=args.batch_size)
    ledger.charge(seconds=time.perf_counter() - started)
    if args.json:
        print(json.dumps({
            "model": loaded.name,
            "continuations": [{"text": s.text, "tokens": list(s.tokens), "logprobs": list(s.logprobs),
                               "logprob": s.logprob, "mean_logprob": s.mean_logprob} for s in scores],
            "usage": ledger.usage.to_dict(),
        }))
    else:
        for s in scores:
            print(f"{s.logprob:10.4f}  {s.mean_logprob:8.4f}/token  {len(s.tokens):3d} tokens  {s.text!r}")
    return 0
