"""`metaloom bench speculative`: every drafter against plain greedy, transformers' assisted
generation and llama.cpp, in one run on the same input-grounded prompts (code edits and a
summary, where the output quotes the input), plus the radix prefix cache's time to first token.

Each method decodes every prompt greedily up to ``--new-tokens`` tokens (end-of-sequence on,
so the task ends where the model ends it); metaloom's speculative methods emit exactly plain
greedy's tokens (asserted here too). Methods are interleaved within each repeat so drifting
machine load hits them alike; one warm-up pass, then medians over ``--repeats`` per prompt.
Reported: tokens, tok/s (prefill included, as a user waits for it), speedup over metaloom's
plain greedy, acceptance rate, mean accepted draft tokens per verification step, and tokens
per target forward. Peers: transformers ``generate`` plain, with ``prompt_lookup_num_tokens``,
and with ``assistant_model`` when ``--draft-model`` is given; llama.cpp through
``llama-cpp-python`` (plain and with its prompt-lookup draft) when installed, on the GGUF file
(llama.cpp runs the GGUF's own quantised weights, so its tokens differ; compare rates).

The package: `prompts` (the two prompt sets), `methods` (metaloom's rows: greedy and the
drafters), `peers` (transformers and llama.cpp), `report` (one dtype's table); here, the timed
loop (`run`), the flags and the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from metaloom.bench import model_args, single_weights
from metaloom.bench.speculative.methods import Method, drafter_methods, metaloom_method
from metaloom.bench.speculative.peers import PEERS, check_peers
from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.bench.speculative.report import run_report
from metaloom.errors import MetaloomError
from metaloom.models import LoadedModel, load


def prefix_cache_case(loaded: LoadedModel, prefix_tokens: int, repeats: int) -> dict[str, Any]:
    """Time to first token of a call sharing a ``prefix_tokens``-token prefix with an earlier
    call, without and with the radix prefix cache (`metaloom.bench.prefix`)."""
    from metaloom.bench.prefix import time_to_first_token

    return time_to_first_token(loaded, prefix_tokens, repeats=repeats)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One report per dtype in ``--dtypes``; the prefix-cache case runs once, on the first."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_peers(args)  # a bad --peers fails before any model loads
    reports: list[dict[str, Any]] = []
    for dtype in (d for d in args.dtypes.split(",") if d):
        reports.append(_one_dtype(args, dtype, reports))
    out: dict[str, Any] = {**_header(args), "runs": reports}
    if args.prefix_tokens > 0:
        loaded = load(args.model, dtype=reports[0]["dtype"], weights=single_weights(args), activations=args.activations)
        out["prefix_cache"] = prefix_cache_case(loaded, args.prefix_tokens, args.repeats)
    if args.out:
        write_json(args.out, out)
    return out


def _header(args: argparse.Namespace) -> dict[str, Any]:
    """What the figures depend on besides the methods: the CPU (its name, vector features and the
    kernels' instruction-set path), the threads, the weights asked for, the workload."""
    from metaloom.models.kernels import isa

    return {"cpu": isa.cpu_name(), "cpu_features": isa.describe(isa.cpu_features()), "isa": isa.chosen().name,
            "threads": torch.get_num_threads(), "weights": str(args.weights), "activations": args.activations,
            "new_tokens": args.new_tokens,
            "prompts": len(PROMPT_SETS[args.prompts]), "prompt_set": args.prompts, "repeats": args.repeats}


def _one_dtype(args: argparse.Namespace, dtype: str, done: list[dict[str, Any]]) -> dict[str, Any]:
    loaded = load(args.model, dtype=dtype, weights=single_weights(args), activations=args.activations)
    n = args.new_tokens
    skipped: dict[str, str] = {}
    prompts = PROMPT_SETS[args.prompts]
    methods = [metaloom_method(loaded, "metaloom greedy", None, n, prompts)]
    # the prefill and first token of each prompt alone: what no drafter speeds up, taken off
    # metaloom's times for the decode-only rates (`run_report`)
    first = metaloom_method(loaded, "metaloom first token", None, 1, prompts)
    methods += drafter_methods(args, loaded, n, skipped)
    peers = check_peers(args)
    for peer, build in PEERS.items():
        if peer in peers:
            methods += build(args, loaded, n, skipped)
        else:
            skipped[peer] = "not asked for (--peers)"
    for i in range(len(prompts)):
        first.run(i)
    for m in list(methods):  # warm-up: first calls pay for allocations, thread pools, lazy imports
        try:
            for i in range(len(prompts)):
                m.run(i)
        except MetaloomError as exc:  # e.g. no speculator heads for this model: report, keep benchmarking
            skipped[m.name] = str(exc)
            methods.remove(m)
    for repeat in range(args.repeats):
        # prompt by prompt, every method on it in turn (the order reversed on odd repeats), so
        # that each drafter runs seconds, not a whole set of prompts, after the greedy run it is
        # compared with: the machine's drift then hits both alike
        order = methods if repeat % 2 == 0 else methods[::-1]
        for i in range(len(prompts)):
            _timed(first, i)
            for m in order:
                _timed(m, i)
                if args.out:  # a long run that is stopped still leaves every row measured so far
                    write_partial(args.out, args, done, _report_so_far(loaded, methods, skipped, dtype, first))
        so_far = _report_so_far(loaded, methods, skipped, dtype, first)
        for row in so_far["methods"]:
            print(f"[{dtype} repeat {repeat + 1}/{args.repeats}] {row['method']}: {row['tok_s']:.2f} tok/s "
                  f"({row['speedup']:.2f}x greedy)", file=sys.stderr, flush=True)
    return run_report(loaded, methods, skipped, dtype, first)


def _report_so_far(loaded: LoadedModel, methods: list[Method], skipped: dict[str, str], dtype: str,
                   first: Method) -> dict[str, Any]:
    """The report over the prompts that every method measured so far has run (partway through
    the first repeat the later methods have run fewer prompts than the earlier ones)."""
    measured = [m for m in methods if m.times]
    common = set.intersection(*(set(m.times) for m in measured))
    return run_report(loaded, [m.only(common) for m in measured], skipped, dtype, first.only(common))


def _timed(m: Method, i: int) -> None:
    """One timed run of prompt ``i``: its seconds, and its tokens and ledger."""
    start = time.perf_counter()
    tokens, ledger = m.run(i)
    m.times.setdefault(i, []).append(time.perf_counter() - start)
    m.tokens.setdefault(i, tokens)
    if ledger is not None:
        m.ledgers[i] = ledger


def write_partial(path: str, args: argparse.Namespace, done: list[dict[str, Any]], current: dict[str, Any]) -> None:
    """``--out``: the report so far (finished dtypes, then the one being measured, marked
    ``partial``), replaced atomically after each timed run (a method on a prompt)."""
    write_json(path, {**_header(args), "runs": [*done, {**current, "partial": True}], "partial": True})


def write_json(path: str, report: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


HELP = "every drafter against plain greedy, transformers' assisted generation and llama.cpp"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, dtypes="float32,bfloat16")
    p.set_defaults(weights="auto")  # what a user gets: the weights `load` picks for this model and machine
    for action in p._actions:
        if action.dest == "weights":
            action.help = "auto (default: what `load` picks on this machine, as a user gets) | native | dense"
    p.add_argument("--activations", default="float", choices=("float", "q8"),
                   help="q8: the native weights multiply int8 inputs (load(activations=)), greedy and every drafter alike")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--drafters", default="auto,ngram,quantized,quantized-int4,jacobi,jacobi-lookup,heads,draft,"
                                         "recycling/chain,recycling",
                   help="drafters to compare, comma-separated")
    p.add_argument("--draft-model", default=None, help="draft model (same tokenizer) for the draft-model drafter")
    p.add_argument("--num-draft", type=int, default=None, help="draft tokens per step (default: each drafter's own)")
    p.add_argument("--cost-model", choices=("on", "off", "both"), default="on",
                   help="the speculation cost model on each drafter (on: it decides each step's draft length, 0 "
                        "included), off (K tokens every step), or both side by side; auto always has it")
    p.add_argument("--peers", default="transformers,llama.cpp",
                   help="peers to run beside metaloom, comma-separated ('' for none): transformers, llama.cpp")
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="grounded",
                   help="grounded: code edits and a summary that quote their input; free: open-ended generation")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix for the prefix-cache case (0: skip)")
    p.add_argument("--out", default=None,
                   help="write the JSON report here, rewritten after each timed run (a stopped run keeps "
                        "its rows, marked partial)")

def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    kind = "input-grounded" if report.get("prompt_set", "grounded") == "grounded" else "free-generation"
    print(f"{report['prompts']} {kind} prompts, up to {report['new_tokens']} new tokens each, greedy; "
          f"{report['threads']} threads; median of {report['repeats']} after 1 warm-up")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for run_ in report["runs"]:
        print(f"\n{run_['model']} ({run_['dtype']})")
        print(f"{'method':<44} {'tokens':>6} {'tok/s':>7} {'speedup':>8} {'decode':>7} {'accept':>7} {'acc/step':>9} "
              f"{'tok/fwd':>8}")
        for r in run_["methods"]:
            same = "" if r.get("same_tokens_as_greedy", True) else "  (tokens differ from greedy!)"
            decode = "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x"
            print(f"{r['method']:<44} {r['tokens']:>6} {r['tok_s']:>7.1f} {r['speedup']:>7.2f}x {decode:>7} "
                  f"{fmt(r.get('acceptance_rate'), '.0%'):>7} {fmt(r.get('accepted_per_step'), '.2f'):>9} "
                  f"{fmt(r.get('tokens_per_forward'), '.2f'):>8}{same}")
        if run_.get("first_token_s") is not None:
            print(f"decode: the speedup after each prompt's prefill and first token "
                  f"({run_['first_token_s'] * 1e3:.0f} ms for the {report['prompts']} prompts, greedy alone)")
        for name, ratio in run_["ratios"].items():
            print(f"{name}: {ratio:.2f}x")
        for name, why in run_["skipped"].items():
            print(f"skipped {name}: {why}")
    if "prefix_cache" in report:
        p = report["prefix_cache"]
        print(f"prefix cache, {p['prefix_tokens']}-token shared prefix: time to first token {p['uncached_s'] * 1e3:.0f} ms "
              f"uncached vs {p['cached_s'] * 1e3:.0f} ms cached ({p['speedup']:.1f}x; {p['cached_tokens']:.0f} tokens cached)")
    return 0
