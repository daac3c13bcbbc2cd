"""`metaloom bench serve`: an OpenAI-compatible server measured from the client side, metaloom's
own (`metaloom serve`) beside vLLM's (`--vllm VENV`), one server at a time.

At each concurrency level (``--clients``, default 1, 8 and 32) N asyncio clients share one
`openai.AsyncOpenAI` and each sends its share of the requests one after another: streamed
greedy chat completions over a fixed list of mixed prompts (`serve_prompts.PROMPTS`),
``max_tokens`` = ``--serve-tokens``, with ``stream_options={"include_usage": True}`` so the
output tokens are the server's own count. Per level: throughput (output tokens / wall time of the whole level), p50
and p99 time to first token (send to the first chunk with content) and p50 and p99 request
latency.

Per repeat, metaloom starts, answers a warm-up request, runs every level and stops; then vLLM
does the same (A B A B ...: load that drifts hits both alike). Medians per (system, clients)
over repeats, and metaloom/vLLM ratios. A system that fails to start (or dies) is reported as
skipped with the reason and the tail of its output; the others still run. Starting and
stopping the servers: `metaloom.bench.servers`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from metaloom.bench import model_args
from metaloom.bench.serve_prompts import PROMPTS, tagged
from metaloom.bench.servers import HOST, ServerSpec, StartFailed, server_args, serving, vllm_spec
from metaloom.errors import InvalidParameter

# ---------------------------------------------------------------- pure pieces


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), numpy's linear interpolation; refuses no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} outside 0..100")
    return float(np.percentile(values, q))


def requests_per_client(total: int, clients: int) -> int:
    """Each client's share of about ``total`` requests, at least 2 (one request per client
    would measure a single burst, not a steady state)."""
    return max(2, total // clients)


def split_requests(total: int, clients: int) -> list[list[int]]:
    """Request indices 0..total-1 dealt round-robin to ``clients`` (shares differ by at most
    one). With the prompt of request i being ``PROMPTS[i % len(PROMPTS)]``, every level sends
    the same mix of prompts whatever its number of clients."""
    if clients < 1 or total < 0:
        raise ValueError(f"split of {total} requests among {clients} clients")
    return [list(range(c, total, clients)) for c in range(clients)]


def parse_clients(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise InvalidParameter("clients", text, "comma-separated integers >= 1, e.g. 1,8,32")
    return levels


@dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it."""

    request: int  # the request's index (its prompt: PROMPTS[request % len(PROMPTS)])
    latency_s: float  # send to the end of the stream
    ttft_s: float | None = None  # send to the first chunk with content; None: no content came
    output_tokens: int | None = None  # from the server's usage chunk; None: none came
    error: str | None = None


@dataclass(frozen=True)
class LevelRow:
    """One concurrency level of one run. Percentiles are over the requests that succeeded
    (None when none did)."""

    clients: int
    requests: int
    errors: int
    missing_usage: int  # successful requests without a usage chunk (their tokens are not counted)
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None


def summarise(clients: int, timings: Sequence[RequestTiming], wall_s: float) -> LevelRow:
    ok = [t for t in timings if t.error is None]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    latencies = [t.latency_s for t in ok]
    tokens = sum(t.output_tokens for t in ok if t.output_tokens is not None)

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    return LevelRow(clients=clients, requests=len(timings), errors=len(timings) - len(ok),
                    missing_usage=sum(t.output_tokens is None for t in ok), output_tokens=tokens, wall_s=wall_s,
                    tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
                    ttft_p50_s=pct(ttfts, 50), ttft_p99_s=pct(ttfts, 99),
                    latency_p50_s=pct(latencies, 50), latency_p99_s=pct(latencies, 99))


# the figures compared across repeats and systems; throughput higher is better, times lower
METRICS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s")


def median_row(rows: Sequence[LevelRow]) -> dict[str, Any]:
    """Medians over repeats of one (system, clients): each metric (over the repeats that have
    it), throughput's min and max, and the error totals."""
    out: dict[str, Any] = {"repeats": len(rows), "errors": sum(r.errors for r in rows),
                           "missing_usage": sum(r.missing_usage for r in rows),
                           # the systems' greedy outputs should match: a gap here means one stopped early
                           "output_tokens": statistics.median(r.output_tokens for r in rows) if rows else 0}
    for name in METRICS:
        values = [v for r in rows if (v := getattr(r, name)) is not None]
        out[name] = statistics.median(values) if values else None
    speeds = [r.tokens_per_s for r in rows]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = (min(speeds), max(speeds)) if speeds else (None, None)
    return out


def ratios(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float | None]:
    """``a / b`` for each metric (None where either is missing or ``b`` is 0)."""
    out: dict[str, float | None] = {}
    for name in METRICS:
        x, y = a.get(name), b.get(name)
        out[name] = x / y if x is not None and y else None
    return out


# ---------------------------------------------------------------- client side


async def _request(client: Any, model: str, request: int, prompt: str, max_tokens: int) -> RequestTiming:
    start = time.perf_counter()
    ttft: float | None = None
    tokens: int | None = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            # the first chunk often carries only the role: TTFT waits for real content
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # one failed request is counted, not fatal to the level
        return RequestTiming(request=request, latency_s=time.perf_counter() - start, ttft_s=ttft, output_tokens=tokens,
                             error=f"{type(exc).__name__}: {exc}"[:300])
    return RequestTiming(request=request, latency_s=time.perf_counter() - start, ttft_s=ttft, output_tokens=tokens)


async def run_level(base_url: str, model: str, prompts: Sequence[str], clients: int, per_client: int,
                    max_tokens: int, tag: str | None = None, timeout_s: float = 600.0) -> tuple[list[RequestTiming], float]:
    """``clients`` concurrent clients, each sending its ``per_client`` requests in turn; request
    i sends ``prompts[i % len(prompts)]``, tagged ``{tag}{i}`` when ``tag`` is given (`tagged`).
    Returns every request's timing (in request order) and the wall time of the whole level."""
    from openai import AsyncOpenAI  # an optional dependency: only this benchmark needs it

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s)
    shares = split_requests(clients * per_client, clients)

    def prompt(i: int) -> str:
        return tagged(prompts[i % len(prompts)], None if tag is None else f"{tag}{i}")

    async def worker(share: list[int]) -> list[RequestTiming]:
        return [await _request(client, model, i, prompt(i), max_tokens) for i in share]

    try:
        start = time.perf_counter()
        done = await asyncio.gather(*(worker(s) for s in shares))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return sorted((t for share in done for t in share), key=lambda t: t.request), wall


def measure_level(base_url: str, model: str, prompts: Sequence[str], clients: int, per_client: int,
                  max_tokens: int, tag: str | None = None) -> LevelRow:
    timings, wall = asyncio.run(run_level(base_url, model, prompts, clients, per_client, max_tokens, tag))
    return summarise(clients, timings, wall)


# ---------------------------------------------------------------- the benchmark


def run_benchmark(specs: Sequence[ServerSpec], levels: Sequence[int], total_requests: int, max_tokens: int,
                  repeats: int, prompts: Sequence[str] = PROMPTS, distinct: bool = True,
                  log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Every spec in turn within each repeat, every level per start; a system that fails is
    skipped from then on (its finished repeats still count). ``distinct``: tag every request
    (`tagged`); False sends the bare prompts, so repeats hit the servers' prefix caches."""
    rows: dict[str, list[LevelRow]] = {s.name: [] for s in specs}
    skipped: dict[str, dict[str, Any]] = {}
    startup: dict[str, list[float]] = {s.name: [] for s in specs}
    for repeat in range(repeats):
        for spec in specs:
            if spec.name in skipped:
                continue
            log(f"[{spec.name}] repeat {repeat + 1}/{repeats}: starting")
            try:
                with serving(spec) as served:
                    startup[spec.name].append(served.startup_s)
                    log(f"[{spec.name}] up in {served.startup_s:.1f} s, model {served.model!r}; warm-up")
                    warm, _ = asyncio.run(run_level(served.base_url, served.model, prompts, 1, 1, max_tokens,
                                                    "warm-up " if distinct else None))
                    if warm[0].error is not None:
                        raise StartFailed(f"the warm-up request failed: {warm[0].error}", served.tail())
                    for clients in levels:
                        row = measure_level(served.base_url, served.model, prompts, clients,
                                            requests_per_client(total_requests, clients), max_tokens,
                                            f"{clients}-" if distinct else None)
                        if not served.alive():  # its failed requests measure a crash, not the server
                            raise StartFailed(f"the server exited during the {clients}-client level", served.tail())
                        rows[spec.name].append(row)
                        log(f"[{spec.name}] {clients:3d} clients: {row.tokens_per_s:7.1f} tok/s, "
                            f"{row.requests} requests, {row.errors} errors, {row.wall_s:.1f} s")
            except StartFailed as exc:
                skipped[spec.name] = {"reason": exc.reason, "repeat": repeat + 1, "output_tail": exc.tail}
                log(f"[{spec.name}] skipped: {exc.reason}")
    medians = {name: {c: median_row([r for r in rs if r.clients == c]) for c in levels if any(r.clients == c for r in rs)}
               for name, rs in rows.items()}
    out: dict[str, Any] = {"levels": list(levels), "repeats": repeats, "distinct_prompts": distinct, "skipped": skipped,
                           "startup_s": {k: statistics.median(v) for k, v in startup.items() if v},
                           "runs": {name: [asdict(r) for r in rs] for name, rs in rows.items()}, "medians": medians}
    if len(specs) == 2:
        a, b = specs[0].name, specs[1].name
        out["ratio_of"] = f"{a}/{b}"
        out["ratios"] = {c: ratios(medians[a][c], medians[b][c]) for c in levels if c in medians[a] and c in medians[b]}
    return out


def _specs(args: argparse.Namespace, folder: str | None, folder_error: str | None) -> tuple[list[ServerSpec], dict[str, str]]:
    base_env = dict(os.environ)
    base_env.setdefault("HF_HUB_OFFLINE", "1")
    metaloom = ServerSpec("metaloom", (sys.executable, "-m", "metaloom.cli", "serve", "--model", args.model, "--host", HOST,
                                       "--port", str(args.port_base), "--dtype", args.serve_dtype,
                                       *shlex.split(args.metaloom_serve_args)),
                          args.port_base, base_env, args.serve_startup_timeout)
    specs, not_run = [metaloom], {}
    if args.vllm:
        exe = os.path.join(args.vllm, "bin", "vllm")
        if folder is None:
            not_run["vllm"] = f"no transformers folder for {args.model!r}: {folder_error}"
        elif not os.path.exists(exe):
            not_run["vllm"] = f"{exe} does not exist"
        else:
            specs.append(vllm_spec(args.vllm, folder, args.port_base + 1, args.serve_dtype, base_env,
                                   startup_timeout_s=args.serve_startup_timeout))
    return specs, not_run


HELP = "an OpenAI-compatible server measured from the client side, metaloom's beside vLLM's"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, weights=False)
    server_args(p)
    p.add_argument("--metaloom-serve-args", default="", metavar="ARGS",
                   help="more options for `metaloom serve`, one string (e.g. '--weights dense', or '--activations "
                        "float': the server's default is auto, q8 where it runs)")
    p.add_argument("--clients", default="1,8,32", help="concurrency levels, comma-separated")
    p.add_argument("--serve-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--serve-requests", type=int, default=64,
                   help="requests per level (each of N clients sends max(2, this // N))")
    p.add_argument("--serve-same-prompts", action="store_true",
                   help="send the bare prompts again and again (they then hit prefix caches); by default each "
                        "request is tagged so that none repeats")


def main(args: argparse.Namespace) -> int:
    from metaloom.errors import MetaloomError
    from metaloom.models.find import resolve

    try:
        import openai  # noqa: F401  (the client side of every measurement)
    except ImportError:
        print("error: metaloom bench serve needs the openai client: pip install openai", file=sys.stderr)
        return 2
    levels = parse_clients(args.clients)
    for name in ("serve_tokens", "serve_requests", "repeats"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, getattr(args, name), "an integer >= 1")
    loadavg = os.getloadavg()  # the 2-thread servers collapse under outside load: record it
    # vLLM needs a transformers folder: metaloom's converted one (written on first use), so
    # both serve the same weights; resolving converts without loading the model
    name, folder, folder_error = args.model, None, None
    try:
        name, folder = resolve(args.model)
    except (MetaloomError, OSError) as exc:
        folder_error = str(exc)
    specs, not_run = _specs(args, folder, folder_error)
    result = run_benchmark(specs, levels, args.serve_requests, args.serve_tokens, args.repeats,
                           distinct=not args.serve_same_prompts)
    result["skipped"].update({k: {"reason": v, "repeat": 0, "output_tail": ""} for k, v in not_run.items()})
    result.update({"model": name, "folder": folder, "dtype": args.serve_dtype,
                   "metaloom_serve_args": args.metaloom_serve_args, "max_tokens": args.serve_tokens,
                   "requests_per_level": {c: c * requests_per_client(args.serve_requests, c) for c in levels},
                   "prompts": len(PROMPTS), "cpus": os.cpu_count(), "loadavg_start": list(loadavg),
                   "loadavg_end": list(os.getloadavg())})
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0 if any(result["runs"].values()) else 1


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_table(result: Mapping[str, Any]) -> str:
    load = " ".join(f"{v:.2f}" for v in result["loadavg_start"])
    lines = [f"{result['model']} ({result['dtype']}), up to {result['max_tokens']} tokens per request, "
             f"{len(PROMPTS)} mixed prompts, streamed greedy; medians of {result['repeats']} repeat(s)",
             f"load average at start {load} ({result['cpus']} CPUs)",
             f"{'system':10s} {'clients':>7s} {'requests':>8s} {'tokens':>7s} {'tok/s (min-max)':>22s} "
             f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'lat p50':>8s} {'lat p99':>8s} {'errors':>6s}"]
    for name, per in result["medians"].items():
        for c, m in per.items():
            lo, hi = m["tokens_per_s_min"], m["tokens_per_s_max"]
            speed = f"{m['tokens_per_s']:.1f} ({lo:.1f}-{hi:.1f})"
            flag = f" ({m['missing_usage']} without usage)" if m["missing_usage"] else ""
            lines.append(f"{name:10s} {int(c):7d} {result['requests_per_level'][c]:8d} {m['output_tokens']:7.0f} "
                         f"{speed:>22s} {_ms(m['ttft_p50_s']):>9s} {_ms(m['ttft_p99_s']):>9s} {_s(m['latency_p50_s']):>8s} "
                         f"{_s(m['latency_p99_s']):>8s} {m['errors']:6d}{flag}")
    if result.get("ratios"):
        lines.append(f"{result['ratio_of']} (tok/s: above 1 is faster; times: below 1 is faster)")
        for c, r in result["ratios"].items():
            lines.append(f"{'':10s} {int(c):7d} {'':8s} {'':7s} {_x(r['tokens_per_s']):>22s} {_x(r['ttft_p50_s']):>9s} "
                         f"{_x(r['ttft_p99_s']):>9s} {_x(r['latency_p50_s']):>8s} {_x(r['latency_p99_s']):>8s}")
    for name, s in result["startup_s"].items():
        lines.append(f"{name} started in {s:.1f} s (median)")
    for name, why in result["skipped"].items():
        lines.append(f"{name} skipped: {why['reason']}")
        if why["output_tail"]:
            lines.extend("    " + ln for ln in why["output_tail"].strip().splitlines()[-15:])
    return "\n".join(lines)
