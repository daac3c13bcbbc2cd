"""`metaloom serve`: the OpenAI-compatible server (`metaloom.server`) on one model."""

from __future__ import annotations

import argparse
import logging

from metaloom.commands.common import add_model_args
from metaloom.errors import InvalidParameter


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible server (chat/completions, strategies, continuous batching)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--max-rows", type=int, default=64, help="rows decoded together at most")
    s.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond that before a 429")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (413 beyond)")
    s.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="radix prefix cache shared by all requests (a common system prompt is prefilled once); 0 off")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from metaloom.commands.run import prefix_cache
    from metaloom.generator import LocalGenerator
    from metaloom.models import load
    from metaloom.server.app import create_app

    if not 1 <= args.port <= 65535:
        raise InvalidParameter("port", args.port, "a port in 1..65535")
    if args.max_rows < 1 or args.max_waiting < 0:  # checked before the model load, as the scheduler would
        raise InvalidParameter("max_rows" if args.max_rows < 1 else "max_waiting",
                               args.max_rows if args.max_rows < 1 else args.max_waiting, ">= 1 rows, >= 0 waiting")
    if not args.max_body_mb > 0:
        raise InvalidParameter("max_body_mb", args.max_body_mb, "> 0")
    prefix_cache(args.prefix_cache_mb, None)  # validated before the load
    loaded = load(args.model, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights)
    generator = LocalGenerator(loaded, prefix_cache=prefix_cache(args.prefix_cache_mb, loaded))
    app = create_app(generator, model_ids=[args.served_model_name or args.model], api_key=args.api_key,
                     max_rows=args.max_rows, max_waiting=args.max_waiting, max_body_bytes=int(args.max_body_mb * (1 << 20)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
