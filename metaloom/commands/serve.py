"""`metaloom serve`: the OpenAI-compatible server (`metaloom.server`) on one model.

Stopping (SIGINT or SIGTERM) is a bounded drain: new requests get 503 at once, requests in flight
run on for up to ``--shutdown-timeout`` seconds, then what is left is ended (each client gets a
503 error, a stream its error event and ``[DONE]``) and the process exits 0. A second signal
ends the drain at the next decode step. uvicorn's own handling (wait for every connection without
limit, then re-raise the signal) is replaced: it made a long drain unbounded and a second Ctrl-C
kill the process under the decode thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from types import FrameType
from typing import Any

from metaloom.commands.common import add_model_args, engine_options
from metaloom.errors import InvalidParameter
from metaloom.server.limits import MAX_PREFILL_TOKENS, OPEN_ROUTES, Limits, check_sizes

log = logging.getLogger("metaloom.server")
_LIMIT_HELP = {
    "max_n": "samples of one plain request (n, times its prompts)",
    "max_beams": "beam search's beams",
    "max_samples": "a strategy's widths: n, beam_width, k, parallel, width, ... (nested strategies' too)",
    "max_depth": "a strategy's depths: max_depth, rounds, max_steps, iterations, ...",
    "max_request_tokens": "tokens one request may generate in all: n x max_tokens; a strategy's output budget",
    "max_request_seconds": "a strategy's run time, seconds",
    "max_stop": "stop strings of one request",
    "max_tools": "functions offered in one request",
    "max_prompt_tokens": "tokens of one prompt (default: the model's context window)",
}


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible server (chat/completions, strategies, continuous batching)")
    # q8 by default: a server decodes many rows at once, where integer products are 1.3-1.5x faster
    # (docs/performance.md, "32 clients"); --activations float keeps --dtype's arithmetic
    add_model_args(s, activations="auto")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--max-rows", type=int, default=64, help="rows decoded together at most")
    s.add_argument("--max-prefill-tokens", type=int, default=MAX_PREFILL_TOKENS,
                   help="prompt tokens admitted between two decode steps (a longer prompt goes alone): running "
                        "streams take a step between the prefills of a burst")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests that find no free decode row, queued before a 429")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (413 beyond)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request body must arrive within this (408 beyond: a body shorter than its Content-Length)")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this (408 beyond); headers over 32 KiB are a 431")
    s.add_argument("--open-routes", default=",".join(OPEN_ROUTES), metavar="ROUTES",
                   help="with --api-key, the routes served without the key: some of health, metrics, docs "
                        "(/docs, /redoc, /openapi.json), comma-separated, or 'none' (default: all three)")
    limits = s.add_argument_group("per-request limits (a request over one is a 400 naming the field and the limit)")
    for f in dataclasses.fields(Limits):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        limits.add_argument(flag, type=float if f.name == "max_request_seconds" else int, default=default,
                            metavar="N", help=_LIMIT_HELP[f.name] + (f" (default {default})" if default is not None else ""))
    s.add_argument("--kv-pool-mb", type=float, default=None, metavar="MB",
                   help="the most the KV pool may hold (default: half the memory available at the start); a request "
                        "whose KV can never fit is a 400 saying how much it needs, one that cannot fit now waits, "
                        "and a running one that finds the pool full is preempted and recomputed, never failed")
    s.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="radix prefix cache shared by all requests (a common system prompt is prefilled once); 0 off")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, new requests get 503 and those in flight may run this long before they are "
                        "ended with a 503 error; a second signal ends them at once; the exit status is 0 (default 10)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from metaloom.generator import LocalGenerator
    from metaloom.models import load
    from metaloom.server.app import create_app
    from metaloom.wiring.engines import prefix_cache

    if not 1 <= args.port <= 65535:
        raise InvalidParameter("port", args.port, "a port in 1..65535")
    check_sizes(args.max_rows, args.max_waiting, args.max_prefill_tokens)  # before the model load, as the scheduler would
    if not args.max_body_mb > 0:
        raise InvalidParameter("max_body_mb", args.max_body_mb, "> 0")
    if not args.shutdown_timeout >= 0:
        raise InvalidParameter("shutdown_timeout", args.shutdown_timeout, ">= 0 seconds")
    prefix_cache(args.prefix_cache_mb, None)  # validated before the load
    if args.kv_pool_mb is not None and not args.kv_pool_mb > 0:
        raise InvalidParameter("kv_pool_mb", args.kv_pool_mb, "> 0 MB")
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    for name in ("body_timeout", "header_timeout"):
        if not getattr(args, name) > 0:
            raise InvalidParameter(name, getattr(args, name), "> 0 seconds")
    open_routes = () if args.open_routes == "none" else tuple(r for r in args.open_routes.split(",") if r)
    if unknown := sorted(set(open_routes) - set(OPEN_ROUTES)):
        raise InvalidParameter("open_routes", unknown[0], f"some of {', '.join(OPEN_ROUTES)}, comma-separated, or none")
    loaded = load(args.model, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                  **engine_options(args))
    generator = LocalGenerator(loaded, prefix_cache=prefix_cache(args.prefix_cache_mb, loaded))
    # configured before the app: it logs the pool sizes it chose
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("model %s: %s backend, %s weights, %s activations%s", loaded.name, loaded.backend, loaded.weights,
             loaded.activations, " (--activations auto)" if args.activations == "auto" else "")
    app = create_app(generator, model_ids=[args.served_model_name or args.model], api_key=args.api_key,
                     max_rows=args.max_rows, max_waiting=args.max_waiting, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                     limits=limits, body_timeout=args.body_timeout, open_routes=open_routes,
                     kv_pool_bytes=None if args.kv_pool_mb is None else int(args.kv_pool_mb * (1 << 20)),
                     max_prefill_tokens=args.max_prefill_tokens)
    serve(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, header_timeout=args.header_timeout)
    return 0


def serve(app: Any, *, host: str, port: int, shutdown_timeout: float, header_timeout: float = 10.0) -> None:
    """Run ``app`` with uvicorn until a signal, then drain as the module says."""
    from metaloom.server.http import uvicorn_config

    config = uvicorn_config(app, host, port, header_timeout=header_timeout, log_level="info",
                            timeout_graceful_shutdown=5)  # connections still open once the loop drained
    _draining_server(config, app.state.scheduler, shutdown_timeout).run()


def _draining_server(config: Any, scheduler: Any, timeout: float) -> Any:
    """A uvicorn server whose signals start the scheduler's bounded drain; it exits once drained."""
    import uvicorn

    class Server(uvicorn.Server):
        signals = 0
        asked = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # only counted here (a signal handler must not take the scheduler's lock); not
            # recorded for uvicorn to raise again after the shutdown (a KeyboardInterrupt)
            self.signals += 1

        async def on_tick(self, counter: int) -> bool:
            if self.signals > self.asked:
                self.asked = self.signals
                if self.signals == 1:
                    log.info("shutting down: draining requests in flight for up to %g s (again to stop now)", timeout)
                    scheduler.begin_drain(timeout)
                else:
                    log.warning("shutting down now: ending requests in flight")
                    scheduler.begin_drain(0)
            if scheduler.draining and scheduler.drained.is_set():
                self.should_exit = True
            return bool(await super().on_tick(counter))

    return Server(config)
